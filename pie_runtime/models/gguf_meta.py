"""A fast reader of a GGUF file's header, key/value metadata and tensor index (GGUF v2 and v3), without gguf-py's
``GGUFReader``, which builds numpy parts for every element of every array and so takes tens of seconds on a
262k-piece vocabulary. Here arrays of numbers are read with one ``np.frombuffer`` each and arrays of strings
by a tight loop over a memoryview of the file's memory map; tensor bytes are never touched until asked for.

Values have the shapes gguf-py's ``ReaderField.contents()`` gives, so callers can switch without change:
``str``, ``int``, ``float`` (a FLOAT32 widened to a Python float, as ``contents()`` does), ``bool``, and a
``list`` for every array (of numbers too: Python ints/floats/bools, never numpy arrays). Nested arrays are
flattened to the list of their leaves, as ``contents()`` does (GGUF's converters write none). ``fields`` also
holds gguf-py's three pseudo-keys ``GGUF.version``, ``GGUF.tensor_count`` and ``GGUF.kv_count``, and
``types`` each key's value types as ``ReaderField.types`` lists them.

A truncated or corrupt file raises :class:`GGUFFormatError` (a :class:`~.checkpoint.CheckpointError`) naming
what is wrong and where; so does a tensor whose bytes would lie past the end of the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .checkpoint import CheckpointError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses a tensor of more dims

# fixed-size value types: (struct/numpy code, size)
_SCALARS: dict[GGUFValueType, tuple[str, int]] = {
    GGUFValueType.UINT8: ("B", 1),
    GGUFValueType.INT8: ("b", 1),
    GGUFValueType.UINT16: ("H", 2),
    GGUFValueType.INT16: ("h", 2),
    GGUFValueType.UINT32: ("I", 4),
    GGUFValueType.INT32: ("i", 4),
    GGUFValueType.FLOAT32: ("f", 4),
    GGUFValueType.BOOL: ("?", 1),
    GGUFValueType.UINT64: ("Q", 8),
    GGUFValueType.INT64: ("q", 8),
    GGUFValueType.FLOAT64: ("d", 8),
}
# tensor types whose elements numpy reads as they are (the rest are blocks: bytes)
_PLAIN_TENSORS: dict[GGMLQuantizationType, str] = {
    GGMLQuantizationType.F16: "f2",
    GGMLQuantizationType.F32: "f4",
    GGMLQuantizationType.F64: "f8",
    GGMLQuantizationType.I8: "i1",
    GGMLQuantizationType.I16: "i2",
    GGMLQuantizationType.I32: "i4",
    GGMLQuantizationType.I64: "i8",
}


class GGUFFormatError(CheckpointError):
    """The file is not a readable GGUF: truncated, corrupt, or of a version this reader does not know."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor-index entry. ``shape`` is the dims as GGUF stores them (fastest first, like gguf-py's
    ``ReaderTensor.shape``); :attr:`hf_shape` is the row-major (PyTorch / Hugging Face) shape."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    offset: int  # as stored: from the start of the data section
    data_offset: int  # from the start of the file
    n_elements: int
    n_bytes: int
    byte_order: str = field(repr=False)  # "<" or ">"
    _map: np.memmap = field(repr=False, compare=False)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def raw(self) -> np.ndarray:
        """The tensor's bytes, a 1-d uint8 view of the file's memory map (nothing is read until used)."""
        return self._map[self.data_offset : self.data_offset + self.n_bytes]

    @property
    def data(self) -> np.ndarray:
        """The bytes as ``ReaderTensor.data`` shapes them: elements of ``hf_shape`` for plain float and int
        types, otherwise uint8 rows of blocks (``hf_shape`` with the last dim in bytes)."""
        plain = _PLAIN_TENSORS.get(self.tensor_type)
        shape = self.hf_shape
        if plain is not None:
            return self.raw.view(np.dtype(self.byte_order + plain)).reshape(shape)
        block, size = GGML_QUANT_SIZES[self.tensor_type]
        return self.raw.reshape(*shape[:-1], shape[-1] // block * size)


@dataclass
class GGUFFile:
    """A GGUF file's metadata and tensor index; tensors are views into the file's memory map."""

    path: Path
    version: int
    byte_order: str  # "<" little-endian (almost every file) or ">"
    fields: dict[str, Any]
    types: dict[str, list[GGUFValueType]]
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int  # where the data section starts (the tensor index's end, padded to the alignment)

    def tensor(self, name: str) -> GGUFTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def tensor_bytes(self, name: str) -> tuple[GGMLQuantizationType, tuple[int, ...], np.ndarray]:
        """A tensor's GGML type, row-major shape and raw bytes (a memmap view)."""
        t = self.tensor(name)
        return t.tensor_type, t.hf_shape, t.raw


class _Cursor:
    """Reads GGUF values from a memoryview, every read bounds-checked."""

    def __init__(self, buf: memoryview, byte_order: str) -> None:
        self.buf = buf
        self.end = len(buf)
        self.bo = byte_order
        self.pos = 0
        self._u32 = struct.Struct(byte_order + "I")
        self._u64 = struct.Struct(byte_order + "Q")

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{what} (at byte {self.pos} of {self.end})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise self.fail(f"truncated GGUF: {what} needs {n} bytes")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = self._u32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = self._u64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        start, self.pos = self.pos, self.pos + n
        try:
            return str(self.buf[start : self.pos], "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{what} is not UTF-8 (at byte {start}): {e.reason}") from None

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row: the loop is the reader's hot path (a vocabulary's pieces)."""
        self.need(count * 8, what)  # each at least its length
        buf, end, unpack, out = self.buf, self.end, self._u64.unpack_from, []
        append, pos = out.append, self.pos
        try:
            for i in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > end:
                    self.pos = pos
                    raise self.fail(f"truncated GGUF: {what}[{i}] needs {n} bytes")
                append(str(buf[pos : pos + n], "utf-8"))
                pos += n
        except struct.error:
            self.pos = pos
            raise self.fail(f"truncated GGUF: {what}[{len(out)}] length") from None
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{what}[{len(out)}] is not UTF-8 (at byte {pos}): {e.reason}") from None
        self.pos = pos
        return out

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.u32(what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            self.pos -= 4
            raise self.fail(f"{what}: unknown GGUF value type {raw}") from None

    def value(self, vtype: GGUFValueType, what: str) -> tuple[Any, list[GGUFValueType]]:
        """One value and its type list (``ReaderField.types``); arrays flattened to their leaves."""
        if vtype == GGUFValueType.STRING:
            return self.string(what), [vtype]
        if vtype in _SCALARS:
            code, size = _SCALARS[vtype]
            self.need(size, what)
            (v,) = struct.unpack_from(self.bo + code, self.buf, self.pos)
            self.pos += size
            return v, [vtype]
        itype = self.value_type(f"{what} item type")
        count = self.u64(f"{what} length")
        if itype in _SCALARS:
            code, size = _SCALARS[itype]
            self.need(count * size, what)
            arr = np.frombuffer(self.buf, np.dtype(self.bo + code), count, self.pos)
            self.pos += count * size
            return arr.tolist(), [vtype, itype] if count else [vtype]
        if itype == GGUFValueType.STRING:
            return self.strings(count, what), [vtype, itype] if count else [vtype]
        self.need(count * 12, what)  # nested arrays: each at least its item type and length
        flat: list[Any] = []
        types = [vtype]
        for i in range(count):
            inner, inner_types = self.value(itype, f"{what}[{i}]")
            flat.extend(inner)
            if i == 0:
                types += inner_types
        return flat, types


def read_gguf(path: str | Path) -> GGUFFile:
    """Read a GGUF file's header, metadata and tensor index (tensor bytes stay on disk, memory-mapped)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size < 24:
            raise GGUFFormatError(f"truncated GGUF: {size} bytes, less than a header")
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        return _read(path, mm)
    except OSError as e:
        raise CheckpointError(f"cannot read GGUF file {path}: {e}") from e
    except GGUFFormatError as e:
        raise GGUFFormatError(f"cannot read GGUF file {path}: {e}") from None


