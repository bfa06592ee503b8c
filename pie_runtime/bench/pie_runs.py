"""Our side of `pie bench decode`: one engine subprocess per weight format, driven through shipped inferlets
(text-completion, cacheback) in child processes, greedy; the engine's peak RSS and its pass-cost curve. The
engine runs without its prefix cache: the warm-up's prompt is the measured one, and prefill must be computed."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field

from ..launcher import EmbeddedEngine, LaunchError, resolve_inferlet, run_inferlet
from .report import Measured
from .rss import peak_rss_mib

_PASS_COST = re.compile(r"pass cost by rows \(ms\) (.*)")
_ROWS_MS = re.compile(r"(\d+):(\d+(?:\.\d+)?)")  # "8:42.5"


def parse_pass_costs(log: str) -> dict[int, float]:
    """Rows → ms from the engine's "pass cost by rows (ms) 1:36.0 2:37.1 ..." start-up line."""
    m = _PASS_COST.search(log)
    if not m:
        return {}
    pairs = (_ROWS_MS.fullmatch(word) for word in m.group(1).split())  # other words (a note after them) skipped
    return {int(p[1]): float(p[2]) for p in pairs if p}


@dataclass
class Job:
    """One inferlet run on the engine: ``label`` names it in the results."""

    label: str
    inferlet: str
    prompt: str
    words: list[str] = field(default_factory=list)


@dataclass
class EngineSession:
    """What one engine in one format measured: each job's result, its peak RSS after the first job (the plain
    decode; the high-water mark only grows), and its pass costs."""

    results: dict[str, Measured]
    peak_rss_mib: float | None
    pass_cost_ms: dict[int, float]
    log: str


def _measured(result: dict) -> Measured:
    s = result["stats"]
    prefill_ms = s.get("prefill_ms") or 0.0
    prompt = int(s.get("prompt_tokens", 0))
    return Measured(
        decode_tokens_per_s=float(s.get("decode_tokens_per_s", 0.0)),
        prefill_tokens_per_s=prompt / (prefill_ms / 1e3) if prefill_ms and prompt else None,
        prompt_tokens=prompt,
        token_ids=list(result["token_ids"]),
        acceptance=s.get("acceptance"),
    )


def run_session(
    model: str, fmt: str, threads: int, jobs: list[Job], tokens: int, engine_args: list[str] | None = None
) -> EngineSession:
    """Starts an engine in ``fmt``, warms it up on the first job's prompt, runs ``jobs`` one after the other
    (greedy, at most ``tokens`` new tokens each) and stops it. Raises LaunchError when the engine or a job fails."""
    args = ["--weights", fmt, "--threads", str(threads), "--no-prefix-cache", *(engine_args or [])]
    results: dict[str, Measured] = {}
    peak: float | None = None
    with EmbeddedEngine([model], args, die_with_parent=True) as eng:

        def go(job: Job, max_tokens: int) -> dict:
            words = ["--prompt", job.prompt, "--max-tokens", str(max_tokens), "--stream", "false", *job.words]
            out = run_inferlet(resolve_inferlet(job.inferlet), eng.address, words, stdout=subprocess.DEVNULL)
            if not out["ok"]:
                raise LaunchError(f"{job.inferlet}: {out.get('error')}")
            return out["result"]

        go(Job("warm-up", "text-completion", jobs[0].prompt), 4)  # first-call costs, the prefill path
        for job in jobs:
            results[job.label] = _measured(go(job, tokens))
            if peak is None:
                peak = peak_rss_mib(eng.proc.pid)
        log = eng.log
    return EngineSession(results, peak, parse_pass_costs(log), log)
