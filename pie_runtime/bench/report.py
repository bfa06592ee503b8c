"""What `pie bench decode` measures, as pydantic models (the workers' JSON lines and the --json output), the
ratios between its rows, and the rich tables a person reads."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from pydantic import BaseModel, Field

PIE, TRANSFORMERS, LLAMA_CPP, OPENVINO = "pie", "transformers", "llama.cpp", "openvino"
PASS_ROWS = (1, 4, 8, 16)  # the pass costs the table shows: one sequence's pass of that many rows after 128 tokens


def digest(token_ids: list[int]) -> str:
    """Short sha256 of a token-id list (the same digest `pie bench speculation` prints)."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


class Measured(BaseModel):
    """One timed greedy decode, as a runner reports it (a worker prints it as its last stdout line)."""

    decode_tokens_per_s: float
    prefill_tokens_per_s: float | None = None
    prompt_tokens: int
    token_ids: list[int]
    peak_rss_mib: float | None = None
    acceptance: float | None = None  # speculative runs only
    pass_cost_ms: dict[int, float] = Field(default_factory=dict)  # rows → ms of one pass, when the runner timed it


class Row(BaseModel):
    """A table row: one runner in one weight format (or one decoding method, in the speculation table)."""

    runner: str  # pie, transformers, llama.cpp, openvino
    variant: str  # fp32 / bf16 / int8 / int4 / the GGUF's kind (Q4_1, Q4_K_M), or "bf16 cacheback", ...
    decode_tokens_per_s: float
    prefill_tokens_per_s: float | None = None
    prompt_tokens: int
    generated_tokens: int
    digest: str
    peak_rss_mib: float | None = None
    pass_cost_ms: dict[int, float] = Field(default_factory=dict)  # rows → ms of one pass (pie and llama.cpp)
    acceptance: float | None = None
    vs_llama_cpp: float | None = None  # decode rate / llama.cpp plain's, same prompt
    vs_transformers_fp32: float | None = None
    vs_openvino: float | None = None  # decode rate / OpenVINO GenAI's, same prompt
    same_tokens_as_pie_fp32: bool | None = None
    token_mb: float | None = None  # MB of weights a decode token streams (bench/bandwidth.py)
    bandwidth_share: float | None = None  # decode tok/s x token_mb over the measured read bandwidth

    @property
    def label(self) -> str:
        return f"{self.runner} {self.variant}"

    def pass_cost_over_1(self, rows: int) -> float | None:
        """A pass of ``rows`` rows over a 1-row pass (what a verify window or a batch of that width costs)."""
        one, wide = self.pass_cost_ms.get(1), self.pass_cost_ms.get(rows)
        return round(wide / one, 2) if one and wide else None

    @classmethod
    def of(cls, runner: str, variant: str, m: Measured, pass_cost_ms: dict[int, float] | None = None) -> Row:
        return cls(
            runner=runner,
            variant=variant,
            decode_tokens_per_s=round(m.decode_tokens_per_s, 2),
            prefill_tokens_per_s=None if m.prefill_tokens_per_s is None else round(m.prefill_tokens_per_s, 1),
            prompt_tokens=m.prompt_tokens,
            generated_tokens=len(m.token_ids),
            digest=digest(m.token_ids),
            peak_rss_mib=None if m.peak_rss_mib is None else round(m.peak_rss_mib, 1),
            pass_cost_ms=pass_cost_ms or m.pass_cost_ms,
            acceptance=m.acceptance,
        )


class Skipped(BaseModel):
    runner: str
    variant: str
    reason: str

    def line(self) -> str:
        return f"{self.runner} {self.variant} skipped: {self.reason}"


class Report(BaseModel):
    """Everything one `pie bench decode` run measured (no stored figures)."""

    model: str
    threads: int
    tokens: int  # max new tokens asked of every runner (each stops earlier at EOS, the same for all)
    formats: list[str]  # pie weight formats asked for
    prompt: str
    rows: list[Row] = Field(default_factory=list)
    speculation_prompt: str | None = None
    speculation: list[Row] = Field(default_factory=list)
    skipped: list[Skipped] = Field(default_factory=list)
    note: str = ""
    read_gb_s: float | None = None  # the machine's streaming read bandwidth, measured in the run

    def add_ratios(self) -> None:
        """Fills each row's ratios against llama.cpp's plain decode and transformers fp32 (same table)."""
        _ratios(self.rows, plain=lambda r: True)
        _ratios(self.speculation, plain=lambda r: r.variant.endswith(" plain"))
        fp32 = next((r for r in self.rows if r.runner == PIE and r.variant == "fp32"), None)
        for r in self.rows:
            r.same_tokens_as_pie_fp32 = None if fp32 is None or r is fp32 else r.digest == fp32.digest


