"""The ground floor (pie_runtime/paths.py): where pie keeps its files, and the digest stored files are checked
by."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pie_runtime.paths import cache_dir, pie_home, sha256_file


def test_home_defaults(monkeypatch):
    monkeypatch.delenv("PIE_HOME", raising=False)
    assert pie_home() == Path.home() / ".cache" / "pie"


def test_home_and_caches_follow_pie_home(monkeypatch, tmp_path):
    monkeypatch.setenv("PIE_HOME", str(tmp_path))
    assert pie_home() == tmp_path and cache_dir("kernels") == tmp_path / "cache" / "kernels"
    monkeypatch.setenv("PIE_HOME", "")  # set but empty: the default, not the working folder
    assert pie_home() == Path.home() / ".cache" / "pie"


def test_sha256_file_reads_in_chunks_and_equals_hashlib(tmp_path):
    data = bytes(range(256)) * 1000
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f", chunk=1000) == hashlib.sha256(data).hexdigest()
