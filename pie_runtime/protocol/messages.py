"""Wire messages. A request is one msgpack map ``{"id": n, "op": ..., ...}``; the reply is
``{"id": n, "ok": true, ...}`` or ``{"id": n, "ok": false, "error": {"code", "message"}}``.

Only relative row indexes and working-set handles cross the wire, never physical page ids.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .arrays import decode_array
from .dtypes import ChannelDtype

# 2: spec_report, MTP at_accepted, pass costs in hello; 3: tree windows (protocol.tree); 4: program_unregister,
# ws_evict (rows kept at their positions: a row index and its position part ways), ws_read_kv and ws_append_kv
# (a working set's K/V out to a client and into another engine: prompt caches); 5: the attention readout
PROTOCOL_VERSION = 5
Deferred = Literal["deferred"]
DEFERRED: Final[Deferred] = "deferred"
"""The fold of a fire that commits nothing yet: ``fp.fold(DEFERRED)`` leaves the window's rows to a later
``ws.fold(n)``, the next fire's settle (``ws.settle(n)``) or the epilogue program, once the host knows how many
rows to keep (speculative decoding: how many drafts were accepted)."""


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class WireArray(_Msg):
    dtype: str
    shape: list[int]
    data: bytes

    def to_numpy(self) -> np.ndarray:
        return decode_array(self.model_dump())


ReadoutKind = Literal["logits", "argmax", "distribution", "sample", "hidden", "mtp", "eagle", "attention"]
# An attention readout's reply, float32 (rows, [layers,] keys): at most this many bytes (limit_exceeded), well under
# the codec's 16 MiB message limit
MAX_ATTENTION_BYTES = 8 * 1024 * 1024

# The sampler's ranges, shared by the engine's sampler and the SDK's filter_distribution: a temperature
# below MIN_TEMPERATURE (0 included) is greedy (one-hot at the argmax), one above MAX_TEMPERATURE is
# refused on the wire (and treated as MAX_TEMPERATURE by the samplers); top_p in (0, 1] always keeps the
# most probable token, so a tiny top_p is greedy too.
MIN_TEMPERATURE: Final = 1e-4
MAX_TEMPERATURE: Final = 1e4


class Readout(_Msg):
    """What to read at some rows of a fire's window. ``mask`` is an optional packed allowed-token bitmask
    (int32/uint32, shape (len(rows), ceil(vocab / 32)), bit i of word j allows token 32 j + i).

    ``attention``: the attention mass each KV row of the working set received from each read row, the softmax
    probabilities summed over query heads and layers (``per_layer``: over heads only, one row per layer). Reply
    ``{"scores"}``, float32 (rows, keys) or (rows, layers, keys), keys = the working set's rows up to the end of
    the fire's window, indexed by row (not position: after an eviction they part ways); a key a row does not
    attend (later rows, another branch of a tree) gets exactly 0. Each layer's mass sums to the query heads'
    count. At most ``MAX_ATTENTION_BYTES`` (``limit_exceeded``); ``unsupported`` on a model without attention
    everywhere (recurrent layers) or a tensor-parallel engine."""

    rows: list[int]
    kind: ReadoutKind
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = None
    k: int = Field(default=1, ge=1, le=16)  # MTP or EAGLE draft depth
    with_probs: bool = False  # MTP, EAGLE: also return the draft distribution at each step
    # MTP or EAGLE, greedy: chain drafts only from the row after the longest prefix of rows whose argmax equals the
    # window's next token (the row a greedy verifier keeps going from); the other rows' drafts are -1
    at_accepted: bool = False
    per_layer: bool = False  # attention: the mass per layer instead of summed over the layers
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
    # its prefix-cache pages are shared only with working sets opened with the same salt (pie serve: a key's)
    cache_salt: str | None = Field(default=None, max_length=128)


class WsFork(_Req):
    op: Literal["ws_fork"]
    ws: int


class WsRelease(_Req):
    op: Literal["ws_release"]
    ws: int


_Count = Annotated[int, Field(ge=0)]


class WsFold(_Req):
    """Settles a deferred fold: ``n`` leading rows, or a path of window rows (a tree fire's, protocol.tree)."""

    op: Literal["ws_fold"]
    ws: int
    n: _Count | list[int]


class WsTruncate(_Req):
    op: Literal["ws_truncate"]
    ws: int
    n: int = Field(ge=0)


MAX_EVICT_SPANS = 4096  # rows or ranges in one ws_evict


class WsEvict(_Req):
    """Drops committed rows of a working set: ``rows`` (indices) and ``ranges`` (``[start, stop)`` pairs), any
    mix, in any order. The kept rows keep their order and the positions they were written at (their keys are
    rotated there); the next row's position is the sequence's logical length (rows kept + rows ever dropped),
    not the number of rows kept. Pages that no longer hold a kept row go back to the pool at once."""

    op: Literal["ws_evict"]
    ws: int
    rows: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=MAX_EVICT_SPANS)
    ranges: list[Annotated[list[_Count], Field(min_length=2, max_length=2)]] = Field(
        default_factory=list, max_length=MAX_EVICT_SPANS
    )

    @model_validator(mode="after")
    def _ranges_ascend(self) -> WsEvict:
        if any(stop < start for start, stop in self.ranges):
            raise ValueError("a range is [start, stop) with stop >= start")
        return self


