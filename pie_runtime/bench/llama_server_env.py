"""llama.cpp's ``llama-server`` for `pie bench serve --against llama-server`, built on demand from a pinned
source: the llama.cpp that llama-cpp-python's sdist (``llama_cpp_env.VERSION``) vendors under
``vendor/llama.cpp``, fetched with pip, configured with the same explicit CPU options as the Python build
(``llama_cpp_env.cmake_args``) and built with ``--target llama-server`` into that build's cache folder
(``<cache>/server/``, its log ``server-build.log`` beside it). A file lock makes a second bench wait for a
build in progress. Every failure is an ``LlamaCppUnavailable`` whose one-line message says why, for the
bench's "llama-server skipped: ..." line.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

from .llama_cpp_env import VERSION, LlamaCppUnavailable, cache_dir, cmake_args
from .logged_step import run_step

SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
EXTRA_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary
    "-DLLAMA_CURL=OFF",  # no downloads: it only opens the local GGUF
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
BUILD_TIMEOUT_S = 7200  # a step; 65 minutes on 2 cores under a load average of 20 (the build resumes where it stopped)


def server_dir(root: Path | None = None) -> Path:
    return (root or cache_dir()) / "server"


def server_binary(root: Path | None = None) -> Path:
    return server_dir(root) / "build" / "bin" / "llama-server"


def _run(cmd: list[str], log: Path, what: str, cwd: Path | None = None) -> None:
    """Runs one build step, its output appended to ``log``; LlamaCppUnavailable when it fails."""
    run_step(cmd, log, what, LlamaCppUnavailable, BUILD_TIMEOUT_S, cwd)


def fetch_source(work: Path, log: Path) -> Path:
    """The vendored llama.cpp of the pinned sdist, downloaded by pip and unpacked under ``work``."""
    src = work / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    sdist = work / SDIST
    if not sdist.is_file():
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python", "-d", str(work)]
        _run([*pip, f"llama-cpp-python=={VERSION}"], log, f"downloading the llama-cpp-python {VERSION} sdist")
    if not sdist.is_file():
        raise LlamaCppUnavailable(f"pip did not leave {SDIST} in {work} (log {log})")
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    if not (src / "CMakeLists.txt").is_file():
        raise LlamaCppUnavailable(f"the sdist has no vendor/llama.cpp (looked in {src})")
    return src


def ensure_llama_server(progress: Callable[[str], None] = print, root: Path | None = None) -> Path:
    """The path of a ``llama-server`` binary built with this CPU's options, building it first when needed."""
    binary = server_binary(root)
    if binary.is_file():
        return binary
    if shutil.which("cmake") is None:
        raise LlamaCppUnavailable("cmake is not installed (llama-server is built from source)")
    work = server_dir(root)
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LlamaCppUnavailable(f"cannot make the build folder {work}: {e.strerror}") from None
    log = work.parent / "server-build.log"
    with open(work / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another bench is building it now: wait for that one
            progress(f"waiting for the llama-server build in progress (log {log})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.is_file():
            return binary
        log.write_text("")
        progress(f"building llama-server from llama-cpp-python {VERSION}'s llama.cpp into {work} (log {log})")
        src = fetch_source(work, log)
        from ..models.native_lib import cpu_flags

        options = [*cmake_args(cpu_flags()), *EXTRA_CMAKE_ARGS]
        progress(f"llama-server build options: {' '.join(options)}")
        build = work / "build"
        _run(["cmake", "-S", str(src), "-B", str(build), *options], log, "configuring llama-server")
        jobs = str(os.cpu_count() or 1)
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], log, "building llama-server")
        if not binary.is_file():
            raise LlamaCppUnavailable(f"the build left no {binary} (log {log})")
    return binary
