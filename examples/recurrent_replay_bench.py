"""What a rejecting round costs on a model with recurrent state under each way of folding fewer rows than ran
(engine ``--recurrent-fold``: ``replay`` or ``per-row``), and the acceptance a round needs to pay.

A random checkpoint (default: a hybrid LFM2, hidden 512, 8 layers: 5 short-conv and 3 attention, vocab 8192;
``--family mamba``: a Mamba of the same width and depth) is imported into a private store and served by one
in-process engine core per fold mode (fp32). After a 256-token prompt, round-robin:

    plain    a 1-row fire that folds its row (a text-completion step)
    accept   a speculative round's fire of 1 + k rows, fold deferred, then folded whole (every draft kept)
    reject   the same round folding 2 rows (one draft kept). ``replay``: the engine restores the state from
             before the fire and runs the 2 kept rows again; ``per-row``: the fire kept the state after each
             of its rows and the fold copies the one after row 2

From the medians it solves, per k and mode, the per-draft acceptance α at which a round emits tokens as fast
as plain steps, ``(1 - α^(k+1)) / (1 - α) / E[round ms] = 1 / plain ms``, with
``E[round ms] = accept + (1 - α^k) * (reject - accept)``, and the same for a stateless model with these pass
costs (no extra cost on a rejection). Memory: a working set holds its state and a snapshot under either mode,
and ``per_row_states`` (8 by default) more states under ``per-row``.

    OMP_NUM_THREADS=1 .venv/bin/python examples/recurrent_replay_bench.py --threads 1 --repeats 15
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
from pie_runtime.engine.options import ServeOptions
from pie_runtime.protocol.codec import pack, parse_request
from pie_runtime.store import ModelStore, import_model

CLIENT = b"bench"


def write_checkpoint(folder: Path, family: str, hidden: int, layers: int, vocab: int) -> None:
    import transformers

    from tests.models.tiny_models import tiny_tokenizer_json

    torch.manual_seed(0)
    if family == "mamba":
        cfg = transformers.MambaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            state_size=16,
            num_hidden_layers=layers,
            conv_kernel=4,
            expand=2,
            tie_word_embeddings=True,
            use_associative_scan=False,
        )
        model = transformers.MambaForCausalLM(cfg)
    else:
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
        model = transformers.Lfm2ForCausalLM(cfg)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json())


class Engine:
    def __init__(self, store: ModelStore, name: str, fold: str):
        opts = ServeOptions(kv_pages=512, state_slots=4, prepack_lm_head=True, recurrent_fold=fold)
        self.sm = build_served_model(name, opts, store=store)
        self.core = EngineCore([self.sm])
        self.ids = iter(range(1, 1 << 30))

    def call(self, op: str, **fields) -> dict:
        _, req = parse_request(pack({"id": next(self.ids), "op": op, **fields}))
        reply = self.core.handle(CLIENT, req)
        assert reply is not None
        return reply

    def fire(self, ws: int, tokens: list[int], fold: int, deferred: bool = True) -> float:
        """ms from submitting a greedy fire (argmax on every row) to its fold, the replay included: a
        speculative round's fire folds later (deferred, then ``ws_fold``), a plain step's at once."""
        rows = list(range(len(tokens)))
        t0 = time.perf_counter()
        fields = {"ws": ws, "tokens": tokens, "readouts": [{"kind": "argmax", "rows": rows}]}
        _, req = parse_request(
            pack({"id": next(self.ids), "op": "fire", **fields, "fold": "deferred" if deferred else fold})
        )
        self.core.handle(CLIENT, req)
        while self.core.has_work():
            for _, reply in self.core.step():
                assert reply["ok"], reply
        if deferred:
            self.call("ws_fold", ws=ws, n=fold)
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


def measure(engines: dict[str, Engine], a: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per engine, median ms of a plain step and of accepting and rejecting rounds per k, the engines and the
    kinds interleaved so that a loaded machine's drift falls on all of them alike."""
    window = lambda n: [(3 * i + 1) % 250 for i in range(n)]  # noqa: E731
    times: dict[str, dict[str, list[float]]] = {}
    sets: dict[str, int] = {}
    for fold, eng in engines.items():
        ws = sets[fold] = eng.call("ws_open")["ws"]
        eng.fire(ws, [(7 * i) % 250 for i in range(a.context)], a.context, deferred=False)
        times[fold] = {"plain": [], **{f"{kind}{k}": [] for k in a.drafts for kind in ("accept", "reject")}}
    for rep in range(2 + a.repeats):  # 2 warm-up rounds: first calls at a new shape pick their kernels
        for fold, eng in engines.items():
            ws, t = sets[fold], times[fold]
            ms = eng.fire(ws, window(1), 1, deferred=False)
            if rep >= 2:
                t["plain"].append(ms)
            for k in a.drafts:
                accept, reject = eng.fire(ws, window(1 + k), 1 + k), eng.fire(ws, window(1 + k), 2)
                if rep >= 2:
                    t[f"accept{k}"].append(accept)
                    t[f"reject{k}"].append(reject)
    return {fold: {key: statistics.median(v) for key, v in t.items()} for fold, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=["lfm2", "mamba"], default="lfm2")
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
        write_checkpoint(root / "ckpt", a.family, a.hidden, a.layers, a.vocab)
        store = ModelStore(root / "models")
        import_model(str(root / "ckpt"), name="bench", store=store, progress=False)
        engines = {fold: Engine(store, "bench", fold) for fold in ("replay", "per-row")}
    med = measure(engines, a)
    info = engines["per-row"].sm.info
    state_bytes = info.state_bytes

    rows = []
    for k in a.drafts:
        plain = statistics.mean(m["plain"] for m in med.values())  # the same step in both modes: one figure
        row: dict = {"k": k, "plain_ms": round(plain, 2)}
        for fold, m in med.items():
            extra = max(0.0, m[f"reject{k}"] - m[f"accept{k}"])
            row[fold] = {
                "plain_ms": round(m["plain"], 2),
                "accept_round_ms": round(m[f"accept{k}"], 2),
                "reject_round_ms": round(m[f"reject{k}"], 2),
                "reject_extra_ms": round(extra, 2),
                "break_even_alpha": break_even(k, plain, m[f"accept{k}"], extra),
            }
        m = med["replay"]  # the same passes with nothing to pay on a rejection (a model without state)
        row["stateless_break_even_alpha"] = break_even(k, plain, m[f"accept{k}"], 0.0)
        rows.append(row)
    memory = {
        "state_bytes": state_bytes,
        "replay_bytes_per_sequence": 2 * state_bytes,
        "per_row_bytes_per_sequence": (2 + info.per_row_states) * state_bytes,
        "per_row_states": info.per_row_states,
    }
    if a.json:
        print(json.dumps({"rounds": rows, "memory": memory}))
        return
    print(
        f"{a.family} random, hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, fp32, {a.threads} threads, "
        f"context {a.context}, medians of {a.repeats}"
    )
    for r in rows:
        print(json.dumps(r))
    print(json.dumps(memory))


if __name__ == "__main__":
    main()
