"""The native step's loader packs stored Q4_0/Q4_1/Q8_0 tensors a slice of rows at a time (native_load.py): the
packed bytes must be those of the whole weight packed at once, fused parts and a short last slice included."""

from __future__ import annotations

import pytest
import torch

from pie_runtime.models import native_lib
from pie_runtime.models.native_linear import PackedWeight
from pie_runtime.models.quant import GroupQuant, QuantError
from pie_runtime.store import WEIGHTS_FILE, ModelStore, import_model
from tests.store.test_store import write_tiny_gguf

pytestmark = pytest.mark.skipif(not native_lib.available(), reason="the native kernels are not built here")

Q4_TYPES = {  # every projection a 4-bit kind, so the fused q/k/v and gate/up take the sliced path too
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q4_0",
    "attn_output": "Q4_1",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q4_1",
    "ffn_down": "Q4_0",
}


@pytest.fixture
def reader(tmp_path, monkeypatch):
    from pie_runtime import native_load

    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    store = ModelStore()
    manifest = import_model(str(write_tiny_gguf(tmp_path / "q4.gguf", Q4_TYPES)), name="q4", progress=False).manifest
    f = native_load._FileTensors(store.path("q4") / WEIGHTS_FILE)
    yield native_load._Reader(f, dict(manifest.quantized))
    f.close()


def _whole(reader, names: list[str], q4: bool) -> PackedWeight:
    from pie_runtime import native_load

    gq = GroupQuant.cat([reader.get(n).blocks.group_quant() for n in names])
    return native_load._pack_group_quant(gq, q4)


@pytest.mark.parametrize("rows", [8, 24])  # 24: every tensor's last slice is short (256 and 64 rows are not 24k)
def test_sliced_packing_gives_the_whole_weights_bytes(reader, monkeypatch, rows):
    from pie_runtime import native_load

    monkeypatch.setattr(native_load, "_PACK_ROWS", rows)
    at = "model.layers.1."
    weights = {
        "q/k/v": ([f"{at}self_attn.{p}_proj.weight" for p in "qkv"], True),
        "gate/up": ([f"{at}mlp.{p}_proj.weight" for p in ("gate", "up")], True),
        "embedding": (["model.embed_tokens.weight"], False),  # Q8_0, 256 rows
    }
    for what, (names, q4) in weights.items():
        assert reader.quantized[names[0]] in (("q4_0",) if q4 else ("q8_0",)), what
        got, want = native_load._pack_stored(reader, names, q4), _whole(reader, names, q4)
        assert (got.kind, got.n, got.k) == (want.kind, want.n, want.k), what
        assert torch.equal(got.data, want.data), what


def test_stacked_refuses_slices_that_do_not_make_the_weight():
    w = torch.randint(-127, 128, (24, 64), dtype=torch.int8)
    d = torch.rand(24, 2).to(torch.float16)
    eight = PackedWeight.pack_q8(w[:8], d[:8])
    with pytest.raises(QuantError, match="hold 8 rows, not 24"):
        PackedWeight.stacked(24, [eight])
    with pytest.raises(QuantError, match="8-row groups"):
        PackedWeight.stacked(24, [PackedWeight.pack_q8(w[:5], d[:5]), eight])
    whole = PackedWeight.stacked(24, [eight, PackedWeight.pack_q8(w[8:], d[8:])])
    assert torch.equal(whole.data, PackedWeight.pack_q8(w, d).data)
