"""`pie bench decode`: batch-1 greedy decode of one model, measured in one run and one process tree — pie in
each weight format, transformers fp32 and bf16, and llama.cpp (llama-cpp-python on the packaged GGUF).

    pie bench decode [--formats fp32,bf16,int8,int4] [--tokens 128] [--threads N]
                     [--peers transformers,llama.cpp] [--speculation] [--json]

Everyone gets the same ~512-token prompt (pie_runtime/assets/prompts/prefill512.txt, chat-rendered), the
same token ids, the same token budget (each stops at EOS) and the same thread count, each in its own process:
an engine subprocess per format driven by text-completion, a transformers worker per dtype, a llama.cpp worker
(installed on demand, ``pie_runtime.bench.llama_cpp_env``). Columns: decode tok/s, ratios against llama.cpp's
plain decode and transformers fp32, prefill tok/s, peak RSS (VmHWM) of the process that holds the weights, and
for pie the engine's pass cost at 1/8/16 rows. ``--speculation`` adds cacheback (pie, the engine's default
format) and llama.cpp's prompt lookup on the repetitive prompt, each beside its plain decode.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, field_validator

from ..bench.prompts import DECODE_PROMPT, SPECULATION_PROMPT, prompt_text
from ..models.formats import DEFAULT_WEIGHTS, WEIGHT_FORMATS, WeightFormat
from ..store import DEFAULT_MODEL

Peer = Literal["transformers", "llama.cpp"]
WORKER_TIMEOUT_S = 1200


class DecodeOptions(BaseModel):
    """`pie bench decode`'s options, checked."""

    model: str = DEFAULT_MODEL
    formats: list[WeightFormat] = Field(default_factory=lambda: list(WEIGHT_FORMATS), min_length=1)
    tokens: int = Field(default=128, ge=2)
    threads: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    peers: list[Peer] = Field(default_factory=lambda: ["transformers", "llama.cpp"])
    speculation: bool = False
    lookup: int = Field(default=10, ge=1)  # llama.cpp's num_pred_tokens
    json_output: bool = False
    engine_args: list[str] = Field(default_factory=list)

    @field_validator("formats", "peers", mode="before")
    @classmethod
    def _comma_list(cls, v: object) -> object:
        if isinstance(v, str):
            return [] if v.strip().lower() in ("", "none") else [w.strip() for w in v.split(",") if w.strip()]
        return v

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> DecodeOptions:
        given = {
            "model": a.model,
            "formats": a.formats,
            "tokens": a.tokens,
            "threads": a.threads,
            "peers": a.peers,
            "speculation": a.speculation,
            "lookup": a.lookup,
            "json_output": a.json,
            "engine_args": a.engine_arg,
        }
        return cls.model_validate({k: v for k, v in given.items() if v is not None})


def add_decode_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="batch-1 decode: pie per weight format vs transformers vs llama.cpp")
    p.add_argument("--model", default=None, help=f"a store model (default {DEFAULT_MODEL}; llama.cpp needs it)")
    p.add_argument("--formats", default=None, help="pie weight formats, comma-separated (default fp32,bf16,int8,int4)")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per run (default 128; EOS stops earlier)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for every runner (default: all CPUs)")
    p.add_argument("--peers", default=None, help="transformers,llama.cpp (default both; 'none' for neither)")
    p.add_argument("--speculation", action="store_true", help="cacheback vs llama.cpp prompt lookup, repetitive prompt")
    p.add_argument("--lookup", type=int, default=None, help="llama.cpp prompt lookup's num_pred_tokens (default 10)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--engine-arg", action="append", default=None, help="extra engine flag for pie (repeatable)")
    p.set_defaults(func=_decode)


def _progress(line: str) -> None:
    print(f"[bench] {line}", file=sys.stderr, flush=True)


class WorkerFailed(RuntimeError):
    pass


def run_worker(cmd: list[str], timeout: float = WORKER_TIMEOUT_S):
    """Runs a worker process and parses the ``Measured`` JSON on its last stdout line."""
    from ..bench.report import Measured

    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise WorkerFailed(f"ran past {timeout:.0f} s") from None
    if out.returncode != 0:
        if out.returncode < 0:
            why = signal.Signals(-out.returncode).name
            why += " (illegal instruction: a build for another CPU)" if why == "SIGILL" else ""
        else:
            tail = [ln for ln in out.stderr.splitlines() if ln.strip()][-1:]
            why = f"exit {out.returncode}: {tail[0].strip()[:300] if tail else 'no output'}"
        raise WorkerFailed(why)
    lines = out.stdout.strip().splitlines()
    try:
        return Measured.model_validate_json(lines[-1] if lines else "")
    except ValidationError as e:
        raise WorkerFailed(f"unreadable result: {e.errors()[0]['msg']}") from None