# K/V that travel in one ws_read_kv reply or ws_append_kv request, K and V together: a long sequence goes in
# several messages, each well under the codec's 16 MiB message limit
MAX_KV_TRANSFER_BYTES = 8 * 1024 * 1024
# a KV pool's dtype → the wire dtype its raw bits travel in (bfloat16 has no numpy dtype: its bits go as uint16)
KV_WIRE_DTYPES: Final[dict[str, str]] = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}


class WsReadKV(_Req):
    """Reads the K/V of committed rows ``start ..`` of an idle working set: at most ``count`` rows, and no more
        than fit in ``MAX_KV_TRANSFER_BYTES`` (a long sequence is read in several requests). Reply: ``{"k", "v"}``,
        arrays (``protocol/arrays.py``) of shape ``(layers, kv_heads, rows, head_dim)`` holding the pool's bits in
        its wire dtype (``KV_WIRE_DTYPES``), with ``"kv_dtype"`` (the pool's dtype), ``"committed"`` and
        ``"dropped"`` (the next row's position is their sum), and per KV layer ``"layer_windows"`` (the rows it attends:
    None for every earlier row) and ``"held_from"`` (the first row of the working set whose K/V it still holds: a
    sliding layer's page group lets go of the rows before its window; the arrays hold zeros there). Refused
    ``row_out_of_range`` past the committed rows,
        ``busy``/``fold_pending`` while a fire may write, ``unsupported`` for a model with recurrent state or an
        EAGLE head's extra KV layer, or a tensor-parallel engine."""

    op: Literal["ws_read_kv"]
    ws: int
    start: _Count = 0
    count: int = Field(ge=1)


class WsAppendKV(_Req):
    """Appends rows to an idle working set from K/V a ``ws_read_kv`` gave (another engine's, as like as not):
    ``k`` and ``v`` of shape ``(layers, kv_heads, rows, head_dim)`` in the pool's wire dtype, with ``kv_dtype``
    the pool's dtype: anything else is refused ``kv_mismatch`` before any change. They become committed rows
    ``committed ..``; their keys are already rotated at the positions they were written at, so ``dropped``
    (optional) sets the working set's rows-ever-dropped, making the next row's position ``committed +
    dropped`` what it was where the rows were read (never below its current value). Pages are reserved all or
    nothing (``out_of_pages`` changes nothing). The prefix cache names none of these rows, nor any row after
    them. ``held_from`` (optional, per KV layer, as ``ws_read_kv``'s but counted from these arrays' first row): the
    rows before it hold nothing for that layer; refused ``kv_mismatch`` when such a layer's page group keeps every
    row (``--kv-swa-full``, or a global layer), else a sliding group marks them not held (``WorkingSet.held_from``),
    so no later edit brings them into its window. Reply: ``{"committed", "dropped", "pages"}``. Refusals as
    ``ws_read_kv``'s, and ``capacity`` past the model's positions."""

    op: Literal["ws_append_kv"]
    ws: int
    k: WireArray
    v: WireArray
    kv_dtype: str
    dropped: _Count | None = None
    held_from: list[_Count] | None = None


