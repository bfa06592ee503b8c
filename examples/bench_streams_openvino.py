"""Many greedy streams in one process, pie against OpenVINO GenAI: pie's working sets driven by one inferlet process
(examples/streams.py, one engine, prefix cache off) and OpenVINO GenAI's ``ContinuousBatchingPipeline`` (prefix
caching off) on the int4 (group 32) export of the same dequantized weights, the same prompt ids, the same token
budget and threads. Prints each side's total new tokens a second, prefill included, and the ratio, round by round
(the two alternate, so a slow spell of a shared machine spreads over both).

    .venv/bin/python examples/bench_streams_openvino.py [--model smollm2-135m] [--streams 16] [--tokens 128]
                                                        [--threads 2] [--rounds 2] [--weights FORMAT]

Each stream's prompt is a different window of the packaged ``mixed`` prose (the model's BOS first where it adds
one). OpenVINO GenAI is installed into its own venv and the model exported on first use
(``pie_runtime.bench.openvino_env``); when that fails the script says why and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pie_runtime.bench import openvino_env
from pie_runtime.bench.prompts import prompt_text
from pie_runtime.launcher import EmbeddedEngine, LaunchError, run_inferlet
from pie_runtime.shipped import ensure_default_model
from pie_runtime.store import DEFAULT_MODEL, ModelStore

STREAMS_INFERLET = Path(__file__).with_name("streams.py")
PROMPT_TOKENS = 120  # each stream's prompt, BOS aside
STRIDE = 8  # ids between the starts of two streams' windows


def prompts(model: str, streams: int) -> list[list[int]]:
    """``streams`` different prompts: windows of the mixed prose's ids, each after the model's BOS."""
    from tokenizers import Tokenizer

    store = ModelStore()
    manifest = store.get(model)
    tok = Tokenizer.from_file(str(store.path(model) / "tokenizer.json"))
    ids = tok.encode(prompt_text("mixed"), add_special_tokens=False).ids
    need = (streams - 1) * STRIDE + PROMPT_TOKENS
    ids = (ids * (need // max(1, len(ids)) + 1))[:need]
    t = manifest.tokenizer
    head = [t.bos_token_id] if t.add_bos_token and t.bos_token_id is not None else []
    return [head + ids[i * STRIDE : i * STRIDE + PROMPT_TOKENS] for i in range(streams)]


def pie_round(eng: EmbeddedEngine, prompts_file: Path, tokens: int) -> dict:
    words = ["--prompts-file", str(prompts_file), "--max-tokens", str(tokens)]
    out = run_inferlet(STREAMS_INFERLET, eng.address, words, stdout=subprocess.DEVNULL)
    if not out["ok"]:
        raise LaunchError(f"streams.py: {out.get('error')}")
    return out["result"]


def openvino_round(python: Path, folder: Path, streams: list[list[int]], a: argparse.Namespace, eos: list[int]):
    job = {"model_dir": str(folder), "threads": a.threads, "streams": streams, "tokens": a.tokens, "eos_ids": eos}
    out = subprocess.run([str(python), str(openvino_env.WORKER), json.dumps(job)], capture_output=True, text=True)
    if out.returncode != 0:
        tail = [ln for ln in out.stderr.splitlines() if ln.strip()][-1:]
        raise openvino_env.OpenVinoUnavailable(f"the worker failed: {tail[0][:300] if tail else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--weights", default=None, help="pie's weight format (default: the engine's)")
    a = ap.parse_args(argv)
    if a.model == DEFAULT_MODEL:
        ensure_default_model()
    try:
        python = openvino_env.ensure_openvino(lambda s: print(s, file=sys.stderr))
        folder = openvino_env.exported_model(a.model, python, lambda s: print(s, file=sys.stderr))
    except openvino_env.OpenVinoUnavailable as e:
        print(f"openvino skipped: {e}", file=sys.stderr)
        return 1
    streams = prompts(a.model, a.streams)
    eos = list(ModelStore().get(a.model).config.eos_token_ids)
    args = ["--threads", str(a.threads), "--no-prefix-cache", *(["--weights", a.weights] if a.weights else [])]
    print(
        f"{a.streams} greedy streams of up to {a.tokens} tokens, {a.model}, {a.threads} threads, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory() as tmp, EmbeddedEngine([a.model], args, die_with_parent=True) as eng:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(streams[:2]))
        pie_round(eng, prompts_file, 4)  # warm-up: first-call costs
        prompts_file.write_text(json.dumps(streams))
        for r in range(a.rounds):
            pie = pie_round(eng, prompts_file, a.tokens)
            ov = openvino_round(python, folder, streams, a, eos)
            ratio = pie["tokens_per_s"] / ov["tokens_per_s"]
            print(
                f"round {r + 1}: pie {pie['tokens_per_s']:.1f} tok/s ({pie['total_tokens']} tokens in "
                f"{pie['seconds']:.2f} s), openvino {ov['tokens_per_s']:.1f} tok/s ({ov['total_tokens']} in "
                f"{ov['seconds']:.2f} s): {ratio:.2f}x, load average {os.getloadavg()[0]:.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
