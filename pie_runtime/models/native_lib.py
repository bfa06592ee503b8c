"""The native kernels of ``kernels/native/`` (integer-dot matmuls, paged attention, the whole decoder step): one
ISA variant picked once a process from what the CPU has, built with the machine's C compiler the first time it
is needed, and called through ctypes (a pass is one call, so there is no graph of small ops left to compile).

Variants, best first: ``amx`` (``avx512vnni``'s kernels, and Intel's AMX tiles for matmuls of 6+ rows: the
same int32 sums, so the same bits), ``avx512vnni`` (AVX512-VNNI with AVX512-VL: dpbusd on 256-bit lanes,
512-bit attention), ``avxvnni`` (AVX-VNNI), ``avx2`` (AVX2's maddubs + madd). All need AVX2, FMA and F16C on
Linux x86-64. Where none fits, no compiler is found, or ``PIE_CPU_KERNELS=torch`` declines them, the models run
torch's kernels and the log says why, once. ``PIE_NATIVE_VARIANT=NAME`` picks a lower variant than the CPU's
best (the tests run each); ``PIE_NATIVE_PROFILE=1`` builds the step with per-stage timers (:func:`stage_times`).

The libraries land in the kernel cache (``paths.cache_dir("kernels")``), named by variant and by the digest of the
sources and flags. Their OpenMP runtime is torch's own ``libgomp.so.1`` (torch loads it first, so the dynamic
loader hands the library the same one): ``torch.set_num_threads`` governs both, one thread pool.
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
from dataclasses import dataclass
from pathlib import Path

from ..paths import cache_dir

log = logging.getLogger("pie.kernels")

SOURCES = Path(__file__).with_name("kernels") / "native"
ENTRY = SOURCES / "step.c"
BASE_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")


@dataclass(frozen=True)
class Variant:
    name: str
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags it needs beyond AVX2, FMA and F16C
    cc_flags: tuple[str, ...]


_AVX512VNNI = ("-DPIE_AVX512VNNI", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
VARIANTS = (
    Variant(
        "amx",
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"),
        (*_AVX512VNNI, "-DPIE_AMX", "-mamx-tile", "-mamx-int8"),
    ),
    Variant(
        "avx512vnni",
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
        _AVX512VNNI,
    ),
    Variant("avxvnni", ("avx_vnni",), ("-DPIE_AVXVNNI", "-mavxvnni")),
    Variant("avx2", (), ()),
)
BASE_CPU_FLAGS = ("avx2", "fma", "f16c")


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def choose_variant(flags: set[str], wanted: str | None = None) -> Variant | str:
    """The best variant ``flags`` allow (or ``wanted``, if they allow it), or why there is none."""
    missing = [f for f in BASE_CPU_FLAGS if f not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    names = [v.name for v in VARIANTS]
    if wanted is not None and wanted not in names:
        return f"PIE_NATIVE_VARIANT={wanted} is none of {', '.join(names)}"
    for v in VARIANTS:
        if all(f in flags for f in v.cpu_flags) and (wanted is None or v.name == wanted):
            return v
    return f"the CPU cannot run the {wanted} variant"


def unavailable_reason() -> str | None:
    """Why the native kernels do not run in this process (None: they do), building them if not yet."""
    if library() is not None:
        return None
    return _failure or str(_variant())


_failure = ""  # why the build or load failed, when it did


@functools.cache
def _variant() -> Variant | str:
    if os.environ.get("PIE_CPU_KERNELS", "").lower() == "torch":
        return "PIE_CPU_KERNELS=torch"
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.system()} {platform.machine()} is not Linux on x86-64"
    return choose_variant(cpu_flags(), os.environ.get("PIE_NATIVE_VARIANT") or None)


def _flags(variant: Variant) -> tuple[str, ...]:
    profile = ("-DPIE_PROFILE",) if os.environ.get("PIE_NATIVE_PROFILE") == "1" else ()
    return (*BASE_FLAGS, *variant.cc_flags, *profile)


def _digest(flags: tuple[str, ...]) -> str:
    """Of the sources and the flags: the library's name, so builds of other sources never meet."""
    sources = sorted(SOURCES.glob("*.[ch]"))
    return hashlib.sha256(b"".join(p.read_bytes() for p in sources) + " ".join(flags).encode()).hexdigest()[:16]


