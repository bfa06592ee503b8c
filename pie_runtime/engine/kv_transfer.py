"""A working set's K/V out to a client and back into a working set, in this engine or another one
(docs/working-sets.md, "Saved working sets"): ``ws_read_kv`` reads committed rows' K/V in the pool's dtype, a
bounded range per message; ``ws_append_kv`` appends rows to an idle working set from such arrays, which must
match the pool exactly. Rows keep the positions they were written at (their keys are rotated there): the
append may set the working set's ``dropped``, so that its next row's position is what it was where the rows
were read. The prefix cache names no appended row, nor any after it: the engine cannot vouch for what they hold.

Refused for a model with recurrent state (its state is no row of the pool), a model served with an EAGLE head
(its draft layer's K/V, a drafter's and not the model's, live in the same pages; a saved working set carries the
model's own layers only, so rather than leave that layer unwritten both ops refuse), and a tensor-parallel
engine (each rank holds its own heads).

Page groups (models/kv_groups.py): the arrays hold every KV layer in model order, whatever group it reads; a
sliding layer's rows its group no longer holds read as zeros (no later row attends them), and the read reply
names, per layer, its window (``layer_windows``) and the first row it holds (``held_from``). An append writes a
row into a sliding group only while it holds its page (then lets go of the pages that left the window, as a
fold does), and only from the first row the sender held (its ``held_from``): the rows before it are marked not
held (``WorkingSet.held_from``), so a truncation or eviction that would bring them into the window is refused
as one that needs a row the group let go of. A layer whose group keeps every row (a global layer, or any layer
under ``--kv-swa-full``) cannot take rows the sender did not hold: refused ``kv_mismatch``. So rows saved from an
all-rows engine load anywhere, rows saved from a sliding engine load into a sliding one, and both continue
exactly."""

from __future__ import annotations

import numpy as np

from ..protocol import ErrorCode, PieError
from ..protocol import messages as m
from ..protocol.arrays import encode_array
from .jobs import Handler
from .served import ServedModel, ServedModels
from .working_set import WorkingSet, WorkingSetTable


