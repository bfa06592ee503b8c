"""Typed error codes. Every refusal the engine sends carries one of these codes and a one-line message."""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Why the engine refused a request: the ``code`` of a :class:`PieError` (``except PieError as e: if
    e.code is ErrorCode.OUT_OF_PAGES: ...``)."""

    BAD_MESSAGE = "bad_message"  # not msgpack, not a map, or fields of the wrong type
    UNKNOWN_OP = "unknown_op"
    VERSION_MISMATCH = "version_mismatch"
    MESSAGE_TOO_LARGE = "message_too_large"
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_WORKING_SET = "unknown_working_set"  # never opened, released, or another client's
    TOKEN_OUT_OF_RANGE = "token_out_of_range"
    ROW_OUT_OF_RANGE = "row_out_of_range"
    INVALID_ARGUMENT = "invalid_argument"
    FOLD_PENDING = "fold_pending"  # a fire on a working set whose deferred fold is not settled
    NO_PENDING_FOLD = "no_pending_fold"
    BUSY = "busy"  # a control op on a working set with fires in flight
    OUT_OF_PAGES = "out_of_pages"  # the KV pool cannot hold the request
    OUT_OF_STATE_SLOTS = "out_of_state_slots"  # every recurrent-state slot is held (one per working set)
    GRANULE = "granule"  # a fold that splits the state's granule (a model whose state advances in chunks)
    CAPACITY = "capacity"  # past the model's maximum positions
    UNAUTHORIZED = "unauthorized"  # tcp:// engines want their token in hello
    UNSUPPORTED = "unsupported"  # e.g. MTP readout on a model without an MTP drafter
    INVALID_PROGRAM = "invalid_program"  # a program the validator refuses (unknown op, arity, dtype, shape, size)
    UNKNOWN_PROGRAM = "unknown_program"  # a fire names a program hash this client never registered
    UNKNOWN_CHANNEL = "unknown_channel"  # never opened, closed, or another client's
    CHANNEL_EMPTY = "channel_empty"  # a take or read with no cell and no in-flight fire that writes one
    CHANNEL_FULL = "channel_full"  # a put past the channel's capacity
    CHANNEL_POISONED = "channel_poisoned"  # a fire that writes the channel failed; the message says why
    PROGRAM_FAILED = "program_failed"  # an epilogue failed at run time (e.g. a gather index out of range)
    LIMIT_EXCEEDED = "limit_exceeded"  # a request past one of the engine's limits; the message names the limit
    EMPTY_MASK = "empty_mask"  # a readout row whose allowed-token mask allows no token
    INVALID_TREE = "invalid_tree"  # a fire's parents that form no tree, or a fold path that is no path of it
    # K/V that do not fit this engine's model: another model's weights, format or KV dtype, or K/V arrays whose
    # shape or dtype differ from the pool's (ws_append_kv, the SDK's load of a saved working set)
    KV_MISMATCH = "kv_mismatch"
    INTERNAL = "internal"


class PieError(Exception):
    """An error with a wire code; raised on both sides of the protocol."""

    def __init__(self, code: ErrorCode | str, message: str):
        self.code = ErrorCode(code)
        self.message = message
        self.request_id: int | None = None  # set when the refused request's id could be read
        super().__init__(f"{self.code.value}: {message}")

    def to_wire(self) -> dict:
        return {"code": self.code.value, "message": self.message}