def run_bench(o: DecodeOptions, progress: Callable[[str], None] = _progress):
    """Measures every runner ``o`` asks for, one after the other; returns the ``Report``."""
    from tokenizers import Tokenizer

    from ..bench import llama_cpp_env
    from ..bench.hf_worker import HfJob
    from ..bench.pie_runs import EngineSession, Job, run_session
    from ..bench.report import LLAMA_CPP, PIE, TRANSFORMERS, Report, Row, Skipped
    from ..launcher import LaunchError
    from ..shipped import ensure_default_model
    from ..store import ModelStore

    if o.model == DEFAULT_MODEL:
        ensure_default_model()
    store = ModelStore()
    manifest = store.get(o.model)
    tok = Tokenizer.from_file(str(store.path(o.model) / "tokenizer.json"))
    texts = {name: prompt_text(name) for name in (DECODE_PROMPT, SPECULATION_PROMPT)}
    ids = {name: tok.encode(text, add_special_tokens=False).ids for name, text in texts.items()}
    load = os.getloadavg()[0]
    report = Report(
        model=o.model,
        threads=o.threads,
        tokens=o.tokens,
        formats=list(o.formats),
        prompt=DECODE_PROMPT,
        speculation_prompt=SPECULATION_PROMPT if o.speculation else None,
        note=f"one run, {os.cpu_count()} CPUs shared with other processes, load average {load:.1f} at start",
    )
    default_fmt = DEFAULT_WEIGHTS

    def skip(runner: str, variant: str, reason: str) -> None:
        report.skipped.append(Skipped(runner=runner, variant=variant, reason=reason))
        progress(report.skipped[-1].line())

    # pie: one engine per format; the speculation runs share the default format's engine
    decode_job = Job("plain", "text-completion", texts[DECODE_PROMPT])
    spec_jobs = [
        Job("spec plain", "text-completion", texts[SPECULATION_PROMPT]),
        Job("spec cacheback", "cacheback-speculative-decoding", texts[SPECULATION_PROMPT]),
    ]
    sessions: dict[str, EngineSession] = {}
    for fmt in o.formats:
        jobs = [decode_job] + (spec_jobs if o.speculation and fmt == default_fmt else [])
        progress(f"pie {fmt}: engine start, then {len(jobs)} run(s)")
        try:
            s = sessions[fmt] = run_session(o.model, fmt, o.threads, jobs, o.tokens, o.engine_args)
        except LaunchError as e:
            skip(PIE, fmt, str(e))
            continue
        row = Row.of(PIE, fmt, s.results["plain"], s.pass_cost_ms)
        row.peak_rss_mib = None if s.peak_rss_mib is None else round(s.peak_rss_mib, 1)
        report.rows.append(row)
        progress(f"pie {fmt}: {row.decode_tokens_per_s} tok/s, pass costs (ms by rows) {s.pass_cost_ms}")
    if o.speculation and default_fmt not in sessions:
        progress(f"pie {default_fmt}: engine start for the speculation runs")
        try:
            sessions[default_fmt] = run_session(o.model, default_fmt, o.threads, spec_jobs, o.tokens, o.engine_args)
        except LaunchError as e:
            skip(PIE, f"{default_fmt} speculation", str(e))
    if o.speculation and default_fmt in sessions:
        res = sessions[default_fmt].results
        report.speculation += [
            Row.of(PIE, f"{default_fmt} text-completion", res["spec plain"]),
            Row.of(PIE, f"{default_fmt} cacheback", res["spec cacheback"]),
        ]

    if "transformers" in o.peers:
        for dtype in ("fp32", "bf16"):
            progress(f"transformers {dtype}")
            job = HfJob(model=o.model, dtype=dtype, threads=o.threads, prompt_ids=ids[DECODE_PROMPT], tokens=o.tokens)
            cmd = [sys.executable, "-m", "pie_runtime.bench.hf_worker", job.model_dump_json()]
            try:
                report.rows.append(Row.of(TRANSFORMERS, dtype, run_worker(cmd)))
                progress(f"transformers {dtype}: {report.rows[-1].decode_tokens_per_s} tok/s")
            except WorkerFailed as e:
                skip(TRANSFORMERS, dtype, str(e))

    if "llama.cpp" in o.peers:
        try:
            gguf = llama_cpp_env.packaged_gguf(o.model)
            python = llama_cpp_env.ensure_llama_cpp(progress)
        except llama_cpp_env.LlamaCppUnavailable as e:
            skip(LLAMA_CPP, "Q4_1", str(e))
        else:
            runs = [("Q4_1", DECODE_PROMPT, 0, report.rows)]
            if o.speculation:
                runs += [("Q4_1 plain", SPECULATION_PROMPT, 0, report.speculation)]
                runs += [(f"Q4_1 prompt lookup ({o.lookup})", SPECULATION_PROMPT, o.lookup, report.speculation)]
            for variant, prompt, lookup, rows in runs:
                progress(f"llama.cpp {variant} ({prompt} prompt)")
                job = {
                    "gguf": str(gguf),
                    "threads": o.threads,
                    "prompt_ids": ids[prompt],
                    "tokens": o.tokens,
                    "eos_ids": list(manifest.config.eos_token_ids),
                    "lookup": lookup,
                }
                try:
                    m = run_worker([str(python), str(llama_cpp_env.WORKER), json.dumps(job)])
                    rows.append(Row.of(LLAMA_CPP, variant, m))
                    progress(f"llama.cpp {variant}: {m.decode_tokens_per_s:.1f} tok/s")
                except WorkerFailed as e:
                    skip(LLAMA_CPP, variant, str(e))
    report.note += f" and {os.getloadavg()[0]:.1f} at the end; peak RSS = VmHWM of the process holding the weights"
    report.add_ratios()
    return report


def _decode(args: argparse.Namespace) -> int:
    from ..bench.report import print_report
    from ..store import StoreError

    try:
        o = DecodeOptions.from_args(args)
    except ValidationError as e:
        err = e.errors()[0]
        print(f"error: --{err['loc'][0] if err['loc'] else 'options'}: {err['msg']}", file=sys.stderr)
        return 2
    try:
        report = run_bench(o)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if o.json_output:
        print(report.model_dump_json())
    else:
        print_report(report)
    return 0
