"""The README and the docs tell the truth: the README's inferlet and the tutorial's (examples/bigram_drafter.py)
run on the real default model and decode exactly as text-completion does; the README's commands and its table of
shipped inferlets stay in step with CI and inferlets/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO, run

README = (REPO / "README.md").read_text()
REPETITIVE = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_readme_commands_are_setup_and_run_then_the_ci_test_command():
    first, second = code_blocks(README, "bash")[:2]
    assert first.startswith("bash scripts/setup.sh && .venv/bin/pie run ") and first.count("\n") == 1
    inferlet = first.split(".venv/bin/pie run ")[1].split()[0]
    assert (REPO / "inferlets" / f"{inferlet}.py").is_file()
    assert second == "bash scripts/test.sh\n"
    assert "exec bash scripts/test.sh" in (REPO / ".ci/run").read_text()  # CI runs the README's test command


def test_readme_lists_every_shipped_inferlet_once():
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", README.split("## Shipped inferlets")[1].split("\n## ")[0], re.M)
    assert sorted(rows) == sorted(p.stem for p in (REPO / "inferlets").glob("*.py"))


@pytest.mark.e2e
def test_readme_inferlet_decodes_as_text_completion(engine, tmp_path):
    source = code_blocks(README.split("## Write your own inferlet")[1], "python")[0]
    path = tmp_path / "greedy.py"
    path.write_text(source)
    prompt = "The capital of France is"
    mine = run(str(path), engine.address, "--prompt", prompt, "--max-tokens", "8")
    plain = run("text-completion", engine.address, "--prompt", prompt, "--max-tokens", "8", "--ignore-eos")
    assert mine["token_ids"] == plain["token_ids"] and len(mine["token_ids"]) == 8
    assert mine["text"] == plain["text"]


def test_bigram_table_drafts_the_most_frequent_follower_chain():
    from examples.bigram_drafter import BigramTable

    table = BigramTable()
    table.extend(None, [1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert table.draft(1, 4) == [2, 3, 1, 2]  # 2 follows 1 three times; 3 follows 2 twice, 4 once
    assert table.draft(9, 4) == []  # never seen: no drafts
    table.extend(3, [7])  # the pair (3, 7) across the call's boundary
    assert dict(table.follow[3]) == {1: 1, 7: 1}


@pytest.mark.e2e
@pytest.mark.parametrize("words", [[], ["--by-hand"]], ids=["round-loop", "by-hand"])
def test_tutorial_drafter_equals_greedy_and_keeps_drafts(engine, words):
    """docs/writing-inferlets.md's inferlet, both its steps: the same tokens as text-completion, fewer rounds."""
    args = ["--prompt", REPETITIVE, "--max-tokens", "24", *words]
    spec = run(str(REPO / "examples/bigram_drafter.py"), engine.address, *args)
    plain = run("text-completion", engine.address, "--prompt", REPETITIVE, "--max-tokens", "24")
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["accepted"] > 0 and spec["stats"]["rounds"] < len(plain["token_ids"])


@pytest.mark.e2e
def test_tutorial_drafter_samples_as_seeded(engine):
    """Sampled through the SDK's round loop: the same seed gives the same tokens, and the run reports its drafts.
    With a fixed draft schedule: the adaptive one sizes rounds from measured pass times, and rounds of other
    sizes draw the seeded generator in another order (the same distribution, other tokens)."""
    args = ["--prompt", REPETITIVE, "--max-tokens", "16", "--temperature", "0.8", "--seed", "3"]
    args += ["--draft-schedule", "fixed"]
    a = run(str(REPO / "examples/bigram_drafter.py"), engine.address, *args)
    b = run(str(REPO / "examples/bigram_drafter.py"), engine.address, *args)
    assert a["token_ids"] == b["token_ids"] and a["stats"]["proposed"] > 0


