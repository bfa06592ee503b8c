"""The epilogue interpreter: each op of the closed set mapped to a torch function, run on the engine's device.

Programs run once per fire (a per-fire loop; fires of one step are not yet batched by program). Values are
float32, int64 or bool tensors (``protocol.programs.DTYPE_BYTES``); channel cells are cast to and from their
channel's dtype at the boundary. Each value is dropped after its last use (``Program.frees``) and slices are
copies, so the live values never exceed the peak the validator bounded (``protocol.programs.peak_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ...protocol import ErrorCode, PieError
from .. import sampling
from ..channels import Txn
from .validate import Program

DTYPE = {"float": torch.float32, "int": torch.int64, "bool": torch.bool}


class Intrinsics(Protocol):
    """What a fire offers its epilogue: readouts of its window rows, and the window's tokens."""

    def logits(self, rows: list[int]) -> torch.Tensor: ...  # (R, V) float32
    def hidden(self, rows: list[int]) -> torch.Tensor: ...  # (R, H) float32
    def mtp_logits(self, rows: list[int], k: int) -> torch.Tensor: ...  # (R, k, V) float32
    def mtp_logits_at(self, rows: list[int], k: int, index: torch.Tensor) -> torch.Tensor: ...  # (k, V) float32
    def tokens(self) -> torch.Tensor: ...  # (W,) int64


def _generator(rng: torch.Tensor, salt: int) -> torch.Generator:
    seed, counter = (int(v) for v in rng.tolist())  # one small sync: the state picks the noise
    mixed = (seed * 0x9E3779B1 + counter * 0x85EBCA77 + salt) % (1 << 63)
    return torch.Generator(device=rng.device).manual_seed(mixed)


def _sample(logits: torch.Tensor, rng: torch.Tensor, a: dict) -> torch.Tensor:
    """Gumbel-max over the filtered distribution (temperature → top-k → top-p, the readouts' order)."""
    flat = logits.reshape(-1, logits.shape[-1])
    probs = sampling.filtered_probs(
        flat, float(a.get("temperature", 1.0)), int(a.get("top_k", 0)), float(a.get("top_p", 1.0))
    )
    noise = torch.rand(probs.shape, generator=_generator(rng, 1), device=probs.device).clamp_min(1e-20)
    gumbel = -torch.log(-torch.log(noise))
    return (torch.log(probs) + gumbel).argmax(dim=-1).reshape(logits.shape[:-1])


def _float2(fn: Callable) -> Callable:
    return lambda x, y, a: fn(x.float() if y.is_floating_point() else x, y.float() if x.is_floating_point() else y)


def _dim(a: dict) -> int:
    return a.get("dim", -1)


def _acc(x: torch.Tensor) -> torch.dtype | None:
    """The dtype a sum or scan of ``x`` accumulates in: its own when float, int64 otherwise."""
    return None if x.is_floating_point() else torch.int64