class RunAhead(_Msg):
    """Leaves a channel-fed pass with the engine: it re-fires it after every step until a budget or a stop.
    ``output`` is the bound channel whose cells are the committed tokens (entries < 0 are padding); they
    count toward ``budget_tokens`` and are checked for ``stop_tokens``. A nonzero front cell of
    ``stop_channel`` (set by the host or by the epilogue) stops it too."""

    output: int
    budget_tokens: int | None = Field(default=None, ge=1)
    budget_rounds: int | None = Field(default=None, ge=1)
    stop_tokens: list[int] = []
    stop_channel: int | None = None


class Fire(_Req):
    """One ForwardPass: embed ``tokens`` (or the front cell of channel ``tokens_from``) at rows
    ``committed ..`` of working set ``ws``, read out, run the epilogue ``program``, fold.
    ``fold``: None folds every row, an int folds that many, a list of rows folds that path of a tree window,
    ``"deferred"`` leaves it for ``ws_fold`` or, when the program folds, for the epilogue. ``settle`` settles
    the working set's pending deferred fold with that count (or path) first, saving the ``ws_fold`` round
    trip. ``parents`` makes the window a token tree (protocol.tree): one parent row per row, -1 for a row
    that follows the committed sequence. ``bindings`` are the channel handles of the program's slots."""

    op: Literal["fire"]
    ws: int
    tokens: list[int] | None = Field(default=None, min_length=1)
    tokens_from: int | None = None
    positions: list[int] | None = None
    parents: list[int] | None = None
    readouts: list[Readout] = []
    fold: int | list[int] | Deferred | None = None
    settle: _Count | list[int] | None = None
    program: str | None = None
    bindings: list[int] = []
    run_ahead: RunAhead | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Fire:
        if (self.tokens is None) == (self.tokens_from is None):
            raise ValueError("give exactly one of tokens and tokens_from")
        return self


class ProgramNode(_Msg):
    """One node of an epilogue program (see ``protocol.programs`` for the op set and its rules)."""

    op: str
    inputs: list[int] = []
    attrs: dict[str, Any] = {}


class ProgramRegister(_Req):
    """Registers an epilogue program for ``model``; the reply names it by hash. A client holds at most the
    engine's ``--max-programs``: one more evicts its least recently used program that no queued fire uses
    (``limit_exceeded`` when queued fires use every one), and a fire naming an evicted program is refused
    ``unknown_program``, which the SDK answers by registering it again."""

    op: Literal["program_register"]
    model: str | None = None
    nodes: list[ProgramNode] = Field(min_length=1)


PROGRAM_HASH = r"^[0-9a-f]{32}$"  # a program's name: protocol.programs.program_hash


class ProgramUnregister(_Req):
    """Drops a registered program by its hash. Fires already queued with it (a run-ahead included) run on with
    it; a later fire naming it is refused ``unknown_program`` until it is registered again. The reply says
    whether the client held it (``{"removed": bool}``): a program the engine already evicted, or never had,
    is no error, so unregistering twice is harmless."""

    op: Literal["program_unregister"]
    program: str = Field(pattern=PROGRAM_HASH)


class ChannelOpen(_Req):
    """A bounded queue of cells of one ``shape`` and ``dtype``, held on ``model``'s device."""

    op: Literal["channel_open"]
    model: str | None = None
    shape: list[int] = Field(max_length=4)
    dtype: ChannelDtype
    capacity: int = Field(ge=1, le=4096)


class ChannelPut(_Req):
    op: Literal["channel_put"]
    channel: int
    value: WireArray


class ChannelSet(_Req):
    """Replaces the front cell (or puts one into an empty channel)."""

    op: Literal["channel_set"]
    channel: int
    value: WireArray


