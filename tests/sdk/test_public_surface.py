"""The SDK's public surface: ``inferlet`` (the core), ``inferlet.programs`` (the device-program tracer) and the
subpackages ``inferlet.spec``, ``inferlet.text`` and ``inferlet.kv``, each with an explicit ``__all__``. The
shipped inferlets and the examples import nothing else; every public name has a docstring (the reference page
is generated from them); the moved modules' old paths still work and warn; the package docstring's example runs.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from tests.conftest import REPO, run

PUBLIC = ("inferlet", "inferlet.programs", "inferlet.spec", "inferlet.text", "inferlet.kv")
SUBPACKAGES = ("inferlet.spec", "inferlet.text", "inferlet.kv")


def public_names() -> dict[str, set[str]]:
    return {m: set(importlib.import_module(m).__all__) for m in PUBLIC}


def private_uses(source: str, public: dict[str, set[str]]) -> list[str]:
    """Each use of the SDK in ``source`` that is not a public name: an import from a module outside ``PUBLIC``,
    a name its module does not list, or ``inferlet.X`` for an ``X`` the core does not list."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "inferlet":
            for alias in node.names:
                if node.module not in public or alias.name not in public[node.module]:
                    bad.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            bad += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.startswith("inferlet.")]
            bad += [f"{node.lineno}: import {a.name}" for a in node.names if a.name in public and a.name != "inferlet"]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "inferlet":
            bad += [f"{node.lineno}: inferlet.{node.attr}"] if node.attr not in public["inferlet"] else []
    return bad


def sdk_users() -> list[Path]:
    """The shipped inferlets and the examples, less the harnesses that drive pie_runtime itself (benchmarks
    that import the engine's or the cluster's code are tools over the runtime, not SDK code to copy)."""
    paths = sorted((REPO / "inferlets").glob("*.py")) + sorted((REPO / "examples").rglob("*.py"))
    return [p for p in paths if not re.search(r"^\s*(from|import) pie_runtime\b", p.read_text(), re.M)]


def test_shipped_inferlets_and_examples_use_only_public_names():
    public = public_names()
    bad = {str(p.relative_to(REPO)): private_uses(p.read_text(), public) for p in sdk_users()}
    assert {k: v for k, v in bad.items() if v} == {}
    assert len(sdk_users()) > len(list((REPO / "inferlets").glob("*.py")))  # examples are read too


def test_the_check_sees_private_imports_and_attributes():
    public = public_names()
    source = (
        "import inferlet\nimport inferlet.decode\nfrom inferlet.decode import speculate\n"
        "from inferlet.spec import speculate, Drafter\nfrom inferlet.text import run_rounds\n"
        "x = inferlet.Argmax()\ny = inferlet.sampler.Verifier\n"
    )
    assert private_uses(source, public) == [
        "2: import inferlet.decode",
        "3: from inferlet.decode import speculate",
        "5: from inferlet.text import run_rounds",
        "7: inferlet.sampler",
    ]


@pytest.mark.parametrize("module", SUBPACKAGES)
def test_each_subpackage_all_resolves_and_names_each_once(module):
    mod = importlib.import_module(module)
    assert mod.__doc__ and "reach for" in mod.__doc__  # says when to use it
    assert len(mod.__all__) == len(set(mod.__all__))
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name
    assert set(mod.__all__) <= set(dir(mod))


@pytest.mark.parametrize("module", ["inferlet.spec", "inferlet.text"])
def test_lazy_table_equals_the_imports_type_checkers_read(module):
    """A lazy subpackage names each export twice (under TYPE_CHECKING for tools, in ``_HOMES`` for the run):
    both say the same names from the same modules, and ``__all__`` is exactly those names."""
    mod = importlib.import_module(module)
    tree = ast.parse(Path(mod.__file__ or "").read_text())
    checked = next(n for n in tree.body if isinstance(n, ast.If))
    pkg = module.split(".")
    seen: dict[str, str] = {}
    for node in checked.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        base = ".".join(pkg[: len(pkg) - node.level + 1]) if node.level else ""
        home = f"{base}.{node.module}" if base else node.module
        seen.update({a.name: home for a in node.names})
    assert seen == {n: m for m, names in mod._HOMES.items() for n in names}
    assert set(mod.__all__) == set(seen)


def test_every_public_name_has_a_docstring():
    """What the generated reference shows: griffe reads the sources as mkdocstrings does; a constant needs a
    docstring under its assignment."""
    griffe = pytest.importorskip("griffe")
    loader = griffe.GriffeLoader(search_paths=[str(REPO / "sdk"), str(REPO)])
    pkg = loader.load("inferlet")
    loader.load("pie_runtime.protocol")  # ErrorCode, PieError and DEFERRED are the protocol's
    loader.resolve_aliases(external=True)
    missing = []
    for module in PUBLIC:
        obj = pkg if module == "inferlet" else pkg[module.removeprefix("inferlet.")]
        for name in importlib.import_module(module).__all__:
            member = obj[name]
            member = member.final_target if member.is_alias else member
            value = getattr(importlib.import_module(module), name)
            if member.is_module and not isinstance(value, type(sys)):  # `inferlet.model`: a function, and a module
                member = loader.modules_collection[f"{value.__module__}.{value.__qualname__}"]
            if not (member.docstring and member.docstring.value.strip()):
                missing.append(f"{module}.{name}")
    assert missing == [], "\n".join(missing)


def test_a_moved_module_still_imports_and_warns_only_outside_the_sdk(monkeypatch):
    import inferlet.text

    for importer, warns in (("user_code", True), ("inferlet.some_module", False)):
        monkeypatch.delitem(sys.modules, "inferlet.args", raising=False)
        scope: dict = {"__name__": importer}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec("from inferlet.args import DecodeArgs", scope)
        assert scope["DecodeArgs"] is inferlet.text.DecodeArgs
        said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
        assert said == (
            [
                "inferlet.args moved to inferlet.text.arguments: import from there (or from its package); "
                "the old path goes in the next release"
            ]
            if warns
            else []
        ), importer


def package_example() -> str:
    import inferlet

    doc = inferlet.__doc__ or ""
    block = doc.split("::\n\n", 1)[1].split("\n\n\n", 1)
    code = block[0] + "\n\n\n" + block[1].split("\n\n", 1)[0]  # the imports, two blank lines, the function
    return textwrap.dedent(code)


@pytest.mark.e2e
def test_the_package_docstring_example_decodes_as_text_completion(engine, tmp_path):
    """The package docstring's inferlet reads the last prompt row (the next token), so it is greedy decoding."""
    path = tmp_path / "example.py"
    path.write_text(package_example())
    prompt = "The capital of France is"
    mine = run(str(path), engine.address, "--prompt", prompt, "--max-tokens", "6")
    plain = run("text-completion", engine.address, "--prompt", prompt, "--max-tokens", "6", "--ignore-eos")
    assert mine == plain["text"]


def test_the_reference_page_shows_every_public_name(tmp_path):
    """docs/reference.md, built as the docs site is: an entry (an anchor) for each name of each ``__all__``."""
    pytest.importorskip("mkdocs")
    out = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    anchors = set(re.findall(r'id="(inferlet[^"]*)"', (out / "reference" / "index.html").read_text()))
    if "inferlet.runtime.model" in anchors:  # rendered from its home: the module `inferlet.model` hides its name
        anchors.add("inferlet.model")
    missing = [f"{m}.{n}" for m, names in public_names().items() for n in names if f"{m}.{n}" not in anchors]
    assert missing == []
