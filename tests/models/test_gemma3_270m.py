"""The real Gemma 3 270M (the packaged Q4_K_M GGUF, `pie model import gemma3-270m`) in float32 against
transformers' Gemma3ForCausalLM on the same weights (each GGUF tensor through gguf's own dequantize, norms
back to Hugging Face's w): logits of a 1,000+ token text, far past the 512-row window, through one prefill, a
chunked prefill, row-by-row decode and a verify window, within 2e-3; greedy continuations equal. Through a real
engine: text-completion's and cacheback's 64-token greedy continuations of a 1,000-token prompt in float32 equal
transformers' of the same ids, and the default weight format's top-1 equals the reference's at >= 97% of a 1,100-
token text's positions. One module fixture imports the model (the store's import, as `pie model import
gemma3-270m` runs it) and builds the reference once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from pie_runtime.launcher import EmbeddedEngine
from pie_runtime.models.context import ForwardContext, Segment
from pie_runtime.models.gguf_arch import ARCHITECTURES
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.llama import LlamaForCausalLM
from pie_runtime.store import ModelStore, import_model, load_model, packaged_path
from tests.conftest import run as run_inferlet
from tests.conftest import start_engine

CORPUS = Path("/work/shared/corpus/austen.txt")
PROMPT_TOKENS = 1100
ATOL = 2e-3
PAGE = 16
NEW_TOKENS = 12
LONG_NEW_TOKENS = 64
TOP1_SHARE = 0.97

# every position's argmax, 512 rows a fire: the default format's top-1 against the reference's
TOP1_INFERLET = """
from pydantic import BaseModel

import inferlet


class Args(BaseModel):
    ids: list[int]


@inferlet.main
async def main(args: Args) -> dict:
    ws = inferlet.model().working_set()
    tokens = []
    for start in range(0, len(args.ids), 512):  # a fire reads out at most 1,024 rows
        chunk = args.ids[start : start + 512]
        fp = inferlet.ForwardPass(ws)
        fp.embed(chunk).readout(range(len(chunk)), inferlet.Argmax())
        tokens += [int(t) for t in (await fp.submit()).tokens]
    await ws.release()
    return {"top1": tokens}
