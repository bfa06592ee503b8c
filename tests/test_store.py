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
    pie_home,
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


def test_home_defaults(monkeypatch):
    monkeypatch.delenv("PIE_HOME", raising=False)
    assert pie_home() == Path.home() / ".cache" / "pie"


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
    with pytest.raises(ModelNotFoundError):
        store.get("absent")
    with pytest.raises(ImportRefused):
        import_model("/definitely/not/here", store=store)
    assert issubclass(ModelNotFoundError, StoreError) and issubclass(ImportRefused, StoreError)
