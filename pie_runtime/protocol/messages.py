"""Wire messages. A request is one msgpack map ``{"id": n, "op": ..., ...}``; the reply is
``{"id": n, "ok": true, ...}`` or ``{"id": n, "ok": false, "error": {"code", "message"}}``.

Only relative row indexes and working-set handles cross the wire, never physical page ids.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .arrays import decode_array

PROTOCOL_VERSION = 1
DEFERRED = "deferred"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class WireArray(_Msg):
    dtype: str
    shape: list[int]
    data: bytes

    def to_numpy(self) -> np.ndarray:
        return decode_array(self.model_dump())


ReadoutKind = Literal["logits", "argmax", "distribution", "sample", "hidden", "mtp"]


class Readout(_Msg):
    """What to read at some rows of a fire's window. ``mask`` is an optional packed allowed-token bitmask
    (int32/uint32, shape (len(rows), ceil(vocab / 32)), bit i of word j allows token 32 j + i)."""

    rows: list[int]
    kind: ReadoutKind
    temperature: float = Field(default=1.0, ge=0.0)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    k: int = Field(default=1, ge=1, le=16)  # MTP draft depth
    with_probs: bool = False  # MTP: also return the draft distribution at each step
    mask: WireArray | None = None


class _Req(_Msg):
    id: int


class Hello(_Req):
    op: Literal["hello"]
    version: int
    client: str = ""
    token: str | None = None


class GetTokenizer(_Req):
    op: Literal["tokenizer"]
    model: str | None = None


class WsOpen(_Req):
    op: Literal["ws_open"]
    model: str | None = None


class WsFork(_Req):
    op: Literal["ws_fork"]
    ws: int


class WsRelease(_Req):
    op: Literal["ws_release"]
    ws: int


class WsFold(_Req):
    op: Literal["ws_fold"]
    ws: int
    n: int = Field(ge=0)


class WsTruncate(_Req):
    op: Literal["ws_truncate"]
    ws: int
    n: int = Field(ge=0)


class Fire(_Req):
    """One ForwardPass: embed ``tokens`` at rows ``committed ..`` of working set ``ws``, read out, fold.
    ``fold``: None folds every row, an int folds that many, ``"deferred"`` leaves it for ``ws_fold``."""

    op: Literal["fire"]
    ws: int
    tokens: list[int] = Field(min_length=1)
    positions: list[int] | None = None
    readouts: list[Readout] = []
    fold: int | Literal["deferred"] | None = None


class Stats(_Req):
    op: Literal["stats"]


class Ping(_Req):
    op: Literal["ping"]


Request = Annotated[
    Union[Hello, GetTokenizer, WsOpen, WsFork, WsRelease, WsFold, WsTruncate, Fire, Stats, Ping],
    Field(discriminator="op"),
]
OPS = ("hello", "tokenizer", "ws_open", "ws_fork", "ws_release", "ws_fold", "ws_truncate", "fire", "stats", "ping")


class ModelInfo(BaseModel):
    """What ``hello`` tells a client about each served model."""

    name: str
    vocab_size: int
    max_positions: int
    page_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    chat_template: str | None
    drafters: list[dict] = []
    mtp_depth: int = 0  # > 0 when the model serves MTP(k) readouts