"""


def transformers_reference(path: Path):
    """Gemma3ForCausalLM holding the file's tensors, dequantized by gguf itself."""
    import gguf
    import transformers

    reader = gguf.GGUFReader(str(path))
    meta = {name: f.contents() for name, f in reader.fields.items()}
    spec = ARCHITECTURES["gemma3"]
    cfg = transformers.Gemma3TextConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=meta["gemma3.embedding_length"],
        intermediate_size=meta["gemma3.feed_forward_length"],
        num_hidden_layers=meta["gemma3.block_count"],
        num_attention_heads=meta["gemma3.attention.head_count"],
        num_key_value_heads=meta["gemma3.attention.head_count_kv"],
        head_dim=meta["gemma3.attention.key_length"],
        query_pre_attn_scalar=meta["gemma3.attention.key_length"],
        sliding_window=meta["gemma3.attention.sliding_window"],
        max_position_embeddings=meta["gemma3.context_length"],
        rms_norm_eps=meta["gemma3.attention.layer_norm_rms_epsilon"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": meta["gemma3.rope.freq_base"]},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
    )
    state = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # the file holds Gemma's 1 + w
        state[spec.hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(our model in float32, transformers' reference, the prompt's ids, the store's home)."""
    home = tmp_path_factory.mktemp("gemma-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIE_HOME", str(home))
        source = packaged_path("gemma3-270m")  # its packages come with scripts/setup.sh
        import_model("gemma3-270m", store=ModelStore(home / "models"), progress=False)
        loaded = load_model("gemma3-270m", store=ModelStore(home / "models"), keep_quantized=False)
    tok = Tokenizer.from_file(str(loaded.tokenizer_path))
    ids = tok.encode(CORPUS.read_text()[:20_000]).ids[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    return loaded.llama, transformers_reference(source), ids, home


def run(model: LlamaForCausalLM, ids: list[int], chunks: list[int], rows: list[int]) -> torch.Tensor:
    """Feed ``ids`` in ``chunks`` over a scattered page table; the float32 logits at ``rows``."""
    pages = -(-len(ids) // PAGE) + 1
    table = [pages - 1 - i for i in range(pages)]  # pages in reverse: a row's slot is not its index
    kv = KVCache(model.config, pages, PAGE, torch.float32)
    done, out = 0, []
    for n in chunks:
        ctx = ForwardContext.build([Segment(table, done, n)], PAGE, layout=kv.layout)
        hidden = model.forward(model.embed(torch.tensor(ids[done : done + n])), ctx, kv)
        keep = [r - done for r in rows if done <= r < done + n]
        if keep:
            out.append(model.logits(hidden[keep]))
        done += n
    return torch.cat(out)


def greedy(model: LlamaForCausalLM, ids: list[int], n: int) -> list[int]:
    pages = -(-(len(ids) + n) // PAGE)
    kv = KVCache(model.config, pages, PAGE, torch.float32)
    table = list(range(pages))
    seq, new, feed = list(ids), [], len(ids)
    for _ in range(n):
        ctx = ForwardContext.build([Segment(table, len(seq) - feed, feed)], PAGE, layout=kv.layout)
        hidden = model.forward(model.embed(torch.tensor(seq[-feed:])), ctx, kv)
        token = int(model.logits(hidden[-1:]).argmax())
        seq.append(token)
        new.append(token)
        feed = 1
    return new


def test_gemma3_270m_logits_past_the_window_match_transformers(gemma):
    model, reference, ids, _ = gemma
    assert model.config.sliding_window == 512 and model.config.attention_window(5) is None
    rows = [0, 100, 511, 512, 513, 700, 900] + list(range(PROMPT_TOKENS - 8, PROMPT_TOKENS))
    with torch.no_grad():
        hidden = reference.model(torch.tensor([ids])).last_hidden_state[0, rows]
        want = reference.lm_head(hidden).float()
    n = len(ids)
    # one prefill; uneven chunks, then rows one by one, then a 3-row verify window
    for chunks in ([n], [300, 250, 37, n - 587 - 8] + [1] * 5 + [3]):
        got = run(model, ids, chunks, rows)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_gemma3_270m_greedy_continuation_equals_transformers(gemma):
    model, reference, ids, _ = gemma
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert greedy(model, ids, NEW_TOKENS) == out[0, len(ids) :].tolist()


def id_words(flag: str, ids: list[int]) -> list[str]:
    """``flag`` once per id (a list argument on the command line): exact ids, no BOS added, no retokenizing."""
    return [w for i in ids for w in (flag, str(i))]


@pytest.mark.e2e
def test_gemma3_270m_long_greedy_continuations_through_the_engine_equal_transformers(gemma):
    """float32 (start_engine's format): text-completion and cacheback (drafts from the prompt, accepted and
    rejected past the window) continue a 1,000-token prompt as transformers does for 64 tokens."""
    _, reference, ids, home = gemma
    prompt = ids[:1000]
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=LONG_NEW_TOKENS, do_sample=False)
    want = out[0, len(prompt) :].tolist()
    eng = start_engine(home, ["gemma3-270m"], "--pass-cost-rows", "0", "--kv-pages", "1024")
    try:
        ids_words = id_words("--prompt-token-ids", prompt)
        words = ["--prompt", "", *ids_words, "--max-tokens", str(LONG_NEW_TOKENS), "--ignore-eos"]
        plain = run_inferlet("text-completion", eng.address, *words, "--temperature", "0")
        spec = run_inferlet("cacheback-speculative-decoding", eng.address, *words)
    finally:
        eng.stop()
    assert plain["stats"]["prompt_tokens"] == len(prompt)
    assert plain["token_ids"] == want
    assert spec["token_ids"] == want


@pytest.mark.e2e
def test_gemma3_270m_default_format_top1_agrees_with_transformers(gemma, tmp_path):
    """The format `pie run` uses when not told (no --weights): its argmax at every position of the 1,100-token
    text equals the float32 reference's at >= 97% of them."""
    _, reference, ids, home = gemma
    with torch.no_grad():
        hidden = reference.model(torch.tensor([ids])).last_hidden_state[0]
        want = torch.cat([reference.lm_head(h).argmax(-1) for h in hidden.split(128)]).tolist()
    script = tmp_path / "top1.py"
    script.write_text(TOP1_INFERLET)
    eng = EmbeddedEngine(["gemma3-270m"], ["--kv-pages", "1024", "--no-compile"], env={"PIE_HOME": str(home)})
    try:
        got = run_inferlet(str(script), eng.address, *id_words("--ids", ids))["top1"]
    finally:
        eng.stop()
    assert len(got) == len(want)
    share = sum(a == b for a, b in zip(got, want, strict=True)) / len(want)
    assert share >= TOP1_SHARE, f"default format's top-1 agrees at {share:.1%} of positions"
