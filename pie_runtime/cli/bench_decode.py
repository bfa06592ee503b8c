"""`pie bench decode`: batch-1 greedy decode of one model, measured in one run and one process tree — pie in
each weight format, transformers fp32 and bf16, llama.cpp (llama-cpp-python on the packaged GGUF) and OpenVINO
GenAI (an int4 export of the same weights; asked for with ``--peers openvino``).

    pie bench decode [--formats fp32,bf16,int8,int4] [--tokens 128] [--threads N] [--depth N]
                     [--peers transformers,llama.cpp,openvino] [--speculation] [--json]

Everyone gets the same ~512-token prompt (pie_runtime/assets/prompts/prefill512.txt, chat-rendered), the
same token ids, the same token budget (each stops at EOS) and the same thread count, each in its own process:
an engine subprocess per format driven by text-completion, a transformers worker per dtype, a llama.cpp worker
(installed on demand, ``pie_runtime.bench.llama_cpp_env``). Columns: decode tok/s, ratios against llama.cpp's
plain decode and transformers fp32, prefill tok/s, peak RSS (VmHWM) of the process that holds the weights, and
for pie and llama.cpp the cost of one sequence's pass of 1/4/8/16 rows after 128 cached tokens (a verify
window's width: the engine's own start-up curve for pie, timed the same way by the llama.cpp worker).
``--speculation`` adds cacheback (pie, the engine's default format) and llama.cpp's prompt lookup on the
repetitive prompt, each beside its plain decode. ``--depth N`` replaces the prompt by exactly N token ids cut
from a corpus text (decode after a long context; every runner gets the same ids, pie's KV pool is sized to hold
them, llama.cpp keeps its window-sized SWA cache as ``llama-bench -d`` does).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator

from ..bench.prompts import DECODE_PROMPT, SPECULATION_PROMPT, depth_corpus, depth_prompt_ids, prompt_text
from ..models.formats import DEFAULT_WEIGHTS, WEIGHT_FORMATS, WeightFormat
from ..store import DEFAULT_MODEL

if TYPE_CHECKING:
    from ..bench.pie_runs import EngineSession, Job
    from ..bench.report import Report

Peer = Literal["transformers", "llama.cpp", "openvino"]
PASS_CONTEXT = 128  # cached tokens before a timed pass: the engine's pass-cost curve's (engine/pass_costs.py)
WORKER_TIMEOUT_S = 1200


class DecodeOptions(BaseModel):
    """`pie bench decode`'s options, checked."""

    model: str = DEFAULT_MODEL
    # gguf runs the default model's blocks as int4 does (its Q4_1/Q8_0 on the same kernels): asked for, not default
    formats: list[WeightFormat] = Field(
        default_factory=lambda: [f for f in WEIGHT_FORMATS if f != "gguf"], min_length=1
    )
    tokens: int = Field(default=128, ge=2)
    threads: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    peers: list[Peer] = Field(default_factory=lambda: ["transformers", "llama.cpp"])
    speculation: bool = False
    lookup: int = Field(default=10, ge=1)  # llama.cpp's num_pred_tokens
    depth: int | None = Field(default=None, ge=2)  # decode after exactly this many prompt token ids
    depth_corpus: Path | None = None  # the text a --depth prompt is cut from (default: the corpus's austen.txt)
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
            "depth": a.depth,
            "depth_corpus": a.depth_corpus,
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
    p.add_argument(
        "--peers", default=None, help="transformers,llama.cpp,openvino (default transformers,llama.cpp; 'none')"
    )
    p.add_argument("--speculation", action="store_true", help="cacheback vs llama.cpp prompt lookup, repetitive prompt")
    p.add_argument("--lookup", type=int, default=None, help="llama.cpp prompt lookup's num_pred_tokens (default 10)")
    p.add_argument("--depth", type=int, default=None, help="decode after a prompt of exactly N tokens (from a corpus)")
    p.add_argument("--depth-corpus", type=Path, default=None, help="the text --depth cuts from (default austen.txt)")
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