class ChannelTake(_Req):
    """Consumes up to ``max`` cells; waits while fewer than ``min`` are there and a fire in flight writes the
    channel (a larger ``min`` batches a run-ahead's output into fewer replies)."""

    op: Literal["channel_take"]
    channel: int
    max: int = Field(default=1, ge=1, le=4096)
    min: int = Field(default=1, ge=1, le=4096)


class ChannelRead(_Req):
    """A copy of the front cell; waits like ``channel_take``."""

    op: Literal["channel_read"]
    channel: int


class ChannelClose(_Req):
    op: Literal["channel_close"]
    channel: int


class Stats(_Req):
    op: Literal["stats"]


class Ping(_Req):
    op: Literal["ping"]


_SPEC_COUNT = Annotated[int, Field(ge=0, le=2**53 - 1)]  # exact in a double; summed saturating (spec_totals.py)
_SPEC_SPAN = Annotated[float, Field(ge=0.0, le=1e12, allow_inf_nan=False)]


class SpecReport(_Req):
    """A finished speculative run's counters, which the engine sums per model and inferlet (``stats``). Every
    count is an integer in ``[0, 2**53)`` and every duration a finite float in ``[0, 1e12]``."""

    op: Literal["spec_report"]
    model: str | None = None
    inferlet: str = Field(default="", max_length=128)
    rounds: _SPEC_COUNT
    proposed: _SPEC_COUNT
    accepted: _SPEC_COUNT
    proposed_per_position: list[_SPEC_COUNT] = Field(default=[], max_length=64)
    accepted_per_position: list[_SPEC_COUNT] = Field(default=[], max_length=64)
    reached_per_position: list[_SPEC_COUNT] = Field(default=[], max_length=64)
    rounds_with_rejection: _SPEC_COUNT
    skipped: dict[Annotated[str, Field(max_length=64)], _SPEC_COUNT] = Field(default={}, max_length=32)
    replayed_rows: _SPEC_COUNT = 0
    draft_rows: _SPEC_COUNT = 0
    tree_rounds: _SPEC_COUNT = 0
    tree_rows: _SPEC_COUNT = 0
    tree_depth: _SPEC_COUNT = 0
    decode_tokens: _SPEC_COUNT = 0
    decode_s: _SPEC_SPAN = 0.0
    prefill_ms: _SPEC_SPAN = 0.0

    @model_validator(mode="after")
    def _consistent(self) -> SpecReport:
        if self.accepted > self.proposed:
            raise ValueError("accepted drafts exceed proposed ones")
        n = len(self.proposed_per_position)
        if len(self.accepted_per_position) != n or len(self.reached_per_position) != n:
            raise ValueError("per-position lists differ in length")
        for a, r, p in zip(self.accepted_per_position, self.reached_per_position, self.proposed_per_position):
            if a > r:
                raise ValueError("a position accepted more drafts than rounds reached it")
            if r > p:
                raise ValueError("a position was reached in more rounds than proposed it")
        if self.rounds_with_rejection > self.rounds:
            raise ValueError("more rejecting rounds than rounds")
        if self.tree_rounds > self.rounds:
            raise ValueError("more tree rounds than rounds")
        return self


Request = Annotated[
    Hello
    | GetTokenizer
    | WsOpen
    | WsFork
    | WsRelease
    | WsFold
    | WsTruncate
    | WsEvict
    | WsReadKV
    | WsAppendKV
    | Fire
    | Stats
    | Ping
    | ProgramRegister
    | ProgramUnregister
    | ChannelOpen
    | ChannelPut
    | ChannelSet
    | ChannelTake
    | ChannelRead
    | ChannelClose
    | SpecReport,
    Field(discriminator="op"),
]


def _op_of(request: type[_Req]) -> str:
    (op,) = get_args(request.model_fields["op"].annotation)
    return op


REQUEST_OPS: tuple[str, ...] = tuple(_op_of(r) for r in get_args(get_args(Request)[0]))  # the wire ops, in order


