"""What a rejecting round costs on a model with recurrent state, and the acceptance a round needs to pay.

A random hybrid LFM2 checkpoint (hidden 512, 8 layers: 5 short-conv and 3 attention, vocab 8192) is imported
into a private store and served by an in-process engine core (fp32). After a 256-token prompt, round-robin:

    plain    a 1-row fire that folds its row (a text-completion step)
    accept   a fire of 1 + k rows that folds them all (every draft kept: no replay)
    reject   the same fire folding 2 rows (one draft kept): the engine restores the state from before the
             fire and replays the 2 kept rows (engine/fold.py)

and the alternative to replaying, per-row states: the copies a fire would make to keep each row's state
(1 + k state copies instead of 1 snapshot). From the medians it solves, per k, the per-draft acceptance α at
which a round emits tokens as fast as plain steps, ``(1 - α^(k+1)) / (1 - α) / E[round ms] = 1 / plain ms``,
with ``E[round ms] = accept + (1 - α^k) * replay``, and the same without the replay (a stateless model with
these pass costs).

    nice -n 10 .venv/bin/python examples/recurrent_replay_bench.py --threads 2 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pie_runtime.engine.build import build_served_model
from pie_runtime.engine.core import EngineCore
from pie_runtime.models.state_cache import StateCache
from pie_runtime.protocol.codec import pack, parse_request
from pie_runtime.store import ModelStore, import_model

CLIENT = b"bench"


def write_checkpoint(folder: Path, hidden: int, layers: int, vocab: int) -> None:
    import transformers

    from tests.models.tiny_models import tiny_tokenizer_json

    kinds = ["conv", "conv", "full_attention"] * (layers // 3 + 1)
    cfg = transformers.Lfm2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        layer_types=kinds[:layers],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.Lfm2ForCausalLM(cfg)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json())


class Engine:
    def __init__(self, store: ModelStore, name: str):
        self.sm = build_served_model(name, store=store, kv_pages=512, state_slots=4, prepack_lm_head=True)
        self.core = EngineCore([self.sm])
        self.ids = iter(range(1, 1 << 30))

    def call(self, op: str, **fields) -> dict:
        _, req = parse_request(pack({"id": next(self.ids), "op": op, **fields}))
        reply = self.core.handle(CLIENT, req)
        assert reply is not None
        return reply

    def fire(self, ws: int, tokens: list[int], fold: int) -> float:
        """ms from submitting a greedy fire (argmax on every row) to its reply, its fold and replay included."""
        rows = list(range(len(tokens)))
        t0 = time.perf_counter()
        _, req = parse_request(
            pack(
                {
                    "id": next(self.ids),
                    "op": "fire",
                    "ws": ws,
                    "tokens": tokens,
                    "readouts": [{"kind": "argmax", "rows": rows}],
                    "fold": fold,
                }
            )
        )
        self.core.handle(CLIENT, req)
        while self.core.has_work():
            for _, reply in self.core.step():
                assert reply["ok"], reply
        return (time.perf_counter() - t0) * 1e3


def break_even(k: int, plain: float, accept: float, replay: float) -> float | None:
    """The per-draft acceptance at which k-draft rounds match plain steps (None: they never pay)."""

    def rate(a: float) -> float:
        tokens = sum(a**i for i in range(k + 1))
        return tokens / (accept + (1 - a**k) * replay)

    if rate(0.999) < 1 / plain:
        return None
    lo, hi = 0.0, 0.999
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < 1 / plain else (lo, mid)
    return round(hi, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--drafts", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_checkpoint(root / "ckpt", a.hidden, a.layers, a.vocab)
        store = ModelStore(root / "models")
        import_model(str(root / "ckpt"), name="lfm2-bench", store=store, progress=False)
        eng = Engine(store, "lfm2-bench")
    ws = eng.call("ws_open")["ws"]
    eng.fire(ws, [(7 * i) % 250 for i in range(a.context)], a.context)
    times: dict[str, list[float]] = {"plain": []}
    for k in a.drafts:
        times[f"accept{k}"], times[f"reject{k}"] = [], []
    window = lambda n: [(3 * i + 1) % 250 for i in range(n)]  # noqa: E731
    for _ in range(2):  # warm-up: first calls at a new shape pick their kernels
        eng.fire(ws, window(1), 1)
        for k in a.drafts:
            eng.fire(ws, window(1 + k), 1 + k)
            eng.fire(ws, window(1 + k), 2)
    for _ in range(a.repeats):
        times["plain"].append(eng.fire(ws, window(1), 1))
        for k in a.drafts:
            times[f"accept{k}"].append(eng.fire(ws, window(1 + k), 1 + k))
            times[f"reject{k}"].append(eng.fire(ws, window(1 + k), 2))
    med = {key: statistics.median(v) for key, v in times.items()}

    # the per-row alternative: 1 + k copies of the state per fire instead of one snapshot
    state = eng.sm.runner.state
    assert state is not None
    copies: dict[int, float] = {}
    for k in a.drafts:
        t0 = time.perf_counter()
        for _ in range(a.repeats):
            for _ in range(1 + k):
                state.copy([0], [state.snapshot_of(0)])
        copies[k] = (time.perf_counter() - t0) * 1e3 / a.repeats
    per_slot = StateCache.bytes_per_slot({i: tuple(t.shape[1:] for t in ts) for i, ts in state.layers.items()})

    rows = []
    for k in a.drafts:
        replay = max(0.0, med[f"reject{k}"] - med[f"accept{k}"])
        rows.append(
            {
                "k": k,
                "plain_ms": round(med["plain"], 2),
                "accept_round_ms": round(med[f"accept{k}"], 2),
                "reject_round_ms": round(med[f"reject{k}"], 2),
                "replay_ms": round(replay, 2),
                "per_row_copies_ms": round(copies[k], 3),
                "per_row_state_bytes": (1 + k) * per_slot,
                "snapshot_bytes": per_slot,
                "break_even_alpha": break_even(k, med["plain"], med[f"accept{k}"], replay),
                "break_even_alpha_no_replay": break_even(k, med["plain"], med[f"accept{k}"], 0.0),
            }
        )
    if a.json:
        print(json.dumps(rows))
        return
    print(
        f"LFM2 random, hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, fp32, {a.threads} threads, "
        f"context {a.context}, medians of {a.repeats}"
    )
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
