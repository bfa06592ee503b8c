"""The ground floor: where pie keeps its files (``$PIE_HOME``, default ``~/.cache/pie``), the cache folders
under it, and the sha256 digest every stored file is checked by. It imports nothing of pie_runtime, so any
module may use it (the store, the engine, the models' kernel builder) without reaching up a floor."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Literal

# $PIE_HOME/cache/<kind>: built kernels (models/cpu_kernels.py, models/native_lib.py), pass-cost curves
# (engine/pass_cost_cache.py), the teacher data of drafter training (cli/drafter.py)
CacheKind = Literal["kernels", "pass_costs", "distill"]


def pie_home() -> Path:
    """``$PIE_HOME``, or ``~/.cache/pie`` when it is unset or empty."""
    return Path(os.environ.get("PIE_HOME") or Path.home() / ".cache" / "pie")


def cache_dir(kind: CacheKind) -> Path:
    """The folder (not created here) that keeps what ``kind`` caches: anything in it may be deleted."""
    return pie_home() / "cache" / kind


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """The hex sha256 of a file's bytes, read ``chunk`` bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
