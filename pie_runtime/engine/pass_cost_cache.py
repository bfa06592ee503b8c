"""A measured pass-cost curve kept on disk, so that an engine started again on the same machine, model, weight
format and threads reuses it instead of timing the whole curve again.

Timing the curve (engine/pass_costs.py) runs about 44 passes, half of a small CPU engine's start
(docs/performance.md, "Pass costs"). Kernel
autotuners keep their choices the same way, keyed by the hardware (Triton's cache, vLLM's tuned MoE configs).
A reused curve is checked first: its 1-row and widest passes are timed again, and when either moved by more than
``TOLERANCE`` (another CPU behind the same home folder, a code change, a machine busy when it was measured) the
whole curve is measured anew and stored. ``pie engine --pass-cost-cache refresh`` measures anew regardless;
``off`` neither reads nor writes the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ValidationError

from ..models import native_lib
from ..paths import cache_dir
from ..store import Manifest
from .options import PASS_COST_CACHE_MODES as CACHE_MODES
from .pass_costs import measure_pass_costs, time_passes
from .runner import ModelRunner

log = logging.getLogger(__name__)

TOLERANCE = 0.25  # a checked pass this much slower or faster than the stored curve says: measure it all again
CHECK_REPEATS = 3


class CurveKey(BaseModel):
    """What a pass's cost depends on: a curve is reused only under an equal key."""

    model: str
    model_files: str  # digest of the manifest's file digests: the same weights
    weights: str
    device: str  # "cpu: <model name>" or the CUDA device's name
    threads: int
    max_rows: int
    page_size: int
    compiled: bool
    tensor_parallel: int
    torch: str
    kernels: str = ""  # the native kernels' variant and source digest (models/native_lib.build_id), if they run


class StoredCurve(BaseModel):
    key: CurveKey
    costs_ms: list[float]
    measured_at: float  # time.time()


def curve_key(
    manifest: Manifest,
    weights: str,
    device: torch.device,
    max_rows: int,
    page_size: int,
    compiled: bool,
    tensor_parallel: int,
) -> CurveKey:
    files = hashlib.sha256(json.dumps(manifest.files, sort_keys=True).encode()).hexdigest()[:16]
    return CurveKey(
        model=manifest.name,
        model_files=files,
        weights=weights,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu: {_cpu_name()}",
        threads=torch.get_num_threads(),
        max_rows=max_rows,
        page_size=page_size,
        compiled=compiled,
        tensor_parallel=tensor_parallel,
        torch=torch.__version__,
        kernels=native_lib.build_id() or "",
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path(key: CurveKey, folder: Path | None = None) -> Path:
    digest = hashlib.sha256(key.model_dump_json().encode()).hexdigest()[:16]
    return (folder or cache_dir("pass_costs")) / f"{key.model}-{key.weights}-{digest}.json"


def pass_costs(runner: ModelRunner, num_pages: int, key: CurveKey, mode: str = "reuse") -> tuple[list[float], str]:
    """(the curve, how it was had: "measured" or "reused, measured ..."), reusing a stored curve whose 1-row
    and widest passes still cost what it says (within ``TOLERANCE``)."""
    if mode not in CACHE_MODES:
        raise ValueError(f"--pass-cost-cache is one of {', '.join(CACHE_MODES)}, not {mode!r}")
    path = cache_path(key)
    stored = _read(path, key) if mode == "reuse" else None
    if stored is not None:
        now = time_passes(runner, num_pages, [1, key.max_rows], CHECK_REPEATS)
        then = [stored.costs_ms[0], stored.costs_ms[-1]]
        if now and all(abs(n - t) <= TOLERANCE * t for n, t in zip(now, then, strict=True)):
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(stored.measured_at))
            checked = f"now {now[0]:.1f} ms at 1 row, {now[1]:.1f} at {key.max_rows}"
            return stored.costs_ms, f"reused, measured {when}; {checked}"
        log.info("pass costs moved (now %s ms, stored %s): measuring them again", now, then)
    costs = measure_pass_costs(runner, num_pages, key.max_rows)
    if costs and mode != "off":
        _write(path, StoredCurve(key=key, costs_ms=costs, measured_at=time.time()))
    return costs, "measured"


def _read(path: Path, key: CurveKey) -> StoredCurve | None:
    try:
        stored = StoredCurve.model_validate_json(path.read_text())
    except (OSError, ValidationError):
        return None  # none yet, or unreadable: measured and written again
    return stored if stored.key == key and len(stored.costs_ms) == key.max_rows else None


def _write(path: Path, stored: StoredCurve) -> None:
    """Atomically (engines started at once with one key each write a whole file); a read-only home skips it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(stored.model_dump_json(indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("could not keep the pass costs in %s: %s", path, e)
