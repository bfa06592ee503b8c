"""Replays draft-length schedules offline on real greedy decodes: the same speedup comparison as `pie bench
speculation`, without the machine's noise, so that a change to the planner (sdk/inferlet/spec/draft_policy.py)
can be judged in seconds on many prompts.

Speculative greedy output is the target's greedy output, and the head's drafts at a row depend only on the
text before it, so one greedy decode that reads the MTP head's chain at every step
(examples/drafters/trace_head.py) says what every round of every schedule would draft and keep. Each
schedule is then replayed through the SDK's own planner and head-depth code (``DraftPolicy``,
``ChainedDrafter.chain_depth``), each round priced as the engine measured it at start: the pass cost of
its rows, a head step per level of the chain its fire reads, and the prompt's overhead (the median wall time
of the traced steps past a 1-row pass: messages, sampling, attention over a longer context than the curve's).
Modelled, not timed: it has no noise, but it is only as right as its prices. The ratios run above `pie
bench`'s, and where two counts are near break-even the planner's choice turns on small cost differences that
move between engine starts: scoring a spare draft (the head's chain one level deeper) modelled +5-10% on two
chat replies, where the replayed planner then drafted 2.5 rows a round, and measured -4% to -6% there, where
the engine's drafted 2.2 as before and paid the extra head step. Check a change it favours with `pie bench
speculation` before trusting it.

    python examples/drafters/replay_planner.py --prompt mixed --prompt repetitive --prompt chat.txt --depth 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from inferlet.spec import ChainedDrafter, DraftPolicy, PassCostModel
from pie_runtime.bench.prompts import prompt_text
from pie_runtime.launcher import EmbeddedEngine, LaunchError, run_inferlet

TRACER = Path(__file__).resolve().parent / "trace_head.py"


@dataclass
class Trace:
    """One greedy decode: per step the target's token and the head's chained drafts for the tokens after it."""

    name: str
    tokens: list[int]
    drafts: list[list[int]]
    pass_cost_ms: list[float]
    step_ms: float
    overhead_ms: float
    acceptance: list[float] = field(default_factory=list)  # the head's training record: the planner's prior

    @classmethod
    def record(cls, prompt: str, max_tokens: int, depth: int, engine: str) -> Trace:
        """The trace of ``prompt`` (mixed, repetitive or a file) decoded by ``engine``."""
        words = ["--prompt", prompt_text(prompt), "--max-tokens", str(max_tokens), "--depth", str(depth)]
        out = run_inferlet(TRACER, engine, words, stdout=subprocess.DEVNULL)
        if not out["ok"]:
            raise LaunchError(f"{TRACER.stem}: {out.get('error')}")
        return cls.from_result(Path(prompt).stem, out["result"])

    @classmethod
    def from_result(cls, name: str, out: dict) -> Trace:
        """The trace in trace_head.py's result ``out``."""
        costs, rows = out["pass_cost_ms"], out["rows"]
        chain = out["step_ms"] * (len(rows[0]) - 1)  # each traced step read the whole chain
        overhead = statistics.median([max(0.0, w - costs[0] - chain) for w in out["wall_ms"]] or [0.0])
        drafts = [r[1:] for r in rows]
        return cls(name, [r[0] for r in rows], drafts, costs, out["step_ms"], overhead, out.get("acceptance", []))


def replay(trace: Trace, k: int, adaptive: bool) -> tuple[float, float]:
    """(speedup over plain steps, rows a round) of a run drafting up to ``k`` a round, the planner's count with
    ``adaptive``, else always ``k``; the loop mirrors inferlet.spec.drafting.DraftRounds for a chained head."""
    drafter = ChainedDrafter(lambda depth, at_accepted: None, k, trace.step_ms, trace.acceptance)  # type: ignore[arg-type, return-value]
    costs = trace.pass_cost_ms if adaptive else []
    planner = drafter.planner = DraftPolicy(k, costs, trace.step_ms, prior=drafter.acceptance_prior)
    pass_cost = PassCostModel(trace.pass_cost_ms).pass_cost  # the price of a round, whatever the schedule
    n, ms, chained, rounds, rows = 0, 0.0, k, 0, 0
    last = len(trace.tokens) - 1  # the first token comes with the prefill
    while n < last:
        want = planner.next() if last - n > 1 else 0
        drafts = trace.drafts[n][: min(chained, want, last - n - 1)]
        drafter.proposed = len(drafts)
        depth = drafter.chain_depth()
        kept = 0
        while kept < len(drafts) and drafts[kept] == trace.tokens[n + 1 + kept]:
            kept += 1
        planner.observe(len(drafts), kept)
        elapsed = pass_cost(1 + len(drafts)) + depth * trace.step_ms + trace.overhead_ms
        planner.observe_time(elapsed, 1 + len(drafts), depth)
        ms, n, chained = ms + elapsed, n + kept + 1, depth
        rounds, rows = rounds + 1, rows + 1 + len(drafts)
    plain = last * (pass_cost(1) + trace.overhead_ms)
    return plain / ms, rows / max(rounds, 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", action="append", help="mixed, repetitive (pie_runtime/assets/prompts) or a file")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=3, help="schedules draft up to 1..depth (the head's depth at most)")
    ap.add_argument("--traces", type=Path, help="a JSON file of traces: read if it exists, else written")
    args = ap.parse_args(argv)
    if args.traces is not None and args.traces.exists():
        traces = [Trace(**t) for t in json.loads(args.traces.read_text())]
    else:
        prompts = args.prompt or ["mixed", "repetitive"]
        with EmbeddedEngine(die_with_parent=True) as eng:  # one engine: one cost curve for every trace
            traces = [Trace.record(p, args.max_tokens, args.depth, eng.address) for p in prompts]
        if args.traces is not None:
            args.traces.write_text(json.dumps([t.__dict__ for t in traces]))
    table = Table(title="modelled speedup over plain steps (rows a round)")
    for name in ["schedule", *(t.name for t in traces), "mean"]:
        table.add_column(name, no_wrap=True)
    table.add_row("tokens / overhead", *(f"{len(t.tokens)} / {t.overhead_ms:.1f} ms" for t in traces), "")
    for k in range(1, args.depth + 1):
        for adaptive in (False, True):
            results = [replay(t, k, adaptive) for t in traces]
            cells = [f"{r:.3f}x ({w:.2f})" for r, w in results]
            mean = statistics.mean(r for r, _ in results)
            table.add_row(f"{'adaptive' if adaptive else 'fixed'} {k}", *cells, f"{mean:.3f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
