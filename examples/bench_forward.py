"""Decode speed of our paged forward against Hugging Face transformers on the same converted checkpoint
(the store's copy of a model): batch-1 latency per token and batch-8 throughput, greedy, fp32, CPU.

    .venv/bin/python examples/bench_forward.py --tokens 32
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from pie_runtime.models.context import ForwardContext, Segment
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.reference import transformers_llama
from pie_runtime.shipped import ensure_default_model
from pie_runtime.store import DEFAULT_MODEL, LoadedModel, load_model

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
PAGE_SIZE = 16


def ours_decode(loaded: LoadedModel, prompt: list[int], batch: int, tokens: int) -> float:
    """Seconds for ``tokens`` greedy decode steps of ``batch`` sequences (prefill not counted)."""
    model = loaded.llama
    pages_per_seq = (len(prompt) + tokens) // PAGE_SIZE + 1
    kv = KVCache(model.config, pages_per_seq * batch, PAGE_SIZE, torch.float32)
    tables = [list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(batch)]
    ctx = ForwardContext.build([Segment(t, 0, len(prompt)) for t in tables], PAGE_SIZE)
    hidden = model.forward(model.embed(torch.tensor(prompt * batch)), ctx, kv)
    last_rows = torch.arange(1, batch + 1) * len(prompt) - 1
    next_ids = model.logits(hidden[last_rows]).argmax(-1)
    start = time.perf_counter()
    for step in range(tokens):
        ctx = ForwardContext.build([Segment(t, len(prompt) + step, 1) for t in tables], PAGE_SIZE)
        hidden = model.forward(model.embed(next_ids), ctx, kv)
        next_ids = model.logits(hidden).argmax(-1)
    return time.perf_counter() - start


def hf_reference(loaded: LoadedModel, folder: Path):
    return transformers_llama(loaded.tokenizer_path.parent, loaded.config, folder)


@torch.inference_mode()
def hf_decode(model, prompt: list[int], batch: int, tokens: int) -> float:
    from transformers import DynamicCache

    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)  # renamed in 5.x
    cache = DynamicCache()
    out = model(torch.tensor([prompt] * batch), past_key_values=cache, use_cache=True)
    next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(tokens):
        out = model(next_ids, past_key_values=cache, use_cache=True)
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per measurement")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()

    if args.model == DEFAULT_MODEL:
        ensure_default_model()
    loaded = load_model(args.model)
    prompt = Tokenizer.from_file(str(loaded.tokenizer_path)).encode(PROMPT).ids
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_reference(loaded, Path(tmp))
        ours_decode(loaded, prompt, 1, 2)  # warm-up
        hf_decode(hf, prompt, 1, 2)
        results = {}
        for batch in (1, 8):
            results[("ours", batch)] = ours_decode(loaded, prompt, batch, args.tokens)
            results[("transformers", batch)] = hf_decode(hf, prompt, batch, args.tokens)

    table = Table(
        title=f"{args.model}: {args.tokens} greedy decode steps, {len(prompt)}-token prompt, fp32, "
        f"{torch.get_num_threads()} threads"
    )
    table.add_column("measure")
    for col in ("ours", "transformers", "ours / transformers"):
        table.add_column(col, justify="right")
    b1 = {k: results[(k, 1)] / args.tokens * 1e3 for k in ("ours", "transformers")}
    b8 = {k: 8 * args.tokens / results[(k, 8)] for k in ("ours", "transformers")}
    table.add_row(
        "batch 1: ms per token",
        f"{b1['ours']:.1f}",
        f"{b1['transformers']:.1f}",
        f"{b1['ours'] / b1['transformers']:.2f}x",
    )
    table.add_row(
        "batch 8: tokens per s",
        f"{b8['ours']:.1f}",
        f"{b8['transformers']:.1f}",
        f"{b8['ours'] / b8['transformers']:.2f}x",
    )
    console = Console(width=120)
    console.print(table)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is KiB on Linux
    console.print(f"peak RSS {peak_mib:.0f} MiB (both models loaded in one process)")


if __name__ == "__main__":
    main()
