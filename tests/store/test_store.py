"""The model store through `pie model ...`: every refusal leaves the store as it was, --force replaces,
remove deletes, list/info speak JSON, and a tampered file is refused at load. All in a temporary PIE_HOME."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pie_runtime.cli.main import main as pie
from pie_runtime.store import (
    ImportRefused,
    ModelNotFoundError,
    ModelStore,
    StoreError,
    StoreIntegrityError,
    import_model,
    load_model,
)


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok.to_str()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint folder, the template the refusal tests damage copies of."""
    import transformers

    folder = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(_tokenizer_json())
    return folder


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def copy_of(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def snapshot(home: Path) -> list[tuple[str, int]]:
    models = home / "models"
    return sorted((str(p.relative_to(models)), p.stat().st_size) for p in models.rglob("*")) if models.exists() else []


def refuse(args: list[str], capsys, home: Path, words: str) -> None:
    """The command exits non-zero with one `error:` line naming ``words``, and the store is untouched."""
    before = snapshot(home)
    capsys.readouterr()
    assert pie(args) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert words in err, err
    assert snapshot(home) == before


def test_import_list_info_remove(home, checkpoint, capsys):
    assert pie(["model", "import", str(checkpoint)]) == 0
    assert "imported tiny-llama" in capsys.readouterr().out
    assert (home / "models" / "tiny-llama" / "model.safetensors").is_file()
    assert not [p for p in (home / "models").iterdir() if p.name.startswith(".tmp-")]

    assert pie(["model", "list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in listing] == ["tiny-llama"]
    assert listing[0]["family"] == "llama" and listing[0]["vocab_size"] == 256

    assert pie(["model", "info", "tiny-llama", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info["files"]) == {"model.safetensors", "tokenizer.json"}
    assert info["drafters"] == [] and info["config"]["num_hidden_layers"] == 2
    assert info["parameters"] == sum(t.numel() for t in load_file(checkpoint / "model.safetensors").values())
    assert pie(["model", "info", "tiny-llama"]) == 0
    assert "drafters" in capsys.readouterr().out
    assert pie(["model", "list"]) == 0
    assert "tiny-llama" in capsys.readouterr().out

    assert pie(["model", "remove", "tiny-llama"]) == 0
    assert ModelStore().list() == []
    refuse(["model", "remove", "tiny-llama"], capsys, home, "not in the store")


def test_second_import_is_a_no_op_unless_forced(home, checkpoint, capsys):
    assert pie(["model", "import", str(checkpoint), "--name", "m"]) == 0
    first = ModelStore().get("m")
    before = snapshot(home)
    assert pie(["model", "import", str(checkpoint), "--name", "m"]) == 0
    assert "already imported" in capsys.readouterr().out
    assert snapshot(home) == before and ModelStore().get("m").imported_at == first.imported_at

    (home / "models" / "m" / "model.safetensors").write_bytes(b"junk")  # --force must repair this
    assert pie(["model", "import", str(checkpoint), "--name", "m", "--force"]) == 0
    assert "imported m" in capsys.readouterr().out
    assert ModelStore().verify("m").files == first.files
    assert sorted(p.name for p in (home / "models").iterdir()) == ["m"]


def test_refuses_missing_source(home, capsys):
    refuse(["model", "import", str(home.parent / "nowhere")], capsys, home, "no such file")


def test_a_name_that_is_a_path_is_refused_before_anything_is_written(home):
    for name in ("/tmp/draft.safetensors", "../m", "M"):
        with pytest.raises(ImportRefused, match="invalid model name"):
            ModelStore().add(None, name)  # type: ignore[arg-type]  # refused before the checkpoint is read
    assert not (home / "models").exists() or not any((home / "models").iterdir())


def test_refuses_unreadable_gguf(home, tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    refuse(["model", "import", str(bad)], capsys, home, "cannot read")


def test_refuses_unknown_gguf_architecture(home, tmp_path, capsys):
    import gguf
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    refuse(["model", "import", str(path)], capsys, home, "unsupported GGUF architecture 'gpt2'")


def test_refuses_unknown_model_type(home, checkpoint, tmp_path, capsys):
    folder = copy_of(checkpoint, tmp_path / "gpt2")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"model_type": "gpt2"}))
    refuse(["model", "import", str(folder)], capsys, home, "unsupported model_type 'gpt2'")


def test_refuses_shape_mismatch(home, checkpoint, tmp_path, capsys):
    folder = copy_of(checkpoint, tmp_path / "wide")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 64}))
    refuse(["model", "import", str(folder)], capsys, home, "has shape (32, 48), the config needs (32, 64)")