def _header(buf: memoryview) -> tuple[int, str]:
    """The version and byte order."""
    if bytes(buf[:4]) != MAGIC:
        raise GGUFFormatError(f"not a GGUF file (magic {bytes(buf[:4])!r}, want {MAGIC!r})")
    (version,) = struct.unpack_from("<I", buf, 4)
    byte_order = "<"
    if version & 0xFFFF == 0:  # written big-endian (gguf-py's reader guesses the same way)
        byte_order, (version,) = ">", struct.unpack_from(">I", buf, 4)
    if version not in SUPPORTED_VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} is not supported; supported: 2, 3")
    return version, byte_order


def _read(path: Path, mm: np.memmap) -> GGUFFile:
    buf = memoryview(mm)  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs lack __buffer__
    version, byte_order = _header(buf)
    cur = _Cursor(buf, byte_order)
    cur.pos = 8
    n_tensors, n_kv = cur.u64("tensor count"), cur.u64("key/value count")
    fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    types = {
        "GGUF.version": [GGUFValueType.UINT32],
        "GGUF.tensor_count": [GGUFValueType.UINT64],
        "GGUF.kv_count": [GGUFValueType.UINT64],
    }
    cur.need(n_kv * 12, "key/value pairs")  # each at least a key length and a type
    for i in range(n_kv):
        key = cur.string(f"key {i}")
        if key in fields:
            raise cur.fail(f"duplicate key {key!r}")
        vtype = cur.value_type(key)
        fields[key], types[key] = cur.value(vtype, key)
    alignment = _alignment(fields, types)
    cur.need(n_tensors * 24, "tensor index")  # each at least a name length, a dim count, a type and an offset
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    tensors: list[GGUFTensor] = []
    seen: set[str] = set()
    for name, dims, ggml_type, offset in infos:
        if name in seen:
            raise GGUFFormatError(f"duplicate tensor {name!r}")
        seen.add(name)
        tensors.append(_tensor(name, dims, ggml_type, offset, data_offset, alignment, cur.bo, mm))
    return GGUFFile(path, version, cur.bo, fields, types, tensors, alignment, data_offset)


