"""A saved working set's file (``WorkingSet.save`` / ``Model.load_working_set``): safetensors, written and read
on the client side, so the engine never touches a client's paths.

Tensors (row ``i`` of each is the working set's row ``i``):

    k, v        (layers, kv_heads, rows, head_dim) in the pool's dtype: F32, F16 or BF16 (bits as the pool held
                them; the engine's ``ws_read_kv`` arrays)
    tokens      int64 (rows,): the token each row holds
    positions   int64 (rows,): the position each row was written at, where known (given to ``save``, or the
                default ones of a working set that never evicted); absent otherwise
    pending     int64 (p,): tokens the caller still has to embed to go on (a sampled token not yet fired, or a
                prompt's last token held back so that its readout picks the first new token)

Metadata (strings): ``format`` (``pie-working-set``), ``version``, ``model`` (its name where saved),
``model_digest`` (``ModelInfo.weights_digest``: sha256 over the store manifest's file digests), ``weights``
(the format it was served in), ``kv_dtype``, ``committed`` and ``dropped`` (the next row's position is their
sum), and the KV layout (KV page groups, issue 56), each a JSON list: ``page_windows`` (the saving engine's page
groups: the rows each keeps, null for every row), ``layer_windows`` (per KV layer, the rows it attends) and
``held_from`` (per KV layer, the first row whose K/V the file holds: a sliding layer's page group had let go of
the rows before its window, which hold zeros here). The page size does not matter. A file whose digest, weight
format or KV dtype differ from the engine's model is refused :class:`SavedKVMismatch` before any message is
sent, and so is one whose layers attend other windows, one saved with rows missing (a sliding engine's) for an
engine that keeps every row (``--kv-swa-full``), and one without the layout for a sliding-window model; a file
saved where every row was kept loads into either. The engine refuses arrays of another shape itself
(``kv_mismatch`` too).

The safetensors container is written by hand (8-byte little-endian header length, a JSON header, the data)
since numpy has no bfloat16: ``safetensors.torch.load_file`` reads the result as the pool's tensors."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol.messages import KV_WIRE_DTYPES, ModelInfo

from .errors import UsageError

FORMAT = "pie-working-set"
VERSION = 1
MAX_HEADER_BYTES = 1 << 20  # a saved working set's JSON header is a few hundred bytes
# the pool's dtype → safetensors' name; bfloat16's bits travel as uint16 (protocol messages.KV_WIRE_DTYPES)
_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64"}


class SavedKVMismatch(PieError, UsageError):
    """A saved working set this engine's model cannot take (another model's weights, weight format or KV dtype,
    or not such a file at all): ``code`` is ``kv_mismatch``; ``pie run`` prints it as one line."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.KV_MISMATCH, message)


@dataclass
class SavedKV:
    """A saved working set as read from (or written to) its file."""

    k: np.ndarray  # (layers, kv_heads, rows, head_dim), the wire dtype of kv_dtype
    v: np.ndarray
    tokens: list[int]
    pending: list[int]
    positions: list[int] | None
    dropped: int
    meta: dict[str, str]

    @property
    def rows(self) -> int:
        return int(self.k.shape[2])

    @property
    def kv_dtype(self) -> str:
        return self.meta["kv_dtype"]

    @property
    def held_from(self) -> list[int] | None:
        """Per KV layer, the first row whose K/V the file holds (None: a file saved before it was recorded)."""
        layout = layout_of(self.meta)
        return None if layout is None else layout[1]

    def check_fits(self, info: ModelInfo) -> None:
        """Refuses (:class:`SavedKVMismatch`) unless ``info``'s model is the one these rows were computed by, in
        the same weight format and KV dtype."""
        check_meta(self.meta, info)


def check_meta(meta: dict[str, str], info: ModelInfo) -> None:
    """Refuses (:class:`SavedKVMismatch`) a file's metadata unless ``info``'s model computed its rows, in the same
    weight format and KV dtype, and its engine's KV layout can take them (``check_layout``)."""
    digest = meta.get("model_digest", "")
    if not digest or not info.weights_digest:
        raise SavedKVMismatch(
            f"no model digest to vouch for the saved rows (file: {digest!r}, engine: {info.weights_digest!r})"
        )
    if digest != info.weights_digest:
        raise SavedKVMismatch(
            f"saved from model {meta.get('model')!r} (digest {digest[:12]}), but this engine serves "
            f"{info.name!r} (digest {info.weights_digest[:12]}): another model's K/V"
        )
    for key, have in (("weights", info.weights), ("kv_dtype", info.kv_dtype)):
        if meta.get(key) != have:
            raise SavedKVMismatch(
                f"saved with {key} {meta.get(key)!r}, but this engine serves {info.name} with {key} "
                f"{have!r}: its K/V would differ (restart the engine with that format, or save again)"
            )
    check_layout(meta, info)


