"""Each GGUF architecture (llama with Llama 3's rope_freqs, qwen2, qwen3, gemma3) imported through `pie model
import` from a tiny random checkpoint written as llama.cpp's converter writes it: its logits equal
transformers' on the same weights in float32, in one pass, in uneven prefill chunks, row by row and in a
multi-row verify window, far past Gemma 3's sliding window; an unsupported architecture is refused before its
tokenizer or any tensor is read. Also Hugging Face folders of Gemma 3 and of Mistral with a sliding window."""

from __future__ import annotations

import json
from typing import cast

import pytest
import torch

from pie_runtime.cli.main import main as pie
from pie_runtime.models.config import UnsupportedModelError
from pie_runtime.models.llama import DecoderLayer
from pie_runtime.store import ModelStore, load_model
from tests.models.gguf_models import VOCAB, WINDOW, hf_model, write_gguf
from tests.models.tiny_models import run_chunks, tiny_tokenizer_json

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
ATOL, RTOL = 1e-4, 1e-5
PROMPT_LEN = 40


@pytest.fixture(scope="module")
def gguf_store(tmp_path_factory):
    """Each architecture's tiny GGUF and its transformers model, imported into one temporary store."""
    root = tmp_path_factory.mktemp("gguf")
    models = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIE_HOME", str(root / "home"))
        for arch in ARCHS:
            model = hf_model(arch)
            path = write_gguf(model, arch, root / f"{arch}.gguf")
            assert pie(["model", "import", str(path), "--name", f"g-{arch}"]) == 0
            models[arch] = model
    return ModelStore(root / "home" / "models"), models


def check_paths(model, reference: torch.Tensor, ids: list[int]) -> None:
    """One pass; uneven chunks over scattered pages; prefill then rows one by one; then a 6-row verify window."""
    n = len(ids)
    pages = [list(range(16)), [9, 2, 14, 0, 5, 11, 3, 7, 1, 12, 4, 8, 6, 10, 13, 15]]
    runs = [[n], [3, 1, 9, 2, 5, n - 20], [WINDOW + 2] + [1] * (n - WINDOW - 2), [n - 6, 6]]
    for table, chunks in zip(pages * 2, runs):
        (out,) = run_chunks(model, [ids], [chunks], 4, [table])
        torch.testing.assert_close(out, reference, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_architecture_matches_transformers(arch, gguf_store):
    store, models = gguf_store
    loaded = load_model(f"g-{arch}", store=store)
    cfg = loaded.llama.config
    assert loaded.manifest.family == arch
    if arch == "gemma3":  # the recipe read from the file and llama.cpp's rules, not defaults
        assert [cfg.attention_window(i) for i in range(6)] == [WINDOW] * 5 + [None]
        assert cfg.layer_rope(0) == (10_000.0, None) and cfg.layer_rope(5)[0] == 1e6
    if arch == "llama":
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "freq_factors"
    ids = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        reference = models[arch](torch.tensor([ids])).logits[0].float()
    check_paths(loaded.model, reference, ids)


def test_gemma3_window_changes_the_logits(gguf_store):
    """The window matters here: the same weights with every layer global part from transformers past it."""
    store, models = gguf_store
    loaded = load_model("g-gemma3", store=store)
    ids = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        reference = models["gemma3"](torch.tensor([ids])).logits[0].float()
    layers = cast(list[DecoderLayer], list(loaded.llama.model.layers))
    for layer in layers:
        layer.self_attn.window = None
    try:
        (out,) = run_chunks(loaded.model, [ids], [[PROMPT_LEN]], 4, [list(range(16))])
    finally:
        for i, layer in enumerate(layers):
            layer.self_attn.window = loaded.llama.config.attention_window(i)
    torch.testing.assert_close(out[:WINDOW], reference[:WINDOW], atol=ATOL, rtol=RTOL)
    assert (out[WINDOW + 1 :] - reference[WINDOW + 1 :]).abs().max() > 1e-2


def test_unsupported_architecture_is_refused_before_reading(tmp_path, monkeypatch):
    import gguf

    from pie_runtime.models import gguf_import

    model = hf_model("qwen2")
    path = write_gguf(model, "qwen2", tmp_path / "phi.gguf")
    data = path.read_bytes()
    # same length: the architecture string "qwen2" becomes "phi3x" in place
    path.write_bytes(data.replace(b"qwen2", b"phi3x"))
    touched = []
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a, **k: touched.append("tensor"))
    monkeypatch.setattr(gguf_import, "build_tokenizer", lambda *a, **k: touched.append("tokenizer"))
    with pytest.raises(UnsupportedModelError, match=r"'phi3x'; supported: llama, qwen2, qwen3, gemma3"):
        gguf_import.convert_gguf(path, progress=False)
    assert touched == []


def _save_folder(model, folder) -> None:
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({}))


def _as_multimodal(folder) -> None:
    """Rewrite a saved Gemma3ForCausalLM as a Gemma3ForConditionalGeneration checkpoint as transformers 4 saved
    them: the text model under language_model.model, a vision tower beside it, the config's text_config."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    renamed = {f"language_model.{k}": v for k, v in state.items()}
    renamed["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    renamed["multi_modal_projector.mm_input_projection_weight"] = torch.ones(8, 64)
    save_file(renamed, folder / "model.safetensors")
    text = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))


@pytest.mark.parametrize("kind", ["gemma3", "gemma3-multimodal", "mistral"])
def test_hf_folder_with_sliding_window_matches_transformers(kind, tmp_path, monkeypatch):
    import transformers

    if kind.startswith("gemma3"):
        model = hf_model("gemma3")
    else:
        cfg = transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        model = transformers.MistralForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0, 0.15)
    _save_folder(model, tmp_path / "ckpt")
    if kind == "gemma3-multimodal":
        _as_multimodal(tmp_path / "ckpt")
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    assert pie(["model", "import", str(tmp_path / "ckpt"), "--name", "w"]) == 0
    loaded = load_model("w", store=ModelStore(tmp_path / "home" / "models"))
    assert loaded.llama.config.attention_window(0) == WINDOW
    ids = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].float()
    check_paths(loaded.model, reference, ids)