def _alignment(fields: dict[str, Any], types: dict[str, list[GGUFValueType]]) -> int:
    if "general.alignment" not in fields:
        return DEFAULT_ALIGNMENT
    alignment = fields["general.alignment"]
    if types["general.alignment"] != [GGUFValueType.UINT32]:
        raise GGUFFormatError(f"general.alignment is a {types['general.alignment'][0].name}, not a UINT32")
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
    return alignment


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cur.string(f"tensor {i} name")
    n_dims = cur.u32(f"tensor {name!r} dim count")
    if n_dims > MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dims, more than {MAX_DIMS}")
    dims = tuple(cur.u64(f"tensor {name!r} dims") for _ in range(n_dims))
    raw_type = cur.u32(f"tensor {name!r} type")
    try:
        ggml_type = GGMLQuantizationType(raw_type)
    except ValueError:
        raise cur.fail(f"tensor {name!r} has unknown GGML type {raw_type}") from None
    return name, dims, ggml_type, cur.u64(f"tensor {name!r} offset")


def _tensor(
    name: str,
    dims: tuple[int, ...],
    ggml_type: GGMLQuantizationType,
    offset: int,
    data_start: int,
    alignment: int,
    byte_order: str,
    mm: np.memmap,
) -> GGUFTensor:
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    if dims and dims[0] % block:
        raise GGUFFormatError(f"tensor {name!r}: row of {dims[0]} is not a whole number of {block}-value blocks")
    if offset % alignment:
        raise GGUFFormatError(f"tensor {name!r}: offset {offset} is not a multiple of the alignment {alignment}")
    n_elements = int(np.prod(dims, dtype=object)) if dims else 1
    n_bytes = n_elements // block * type_size
    start = data_start + offset
    if start + n_bytes > len(mm):
        raise GGUFFormatError(
            f"truncated GGUF: tensor {name!r} needs bytes {start}..{start + n_bytes}, the file has {len(mm)}"
        )
    return GGUFTensor(name, dims, ggml_type, offset, start, n_elements, n_bytes, byte_order, mm)