def build_id() -> str | None:
    """``variant-digest`` of the library this process has loaded (None: none loaded; nothing is built here), for
    caches of what it measured."""
    if not library.cache_info().currsize or library() is None:
        return None
    choice = _variant()
    return f"{choice.name}-{_digest(_flags(choice))}" if isinstance(choice, Variant) else None


def build(variant: Variant, cache: Path) -> Path:
    """The shared library of ``variant`` for the current sources and flags, compiled into ``cache`` unless there."""
    flags = _flags(variant)
    lib = cache / f"pie_native-{variant.name}-{_digest(flags)}.so"
    if lib.exists():
        return lib
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: concurrent builds are safe
        out = Path(tmp) / lib.name
        cmd = [compiler, *flags, "-o", str(out), str(ENTRY), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(out, lib)
    return lib


_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int32


def _declare(lib: ctypes.CDLL) -> None:
    sig = {
        "pie_variant": ([], ctypes.c_char_p),
        "pie_packed_bytes": ([_I, _L, _L], _L),
        "pie_pack_q4": ([_P, _P, _P, _L, _L, _P], None),
        "pie_pack_q8": ([_P, _P, _L, _L, _P], None),
        "pie_dequant_rows": ([_P, _I, _L, _L, _P, _L, _P], None),
        "pie_select_rows": ([_P, _I, _L, _P, _L, _P], None),
        "pie_dequant_rows_x": ([_P, _L, _L, _P, _L, _P], None),
        "pie_select_bytes_x": ([_I, _L, _L], _L),
        "pie_select_rows_x": ([_P, _I, _L, _L, _P, _L, _P], None),
        "pie_qmatmul_scratch": ([_L, _L], _L),
        "pie_qmatmul": ([_P, _I, _L, _L, _P, _L, _P, _P], None),
        "pie_step_scratch": ([_P, _L], _L),
        "pie_decoder_step": ([_P, _P, _P], None),
        "pie_struct_layout": ([_L, ctypes.POINTER(ctypes.c_char_p)], _L),
        "pie_profile_names": ([], ctypes.c_char_p),
        "pie_profile_read": ([_P, ctypes.c_int], ctypes.c_int),
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library of this process's variant, or None (the reason logged once)."""
    choice = _variant()
    if isinstance(choice, Variant):
        try:
            lib = ctypes.CDLL(str(build(choice, cache_dir("kernels"))))
        except (OSError, subprocess.CalledProcessError) as e:
            stderr = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) and e.stderr else ""
            global _failure
            choice = _failure = f"building the {choice.name} kernels failed: {stderr.splitlines()[-1] if stderr else e}"
        else:
            _declare(lib)
            log.info("native kernels: %s", choice.name)
            return lib
    log.info("native kernels: none, torch's kernels run (%s)", choice)
    return None


def variant() -> str | None:
    """The name of the variant this process runs, or None."""
    lib = library()
    return lib.pie_variant().decode() if lib is not None else None


def available() -> bool:
    return library() is not None


def stage_times(reset: bool = True) -> dict[str, float]:
    """Seconds spent in each stage of the decoder step since the last reset (each stage with its barrier's
    wait), when the library was built with ``PIE_NATIVE_PROFILE=1``; else {}."""
    lib = library()
    if lib is None:
        return {}
    names = [n for n in lib.pie_profile_names().decode().split(",") if n]
    out = (ctypes.c_double * len(names))()
    got = lib.pie_profile_read(out, int(reset))
    return dict(zip(names, out[:got]))
