"""Prompt lookup side by side: Hugging Face transformers' `generate(prompt_lookup_num_tokens=K)` against our
cacheback-speculative-decoding inferlet, each against its own plain greedy decoding, on the same converted
checkpoint (the store's copy of the model) and prompt. Decode-only rates (the prefill is timed apart), fp32, CPU.

    .venv/bin/python examples/bench_prompt_lookup_vs_transformers.py --prompt repetitive --tokens 128 --lookup 8

transformers drafts ``--lookup`` tokens every round; cacheback drafts up to ``--draft-length`` with its
adaptive schedule (the inferlet's defaults), or exactly that many with ``--fixed``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from pie_runtime.bench.prompts import prompt_text
from pie_runtime.cli.bench import digest, measure_prompts
from pie_runtime.reference import transformers_llama
from pie_runtime.shipped import ensure_default_model
from pie_runtime.store import DEFAULT_MODEL, load_model


def hf_model(name: str, folder: Path):
    """The store's converted weights in transformers' LlamaForCausalLM."""
    loaded = load_model(name)
    store_dir = loaded.tokenizer_path.parent
    return transformers_llama(store_dir, loaded.config, folder), store_dir


@torch.inference_mode()
def hf_generate(model, ids: list[int], tokens: int, lookup: int | None) -> tuple[float, list[int]]:
    """(decode tokens per second, generated ids): a 1-token generate times the prefill, subtracted."""
    warnings.filterwarnings("ignore")
    x = torch.tensor([ids])
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    kw = dict(do_sample=False, pad_token_id=model.config.eos_token_id[0], **extra)
    t0 = time.perf_counter()
    model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(x, max_new_tokens=tokens, **kw)
    total = time.perf_counter() - t0
    gen = out[0, len(ids) :].tolist()
    eos = set(model.config.eos_token_id)
    gen = gen[: next((i for i, t in enumerate(gen) if t in eos), len(gen))]
    return (len(gen) - 1) / max(total - prefill, 1e-9), gen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default="repetitive", help="mixed, repetitive or a file")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--lookup", type=int, default=8, help="transformers' prompt_lookup_num_tokens")
    p.add_argument("--draft-length", type=int, default=16, help="ours: the most drafts a round")
    p.add_argument("--fixed", action="store_true", help="ours: always --draft-length drafts (no adaptive schedule)")
    p.add_argument("--max-ngram", type=int, default=3, help="ours; transformers' default is 2")
    args = p.parse_args()

    ensure_default_model()
    text = prompt_text(args.prompt)
    with tempfile.TemporaryDirectory() as tmp:
        model, store_dir = hf_model(DEFAULT_MODEL, Path(tmp))
        ids = Tokenizer.from_file(str(store_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
        hf_generate(model, ids, 2, None)  # warm-up
        hf_plain, plain_ids = hf_generate(model, ids, args.tokens, None)
        hf_lookup, lookup_ids = hf_generate(model, ids, args.tokens, args.lookup)
        del model
    (m,) = measure_prompts(
        "cacheback-speculative-decoding",
        [text],
        [
            "--draft-length",
            str(args.draft_length),
            "--max-ngram",
            str(args.max_ngram),
            "--draft-schedule",
            "fixed" if args.fixed else "adaptive",
        ],
        args.tokens,
    )
    spec, control = m["spec_runs"][0], m["base_runs"][0]
    ours, base = spec["stats"]["decode_tokens_per_s"], control["stats"]["decode_tokens_per_s"]

    table = Table(
        title=f"prompt lookup, {len(ids)}-token prompt ({args.prompt}), {args.tokens} tokens, "
        f"transformers K={args.lookup}, ours up to {args.draft_length}"
        f"{' fixed' if args.fixed else ' adaptive'}, {torch.get_num_threads()} threads"
    )
    for col in ("", "plain tok/s", "lookup tok/s", "lookup / plain", "digest plain", "digest lookup"):
        table.add_column(col, justify="right")
    table.add_row(
        "transformers",
        f"{hf_plain:.1f}",
        f"{hf_lookup:.1f}",
        f"{hf_lookup / hf_plain:.2f}x",
        digest(plain_ids),
        digest(lookup_ids),
    )
    table.add_row(
        "pie (text-completion / cacheback)",
        f"{base:.1f}",
        f"{ours:.1f}",
        f"{ours / base:.2f}x",
        digest(control["token_ids"]),
        digest(spec["token_ids"]),
    )
    console = Console(width=140)
    console.print(table)
    s = spec["stats"]
    console.print(
        f"pie cacheback / transformers lookup: {ours / hf_lookup:.2f}x; acceptance {s['acceptance']:.3f} "
        f"per position {[round(a, 3) for a in s['acceptance_per_position']]}"
    )
    console.print(
        f"same tokens as transformers plain: ours {m['spec']['token_ids'] == plain_ids}, "
        f"transformers lookup {lookup_ids == plain_ids}"
    )


if __name__ == "__main__":
    main()
