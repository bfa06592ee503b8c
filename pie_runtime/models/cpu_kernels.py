"""The AVX2 8-bit matmul of ``kernels/q8_avx2.c``, for the int8 layers (the lm head of every quantized format,
the drafters' projections, all of ``--weights int8``) on x86 CPUs with AVX2 but no AVX-512: built with the
machine's C compiler the first time it is needed, loaded with ctypes.

Torch's int8 kernel reads the weight again for every row, without prefetching it. This one reads each group of
32 weights once for up to 4 rows and asks for the weight 2 KB ahead, which makes the lm head, int4 passes,
``--weights int8`` passes and the MTP head's chain faster on an AVX2 CPU (docs/performance.md, "The int8 kernel
on AVX2").

It computes what torch's computes (the int8 values, float32 products and sums, times the bf16 scale, rounded to
bf16) in its own fixed order, so it is batch-invariant as torch's is, and the two differ in the last bits only.

Where the kernel cannot be built (no compiler, another architecture) or is not wanted
(``PIE_CPU_KERNELS=torch``) the layers use torch's kernel and the log says why, once. CPUs with AVX-512 keep
torch's kernel too: this one was measured on AVX2 only. The choice is made once a process, before any layer is
built, so every pass of an engine runs the same kernels (what batch invariance needs).

The library lands in ``$PIE_HOME/cache/kernels/``, named by the digest of its source and flags. Its OpenMP
threads are torch's: torch has loaded its ``libgomp.so.1`` before the library asks for one, so the dynamic
loader hands it the same runtime, and ``torch.set_num_threads`` sets both.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..paths import cache_dir

log = logging.getLogger("pie.kernels")

SOURCE = Path(__file__).with_name("kernels") / "q8_avx2.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
K_MULTIPLE = 32  # the kernel reads a row's weights in groups of 32: a layer whose K is not a multiple keeps torch's


def unavailable() -> str | None:
    """Why the kernel is not for this process, or None when it is (before building it)."""
    if os.environ.get("PIE_CPU_KERNELS", "").lower() == "torch":
        return "PIE_CPU_KERNELS=torch"
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.system()} {platform.machine()} is not Linux on x86-64"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        return f"the CPU's vector capability is {capability}, not AVX2"
    return None


def build(cache: Path) -> Path:
    """The shared library of the current source and flags, compiled into ``cache`` unless it is there."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    lib = cache / f"q8_avx2-{digest}.so"
    if lib.exists():
        return lib
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: concurrent builds are safe
        out = Path(tmp) / lib.name
        subprocess.run([compiler, *FLAGS, "-o", str(out), str(SOURCE)], check=True, capture_output=True, text=True)
        os.replace(out, lib)
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (then the layers use torch's; the reason is logged once)."""
    why = unavailable()
    if why is None:
        try:
            lib = ctypes.CDLL(str(build(cache_dir("kernels"))))
        except (OSError, subprocess.CalledProcessError) as e:
            stderr = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) and e.stderr else ""
            why = f"building {SOURCE.name} failed: {stderr.splitlines()[-1] if stderr else e}"
        else:
            p, n = ctypes.c_void_p, ctypes.c_long
            lib.pie_q8_mm.argtypes, lib.pie_q8_mm.restype = [p, n, n, p, p, n, p], None
            log.info("int8 layers: %s", SOURCE.name)
            return lib
    log.info("int8 layers: torch's kernel (%s)", why)
    return None


def available() -> bool:
    """Whether the int8 layers of this process run the kernel (built and loaded now if not yet)."""
    return library() is not None


def q8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(M, K) bf16 activations, (N, K) int8 values, (N,) bf16 scales → (M, N) bf16, where :func:`available`.
    Inside a torch.compile graph (``--compile``) the call is the custom op ``pie::q8_mm``, which the graph keeps
    as one opaque node (a ctypes call would break the graph)."""
    if torch.compiler.is_compiling():
        return q8_mm_op(x, q, scales)
    lib = library()
    assert lib is not None, "the int8 kernel runs only where it was loaded"
    n = q.shape[0]
    xf = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    lib.pie_q8_mm(xf.data_ptr(), xf.shape[0], xf.shape[1], q.data_ptr(), scales.data_ptr(), n, y.data_ptr())
    return y


@torch.library.custom_op("pie::q8_mm", mutates_args=())
def q8_mm_op(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """:func:`q8_mm` as an op a compiled graph can hold."""
    return q8_mm(x, q, scales)


@q8_mm_op.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0], dtype=torch.bfloat16)