def test_refuses_missing_tensor(home, checkpoint, tmp_path, capsys):
    folder = copy_of(checkpoint, tmp_path / "holey")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, folder / "model.safetensors")
    refuse(["model", "import", str(folder)], capsys, home, "missing tensor model.layers.1.mlp.up_proj.weight")


def test_refuses_missing_tokenizer(home, checkpoint, tmp_path, capsys):
    folder = copy_of(checkpoint, tmp_path / "notok")
    (folder / "tokenizer.json").unlink()
    refuse(["model", "import", str(folder)], capsys, home, "missing file")


def test_refuses_bad_name(home, checkpoint, capsys):
    refuse(["model", "import", str(checkpoint), "--name", "../escape"], capsys, home, "invalid model name")


def test_tampered_weights_are_refused_on_load(home, checkpoint, capsys):
    store = ModelStore()
    import_model(str(checkpoint), name="t", store=store, progress=False)
    load_model("t", store=store)  # fills the verified cache
    weights = store.path("t") / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(StoreIntegrityError, match="does not match its manifest digest"):
        load_model("t", store=store)
    refuse(["model", "verify", "t"], capsys, home, "does not match")


def test_errors_are_typed(home):
    store = ModelStore()
    with pytest.raises(ModelNotFoundError, match=r"`pie model import SOURCE --name absent`.*`pie model list`"):
        store.get("absent")  # says what to do next
    with pytest.raises(ImportRefused):
        import_model("/definitely/not/here", store=store)
    assert issubclass(ModelNotFoundError, StoreError) and issubclass(ImportRefused, StoreError)


# ---- GGUF blocks kept as they are (store format 2) --------------------------------------------------------

TINY_GGUF_TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "Q4_1",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q4_1",
    "ffn_down": "F16",
}