def test_readme_links_reach_files_and_every_docs_page_is_linked():
    """mkdocs build --strict checks the links inside docs/; the README's into it are checked here."""
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links and all((REPO / link).is_file() for link in links), [lk for lk in links if not (REPO / lk).is_file()]
    pages = {p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")} - {"docs/index.md"}
    assert pages <= set(links), pages - set(links)


# Inlined code: a ```python block right after `<!-- inlined from PATH[:REGION] -->` is that file, or the part of it
# between `# --8<-- [start:REGION]` and `# --8<-- [end:REGION]`, so the page reads on GitHub and stays true.
# `python -m tests.test_docs --sync` rewrites every such block from its file after the file changed.
INLINED = re.compile(r"<!-- inlined from ([\w./-]+)(?::(\w+))? -->\n```python\n(.*?)```", re.S)
DOC_PAGES = sorted((REPO / "docs").glob("*.md"))


def region(path: str, name: str | None) -> str:
    """The file's text, or its region ``name``, without the markers and the blank lines around it."""
    text = (REPO / path).read_text()
    if name is not None:
        start, end = f"# --8<-- [start:{name}]\n", f"# --8<-- [end:{name}]\n"
        assert start in text and end in text, f"{path} has no region {name!r}"
        text = text.split(start, 1)[1].split(end, 1)[0]
    return text.strip("\n") + "\n"


def sync(page: Path) -> bool:
    """Rewrites ``page``'s inlined blocks from their files; True when something changed."""
    text = page.read_text()
    new = INLINED.sub(lambda m: m.group(0)[: m.start(3) - m.start(0)] + region(m.group(1), m.group(2)) + "```", text)
    if new != text:
        page.write_text(new)
    return new != text


def test_inlined_code_equals_its_example_file():
    found = 0
    for page in DOC_PAGES:
        for path, name, block in INLINED.findall(page.read_text()):
            found += 1
            where = f"{page.name}: {path}:{name or '(whole file)'}; run `python -m tests.test_docs --sync`"
            assert block == region(path, name or None), where
    assert found >= 5  # the tutorial's four steps and the KV-editing guide's policy
    assert not any("--8<--" in p.read_text() for p in DOC_PAGES)  # no include line shows raw on GitHub


# Every complete inferlet (a ```python block with @inferlet.main) in the docs runs in the tests: inlined from an
# example file that a test here runs, or the README's (test_readme_inferlet_decodes_as_text_completion).
RUN_BY_TESTS = {
    "examples/bigram_drafter.py": "test_tutorial_drafter_equals_greedy_and_keeps_drafts",
    "examples/keep_prompt.py": "test_kv_editing_policy_keeps_memory_flat_and_is_exact_until_it_evicts",
}


def test_every_complete_inferlet_in_the_docs_runs_in_the_tests():
    assert all(name in globals() for name in RUN_BY_TESTS.values())
    for page in [*DOC_PAGES, REPO / "README.md"]:
        text = page.read_text()
        for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
            if "@inferlet.main" not in m.group(1):
                continue
            inlined = INLINED.search(text, m.start() - 80, m.end())
            from_file = inlined is not None and inlined.end() == m.end() and inlined.group(1) in RUN_BY_TESTS
            ran = from_file or page.name == "README.md"
            assert ran, f"{page.name}: a complete inferlet that no test runs; inline it from an example a test runs"


def test_no_page_is_over_300_lines_but_the_appendix():
    long = {p.name: n for p in DOC_PAGES if (n := p.read_text().count("\n")) > 300 and p.name != "performance.md"}
    assert not long, long


@pytest.mark.e2e
def test_kv_editing_policy_keeps_memory_flat_and_is_exact_until_it_evicts(engine):
    """docs/kv-editing.md's policy (window 8, pages of 16): its first 8 + 16 + 1 tokens are text-completion's
    (the first eviction follows the 25th), and twice the tokens hold no more pages."""
    policy = str(REPO / "examples/keep_prompt.py")
    prompt = "Count: 1, 2, 3,"
    short = run(policy, engine.address, "--prompt", prompt, "--max-tokens", "40", "--window", "8")
    long = run(policy, engine.address, "--prompt", prompt, "--max-tokens", "80", "--window", "8")
    plain = run("text-completion", engine.address, "--prompt", prompt, "--max-tokens", "25", "--ignore-eos")
    assert short["token_ids"][:25] == plain["token_ids"] == long["token_ids"][:25]
    assert 0 < short["stats"]["evicted_rows"] < long["stats"]["evicted_rows"]
    assert long["stats"]["kv_pages_max"] == short["stats"]["kv_pages_max"]
    assert long["stats"]["kv_rows"] <= short["stats"]["kv_rows"] + 16  # the prompt, the window, under a page


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--sync"]:
        for page in DOC_PAGES:
            if sync(page):
                print(f"rewrote {page.relative_to(REPO)}")


# The glossary's terms, each linked to docs/glossary.md where a page first uses it (headings and code blocks are
# not uses). serving.md and reference.md are left out while other work on them lands (issue 58's split).
GLOSSARY_TERMS = {
    "fire": r"(?<![-\w])fire[sd]?\b",
    "fold": r"(?<![-\w])fold(?:s|ed|ing)?\b",  # not the flag --recurrent-fold
    "deferred-fold": r"\bdeferred fold",
    "wssettle": r"\bws\.settle\b",
    "working-set": r"\bworking[ -]sets?\b",
    "forward-pass": r"\bforward pass(?:es)?\b",
    "readout": r"\breadouts?\b",
    "epilogue": r"\bepilogues?\b",
    "channel": r"(?<!per )\bchannels?\b",  # not a weight's output channel
    "run-ahead": r"\brun-ahead\b",
    "native-step": r"\bnative step\b",
    "drafter": r"(?<!pie )(?<!\w)drafters?\b",  # not the command `pie drafter`
    "verify-window": r"\bverify windows?\b",
    "acceptance": r"\bacceptance\b",
    "pass-cost-curve": r"\bpass[- ]cost curve\b",
    "page-group": r"\bpage groups?\b",
    "prefix-cache": r"\bprefix cache\b",
    "token-tree": r"\btoken trees?\b",
    "mtp-head": r"\bMTP heads?\b",
}
GLOSSARY_EXEMPT = {"glossary.md", "reference.md"}  # reference.md: generated from docstrings
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]*)\)")


