"""Checks a program before it can ever run: known ops, arity, attribute types, size and nesting, dtypes, static
shapes, size limits, acyclic order and peak memory against the engine's budget
(``protocol.programs.check_program``), and records what a fire must bind to run it and when the interpreter
may drop each value."""

from __future__ import annotations

from dataclasses import dataclass

from ...protocol import ErrorCode, PieError
from ...protocol.programs import CHANNEL_OPS, PROGRAM_MEMORY, ModelDims, Spec, check_program, last_uses, program_hash


@dataclass(frozen=True)
class Program:
    hash: str
    model: str
    nodes: list[dict]
    specs: list[Spec | None]
    slots: dict[int, tuple[tuple[int, ...], str]]  # slot → (cell shape, channel dtype)
    writes: frozenset[int]  # slots the program puts or sets
    puts: dict[int, int]  # slot → put count: room a fire needs before it runs
    takes: dict[int, int]  # slot → take count: cells a fire needs before it runs
    rows: frozenset[int]  # window rows the readout intrinsics read
    window: int | None  # the window size a ``tokens`` intrinsic fixes
    folds: bool
    frees: tuple[tuple[int, ...], ...]  # node → the values the interpreter drops once it has run (last use)

    def check_fire(self, w: int, bound: list) -> None:
        """Refuses a fire whose window or bound channels do not fit this program."""
        if self.window is not None and self.window != w:
            raise PieError(
                ErrorCode.INVALID_ARGUMENT, f"the program reads a window of {self.window} tokens, the fire has {w}"
            )
        if any(r >= w for r in self.rows):
            raise PieError(ErrorCode.ROW_OUT_OF_RANGE, f"the program reads rows past the fire's window [0, {w})")
        if len(bound) != len(self.slots) or sorted(self.slots) != list(range(len(self.slots))):
            raise PieError(
                ErrorCode.INVALID_ARGUMENT,
                f"the program has {len(self.slots)} channel slots, the fire binds {len(bound)}",
            )
        for slot, (shape, dtype) in self.slots.items():
            ch = bound[slot]
            if (ch.shape, ch.dtype) != (shape, dtype):
                raise PieError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"slot {slot} wants {list(shape)} {dtype}, channel {ch.id} holds {list(ch.shape)} {ch.dtype}",
                )


def validate(model: str, nodes: list[dict], dims: ModelDims, memory: int = PROGRAM_MEMORY) -> Program:
    """The checked program, or INVALID_PROGRAM (LIMIT_EXCEEDED when its peak bytes exceed ``memory``)."""
    specs = check_program(nodes, dims, memory)
    slots, writes, puts, takes, rows, window = {}, set(), {}, {}, set(), None
    for node in nodes:
        op, a = node["op"], node.get("attrs", {})
        if op in CHANNEL_OPS:
            slots[a["slot"]] = (tuple(a["shape"]), a["dtype"])
            if op in ("put", "set"):
                writes.add(a["slot"])
            if op == "put":
                puts[a["slot"]] = puts.get(a["slot"], 0) + 1
            if op == "take":
                takes[a["slot"]] = takes.get(a["slot"], 0) + 1
        elif op in ("logits", "hidden", "mtp_logits", "mtp_logits_at"):
            rows.update(a["rows"])
        elif op == "tokens":
            if window is not None and window != a["n"]:
                raise PieError(ErrorCode.INVALID_PROGRAM, "two tokens intrinsics with different window sizes")
            window = a["n"]
    if sorted(slots) != list(range(len(slots))):
        raise PieError(ErrorCode.INVALID_PROGRAM, f"channel slots must be 0..n-1, got {sorted(slots)}")
    return Program(
        program_hash(model, nodes),
        model,
        nodes,
        specs,
        slots,
        frozenset(writes),
        puts,
        takes,
        frozenset(rows),
        window,
        any(n["op"] == "fold" for n in nodes),
        _frees(nodes),
    )


def _frees(nodes: list[dict]) -> tuple[tuple[int, ...], ...]:
    frees: list[list[int]] = [[] for _ in nodes]
    for j, last in enumerate(last_uses(nodes)):
        if last < len(nodes):  # a value handed to a channel stays until the program ends
            frees[last].append(j)
    return tuple(tuple(f) for f in frees)