def run_bench(o: DecodeOptions, progress: Callable[[str], None] = _progress) -> Report:
    """Measures every runner ``o`` asks for, one after the other; returns the ``Report``."""
    from tokenizers import Tokenizer

    from ..bench.report import Report
    from ..shipped import ensure_default_model
    from ..store import ModelStore

    if o.model == DEFAULT_MODEL:
        ensure_default_model()
    store = ModelStore()
    manifest = store.get(o.model)
    tok = Tokenizer.from_file(str(store.path(o.model) / "tokenizer.json"))
    texts = {name: prompt_text(name) for name in (DECODE_PROMPT, SPECULATION_PROMPT)}
    ids = {name: tok.encode(text, add_special_tokens=False).ids for name, text in texts.items()}
    prompt, depth_ids = DECODE_PROMPT, None
    if o.depth is not None:
        prompt, depth_ids = _depth_prompt(o, store.path(o.model) / "tokenizer.json", manifest)
        ids[DECODE_PROMPT] = depth_ids
    report = Report(
        model=o.model,
        threads=o.threads,
        tokens=o.tokens,
        formats=list(o.formats),
        prompt=prompt,
        speculation_prompt=SPECULATION_PROMPT if o.speculation else None,
        note=f"one run, {os.cpu_count()} CPUs shared with other processes, load average {os.getloadavg()[0]:.1f} "
        "at start",
    )
    from ..bench.bandwidth import read_bandwidth

    progress("read bandwidth")
    report.read_gb_s = round(read_bandwidth(o.threads), 1)
    bench = DecodeBench(o, report, texts, progress, depth_ids, manifest.config)
    bench.pie()
    if "transformers" in o.peers:
        bench.transformers(ids)
    if "llama.cpp" in o.peers:
        bench.llama_cpp(ids, list(manifest.config.eos_token_ids))
    if "openvino" in o.peers:
        bench.openvino(ids[DECODE_PROMPT], list(manifest.config.eos_token_ids))
    report.note += f" and {os.getloadavg()[0]:.1f} at the end; peak RSS = VmHWM of the process holding the weights"
    report.add_ratios()
    _add_streamed(report, manifest)
    return report


def _depth_prompt(o: DecodeOptions, tokenizer_file: Path, manifest) -> tuple[str, list[int]]:
    """``--depth``'s prompt: its name in the report and its ``o.depth`` token ids (with the model's BOS first
    when it adds one). LaunchError when the model's context cannot hold them and the new tokens."""
    from ..launcher import LaunchError

    assert o.depth is not None
    limit = manifest.config.max_position_embeddings
    if o.depth + o.tokens > limit:
        raise LaunchError(f"--depth {o.depth} + --tokens {o.tokens} is past {o.model}'s context of {limit} tokens")
    corpus = depth_corpus(o.depth_corpus)
    t = manifest.tokenizer
    bos = t.bos_token_id if t.add_bos_token else None
    return f"{corpus.name}, {o.depth} tokens", depth_prompt_ids(tokenizer_file, corpus, o.depth, bos)


def _add_streamed(report: Report, manifest) -> None:
    """Each plain-decode row's bytes a token streams and its share of the measured read bandwidth."""
    from ..bench import llama_cpp_env
    from ..bench.bandwidth import gguf_token_bytes, pie_token_bytes
    from ..bench.report import LLAMA_CPP, PIE, TRANSFORMERS
    from ..engine.build import torch_kernels_reason

    for r in report.rows:
        fmt = r.variant.split()[0]
        size = None
        if r.runner == PIE and fmt in WEIGHT_FORMATS:
            native = torch_kernels_reason(manifest.config, fmt, "cpu", 1) is None
            size = pie_token_bytes(manifest, fmt, native)
        elif r.runner == TRANSFORMERS and fmt in ("fp32", "bf16"):
            size = pie_token_bytes(manifest, fmt, False)
        elif r.runner == LLAMA_CPP:
            try:
                size = gguf_token_bytes(llama_cpp_env.model_gguf(report.model))
            except llama_cpp_env.LlamaCppUnavailable:
                size = None
        if size:
            r.token_mb = round(size / 1e6, 1)
            if report.read_gb_s:
                r.bandwidth_share = round(r.decode_tokens_per_s * size / (report.read_gb_s * 1e9), 3)


