"""No function in pie_runtime/, sdk/ or inferlets/ runs over ``MAX_LINES`` lines (its docstring and nested
functions included): a longer one does more than one job and is split into parts that each do one. Read from
the source, so the failure lists every offender with its line count."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 80
ROOTS = ("pie_runtime", "sdk", "inferlets")


def long_functions(root: Path, base: Path = REPO, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` (``path`` relative to ``base``) for every function under ``root`` longer than
    ``limit`` lines, longest first."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append((lines, f"{path.relative_to(base)}:{node.lineno} {node.name} ({lines} lines)"))
    return [where for _, where in sorted(found, reverse=True)]


def test_no_function_is_longer_than_the_limit():
    offenders = [where for root in ROOTS for where in long_functions(REPO / root)]
    assert offenders == [], "split these by job:\n" + "\n".join(offenders)


def test_the_count_takes_a_function_from_its_def_to_its_last_line(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES - 2))
    (tmp_path / "m.py").write_text(
        f'def fits():\n    """doc"""\n{body}\n\n\ndef over():\n    """doc"""\n{body}\n    return 1\n'
    )
    assert long_functions(tmp_path, tmp_path) == [f"m.py:{MAX_LINES + 3} over ({MAX_LINES + 1} lines)"]