class KVTransferRequests:
    def __init__(self, models: ServedModels, sets: WorkingSetTable):
        self.models = models
        self.sets = sets

    def ops(self) -> dict[str, Handler]:
        return {"ws_read_kv": self.read, "ws_append_kv": self.append}

    def _check(self, client: bytes, ws_id: int) -> tuple[WorkingSet, ServedModel]:
        ws = self.sets.idle(client, ws_id)  # BUSY / FOLD_PENDING: a transfer never races a fire
        served = self.models[ws.model]
        why = _refusal(ws, served)
        if why is not None:
            raise PieError(ErrorCode.UNSUPPORTED, f"model {ws.model}: {why}; its K/V cannot be read or written")
        return ws, served

    def read(self, client: bytes, req: m.WsReadKV) -> dict:
        ws, served = self._check(client, req.ws)
        if req.start + req.count > ws.committed:
            raise PieError(
                ErrorCode.ROW_OUT_OF_RANGE,
                f"rows {req.start}..{req.start + req.count - 1} past the {ws.committed} committed rows of working "
                f"set {ws.id}",
            )
        kv = served.runner.kv
        row_bytes = 2 * len(kv.layout.layer_row) * kv.k[0, :, 0].numel() * kv.k.element_size()
        count = max(1, min(req.count, m.MAX_KV_TRANSFER_BYTES // row_bytes))
        k, v = served.runner.read_slots(served.pages.group_slots(ws, range(req.start, req.start + count)))
        held = served.pages.held_from(ws)
        return {
            "layer_windows": list(kv.layout.layer_window),
            "held_from": [held[g] for g in kv.layout.layer_group],
            "k": encode_array(k),
            "v": encode_array(v),
            "kv_dtype": _kv_dtype(served),
            "committed": ws.committed,
            "dropped": ws.dropped,
        }

    def append(self, client: bytes, req: m.WsAppendKV) -> dict:
        ws, served = self._check(client, req.ws)
        k, v = req.k.to_numpy(), req.v.to_numpy()
        _check_arrays(served, req.kv_dtype, k, v)
        rows = k.shape[2]
        dropped = ws.dropped if req.dropped is None else req.dropped
        if dropped < ws.dropped:
            raise PieError(
                ErrorCode.INVALID_ARGUMENT, f"dropped {dropped} below working set {ws.id}'s {ws.dropped} dropped rows"
            )
        limit = served.info.max_positions
        if ws.committed + rows + dropped > limit:
            raise PieError(
                ErrorCode.CAPACITY,
                f"{ws.committed + rows} rows with {dropped} dropped exceed the model's {limit} positions",
            )
        start = ws.committed
        held_from = _held_from(served, req.held_from, rows)
        served.pages.reserve(ws, start, rows)  # OUT_OF_PAGES here leaves ws as it was
        if held_from:
            ws.held_from = max(ws.held_from, start + held_from)
        if rows:
            served.runner.write_slots(served.pages.group_slots(ws, range(start, start + rows)), k, v)
        served.pages.wrote(ws, start, None)  # the prefix cache names none of these rows, nor any after them
        served.pages.edits.restored(start, rows)
        ws.committed, ws.dropped = start + rows, dropped
        served.pages.slide(ws)
        return {"committed": ws.committed, "dropped": ws.dropped, "pages": served.pages.held(ws)}


def _refusal(ws: WorkingSet, served: ServedModel) -> str | None:
    if ws.state is not None or served.info.recurrent:
        return "it carries recurrent state, which is no row of the KV pool"
    if served.runner.eagle is not None:
        return "an EAGLE head keeps its draft layer's K/V in the same pages, and only the model's own layers travel"
    if not served.runner.kv_transfer:
        return "a tensor-parallel engine holds each rank's heads apart"
    if not served.runner.kv.layout.layer_row:
        return "it has no attention layers"
    return None


def _held_from(served: ServedModel, held_from: list[int] | None, rows: int) -> int:
    """The first of ``rows`` appended rows every sliding page group can take (0: all of them); refuses
    (KV_MISMATCH) a ``held_from`` of the wrong length, or one that leaves a row missing from a group that keeps
    every row."""
    layout = served.runner.kv.layout
    if held_from is None:
        return 0
    if len(held_from) != len(layout.layer_group):
        raise PieError(
            ErrorCode.KV_MISMATCH, f"held_from names {len(held_from)} layers; this pool has {len(layout.layer_group)}"
        )
    first = 0
    for layer, (group, held) in enumerate(zip(layout.layer_group, held_from)):
        if held and layout.windows[group] is None:
            raise PieError(
                ErrorCode.KV_MISMATCH,
                f"KV layer {layer} of these rows holds nothing before row {held} (saved where its sliding layers let "
                "go of the rows before their window), and this engine keeps every row of that layer (a global "
                "layer, or --kv-swa-full): load them into an engine serving the model without --kv-swa-full",
            )
        first = max(first, min(held, rows))
    return first


def _kv_dtype(served: ServedModel) -> str:
    return str(served.runner.kv.k.dtype).removeprefix("torch.")


def _check_arrays(served: ServedModel, kv_dtype: str, k: np.ndarray, v: np.ndarray) -> None:
    """Refuses (KV_MISMATCH) K/V that are not exactly this pool's dtype and per-row shape."""
    pool = served.runner.kv.k
    have = _kv_dtype(served)
    want = (len(served.runner.kv.layout.layer_row), pool.shape[1], pool.shape[3])
    wire = m.KV_WIRE_DTYPES.get(have)
    for name, a in (("k", k), ("v", v)):
        shape = (a.shape[0], a.shape[1], a.shape[3]) if a.ndim == 4 else None
        if kv_dtype != have or a.dtype.name != wire or shape != want or a.shape != k.shape:
            raise PieError(
                ErrorCode.KV_MISMATCH,
                f"{name} is {kv_dtype} ({a.dtype.name}) of shape {list(a.shape)}; this pool holds {have} ({wire}) "
                f"of shape [{want[0]}, {want[1]}, rows, {want[2]}], k and v alike",
            )
