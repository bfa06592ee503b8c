"""What an engine fuzz run found (``FuzzReport``), and its printed summary: messages by kind, typed errors by
code, and the aims (alive, no internal error, no timeout, no leaked page, RSS near its baseline)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FuzzReport:
    seed: int
    messages: int = 0
    sent_by_kind: Counter[str] = field(default_factory=Counter)
    ok_by_kind: Counter[str] = field(default_factory=Counter)
    seconds_by_kind: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # wall time
    errors_by_code: Counter[str] = field(default_factory=Counter)
    internal: list[str] = field(default_factory=list)  # "kind: message ← request"
    timeouts: list[str] = field(default_factory=list)
    first_failure: dict[str, str] = field(default_factory=dict)  # kind → first failing message and why
    control_errors: list[str] = field(default_factory=list)  # valid requests that failed (stats, ws_open, ...)
    context: dict[str, list[str]] = field(default_factory=dict)  # kind → the messages sent just before it
    stray_replies: int = 0
    max_latency_s: float = 0.0
    crashed: str | None = None  # what was in flight when the engine process exited
    ping_failures: int = 0
    greedy_before: Any = None
    greedy_mismatches: list[str] = field(default_factory=list)
    greedy_ms_before: float = 0.0  # the valid client's greedy request: its latency before, and at worst during
    greedy_ms_max: float = 0.0
    foreign_intact: bool = True
    pages_total: int = 0
    pages_free_after: int = 0
    stats_bytes_before: int = 0  # the size of a stats reply before the fuzz, and after the fuzzer left
    stats_bytes_after: int = 0
    rss_before_kb: int | None = None
    rss_after_kb: int | None = None
    engine_alive: bool = True
    elapsed_s: float = 0.0

    @property
    def pages_leaked(self) -> int:
        return self.pages_total - self.pages_free_after

    @property
    def rss_growth(self) -> float | None:
        if not self.rss_before_kb or self.rss_after_kb is None:
            return None
        return self.rss_after_kb / self.rss_before_kb - 1.0

    def fail(self, kind: str, why: str) -> None:
        self.first_failure.setdefault(kind, why)


# ---- the runner --------------------------------------------------------------------------------------------


def print_report(r: FuzzReport) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"engine fuzz: {r.messages} messages, seed {r.seed}, {r.elapsed_s:.1f} s")
    t.add_column("kind")
    t.add_column("sent", justify="right")
    t.add_column("ok", justify="right")
    t.add_column("s", justify="right")
    t.add_column("first failure")
    for kind in sorted(r.sent_by_kind):
        t.add_row(
            kind,
            str(r.sent_by_kind[kind]),
            str(r.ok_by_kind[kind]),
            f"{r.seconds_by_kind[kind]:.1f}",
            r.first_failure.get(kind, ""),
        )
    console.print(t)
    e = Table(title="typed errors by code")
    e.add_column("code")
    e.add_column("count", justify="right")
    for code, n in r.errors_by_code.most_common():
        e.add_row(code, str(n))
    console.print(e)
    s = Table(title="summary")
    s.add_column("check")
    s.add_column("value")
    growth = r.rss_growth
    rows = [
        ("engine alive", str(r.engine_alive) + (f" (crashed with: {r.crashed})" if r.crashed else "")),
        ("internal errors", str(len(r.internal))),
        ("timeouts (no reply within the bound)", str(len(r.timeouts))),
        ("max latency", f"{r.max_latency_s:.2f} s"),
        ("stray replies", str(r.stray_replies)),
        ("ping failures", str(r.ping_failures)),
        ("valid requests failed", "; ".join(r.control_errors) or "0"),
        ("greedy answer changed", str(len(r.greedy_mismatches))),
        ("greedy latency before / worst during", f"{r.greedy_ms_before:.1f} / {r.greedy_ms_max:.1f} ms"),
        ("victim's handles intact", str(r.foreign_intact)),
        ("pages leaked", f"{r.pages_leaked} of {r.pages_total}" if r.pages_total else "unknown (not measured)"),
        ("stats reply before / after", f"{r.stats_bytes_before} / {r.stats_bytes_after} bytes"),
        ("RSS before / after", f"{r.rss_before_kb} / {r.rss_after_kb} kB"
         + (f" ({100 * growth:+.1f}%)" if growth is not None else "")),
    ]  # fmt: skip
    for k, v in rows:
        s.add_row(k, v)
    console.print(s)
