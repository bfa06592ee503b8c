"""The suite's own layout: every folder of tests is a package (an ``__init__.py``), so a test module is
``tests.<folder>.<name>`` and may share a basename with another folder's; folders of inferlet files the tests
run (``*_inferlets``) are data, not packages."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_folder_is_a_package():
    folders = {p.parent for p in TESTS.rglob("test_*.py")} | {p.parent for p in TESTS.rglob("conftest.py")}
    assert sorted(str(f.relative_to(TESTS)) for f in folders if not (f / "__init__.py").is_file()) == []