def _where(c: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.is_floating_point() or y.is_floating_point():
        x, y = x.float(), y.float()
    return torch.where(c, x, y)


KERNELS: dict[str, Callable] = {  # op → its torch function; the intrinsics and effects are run_program's
    "add": _float2(torch.add),
    "sub": _float2(torch.sub),
    "mul": _float2(torch.mul),
    "div": lambda x, y, a: torch.true_divide(x.float(), y.float()),
    "floordiv": _float2(lambda x, y: torch.div(x, y, rounding_mode="floor")),
    "mod": _float2(torch.remainder),
    "maximum": _float2(torch.maximum),
    "minimum": _float2(torch.minimum),
    "eq": lambda x, y, a: x == y,
    "ne": lambda x, y, a: x != y,
    "lt": lambda x, y, a: x < y,
    "le": lambda x, y, a: x <= y,
    "gt": lambda x, y, a: x > y,
    "ge": lambda x, y, a: x >= y,
    "and": lambda x, y, a: x & y,
    "or": lambda x, y, a: x | y,
    "xor": lambda x, y, a: x ^ y,
    "neg": lambda x, a: -x,
    "abs": lambda x, a: x.abs(),
    "exp": lambda x, a: x.float().exp(),
    "log": lambda x, a: x.float().log(),
    "not": lambda x, a: ~x,
    "sum": lambda x, a: x.sum(_dim(a), keepdim=a.get("keepdim", False), dtype=_acc(x)),
    "max": lambda x, a: x.amax(_dim(a), keepdim=a.get("keepdim", False)),
    "min": lambda x, a: x.amin(_dim(a), keepdim=a.get("keepdim", False)),
    "argmax": lambda x, a: x.argmax(_dim(a), keepdim=a.get("keepdim", False)),
    "any": lambda x, a: x.any(_dim(a), keepdim=a.get("keepdim", False)),
    "all": lambda x, a: x.all(_dim(a), keepdim=a.get("keepdim", False)),
    "cumsum": lambda x, a: x.cumsum(_dim(a), dtype=_acc(x)),
    "cumprod": lambda x, a: x.cumprod(_dim(a), dtype=_acc(x)),
    "softmax": lambda x, a: torch.softmax(x.float(), _dim(a)),
    "log_softmax": lambda x, a: torch.log_softmax(x.float(), _dim(a)),
    "where": lambda c, x, y, a: _where(c, x, y),
    "cast": lambda x, a: x.to(DTYPE[a["dtype"]]),
    "masked_argmax": lambda x, m, a: x.float().masked_fill(~m, float("-inf")).argmax(_dim(a)),
    "sample": lambda x, rng, a: _sample(x, rng, a),
    "uniform": lambda rng, a: torch.rand(tuple(a["shape"]), generator=_generator(rng, 2), device=rng.device),
    "gather": lambda x, i, a: torch.gather(x, _dim(a), i),
    "scatter": lambda x, i, v, a: x.scatter(_dim(a), i, v),
    # a copy, not a view: a view would keep its whole input alive past the input's last use
    "slice": lambda x, a: x.narrow(_dim(a), a["start"], a["stop"] - a["start"]).clone(),
    "index": lambda x, a: x.select(_dim(a), a["index"]).clone(),
    "concat": lambda *xs: torch.cat(xs[:-1], dim=_dim(xs[-1])),
    "reshape": lambda x, a: x.reshape(tuple(a["shape"])),
}


@torch.inference_mode()
def run_program(prog: Program, fire: Intrinsics, txn: Txn, device: torch.device) -> int | list[int] | None:
    """Runs ``prog`` for one fire; channel effects go to ``txn``. Returns the fold it set (a count or a path),
    if any.

    Any failure is a PROGRAM_FAILED (or the PieError a channel raised) carrying no traceback or chained
    exception, so that nothing refers to the program's values once it returns or raises: each value is dropped
    after its last use and the rest when the program ends, on success and on failure alike."""
    values: list[torch.Tensor | None] = []
    err: PieError | None = None
    try:
        return _run(prog, fire, txn, device, values)
    except PieError as e:
        err = e
    finally:
        values.clear()
    assert err is not None
    err.__context__ = err.__cause__ = None  # the cause's frames would hold the failing node's inputs
    try:
        raise err.with_traceback(None)
    finally:
        del err  # no cycle error → traceback → this frame → error


def _path(rows: torch.Tensor) -> list[int]:
    """A fold path from a row-list value: its entries before the first negative one."""
    path = rows.tolist()
    return path[: next((i for i, r in enumerate(path) if r < 0), len(path))]


def _run(prog: Program, fire: Intrinsics, txn: Txn, device: torch.device, values: list) -> int | list[int] | None:
    fold = None
    for i, node in enumerate(prog.nodes):
        op, a = node["op"], node.get("attrs", {})
        ins = [values[j] for j in node.get("inputs", [])]
        spec = prog.specs[i]
        try:
            if op == "logits":
                out = fire.logits(a["rows"])
            elif op == "hidden":
                out = fire.hidden(a["rows"])
            elif op == "mtp_logits":
                out = fire.mtp_logits(a["rows"], a["k"])
            elif op == "mtp_logits_at":
                if not 0 <= int(ins[0]) < len(a["rows"]):
                    raise PieError(
                        ErrorCode.PROGRAM_FAILED,
                        f"node {i} (mtp_logits_at): index {int(ins[0])} outside its {len(a['rows'])} rows",
                    )
                out = fire.mtp_logits_at(a["rows"], a["k"], ins[0])
            elif op == "tokens":
                out = fire.tokens()
            elif op == "const":
                out = torch.tensor(a["value"], dtype=DTYPE[a["dtype"]], device=device)
            elif op == "iota":
                out = torch.arange(a["n"], device=device)
            elif op in ("take", "read"):
                out = (txn.take if op == "take" else txn.read)(a["slot"])
            elif op in ("put", "set"):
                (txn.put if op == "put" else txn.set)(a["slot"], ins[0])
                out = None
            elif op == "fold":  # a count, or a tree window's path: the rows before the first negative entry
                fold = int(ins[0]) if ins[0].dim() == 0 else _path(ins[0])
                out = None
            else:
                out = KERNELS[op](*ins, a)
            if out is not None:
                assert spec is not None  # the validator gave every value node a spec
                out = out.to(DTYPE[spec.kind])
        except PieError:
            raise
        except Exception as e:  # noqa: BLE001 - any kernel failure (index out of range, out of memory) fails the fire
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise PieError(ErrorCode.PROGRAM_FAILED, f"node {i} ({op}): {first}") from None
        values.append(out)
        del ins, out
        for j in prog.frees[i]:
            values[j] = None
    return fold
