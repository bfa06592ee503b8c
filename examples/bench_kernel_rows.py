"""What each extra row costs in the native WX matmul (``--weights gguf``): one big weight of random GGUF blocks per
kind, ``PackedWeight`` matmuls of 1 / 2 / 4 / 8 / 16 rows, best of several calls, the row counts (and, with
``--against``, two checkouts' kernels) alternated in rounds so that a loaded machine skews them alike.

    python examples/bench_kernel_rows.py --kinds q4_k,q6_k,q5_0 --n 2048 --k 8192
    python examples/bench_kernel_rows.py --kinds q6_k --against /path/to/other/checkout   # A/B, one process

Each checkout packs the blocks with its own packer (in a subprocess) and its library is loaded here beside the
other's, so both run in one process on the same activations; their outputs are compared bit for bit. With one
thread the time is the thread's CPU time (a descheduled call is not counted); with more, wall time. The weight
of 2048 x 8192 fits a large L3: the figures are the compute a row adds, not a memory-bound pass.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROWS = (1, 2, 4, 8, 16)
WX = 2
PACK = """
import sys
from pie_runtime.models import native_lib
from pie_runtime.models.native_linear import PackedWeight
from tests.models.quant_blocks import random_blocks
p = PackedWeight.pack_blocks([random_blocks(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), seed=1)])
p.data.numpy().tofile(sys.argv[4])
print(native_lib.library()._name)
"""


class Kernels:
    """One checkout's library and its packing of one kind's weight."""

    def __init__(self, tree: Path, kind: str, n: int, k: int, tmp: Path):
        out = tmp / f"{tree.name}-{kind}.bin"
        env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'sdk'}"}
        done = subprocess.run(
            [sys.executable, "-c", PACK, kind, str(n), str(k), str(out)],
            env=env,
            cwd=tree,
            check=True,
            capture_output=True,
            text=True,
        )
        self.name, self.n, self.k = tree.name, n, k
        self.lib = ctypes.CDLL(done.stdout.strip().splitlines()[-1])
        self.lib.pie_qmatmul_scratch.restype = ctypes.c_long
        self.lib.pie_qmatmul_scratch.argtypes = [ctypes.c_long, ctypes.c_long]
        p, lg = ctypes.c_void_p, ctypes.c_long
        self.lib.pie_qmatmul.argtypes = [p, ctypes.c_int32, lg, lg, p, lg, p, p]
        self.data = torch.from_numpy(np.fromfile(out, dtype=np.uint8))

    def time(self, x: torch.Tensor, calls: int, clock) -> tuple[float, torch.Tensor]:
        """Best time of ``calls`` matmuls of x (m, k), and the result."""
        m = x.shape[0]
        y = torch.empty(m, self.n)
        scratch = torch.empty(self.lib.pie_qmatmul_scratch(m, self.k), dtype=torch.uint8)
        args = (self.data.data_ptr(), WX, self.n, self.k, x.data_ptr(), m, y.data_ptr(), scratch.data_ptr())
        best = float("inf")
        for _ in range(calls):
            t = clock()
            self.lib.pie_qmatmul(*args)
            best = min(best, clock() - t)
        return best, y


def run_kind(trees: list[Path], kind: str, a: argparse.Namespace, tmp: Path) -> None:
    kernels = [Kernels(t, kind, a.n, a.k, tmp) for t in trees]
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    x = torch.randn(ROWS[-1], a.k, generator=torch.Generator().manual_seed(0))
    best: dict[tuple[int, int], float] = {}
    outputs: list[torch.Tensor] = []
    for _ in range(a.rounds):
        for i, kern in enumerate(kernels):
            for m in ROWS:
                t, y = kern.time(x[:m].contiguous(), a.calls, clock)
                best[i, m] = min(best.get((i, m), t), t)
                if m == ROWS[-1] and len(outputs) <= i:
                    outputs.append(y)
    for i, kern in enumerate(kernels):
        one = best[i, 1]
        per = (best[i, ROWS[-1]] - one) / (ROWS[-1] - 1)
        cells = " / ".join(f"{best[i, m] * 1e3:.3f}" for m in ROWS)
        print(
            f"{kern.name} {kind} {a.n}x{a.k} ({kern.data.numel() / 1e6:.1f} MB): {cells} ms at rows "
            f"{'/'.join(map(str, ROWS))}; an extra row {per * 1e3:.3f} ms ({per / one:.2f}x a 1-row call)"
        )
    if len(kernels) == 2:
        ratios = " ".join(f"{m}:{best[1, m] / best[0, m]:.2f}" for m in ROWS)
        print(
            f"  {kernels[1].name} / {kernels[0].name} by rows: {ratios}; same outputs: "
            f"{torch.equal(outputs[0], outputs[1])}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="q4_k,q6_k,q5_0")
    ap.add_argument("--n", type=int, default=2048, help="outputs")
    ap.add_argument("--k", type=int, default=8192, help="inputs")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=5, help="calls a round, the best kept")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--against", type=Path, help="another checkout whose kernels run first, as the baseline")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the subprocesses only pack
    here = Path(__file__).resolve().parents[1]
    trees = [a.against.resolve(), here] if a.against else [here]
    with tempfile.TemporaryDirectory() as tmp:
        for kind in a.kinds.split(","):
            run_kind(trees, kind, a, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
