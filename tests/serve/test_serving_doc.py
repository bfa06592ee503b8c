"""docs/serving.md keeps up with `pie serve`: every flag its parser takes (hidden ones aside) appears in the page's
"Every flag" table, and the table names no flag the parser lacks; `pie run --token` and ``$PIE_TOKEN`` are there."""

from __future__ import annotations

import argparse
import re

from pie_runtime.cli import serve
from tests.conftest import REPO

PAGE = (REPO / "docs" / "serving.md").read_text()


def serve_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return {
        flag
        for action in sub._actions
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    }


def test_every_serve_flag_is_in_the_flag_table():
    table = PAGE.split("## Every flag")[1].split("\n## ")[0]
    listed = set(re.findall(r"`(--[a-z][a-z0-9-]*)", table))
    flags = serve_flags()
    assert len(flags) > 50  # the parser was read (the engine's flags included)
    assert sorted(flags - listed) == [], "flags of pie serve missing from docs/serving.md's table"
    assert sorted(listed - flags) == [], "flags in docs/serving.md's table that pie serve does not take"


def test_the_tcp_token_is_documented():
    assert "--token @FILE" in PAGE and "$PIE_TOKEN" in PAGE and "$PIE_ENGINE_TOKEN" in PAGE
