"""llama-cpp-python for `pie bench decode`, installed on demand into a venv in a cache outside the repository
(``$PIE_LLAMA_CPP_DIR``, default ``~/.cache/pie/llama-cpp``), and the packaged GGUF it runs.

The default build (``-DGGML_NATIVE=ON``) died with "Illegal instruction" on some of these machines' CPUs, so it
is built with explicit options for what ``/proc/cpuinfo`` says the CPU has (:func:`cmake_args`): AVX2 always,
and AVX-512 with VNNI and BF16, and AVX-VNNI, where present, as our native kernels pick theirs; not AMX, whose
matmul died with SIGILL. One build per option set, in its own folder of the cache (about 10 minutes on 2 cores;
its log is kept there). A second bench waits for
a build in progress (a file lock) instead of starting another. Every failure is an ``LlamaCppUnavailable``
whose message says why, for the bench's "llama.cpp skipped: ..." line.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from ..store import PACKAGED, ImportRefused, ModelStore, StoreError, packaged_path

VERSION = "0.3.36"
BASE_CMAKE_ARGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON")
# (the CPU flags a set of options needs, the options); the AVX-512 ones only with all of F, BW, VL
OPTIONAL_CMAKE_ARGS = (
    (("avx512f", "avx512bw", "avx512vl"), ("-DGGML_AVX512=ON",)),
    (("avx512f", "avx512bw", "avx512vl", "avx512_vnni"), ("-DGGML_AVX512_VNNI=ON",)),
    (("avx512f", "avx512bw", "avx512vl", "avx512_bf16"), ("-DGGML_AVX512_BF16=ON",)),
    (("avx_vnni",), ("-DGGML_AVX_VNNI=ON",)),
)  # not AMX: ggml 0.25's AMX matmul dies with SIGILL on a prompt (seen on a Xeon with amx_int8, 2026-12-05)
BUILD_TIMEOUT_S = 3600
WORKER = Path(__file__).with_name("llama_worker.py")


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot run here; the message is the reason, one line."""


def cmake_args(cpu: set[str]) -> tuple[str, ...]:
    """llama.cpp's build options for a CPU with the /proc/cpuinfo ``cpu`` flags; AVX-512 off unless it has it."""
    extra = [opt for need, opts in OPTIONAL_CMAKE_ARGS if all(f in cpu for f in need) for opt in opts]
    return (*BASE_CMAKE_ARGS, *(extra or ["-DGGML_AVX512=OFF"]))


def build_name(args: tuple[str, ...]) -> str:
    """The cache folder of one flag set: "avx2", or "avx2" and the options added ("avx2+avx512+...")."""
    added = [a.removeprefix("-DGGML_").removesuffix("=ON").lower() for a in args[len(BASE_CMAKE_ARGS) :] if "=ON" in a]
    return "+".join(["avx2", *added])


def cache_dir() -> Path:
    from ..models.native_lib import cpu_flags

    root = Path(os.environ.get("PIE_LLAMA_CPP_DIR") or Path.home() / ".cache" / "pie" / "llama-cpp")
    return root / build_name(cmake_args(cpu_flags()))


def venv_python(root: Path | None = None) -> Path:
    return (root or cache_dir()) / "venv" / "bin" / "python"


def model_gguf(model: str) -> Path:
    """The GGUF file the store's ``model`` was imported from (its manifest's source), or a packaged alias's file:
    what llama.cpp runs beside it. A model imported from a Hugging Face folder has none."""
    try:
        source = Path(ModelStore().get(model).source)
    except StoreError:
        source = None
    if source is not None and source.suffix == ".gguf" and source.is_file():
        return source
    if model in PACKAGED:
        return _packaged_file(model)
    where = f"its source {source} is not a GGUF file here" if source is not None else "it is not in the store"
    raise LlamaCppUnavailable(f"no GGUF file for {model!r} ({where}): llama.cpp runs GGUF imports only")


def gguf_label(path: Path) -> str:
    """The file's quantization as llama.cpp names it (``general.file_type``: Q4_1, Q4_K_M, ...), or "GGUF"."""
    import gguf

    from ..models.gguf_meta import read_gguf

    kind = read_gguf(path).fields.get("general.file_type")
    try:
        return gguf.LlamaFileType(int(kind)).name.removeprefix("MOSTLY_") if kind is not None else "GGUF"
    except ValueError:
        return "GGUF"


def _packaged_file(model: str) -> Path:
    try:
        return packaged_path(model)
    except ImportRefused as e:
        raise LlamaCppUnavailable(str(e)) from e


def _importable(python: Path) -> bool:
    if not python.is_file():
        return False
    probe = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True, timeout=120)
    return probe.returncode == 0


def ensure_llama_cpp(progress: Callable[[str], None] = print) -> Path:
    """The Python of a venv where ``import llama_cpp`` works, building it first when needed."""
    root = cache_dir()
    python = venv_python(root)
    if _importable(python):
        return python
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another bench may be building it now: wait for that one
        if _importable(python):
            return python
        if not python.is_file():
            made = subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], capture_output=True, text=True)
            if made.returncode != 0:
                raise LlamaCppUnavailable(f"cannot make a venv in {root}: {made.stderr.strip()[-300:]}")
        progress(f"building llama-cpp-python {VERSION} into {root} (about 10 minutes on 2 cores; log {log})")
        from ..models.native_lib import cpu_flags

        flags = " ".join(cmake_args(cpu_flags()))
        progress(f"llama.cpp build options: {flags}")
        env = {**os.environ, "CMAKE_ARGS": flags, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
        with open(log, "w") as out:
            try:
                built = subprocess.run(
                    [str(python), "-m", "pip", "install", f"llama-cpp-python=={VERSION}"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=BUILD_TIMEOUT_S,
                )
            except subprocess.TimeoutExpired:
                raise LlamaCppUnavailable(f"the build ran past {BUILD_TIMEOUT_S} s (log {log})") from None
        if built.returncode != 0:
            tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
            raise LlamaCppUnavailable(f"the build failed ({tail[0].strip()[:200] if tail else 'no output'}; log {log})")
        if not _importable(python):
            raise LlamaCppUnavailable(f"llama_cpp does not import after the build (log {log})")
    return python
