"""The import arrows that must never exist (docs/architecture.md, "Where each lives"), read from the source's
import statements, and no import cycle anywhere in pie_runtime (one under ``if TYPE_CHECKING:`` runs no code and
is allowed).

The floors, lowest first: paths and the weight-format names (``paths.py``, ``models/formats.py``) and the
protocol; models; the store; drafters; the shipped drafters and the default model (``shipped.py``); the engine,
serving, training and the benchmarks; the CLI on top. A module imports its own floor or lower ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO / "sdk" if path.is_relative_to(REPO / "sdk") else REPO).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.AST) -> bool:
    """Whether ``node`` is an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) block."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST, at_run_time: bool):
    """Every node of ``tree``; with ``at_run_time``, none inside an ``if TYPE_CHECKING:`` block's body."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if at_run_time and _type_checking(node):
            assert isinstance(node, ast.If)
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def imports(path: Path, at_run_time: bool = False) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved); with ``at_run_time``, only
    those a run executes (not the ones under ``if TYPE_CHECKING:``)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = set()
    for node in _nodes(ast.parse(path.read_text()), at_run_time):
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


# pie_runtime's top-level modules and packages that sit above the models
ABOVE_MODELS = ("store", "drafters", "shipped", "launcher", "reference", "engine", "serve", "distill", "cluster")
ABOVE_MODELS += ("bench", "cli")
# the packages under the CLI (every one but the CLI itself)
BELOW_CLI = ("protocol", "models", "engine", "serve", "distill", "cluster", "bench")

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
    "the ground floor (paths and digests, the weight-format names) imports no pie_runtime module and no torch": (
        ["pie_runtime/paths.py", "pie_runtime/models/formats.py"],
        lambda i: top(i, "pie_runtime", "torch", "numpy"),
    ),
    "models import nothing above them: no store, drafters, serving, training, benchmark or CLI code": (
        ["pie_runtime/models/**/*.py"],
        lambda i: top(i, *(f"pie_runtime.{m}" for m in ABOVE_MODELS)),
    ),
    "the store imports neither the drafters nor the shipped drafters and the default model's bootstrap": (
        ["pie_runtime/store.py"],
        lambda i: top(i, "pie_runtime.drafters", "pie_runtime.shipped"),
    ),
    "the drafters import no shipped drafter (shipped.py builds on them)": (
        ["pie_runtime/drafters.py"],
        lambda i: top(i, "pie_runtime.shipped"),
    ),
    "nothing below the CLI imports it": (
        ["pie_runtime/*.py", *(f"pie_runtime/{d}/**/*.py" for d in BELOW_CLI)],
        lambda i: top(i, "pie_runtime.cli"),
    ),
    "a bench subcommand imports no other bench command (shared pieces live in bench/)": (
        ["pie_runtime/cli/bench_decode.py", "pie_runtime/cli/bench_serve.py"],
        lambda i: top(i, "pie_runtime.cli.bench", "pie_runtime.cli.bench_decode", "pie_runtime.cli.bench_serve"),
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_import_boundaries(rule):
    globs, bad = RULES[rule]
    paths = files(*globs)
    assert paths, f"no files for {globs}"
    assert offenders(paths, bad) == {}


def test_every_package_is_listed_on_a_floor():
    """A new package of pie_runtime must say where it sits, or the rules above would not see it."""
    packages = {p.parent.name for p in (REPO / "pie_runtime").glob("*/__init__.py")}
    assert packages <= set(BELOW_CLI) | {"cli"}, packages - set(BELOW_CLI)


def assert_no_cycle(paths: list[Path], at_run_time: bool = False) -> None:
    """Raises AssertionError naming the first import cycle between the modules of ``paths``."""
    modules = {module_name(p): p for p in paths}
    graph = {
        name: {i for i in imports(path, at_run_time) if i in modules and i != name} for name, path in modules.items()
    }
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


def test_engine_modules_import_no_cycle():
    assert_no_cycle(files("pie_runtime/engine/**/*.py"))


def test_pie_runtime_imports_no_cycle_outside_type_checking():
    """No circle between any of pie_runtime's modules, a lazy import inside a function included (it runs when
    the function does): two modules that need each other share a piece that belongs a floor below them."""
    assert_no_cycle(files("pie_runtime/**/*.py"), at_run_time=True)


def test_the_sdk_imports_no_cycle_outside_type_checking():
    assert_no_cycle(files("sdk/inferlet/**/*.py"), at_run_time=True)


def test_the_cycle_check_sees_lazy_imports_and_skips_type_checking(tmp_path, monkeypatch):
    pkg = tmp_path / "pie_runtime" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    paths = sorted(pkg.glob("*.py"))
    assert_no_cycle(paths, at_run_time=True)
    with pytest.raises(AssertionError, match="import cycle"):
        assert_no_cycle(paths)  # counted with the TYPE_CHECKING import, a and b make a circle