def write_tiny_gguf(path: Path, types: dict[str, str] | None = None, hidden: int = 64, ffn: int = 96) -> Path:
    """A 2-layer llama GGUF holding Q4_0, Q4_1, Q8_0 (the embedding), F16 and F32 tensors (``types``: the
    kind of each projection, K kinds among them, made by tests/models/quant_blocks.py)."""
    import gguf
    import numpy as np

    from tests.models.quant_blocks import random_blocks

    types = types or TINY_GGUF_TYPES
    heads, kv_heads, head_dim = 4, 2, hidden // 4
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    from tokenizers.pre_tokenizers import ByteLevel

    writer.add_token_list(sorted(ByteLevel.alphabet()))
    writer.add_token_types([1] * 256)
    writer.add_eos_token_id(0)

    def add(name: str, shape: tuple[int, ...], kind: str) -> None:
        w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if kind == "F32":
            writer.add_tensor(name, w)
        elif kind == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        elif kind.endswith("_K"):
            qtype = gguf.GGMLQuantizationType[kind]
            if kind == "Q2_K":  # a kind outside the table: bytes of its size
                raw = rng.integers(0, 256, size=(shape[0], shape[1] // 256 * 84), dtype=np.uint8)
            else:
                raw = random_blocks(kind.lower(), *shape, seed=len(name), scale=2e-4).data.numpy()  # type: ignore[misc]
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    add("token_embd.weight", (256, hidden), "Q8_0")
    add("output_norm.weight", (hidden,), "F32")
    shapes = {
        "attn_q": (heads * head_dim, hidden),
        "attn_k": (kv_heads * head_dim, hidden),
        "attn_v": (kv_heads * head_dim, hidden),
        "attn_output": (hidden, heads * head_dim),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    for i in range(2):
        add(f"blk.{i}.attn_norm.weight", (hidden,), "F32")
        add(f"blk.{i}.ffn_norm.weight", (hidden,), "F32")
        for part, shape in shapes.items():
            add(f"blk.{i}.{part}.weight", shape, types[part])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized_import(path: Path) -> dict[str, torch.Tensor]:
    """What the store's GGUF import produced before format 2: every tensor through gguf's own dequantize,
    q and k rows unpermuted, float32."""
    import gguf
    import numpy as np

    from pie_runtime.models.gguf_import import hf_name, unpermute

    reader = gguf.GGUFReader(str(path))
    heads = {
        "attn_q": int(reader.fields["llama.attention.head_count"].contents()),
        "attn_k": int(reader.fields["llama.attention.head_count_kv"].contents()),
    }
    out = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape.tolist())))
        part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if part in heads:
            w = unpermute(w, heads[part])
        out[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def make_old_format(store: ModelStore, name: str) -> None:
    """Rewrite a stored manifest as the code before format 2 wrote it (no version, no quantized field)."""
    path = store.path(name) / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["format_version"], manifest["quantized"]
    path.write_text(json.dumps(manifest, indent=2))


def test_gguf_import_keeps_quantized_blocks(home, tmp_path, capsys):
    from safetensors import safe_open

    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert pie(["model", "import", str(gguf_path), "--name", "tq"]) == 0
    store = ModelStore()
    manifest = store.get("tq")
    assert manifest.format_version == 2
    assert manifest.quantized["model.embed_tokens.weight"] == "q8_0"
    assert manifest.quantized["model.layers.1.self_attn.q_proj.weight"] == "q4_0"
    assert manifest.quantized["model.layers.0.mlp.up_proj.weight"] == "q4_1"
    assert len(manifest.quantized) == 1 + 2 * 6  # the F16 down_proj and F32 norms stay float
    with safe_open(str(store.path("tq") / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight.q")
        assert q.dtype == torch.uint8 and tuple(q.shape) == (64, 32)  # two 4-bit values a byte
        assert f.get_tensor("model.embed_tokens.weight.q").dtype == torch.int8
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight.d").dtype == torch.float16
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.float32
    assert "model.layers.0.self_attn.q_proj.weight" not in keys
    assert manifest.parameters == sum(t.numel() for t in dequantized_import(gguf_path).values())

    want = dequantized_import(gguf_path)
    loaded = load_model("tq", store=store)
    state = loaded.model.state_dict()
    for name, w in want.items():
        assert bitwise_equal(state[name], w), name  # the float model is the old import, bit for bit
    assert set(loaded.quantized) == set(manifest.quantized)
    for name, gq in loaded.quantized.items():
        assert gq.kind == manifest.quantized[name]
        assert torch.equal(gq.dequantize(), want[name]), name  # blocks already in Hugging Face row order

    bf16 = load_model("tq", store=store, dtype=torch.bfloat16, keep_quantized=False)
    assert bf16.quantized == {}
    assert torch.equal(
        bf16.model.state_dict()["model.layers.0.mlp.up_proj.weight"],
        want["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16),
    )

    capsys.readouterr()
    assert pie(["model", "info", "tq"]) == 0
    assert "quantized   4 q4_0, 6 q4_1, 3 q8_0" in capsys.readouterr().out


K_TYPES = {**TINY_GGUF_TYPES, "attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "ffn_up": "Q5_0",
           "ffn_gate": "Q5_1", "ffn_down": "Q6_K"}  # fmt: skip


def test_every_kind_is_stored_as_its_bytes_and_runs_as_stored(home, tmp_path, capsys):
    """A GGUF of K kinds (rows of 256) and Q5_x: the store keeps each tensor's bytes (its size about the
    file's; format 3); the float model is gguf's dequantization (q/k rows unpermuted as whole blocks); the
    native step in the gguf format computes the float model's logits within its 8-bit activations' rounding."""
    from pie_runtime.models import native_lib
    from pie_runtime.native_load import load_native
    from tests.models.test_weights import greedy_rows

    gguf_path = write_tiny_gguf(tmp_path / "k.gguf", K_TYPES, hidden=256, ffn=512)
    store = ModelStore()
    manifest = import_model(str(gguf_path), name="tk", store=store, progress=False).manifest
    assert manifest.format_version == 3
    assert manifest.quantized_summary() == "2 q4_1, 2 q5_0, 2 q5_1, 1 q8_0, 2 q4_k, 2 q5_k, 4 q6_k"
    stored = (store.path("tk") / "model.safetensors").stat().st_size
    assert 0.95 < stored / gguf_path.stat().st_size < 1.1
    want = dequantized_import(gguf_path)
    loaded = load_model("tk", store=store)
    state = loaded.model.state_dict()
    for name, w in want.items():
        assert bitwise_equal(state[name], w), name
    assert {loaded.quantized[n].kind for n in loaded.quantized} == {"q4_1", "q8_0"}  # what torch's int layers take
    capsys.readouterr()
    assert pie(["model", "info", "tk"]) == 0
    info = capsys.readouterr().out
    assert "q/k/v       2x q4_k+q5_k+q6_k -> wx" in info and "o           2x q4_1 -> q4" in info
    assert "gate/up     2x q5_1+q5_0 -> q4 requantized" in info  # --weights int4
    if not native_lib.available():
        return
    ids = list(range(1, 200, 3))
    _, ref = greedy_rows(loaded.model, ids, torch.float32)
    _, got = greedy_rows(load_native("tk", "gguf", store).model, ids, torch.bfloat16)
    assert ((got - ref).norm() / ref.norm()).item() < 0.02


def test_a_kind_outside_the_table_is_refused_before_a_tensor_is_read(home, tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "q2.gguf", {**K_TYPES, "ffn_down": "Q2_K"}, hidden=256, ffn=512)
    with pytest.raises(ImportRefused, match="Q2_K.*supported kinds: Q4_0"):
        import_model(str(gguf_path), name="q2", progress=False)
    assert not ModelStore().exists("q2")


def test_old_format_store_still_loads(home, tmp_path):
    from pie_runtime.models.gguf_import import convert_gguf

    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")
    store = ModelStore()
    old = convert_gguf(gguf_path, progress=False)
    old.tensors, old.quantized = dequantized_import(gguf_path), {}  # float32 only, as format 1 stored it
    store.add(old, "old")
    make_old_format(store, "old")
    manifest = store.get("old")
    assert manifest.format_version == 1 and manifest.quantized == {}
    loaded = load_model("old", store=store)
    assert loaded.quantized == {}
    state = loaded.model.state_dict()
    for name, w in old.tensors.items():
        assert bitwise_equal(state[name], w), name


def test_default_model_is_reimported_from_an_old_format_store(home, checkpoint):
    """An old-format default model is replaced by a fresh import (its drafters kept); the real packaged
    GGUF's float model equals gguf's own dequantization bit for bit."""
    from pie_runtime.shipped import ensure_default_model
    from pie_runtime.store import DEFAULT_MODEL, DrafterEntry, packaged_path

    store = ModelStore()
    import_model(str(checkpoint), name=DEFAULT_MODEL, store=store, progress=False)  # any old-format model
    make_old_format(store, DEFAULT_MODEL)
    old = store.get(DEFAULT_MODEL)
    (store.path(DEFAULT_MODEL) / "drafters" / "head").mkdir(parents=True)
    (store.path(DEFAULT_MODEL) / "drafters" / "head" / "mtp.json").write_text("{}")
    store.write_manifest(
        old.model_copy(update={"drafters": [DrafterEntry(kind="mtp", name="head", path="drafters/head/")]})
    )

    manifest = ensure_default_model(store)
    assert manifest.format_version == 2 and manifest.quantized_summary() == "210 q4_1, 1 q8_0"
    assert manifest.source == str(packaged_path(DEFAULT_MODEL))
    assert [d.name for d in manifest.drafters] == ["head", "smollm2-135m-mtp"]  # kept, and the shipped head
    assert (store.path(DEFAULT_MODEL) / "drafters" / "head" / "mtp.json").read_text() == "{}"
    assert ensure_default_model(store).imported_at == manifest.imported_at  # current now: no second import

    want = dequantized_import(packaged_path(DEFAULT_MODEL))
    loaded = load_model(DEFAULT_MODEL, store=store)
    state = loaded.model.state_dict()
    for name, w in want.items():
        assert bitwise_equal(state[name], w), name
    assert len(loaded.quantized) == 211


@pytest.mark.parametrize("family", ["mamba", "lfm2"])
def test_refuses_damaged_recurrent_checkpoints(family, home, tmp_path, capsys):
    """The families with recurrent state are refused as the Llama family is: a missing tensor, a config whose
    shapes differ from the weights, and their unsupported variants (Mamba2, a scaled LFM2 rope)."""
    from tests.models.tiny_models import write_tiny_checkpoint

    good = tmp_path / "good"
    write_tiny_checkpoint(good, family)
    holey = copy_of(good, tmp_path / "holey")
    state = load_file(holey / "model.safetensors")
    name = next(k for k in sorted(state) if k.endswith("conv.weight") or k.endswith("conv1d.weight"))
    del state[name]
    save_file(state, holey / "model.safetensors")
    refuse(["model", "import", str(holey)], capsys, home, f"missing tensor {name}")
    wide = copy_of(good, tmp_path / "wide")
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(cfg | {"hidden_size": 96}))
    refuse(["model", "import", str(wide)], capsys, home, "has shape")
    other = copy_of(good, tmp_path / "other")
    bad = {"model_type": "mamba2"} if family == "mamba" else {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}
    (other / "config.json").write_text(json.dumps(cfg | bad))
    refuse(["model", "import", str(other)], capsys, home, "unsupported")