class ModelInfo(BaseModel):
    """What ``hello`` tells a client about each served model."""

    name: str
    vocab_size: int
    max_positions: int
    page_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    chat_template: str | None
    # a plain prompt starts with BOS / ends with EOS (the model's tokenizer rule; the SDK adds them once)
    add_bos_token: bool = False
    add_eos_token: bool = False
    drafters: list[dict] = []
    mtp_depth: int = 0  # > 0 when the model serves MTP(k) readouts
    hidden_size: int = 0  # width of Hidden() readouts and of a program's hidden intrinsic
    pass_cost_ms: list[float] = []  # [w-1]: ms of one sequence's w-row pass + lm head, measured at start
    mtp_step_ms: float = 0.0  # ms of one more MTP(k) draft on a row, measured at start
    # [i]: the MTP head's held-out acceptance of draft i+1 given drafts 1..i kept, from its training record
    # (empty: not recorded); the draft-length planner's prior
    mtp_acceptance: list[float] = []
    eagle_depth: int = 0  # > 0 when the model serves Eagle(k) readouts
    eagle_step_ms: float = 0.0  # ms of one more Eagle(k) draft on a row, measured at start
    eagle_acceptance: list[float] = []  # the EAGLE head's, as mtp_acceptance
    prepacked_bytes: int = 0  # extra weight memory of oneDNN-prepacked copies (multi-row passes on CPU)
    weights: str = "fp32"  # the weight format the engine serves this model in (fp32, bf16, int8, int4)
    # sha256 over the store manifest's file digests (weights and tokenizer): the model's identity across engines,
    # which a saved working set's K/V must match ("" where the engine cannot vouch for one)
    weights_digest: str = ""
    kv_dtype: str = ""  # the KV pool's dtype (float32, bfloat16); "" for a model without a pool
    weight_bytes: int = 0  # bytes of the projections and lm head as served
    kernels: str = "torch"  # what runs the passes: "native <ISA variant>" (models/native_model.py) or "torch"
    kv_bytes: int = 0  # bytes of the KV pool, allocated at start
    page_bytes: int = 0  # bytes of one KV page (every page group's pages are alike: models/kv_groups.py)
    # per KV page group: the rows it keeps (None: every row); more than one, or a window, for sliding-window models
    page_windows: list[int | None] = [None]
    layer_windows: list[int | None] = []  # per KV layer: the rows it attends (None: every earlier row)
    # the most rows of one fire a forward runs (--max-batch-tokens): a sliding group's pages span a window and this
    chunk_rows: int = 256
    sliding: bool = False  # some layers attend only a window of rows (their pages are let go of unless --kv-swa-full)
    compile_s: float = 0.0  # seconds the engine spent compiling the layers at start (0: not compiled)
    family: str = "llama"  # the architecture (llama, mistral, qwen2, qwen3, mamba, lfm2)
    recurrent: bool = False  # a working set carries recurrent state: a fold of fewer rows than ran restores it
    state_slots: int = 0  # working sets the recurrent-state pool holds at once (0: no recurrent state)
    state_bytes: int = 0  # one working set's state (its snapshot doubles it)
    recurrent_fold: str = ""  # per-row or replay: how a fold of fewer rows than ran restores the state
    per_row_states: int = 0  # folds of up to this many rows copy a kept per-row state (each costs state_bytes)
    state_granule: int = 1  # rows the state advances by; > 1: a fire folds all its rows, no speculation


class PrefixCacheStats(BaseModel):
    """A model's prefix cache in ``stats``: first fires that looked it up (``queries``, their rows
    ``query_tokens``), those that mapped cached pages (``hits``, the rows not computed ``hit_tokens``), the pages
    named now (held or idle) and the idle ones evicted to make room. All zero with ``--no-prefix-cache``."""

    enabled: bool
    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    cached_pages: int = 0
    evictions: int = 0


class KVStats(BaseModel):
    """A model's KV pool in ``stats``: pages working sets hold, of the pool's total (idle cached pages are not
    used: a reserve evicts them), and the running totals of KV edits: committed rows dropped by ``ws_evict``
    and the pages those evictions gave back, working sets restored from saved K/V (a ``ws_append_kv`` into an
    empty working set) and the rows appended."""

    pages_used: int
    pages_total: int
    evicted_rows: int = 0
    evicted_pages: int = 0
    restored_working_sets: int = 0
    restored_rows: int = 0
