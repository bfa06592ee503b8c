"""A saved working set's file (sdk/inferlet/kv_file.py) without an engine: it round-trips, a bfloat16 pool's bits
come back as they went, safetensors reads it as the pool's tensors, and a file another model, format or KV dtype
wrote, or no such file at all, is refused ``kv_mismatch``."""

from __future__ import annotations

import numpy as np
import pytest

from inferlet import SavedKV, SavedKVMismatch
from inferlet.kv_file import read_saved, write_saved
from pie_runtime.protocol import ErrorCode
from pie_runtime.protocol.messages import ModelInfo


def info(**fields) -> ModelInfo:
    base = {"name": "m", "vocab_size": 10, "max_positions": 64, "page_size": 16, "bos_token_id": None}
    extra = {"eos_token_ids": [], "chat_template": None, "weights": "int4", "weights_digest": "ab" * 32}
    return ModelInfo(**{**base, **extra, "kv_dtype": "bfloat16", **fields})


def saved(rows: int = 5) -> SavedKV:
    rng = np.random.default_rng(0)
    k = rng.integers(0, 2**16, size=(2, 3, rows, 4), dtype=np.uint16)  # bfloat16 bits
    meta = {"model": "m", "model_digest": "ab" * 32, "weights": "int4", "kv_dtype": "bfloat16"}
    return SavedKV(k, k[::-1].copy(), list(range(rows)), [7], None, 3, {**meta, "committed": str(rows), "dropped": "3"})


def test_the_file_round_trips_and_is_standard_safetensors(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    path = tmp_path / "ws.kv"
    want = saved()
    write_saved(path, want)
    got = read_saved(path)
    assert np.array_equal(got.k, want.k) and np.array_equal(got.v, want.v) and got.k.dtype == np.uint16
    assert (got.tokens, got.pending, got.positions, got.dropped) == (want.tokens, [7], None, 3)
    got.check_fits(info())
    tensors = load_file(str(path))
    assert tensors["k"].dtype == torch.bfloat16 and tensors["k"].view(torch.int16).numpy().view(np.uint16).tolist() == (
        want.k.tolist()
    )


@pytest.mark.parametrize(
    "fields", [{"weights_digest": "cd" * 32}, {"weights_digest": ""}, {"weights": "int8"}, {"kv_dtype": "float32"}]
)
def test_another_model_format_or_dtype_is_refused(tmp_path, fields):
    path = tmp_path / "ws.kv"
    write_saved(path, saved())
    with pytest.raises(SavedKVMismatch) as e:
        read_saved(path).check_fits(info(**fields))
    assert e.value.code == ErrorCode.KV_MISMATCH


def test_a_file_that_is_no_saved_working_set_is_refused(tmp_path):
    path = tmp_path / "junk.kv"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(SavedKVMismatch):
        read_saved(path)