class DecodeBench:
    """One `pie bench decode` run: each runner's measurements go into ``report``, or a skip with its reason."""

    def __init__(
        self,
        o: DecodeOptions,
        report: Report,
        texts: dict[str, str],
        progress: Callable[[str], None],
        depth_ids: list[int] | None = None,
        config=None,
    ):
        self.o, self.report, self.texts, self.progress = o, report, texts, progress
        self.depth_ids = depth_ids  # --depth's prompt ids, handed to every runner as they are
        self.engine_args = list(o.engine_args)
        if depth_ids is not None and config is not None:  # a KV pool that holds the whole depth
            from ..bench.pie_runs import kv_memory_args

            self.engine_args += kv_memory_args(config, len(depth_ids) + o.tokens + 64, o.engine_args)

    def skip(self, runner: str, variant: str, reason: str) -> None:
        from ..bench.report import Skipped

        self.report.skipped.append(Skipped(runner=runner, variant=variant, reason=reason))
        self.progress(self.report.skipped[-1].line())

    def pie(self) -> None:
        """One engine per format; the speculation runs share the default format's engine."""
        from ..bench.pie_runs import Job
        from ..bench.report import PIE, Row

        o, speculation = self.o, self.texts[SPECULATION_PROMPT]
        spec_jobs = [
            Job("spec plain", "text-completion", speculation),
            Job("spec cacheback", "cacheback-speculative-decoding", speculation),
        ]
        sessions: dict[str, EngineSession] = {}
        for fmt in o.formats:
            jobs = [Job("plain", "text-completion", self.texts[DECODE_PROMPT], ids=self.depth_ids)]
            jobs += spec_jobs if o.speculation and fmt == DEFAULT_WEIGHTS else []
            self.progress(f"pie {fmt}: engine start, then {len(jobs)} run(s)")
            s = self._session(fmt, fmt, jobs)
            if s is None:
                continue
            sessions[fmt] = s
            row = Row.of(PIE, fmt, s.results["plain"], s.pass_cost_ms)
            row.peak_rss_mib = None if s.peak_rss_mib is None else round(s.peak_rss_mib, 1)
            self.report.rows.append(row)
            self.progress(f"pie {fmt}: {row.decode_tokens_per_s} tok/s, pass costs (ms by rows) {s.pass_cost_ms}")
        if not o.speculation:
            return
        if DEFAULT_WEIGHTS not in sessions:
            self.progress(f"pie {DEFAULT_WEIGHTS}: engine start for the speculation runs")
            s = self._session(DEFAULT_WEIGHTS, f"{DEFAULT_WEIGHTS} speculation", spec_jobs)
            if s is None:
                return
            sessions[DEFAULT_WEIGHTS] = s
        res = sessions[DEFAULT_WEIGHTS].results
        self.report.speculation += [
            Row.of(PIE, f"{DEFAULT_WEIGHTS} text-completion", res["spec plain"]),
            Row.of(PIE, f"{DEFAULT_WEIGHTS} cacheback", res["spec cacheback"]),
        ]

    def _session(self, fmt: str, variant: str, jobs: list[Job]) -> EngineSession | None:
        """The jobs run on one engine in ``fmt``, or None when it failed (skipped as ``variant``)."""
        from ..bench.pie_runs import run_session
        from ..bench.report import PIE
        from ..launcher import LaunchError

        try:
            return run_session(self.o.model, fmt, self.o.threads, jobs, self.o.tokens, self.engine_args)
        except LaunchError as e:
            self.skip(PIE, variant, str(e))
            return None

    def transformers(self, ids: dict[str, list[int]]) -> None:
        """transformers in fp32 and bf16, each in a worker process."""
        from ..bench.hf_worker import HfJob
        from ..bench.report import TRANSFORMERS, Row

        o = self.o
        if importlib.util.find_spec("transformers") is None:
            for dtype in ("fp32", "bf16"):
                self.skip(TRANSFORMERS, dtype, "transformers is not installed (`bash scripts/setup.sh --test` adds it)")
            return
        for dtype in ("fp32", "bf16"):
            self.progress(f"transformers {dtype}")
            job = HfJob(model=o.model, dtype=dtype, threads=o.threads, prompt_ids=ids[DECODE_PROMPT], tokens=o.tokens)
            cmd = [sys.executable, "-m", "pie_runtime.bench.hf_worker", job.model_dump_json()]
            try:
                self.report.rows.append(Row.of(TRANSFORMERS, dtype, run_worker(cmd)))
                self.progress(f"transformers {dtype}: {self.report.rows[-1].decode_tokens_per_s} tok/s")
            except WorkerFailed as e:
                self.skip(TRANSFORMERS, dtype, str(e))

    def llama_cpp(self, ids: dict[str, list[int]], eos_ids: list[int]) -> None:
        """llama.cpp on the packaged GGUF (installed on demand): plain decode, and with --speculation its plain
        decode and its prompt lookup on the repetitive prompt."""
        from ..bench import llama_cpp_env
        from ..bench.report import LLAMA_CPP, PASS_ROWS, Row

        o, report = self.o, self.report
        try:
            gguf = llama_cpp_env.model_gguf(o.model)
            python = llama_cpp_env.ensure_llama_cpp(self.progress)
        except llama_cpp_env.LlamaCppUnavailable as e:
            self.skip(LLAMA_CPP, "GGUF", str(e))
            return
        kind = llama_cpp_env.gguf_label(gguf)  # the file's own quantization names llama.cpp's rows
        # at --depth llama.cpp keeps a window-sized cache for sliding layers (swa_full=False, as llama-bench does)
        runs = [(kind + (", window SWA cache" if self.depth_ids is not None else ""), DECODE_PROMPT, 0, report.rows)]
        if o.speculation:
            runs += [(f"{kind} plain", SPECULATION_PROMPT, 0, report.speculation)]
            runs += [(f"{kind} prompt lookup ({o.lookup})", SPECULATION_PROMPT, o.lookup, report.speculation)]
        for variant, prompt, lookup, rows in runs:
            self.progress(f"llama.cpp {variant} ({self.report.prompt if prompt == DECODE_PROMPT else prompt} prompt)")
            job = {
                "gguf": str(gguf),
                "threads": o.threads,
                "prompt_ids": ids[prompt],
                "tokens": o.tokens,
                "eos_ids": eos_ids,
                "lookup": lookup,
            }
            if lookup == 0 and prompt == DECODE_PROMPT:  # the pass costs once, beside the plain decode
                job.update(pass_rows=list(PASS_ROWS), pass_context=PASS_CONTEXT)
            if self.depth_ids is not None and prompt == DECODE_PROMPT:
                job["swa_full"] = False  # llama-bench -d's window-sized cache for sliding layers
            try:
                m = run_worker([str(python), str(llama_cpp_env.WORKER), json.dumps(job)])
                rows.append(Row.of(LLAMA_CPP, variant, m))
                self.progress(f"llama.cpp {variant}: {m.decode_tokens_per_s:.1f} tok/s")
            except WorkerFailed as e:
                self.skip(LLAMA_CPP, variant, str(e))

    def openvino(self, prompt_ids: list[int], eos_ids: list[int]) -> None:
        """OpenVINO GenAI's plain decode of the same ids (installed and exported on demand, ``openvino_env``)."""
        from ..bench import openvino_env
        from ..bench.report import OPENVINO, Row

        variant = openvino_env.VARIANT
        try:
            python = openvino_env.ensure_openvino(self.progress)
            folder = openvino_env.exported_model(self.o.model, python, self.progress)
        except openvino_env.OpenVinoUnavailable as e:
            self.skip(OPENVINO, variant, str(e))
            return
        self.progress(f"openvino {variant}")
        job = {"model_dir": str(folder), "threads": self.o.threads, "prompt_ids": prompt_ids, "tokens": self.o.tokens}
        try:
            m = run_worker([str(python), str(openvino_env.WORKER), json.dumps({**job, "eos_ids": eos_ids})])
        except WorkerFailed as e:
            self.skip(OPENVINO, variant, str(e))
            return
        self.report.rows.append(Row.of(OPENVINO, variant, m))
        self.progress(f"openvino {variant}: {m.decode_tokens_per_s:.1f} tok/s")


def _decode(args: argparse.Namespace) -> int:
    from ..bench.report import print_report
    from ..launcher import LaunchError
    from ..store import StoreError

    try:
        o = DecodeOptions.from_args(args)
    except ValidationError as e:
        err = e.errors()[0]
        print(f"error: --{err['loc'][0] if err['loc'] else 'options'}: {err['msg']}", file=sys.stderr)
        return 2
    try:
        report = run_bench(o)
    except (StoreError, LaunchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if o.json_output:
        print(report.model_dump_json())
    else:
        print_report(report)
    return 0
