"""Our side of `pie bench decode`: one engine subprocess per weight format, driven through shipped inferlets
(text-completion, cacheback) in child processes, greedy; the engine's peak RSS and its pass-cost curve. The
engine runs without its prefix cache: the warm-up's prompt is the measured one, and prefill must be computed.
A job given token ids (``--depth``) hands them to the inferlet as they are; its KV pool is sized to hold them
(:func:`kv_memory_args`)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field

from ..launcher import EmbeddedEngine, LaunchError, resolve_inferlet, run_inferlet
from .report import Measured
from .rss import peak_rss_mib

_PASS_COST = re.compile(r"pass cost by rows \(ms\) (.*)")
_ROWS_MS = re.compile(r"(\d+):(\d+(?:\.\d+)?)")  # "8:42.5"
DEFAULT_KV_MIB = 1024  # the engine's --kv-memory default
WARM_UP_IDS = 512  # a token-id job's warm-up reads this many of its ids: the prefill path, not the whole depth


def parse_pass_costs(log: str) -> dict[int, float]:
    """Rows → ms from the engine's "pass cost by rows (ms) 1:36.0 2:37.1 ..." start-up line."""
    m = _PASS_COST.search(log)
    if not m:
        return {}
    pairs = (_ROWS_MS.fullmatch(word) for word in m.group(1).split())  # other words (a note after them) skipped
    return {int(p[1]): float(p[2]) for p in pairs if p}


def kv_memory_args(config, rows: int, engine_args: list[str]) -> list[str]:
    """``--kv-memory`` for an engine whose sequence reaches ``rows`` rows: room for every layer's K/V of every row
    in float32 (as if every layer were global, so page groups only leave slack), a quarter more for the pages'
    rounding, never below the engine's default; [] when ``engine_args`` already size the pool or the config
    does not say its K/V shape."""
    if any(a.split("=")[0] in ("--kv-memory", "--kv-pages") for a in engine_args):
        return []
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None)
    if not (layers and heads and head_dim):
        return []
    need = layers * heads * head_dim * 2 * 4 * rows * 5 // 4
    return ["--kv-memory", str(max(DEFAULT_KV_MIB, -(-need // (1 << 20))))]


@dataclass
class Job:
    """One inferlet run on the engine: ``label`` names it in the results; ``ids``, when given, are the prompt's
    token ids as they are (``prompt`` is then only a name)."""

    label: str
    inferlet: str
    prompt: str
    words: list[str] = field(default_factory=list)
    ids: list[int] | None = None

    def prompt_words(self) -> list[str]:
        if self.ids is None:
            return ["--prompt", self.prompt]
        # one word an id (a list argument repeats its flag); the ids win over the (required) prompt text
        return ["--prompt", "", *(f"--prompt-token-ids={i}" for i in self.ids)]

    def warm_up(self) -> Job:
        """The warm-up before this job: its prompt, or the first ``WARM_UP_IDS`` of its ids."""
        ids = None if self.ids is None else self.ids[:WARM_UP_IDS]
        return Job("warm-up", "text-completion", self.prompt, ids=ids)


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
            words = [*job.prompt_words(), "--max-tokens", str(max_tokens), "--stream", "false", *job.words]
            out = run_inferlet(resolve_inferlet(job.inferlet), eng.address, words, stdout=subprocess.DEVNULL)
            if not out["ok"]:
                raise LaunchError(f"{job.inferlet}: {out.get('error')}")
            return out["result"]

        go(jobs[0].warm_up(), 4)  # first-call costs, the prefill path
        for job in jobs:
            results[job.label] = _measured(go(job, tokens))
            if peak is None:
                peak = peak_rss_mib(eng.proc.pid)
        log = eng.log
    return EngineSession(results, peak, parse_pass_costs(log), log)
