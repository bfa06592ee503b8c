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


def layout(held: list[int], windows: list[int | None] | None = None) -> dict[str, str]:
    import json

    return {"layer_windows": json.dumps(windows or [8, None]), "held_from": json.dumps(held)}


def test_the_kv_layout_decides_which_engines_may_continue_the_rows(tmp_path):
    """A file records, per KV layer, the window it attends and the first row it holds: rows a sliding engine let go
    of load only where the layer slides too; a file from an all-rows engine loads anywhere; other windows, or a
    sliding model's file without the layout, are refused."""
    sliding = {"sliding": True, "layer_windows": [8, None], "page_windows": [None, 8]}
    every = {**sliding, "page_windows": [None]}  # the same model under --kv-swa-full
    path = tmp_path / "ws.kv"
    for held, engine, ok in (
        ([0, 0], sliding, True),
        ([0, 0], every, True),
        ([4, 0], sliding, True),
        ([4, 0], every, False),
    ):
        kv = saved()
        kv.meta.update(layout(held))
        write_saved(path, kv)
        got = read_saved(path)
        assert got.held_from == held
        if ok:
            got.check_fits(info(**engine))
        else:
            with pytest.raises(SavedKVMismatch, match="--kv-swa-full"):
                got.check_fits(info(**engine))
    kv = saved()
    kv.meta.update(layout([0, 0], [16, None]))
    with pytest.raises(SavedKVMismatch, match="attend windows"):
        kv.check_fits(info(**sliding))
    with pytest.raises(SavedKVMismatch, match="save it again"):  # no recorded layout, sliding layers
        saved().check_fits(info(**sliding))
    saved().check_fits(info())  # ... while a model without sliding layers needs none
    kv.meta.update(layout([0, 0, 0]))
    write_saved(path, kv)
    with pytest.raises(SavedKVMismatch, match="layer"):
        read_saved(path)
