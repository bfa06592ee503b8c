"""The EAGLE head on a tiny random target: the served chain (draft-layer K/V written into the pool's extra
layer by the runner's forwards, chained steps held densely) equals the training passes, whatever the
chunking of the forwards; the training-time-test mask; the file round trip and the binding checks."""

from __future__ import annotations

import pytest
import torch

from pie_runtime.distill.dense import dense_hidden
from pie_runtime.distill.eagle import eagle_passes, teacher_features, ttt_mask
from pie_runtime.drafters import DrafterRefused, check_eagle
from pie_runtime.engine.runner import ModelRunner
from pie_runtime.models.context import Segment
from pie_runtime.models.eagle import EagleConfig, EagleHead, EagleModule, load_eagle, save_eagle
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.llama import LlamaForCausalLM
from pie_runtime.store import Manifest
from tests.models.tiny_models import tiny_llama_config

CFG = tiny_llama_config()
PAGE = 4


def random_module(cfg: EagleConfig, seed: int) -> EagleModule:
    torch.manual_seed(seed)
    m = EagleModule(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.15) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.8, 1.2)
    return m.requires_grad_(False).eval()


@pytest.fixture(scope="module")
def parts() -> tuple[LlamaForCausalLM, EagleModule]:
    torch.manual_seed(0)
    target = LlamaForCausalLM(CFG)
    for p in target.parameters():
        torch.nn.init.normal_(p, std=0.15) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.8, 1.2)
    target.requires_grad_(False).eval()
    return target, random_module(EagleConfig.for_target(CFG, 4, "tiny", "x" * 64), 1)


def served(target: LlamaForCausalLM, module: EagleModule, tokens: list[int], n: int, chunks: list[int], k: int):
    """Runs rows 0..n of ``tokens`` through the runner in ``chunks`` (with the feature tails carried as the
    engine does), then chains k drafts from row n with the target's token n+1 as the first. Returns the
    draft tokens and their logits."""
    kv = KVCache(CFG, 32, PAGE, torch.float32, extra_layers=1)
    runner = ModelRunner(target, kv, torch.device("cpu"))
    runner.eagle = head = EagleHead(module, target)
    pages = list(range(16))
    tail, start, hidden = None, 0, []
    for rows in chunks:
        seg = Segment(pages, start, rows)
        h = runner.forward([seg], tokens[start : start + rows], list(range(start, start + rows)), [tail])
        tail = runner.tails([seg], h)[0]
        hidden.append(h)
        start += rows
    assert start == n + 1
    u = head.feature(torch.cat(hidden)[n : n + 1])
    drafts, logits = head.draft(u, torch.tensor([tokens[n + 1]]), torch.tensor([n]), pages, kv, k)
    greedy, _ = head.draft(u, torch.tensor([tokens[n + 1]]), torch.tensor([n]), pages, kv, k, with_logits=False)
    assert torch.equal(greedy, drafts)  # a greedy readout's chain, without the logits, drafts the same
    return drafts[0].tolist(), torch.stack(logits, 1)[0]


@pytest.mark.parametrize("chunks", [[9], [4, 5], [1, 3, 5]], ids=str)
def test_the_served_chain_equals_the_training_passes(parts, chunks):
    target, module = parts
    torch.manual_seed(2)
    n, k = 8, 4
    tokens = torch.randint(0, CFG.vocab_size, (n + 2,)).tolist()
    drafts, _ = served(target, module, tokens, n, chunks, k)
    tokens += drafts[:-1]  # teacher-forced passes see the drafts the chain fed itself
    _, logits = served(target, module, tokens, n, chunks, k)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        u = teacher_features(target, dense_hidden(target, ids))
        outs = eagle_passes(module, target, ids, u, k)
    for j in range(1, k + 1):
        want = target.logits(target.model.norm(outs[j - 1][0, n + j]))
        torch.testing.assert_close(logits[j - 1], want, rtol=1e-4, atol=1e-4)


def test_the_mask_of_pass_j_is_the_chain_from_row_p_minus_j():
    t, j = 6, 3
    mask = ttt_mask(t, j)
    p = 5  # step 3 of the chain from row 2: pass 1 keys 0..3, pass 2 key 4, pass 3 key 5 (itself)
    assert mask[p, :t].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert mask[p, t : 2 * t].nonzero().flatten().tolist() == [4]
    assert mask[p, 2 * t :].nonzero().flatten().tolist() == [5]
    assert ttt_mask(t, 1).equal(torch.ones(t, t, dtype=torch.bool).tril())


def _manifest(digest: str, layers: int = CFG.num_hidden_layers) -> Manifest:
    return Manifest.model_validate(
        {
            "name": "tiny",
            "family": "llama",
            "config": CFG.model_copy(update={"num_hidden_layers": layers}).model_dump(),
            "files": {"model.safetensors": digest},
            "source": "test",
            "imported_at": "2026-12-01T00:00:00Z",
            "dtype": "float32",
            "parameters": 1,
            "tokenizer": {"bos_token_id": None, "eos_token_ids": []},
        }
    )


def test_a_saved_head_loads_back_and_binds_only_to_its_target(parts, tmp_path):
    _, module = parts
    path = tmp_path / "head.safetensors"
    save_eagle(module, path)
    back = load_eagle(path)
    for (name, a), (_, b) in zip(module.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(b, a.to(torch.bfloat16).float(), msg=name)
    assert check_eagle(_manifest("x" * 64), path).depth == 4
    with pytest.raises(DrafterRefused, match="another target"):
        check_eagle(_manifest("y" * 64), path)
    with pytest.raises(DrafterRefused, match="does not fit"):
        check_eagle(_manifest("x" * 64, layers=3), path)