def _ratios(rows: list[Row], plain: Callable[[Row], bool]) -> None:
    """Each row against llama.cpp's plain decode (its row ``plain`` picks: the variant names the GGUF's kind),
    transformers fp32 and OpenVINO GenAI."""
    llama = next((r for r in rows if r.runner == LLAMA_CPP and plain(r)), None)
    hf = next((r for r in rows if r.label == f"{TRANSFORMERS} fp32"), None)
    ov = next((r for r in rows if r.runner == OPENVINO), None)
    for r in rows:
        if ov and ov.decode_tokens_per_s:
            r.vs_openvino = round(r.decode_tokens_per_s / ov.decode_tokens_per_s, 2)
        if llama and llama.decode_tokens_per_s:
            r.vs_llama_cpp = round(r.decode_tokens_per_s / llama.decode_tokens_per_s, 2)
        if hf and hf.decode_tokens_per_s:
            r.vs_transformers_fp32 = round(r.decode_tokens_per_s / hf.decode_tokens_per_s, 2)


def _num(x: float | None, fmt: str = ".1f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{suffix}"


def _same(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "no")


def _pass_costs(r: Row) -> str:
    return " / ".join(_num(r.pass_cost_ms.get(n)) for n in PASS_ROWS) if r.pass_cost_ms else "-"


def _share(r: Row) -> str:
    return _num(None if r.bandwidth_share is None else 100 * r.bandwidth_share, ".0f", "%")


def _decode_columns(openvino: bool) -> list[tuple[str, Callable[[Row], str]]]:
    """The decode table's columns (name, cell of a row); "vs openvino" only when OpenVINO GenAI ran."""
    columns: list[tuple[str, Callable[[Row], str]]] = [
        ("runner", lambda r: r.label),
        ("decode tok/s", lambda r: _num(r.decode_tokens_per_s)),
        ("vs llama.cpp", lambda r: _num(r.vs_llama_cpp, ".2f", "x")),
        ("vs transformers fp32", lambda r: _num(r.vs_transformers_fp32, ".2f", "x")),
        ("prefill tok/s", lambda r: _num(r.prefill_tokens_per_s, ".0f")),
        ("peak RSS MiB", lambda r: _num(r.peak_rss_mib, ".0f")),
        (f"pass ms {' / '.join(map(str, PASS_ROWS))} rows", _pass_costs),
        ("pass 8 / 1", lambda r: _num(r.pass_cost_over_1(8), ".2f", "x")),
        ("pass 16 / 1", lambda r: _num(r.pass_cost_over_1(16), ".2f", "x")),
        ("tokens", lambda r: str(r.generated_tokens)),
        ("= pie fp32", lambda r: _same(r.same_tokens_as_pie_fp32)),
        ("MB/token", lambda r: _num(r.token_mb, ".0f")),
        ("of read bw", _share),
    ]
    if openvino:
        columns.insert(4, ("vs openvino", lambda r: _num(r.vs_openvino, ".2f", "x")))
    return columns


def print_report(report: Report, console=None) -> None:
    """The decode table (and the speculation table, when measured), then the skipped runners."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=160)
    first = report.rows[0].prompt_tokens if report.rows else "?"
    table = Table(
        title=f"batch-1 greedy decode, {report.model}: {report.threads} threads, pie formats "
        f"{','.join(report.formats)}, {first}-token prompt ({report.prompt}), up to {report.tokens} tokens",
        caption=report.note,
    )
    columns = _decode_columns(any(r.runner == OPENVINO for r in report.rows))
    for name, _ in columns:
        table.add_column(name, justify="left" if name == "runner" else "right")
    for r in report.rows:
        table.add_row(*(cell(r) for _, cell in columns))
    console.print(table)
    if report.read_gb_s:
        console.print(f"read bandwidth {report.read_gb_s:.1f} GB/s ({report.threads} threads, streaming float32 sum)")
    if report.speculation:
        spec = Table(title=f"speculation on the {report.speculation_prompt} prompt, batch 1, greedy")
        for name in ("runner", "decode tok/s", "vs llama.cpp plain", "acceptance", "tokens", "digest"):
            spec.add_column(name, justify="left" if name == "runner" else "right")
        for r in report.speculation:
            spec.add_row(
                r.label,
                _num(r.decode_tokens_per_s),
                _num(r.vs_llama_cpp, ".2f", "x"),
                _num(r.acceptance, ".3f"),
                str(r.generated_tokens),
                r.digest,
            )
        console.print(spec)
    for s in report.skipped:
        console.print(s.line())
