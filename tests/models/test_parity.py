"""Logits of our paged forward equal Hugging Face transformers' on the same checkpoint (fp32, 1e-4 + 1e-5
relative): tiny random llama / mistral / qwen2 / qwen3 / mamba / lfm2 checkpoints imported through
`pie model import`, and SmolLM2 from the store. Each is checked in one pass, in uneven chunks over a scattered
page table (a recurrent state carried across the chunks), and as a batch of two prompts of different lengths,
with and without the engine's oneDNN-prepacked lm head."""

from __future__ import annotations

import pytest
import torch

from pie_runtime.models.linear import prepack, unpack
from pie_runtime.reference import transformers_llama
from pie_runtime.store import load_model
from tests.models.tiny_models import ALL_FAMILIES, TINY_VOCAB, run_chunks

# 1e-4 absolute plus float32 rounding relative to the logit (SmolLM2 logits reach ~20, and chunking changes
# the order of the attention sums)
ATOL, RTOL = 1e-4, 1e-5


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def check_all_modes(model, hf_model, prompt_a: list[int], prompt_b: list[int]) -> None:
    """Every mode as loaded, then again with the lm head prepacked as the engine serves it."""
    check_modes(model, hf_model, prompt_a, prompt_b)
    assert prepack(model.lm_head) > 0
    try:
        check_modes(model, hf_model, prompt_a, prompt_b)
    finally:
        unpack(model)


def check_modes(model, hf_model, prompt_a: list[int], prompt_b: list[int]) -> None:
    ref_a, ref_b = reference_logits(hf_model, prompt_a), reference_logits(hf_model, prompt_b)

    (one_pass,) = run_chunks(model, [prompt_a], [[len(prompt_a)]], 4, [list(range(8))])
    torch.testing.assert_close(one_pass, ref_a, atol=ATOL, rtol=RTOL)

    # prefill chunks both short (padded together) and long (a call of their own); pages out of order
    sizes = [3, 1, 9, 2, len(prompt_a) - 15]
    (chunked,) = run_chunks(model, [prompt_a], [sizes], 4, [[5, 2, 7, 0, 3, 6]])
    torch.testing.assert_close(chunked, ref_a, atol=ATOL, rtol=RTOL)

    # two prompts in one batch: b prefills while a goes in pieces, then both decode row by row
    chunks_a = [5, 4, 1, 1] + [1] * (len(prompt_a) - 11)
    chunks_b = [len(prompt_b) - 2, 1, 1]
    out_a, out_b = run_chunks(model, [prompt_a, prompt_b], [chunks_a, chunks_b], 4, [[1, 4, 6, 8, 10], [9, 0, 3]])
    torch.testing.assert_close(out_a, ref_a, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out_b, ref_b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_tiny_checkpoint_matches_transformers(family, tiny_store):
    import transformers

    store, folders = tiny_store
    loaded = load_model(f"tiny-{family}", store=store)
    assert loaded.manifest.family == family
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folders[family], dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(0, TINY_VOCAB, (20,), generator=g).tolist()
    prompt_b = torch.randint(0, TINY_VOCAB, (9,), generator=g).tolist()
    check_all_modes(loaded.model, hf_model, prompt_a, prompt_b)


@pytest.fixture(scope="module")
def smollm_reference(smollm, tmp_path_factory):
    """transformers' LlamaForCausalLM over the very files the store holds."""
    return transformers_llama(smollm.tokenizer_path.parent, smollm.config, tmp_path_factory.mktemp("smollm-hf"))


def test_smollm2_matches_transformers(smollm, smollm_reference):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm.tokenizer_path))
    prompt_a = tok.encode("The quick brown fox jumps over the lazy dog, and then it ran 42 miles home.").ids
    prompt_b = tok.encode("<|im_start|>user\nHello there!<|im_end|>").ids
    assert len(prompt_a) >= 16
    check_all_modes(smollm.model, smollm_reference, prompt_a, prompt_b)
