"""The import arrows that must never exist (docs/architecture.md, "Where each lives"), read from the source's
import statements, and no import cycle between the engine's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO / "sdk" if path.is_relative_to(REPO / "sdk") else REPO).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from . import x` may name a module
    return out


def files(*globs: str) -> list[Path]:
    return sorted(p for g in globs for p in REPO.glob(g))


def offenders(paths: list[Path], bad) -> dict[str, list[str]]:
    found = {str(p.relative_to(REPO)): sorted(i for i in imports(p) if bad(i)) for p in paths}
    return {k: v for k, v in found.items() if v}


def top(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


RULES = {
    "the SDK imports no pie_runtime module but the protocol": (
        ["sdk/inferlet/**/*.py"],
        lambda i: top(i, "pie_runtime") and not top(i, "pie_runtime.protocol"),
    ),
    "inferlets import only the SDK": (["inferlets/*.py"], lambda i: top(i, "pie_runtime")),
    "the protocol imports no torch, zmq or other pie_runtime module": (
        ["pie_runtime/protocol/**/*.py"],
        lambda i: top(i, "torch", "zmq") or (top(i, "pie_runtime") and not top(i, "pie_runtime.protocol")),
    ),
    "models import no engine, protocol or SDK": (
        ["pie_runtime/models/**/*.py"],
        lambda i: top(i, "pie_runtime.engine", "pie_runtime.protocol", "inferlet", "zmq"),
    ),
    "the scheduler, page pool, KV pages and working sets are torch-free": (
        [f"pie_runtime/engine/{n}.py" for n in ("scheduler", "page_pool", "kv_pages", "working_set")],
        lambda i: top(i, "torch", "numpy"),
    ),
    "the engine imports no drafting or verifying code": (
        ["pie_runtime/engine/**/*.py"],
        lambda i: top(i, "inferlet", "pie_runtime.distill"),
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_import_boundaries(rule):
    globs, bad = RULES[rule]
    paths = files(*globs)
    assert paths, f"no files for {globs}"
    assert offenders(paths, bad) == {}


def test_engine_modules_import_no_cycle():
    engine = {module_name(p): p for p in files("pie_runtime/engine/**/*.py")}
    graph = {name: {i for i in imports(path) if i in engine and i != name} for name, path in engine.items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError("import cycle: " + " → ".join(stack[stack.index(name) :] + [name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, stack + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
