"""KV page groups' memory figures for a sliding-window model in the store (docs/measurements-kv-groups.md):

    python examples/kv_groups_figures.py held [--model gemma3-270m]
    python examples/kv_groups_figures.py admit --kv-mib 160 --prompts 8 [--model gemma3-270m]

``held``: the KV one sequence holds (the engine's ``KVPages`` over the model's layout, through one prompt fire of
the given rows, reserved moving and advanced per chunk as the engine does, then 16 decode rows; no forward: pages
held are a function of the operations only), with page groups and with every row kept (``--kv-swa-full``), and
what ``pie serve`` charges such a run at admission (``serve/auth.py kv_needed``). ``admit``: how many prompts of
``--rows`` tokens one engine admits at once in a pool of ``--kv-mib`` MiB, both ways: the prompts' fires are
handed to an ``EngineCore`` (each reserves its pages then, ``out_of_pages`` otherwise), no forward run.
Prints JSON lines."""

from __future__ import annotations

import argparse
import json

from pie_runtime.engine.kv_pages import KVPages
from pie_runtime.engine.page_pool import PagePool
from pie_runtime.engine.working_set import WorkingSet
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.kv_groups import pages_bound
from pie_runtime.store import ModelStore

PAGE, CHUNK, DECODE = 16, 256, 16


def held(model: str, rows: int) -> dict:
    """MiB held at the end and at most, with page groups and with every row kept, for a prompt of ``rows``."""
    cfg = ModelStore().get(model).config
    layer_page = 2 * cfg.num_key_value_heads * cfg.head_dim * PAGE * 2  # K and V of one layer's page, bf16
    out: dict = {"rows": rows + DECODE}
    for full in (False, True):
        layout = KVCache.layout_of(cfg, 0, full)
        pages = KVPages(PagePool(10**7), PAGE, lambda a, b: None, lambda a, b: None, layout.windows)
        pages.chunk_rows = CHUNK
        ws = WorkingSet(1, b"c", model, tables=pages.empty_tables())
        pages.reserve(ws, 0, rows, moving=True)
        most = 0
        for first in range(0, rows, CHUNK):
            pages.advance(ws, 0, first, min(rows, first + CHUNK))
            most = max(most, pages.held(ws))
        ws.committed = rows
        pages.commit(ws)
        for _ in range(DECODE):
            pages.reserve(ws, ws.committed, 1)
            ws.committed += 1
            pages.commit(ws)
            most = max(most, pages.held(ws))
        mib = layer_page * layout.unit / 2**20
        out["all_rows" if full else "groups"] = {
            "held_mib": round(pages.held(ws) * mib, 2),
            "most_mib": round(most * mib, 2),
            "admission_mib": round(pages_bound(rows + DECODE, layout.windows, PAGE, CHUNK) * mib, 2),
        }
    out["held_ratio"] = round(out["groups"]["held_mib"] / out["all_rows"]["held_mib"], 4)
    out["most_ratio"] = round(out["groups"]["most_mib"] / out["all_rows"]["held_mib"], 4)
    return out


def admit(model: str, kv_mib: int, prompts: int, rows: int, swa_full: bool) -> dict:
    """How many of ``prompts`` fires of ``rows`` tokens one engine with ``kv_mib`` MiB of KV admits at once."""
    from pie_runtime.engine.build import build_served_model
    from pie_runtime.engine.core import EngineCore
    from pie_runtime.engine.options import ServeOptions
    from pie_runtime.protocol import PieError
    from pie_runtime.protocol.codec import pack, parse_request

    opts = ServeOptions(weights="gguf", kv_bytes=kv_mib << 20, swa_full=swa_full, prepack_lm_head=False)
    served = build_served_model(model, opts)
    core = EngineCore([served], prefix_cache=False)
    ids = iter(range(1, 10**9))

    def handle(op: str, **fields) -> dict | None:
        _, req = parse_request(pack({"id": next(ids), "op": op, **fields}))
        return core.handle(b"c", req)

    admitted, refused = 0, []
    for i in range(prompts):
        opened = handle("ws_open")
        assert opened is not None
        tokens = [(7 * j + i) % served.info.vocab_size for j in range(rows)]
        try:
            reply = handle("fire", ws=opened["ws"], tokens=tokens, readouts=[{"rows": [rows - 1], "kind": "logits"}])
            admitted += reply is None
        except PieError as e:
            refused.append(str(e.code))
    return {
        "swa_full": swa_full,
        "kv_mib": kv_mib,
        "page_bytes": served.info.page_bytes,
        "pages_total": served.pages.total,
        "pages_used": served.pages.used,
        "admitted": admitted,
        "refused": refused,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["held", "admit"])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--kv-mib", type=int, default=160)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--rows", type=int, default=4000)
    args = p.parse_args()
    if args.what == "held":
        for rows in (4000, 8000, 16000, 32000):
            print(json.dumps(held(args.model, rows)), flush=True)
    else:
        for full in (False, True):
            print(json.dumps(admit(args.model, args.kv_mib, args.prompts, args.rows, full)), flush=True)


if __name__ == "__main__":
    main()
