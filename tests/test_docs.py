"""The README and the docs tell the truth: the README's inferlet and the tutorial's (examples/bigram_drafter.py)
run on the real default model and decode exactly as text-completion does; the README's commands and its table of
shipped inferlets stay in step with CI and inferlets/."""

from __future__ import annotations

import re

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
    """Sampled through the SDK's round loop: the same seed gives the same tokens, and the run reports its drafts."""
    args = ["--prompt", REPETITIVE, "--max-tokens", "16", "--temperature", "0.8", "--seed", "3"]
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
            assert block == region(path, name), where
    assert found >= 5  # the tutorial's four steps and the KV-editing guide's policy
    assert not any("--8<--" in p.read_text() for p in DOC_PAGES)  # no include line shows raw on GitHub


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--sync"]:
        for page in DOC_PAGES:
            if sync(page):
                print(f"rewrote {page.relative_to(REPO)}")