def prose(text: str) -> str:
    """``text`` with what is not a use blanked out, offsets kept: code blocks, comments, headings, link targets."""

    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    text = re.sub(r"```.*?```|<!--.*?-->", blank, text, flags=re.S)
    text = re.sub(r"^#.*$", blank, text, flags=re.M)
    return LINK.sub(lambda m: f"[{m.group(1)}]" + " " * (len(m.group(2)) + 2), text)


def unlinked_first_uses(text: str, glossary: str) -> list[str]:
    """The terms whose first use in ``text`` is not inside a link to ``glossary`` (its path from the page)."""
    links = [m.span(1) for m in LINK.finditer(text) if m.group(2).startswith(glossary + "#")]
    plain = prose(text)
    bad = []
    for anchor, pattern in GLOSSARY_TERMS.items():
        first = re.search(pattern, plain, flags=re.I)
        if first and not any(a <= first.start() < b for a, b in links):
            line = text.count("\n", 0, first.start()) + 1
            bad.append(f"{anchor} (line {line}: {first.group(0)!r})")
    return bad


def test_glossary_terms_are_linked_at_first_use():
    glossary = (REPO / "docs/glossary.md").read_text()
    defined = {
        re.sub(r"[^\w -]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^### (.+)$", glossary, re.M)
    }
    assert set(GLOSSARY_TERMS) <= defined, set(GLOSSARY_TERMS) - defined
    pages = [(p, "glossary.md") for p in DOC_PAGES if p.name not in GLOSSARY_EXEMPT]
    bad = {p.name: unlinked_first_uses(p.read_text(), g) for p, g in [*pages, (REPO / "README.md", "docs/glossary.md")]}
    assert not {k: v for k, v in bad.items() if v}, bad