def layout_of(meta: dict[str, str]) -> tuple[list[int | None], list[int]] | None:
    """A file's ``layer_windows`` and ``held_from``; None for a file saved before they were recorded."""
    if "held_from" not in meta or "layer_windows" not in meta:
        return None
    try:
        windows, held = json.loads(meta["layer_windows"]), json.loads(meta["held_from"])
        if not all(isinstance(h, int) and h >= 0 for h in held) or len(windows) != len(held):
            raise ValueError(f"layer_windows {windows} and held_from {held} disagree")
        if not all(w is None or (isinstance(w, int) and w > 0) for w in windows):
            raise ValueError(f"layer_windows {windows}")
    except (ValueError, TypeError) as e:
        raise SavedKVMismatch(f"a saved working set with a broken KV layout ({e})") from None
    return windows, held


def check_layout(meta: dict[str, str], info: ModelInfo) -> None:
    """Refuses (:class:`SavedKVMismatch`) a file whose KV layout ``info``'s engine cannot continue exactly: layers
    attending other windows, rows missing (its sliding layers had let go of them) where this engine keeps every
    row, or no recorded layout for a model with sliding layers (the file cannot say which rows it holds)."""
    layout = layout_of(meta)
    if layout is None:
        if info.sliding:
            raise SavedKVMismatch(
                f"saved without its KV layout, and {info.name} has sliding-window layers: the file cannot say which "
                "rows its sliding layers held (save it again)"
            )
        return
    windows, held = layout
    if info.layer_windows and windows != info.layer_windows:
        raise SavedKVMismatch(
            f"its KV layers attend windows {windows}, but this engine's {info.name} attends {info.layer_windows}"
        )
    if any(held) and all(w is None for w in info.page_windows):
        first = min(h for h in held if h)
        raise SavedKVMismatch(
            f"saved from an engine whose sliding layers let go of the rows before their window (they hold rows "
            f"from {first} on), and this engine keeps every row of every layer (--kv-swa-full): load it into an "
            "engine serving the model without --kv-swa-full, or save it from one with it"
        )


def read_meta(path: str | Path) -> dict[str, str]:
    """A saved working set's metadata, from its header alone (no K/V read); :class:`SavedKVMismatch` for a file
    that is no saved working set."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"a {n}-byte header")
            meta = json.loads(f.read(n)).get("__metadata__") or {}
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
            raise ValueError("no pie-working-set metadata")
    except (ValueError, AttributeError, struct.error) as e:
        raise SavedKVMismatch(f"{path} is no saved working set ({e})") from None
    return {str(k): str(v) for k, v in meta.items()}


def _ints(values: Sequence[int]) -> np.ndarray:
    return np.asarray(list(values), dtype=np.int64).reshape(-1)


def write_saved(path: str | Path, saved: SavedKV) -> int:
    """Writes ``saved`` as a safetensors file; returns its size in bytes."""
    arrays = {"k": (saved.kv_dtype, saved.k), "v": (saved.kv_dtype, saved.v), "tokens": ("int64", _ints(saved.tokens))}
    if saved.positions is not None:
        arrays["positions"] = ("int64", _ints(saved.positions))
    arrays["pending"] = ("int64", _ints(saved.pending))
    header: dict = {"__metadata__": {**saved.meta, "format": FORMAT, "version": str(VERSION)}}
    blobs, offset = [], 0
    for name, (dtype, a) in arrays.items():
        data = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for data in blobs:
            f.write(data)
    return 8 + len(head) + offset


def read_saved(path: str | Path) -> SavedKV:
    """A saved working set from its file; :class:`SavedKVMismatch` for anything else."""
    raw = Path(path).read_bytes()
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        meta = header.pop("__metadata__", {})
        if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
            raise ValueError(f"format {meta.get('format')!r} version {meta.get('version')!r}")
        kv_dtype = meta["kv_dtype"]
        wire = {"F32": "float32", "F16": "float16", "BF16": KV_WIRE_DTYPES.get(kv_dtype, "?"), "I64": "int64"}
        arrays = {}
        for name, spec in header.items():
            start, stop = spec["data_offsets"]
            dt = np.dtype(wire[spec["dtype"]]).newbyteorder("<")
            arrays[name] = np.frombuffer(raw[8 + n + start : 8 + n + stop], dtype=dt).reshape(spec["shape"])
        k, v, tokens = arrays["k"], arrays["v"], arrays["tokens"].tolist()
        positions = arrays["positions"].tolist() if "positions" in arrays else None
        saved = SavedKV(k, v, tokens, arrays["pending"].tolist(), positions, int(meta["dropped"]), meta)
    except (KeyError, ValueError, TypeError, struct.error, json.JSONDecodeError) as e:
        raise SavedKVMismatch(f"{path} is no saved working set ({e})") from None
    if k.shape != v.shape or k.ndim != 4 or len(tokens) != k.shape[2] or int(meta["committed"]) != k.shape[2]:
        raise SavedKVMismatch(f"{path}: k {list(k.shape)}, v {list(v.shape)} and {len(tokens)} tokens disagree")
    layout = layout_of(meta)
    if layout is not None and saved.rows and len(layout[1]) != k.shape[0]:
        raise SavedKVMismatch(f"{path}: held_from names {len(layout[1])} layers, k holds {k.shape[0]}")
    return saved
