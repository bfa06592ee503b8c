"""Teacher data in rounds (`pie drafter train --rounds R`): each round's windows fall between the earlier
rounds', round 0 is the single-round plan (its cache key unchanged), and raising the rounds reuses the cached
rounds and computes only the new ones; generation and chat rounds hold the target's own continuations and
replies. A tiny random target and a byte-level tokenizer: no store, no corpus."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from pie_runtime.distill import (
    CHAT_PROMPT_LEN,
    CHAT_REQUESTS,
    DataPlan,
    TeacherData,
    build_teacher_data,
    open_requests,
    spaced_windows,
)
from pie_runtime.distill.data import round_phase
from pie_runtime.distill.open_requests import TEMPLATES, TOPICS
from pie_runtime.models.llama import LlamaForCausalLM
from tests.models.tiny_models import tiny_llama_config, tiny_tokenizer_json

SEQ = 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[LlamaForCausalLM, Path, Path]:
    folder = tmp_path_factory.mktemp("rounds")
    tokenizer = folder / "tokenizer.json"
    tokenizer.write_text(tiny_tokenizer_json())
    rng = random.Random(0)
    words = ["sea", "ship", "wind", "salt", "tide", "gull", "rope", "sail", "deck", "wave"]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n")  # about 29K bytes: byte tokens, so about 29K tokens
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config())
    for p in target.parameters():
        torch.nn.init.normal_(p, std=0.15) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.8, 1.2)
    return target.requires_grad_(False).eval(), tokenizer, corpus


def test_round_phases_fill_the_largest_gaps():
    assert [round_phase(r) for r in range(8)] == [0, 1 / 2, 1 / 4, 3 / 4, 1 / 8, 5 / 8, 3 / 8, 7 / 8]


def test_the_first_four_rounds_cover_disjoint_text():
    ids = list(range(10_000))
    spans = []
    for r in range(4):
        for w in spaced_windows(ids, 8, 256, round_phase(r)):
            assert w == list(range(w[0], w[0] + 256))
            spans.append((w[0], w[-1]))
    spans.sort()
    assert len(spans) == 8 + 3 * 7  # a shifted round drops the window that would run past the end
    assert all(a_end < b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_round_zero_is_the_single_round_plan():
    assert spaced_windows(list(range(1000)), 5, 100) == spaced_windows(list(range(1000)), 5, 100, round_phase(0))
    # one window a round: each round's lies elsewhere
    assert [spaced_windows(list(range(1000)), 1, 100, round_phase(r))[0][0] for r in range(3)] == [0, 450, 225]
    plan = DataPlan([Path(__file__)], tokens=4096, gen_tokens=0)
    assert plan.key("d") == DataPlan([Path(__file__)], tokens=4096, gen_tokens=0, data_round=0).key("d")
    assert plan.key("d") != DataPlan([Path(__file__)], tokens=4096, gen_tokens=0, data_round=1).key("d")


def test_raising_the_rounds_computes_only_the_new_ones(setup, tmp_path):
    target, tokenizer, corpus = setup
    plan = DataPlan([corpus], tokens=16 * SEQ, gen_tokens=2 * SEQ, seq_len=SEQ, heldout_tokens=2 * SEQ, prompt_len=8)
    cache = tmp_path / "cache"
    one, held_one = build_teacher_data(target, tokenizer, plan, cache, "d", progress=False)
    (first,) = cache.iterdir()
    stamp = first.stat().st_mtime_ns

    three, held_three = build_teacher_data(target, tokenizer, plan, cache, "d", progress=False, rounds=3)
    assert len(list(cache.iterdir())) == 3 and first.stat().st_mtime_ns == stamp  # round 0 read, not rewritten
    assert torch.equal(held_one.tokens, held_three.tokens)  # the held-out data is round 0's
    # a later round drops its last corpus window and its last prompt, which would run past the text's end
    assert three.num_tokens == one.num_tokens + 2 * (one.num_tokens - 2 * SEQ)
    assert torch.equal(three.tokens[: len(one.tokens)], one.tokens)
    windows = {tuple(row) for row in three.tokens.tolist()}
    assert len(windows) == len(three.tokens)  # no window of a later round repeats one of an earlier round

    # each later round's rows are the target's view of its own windows, as a round built alone would be
    again, _ = build_teacher_data(target, tokenizer, plan, None, "d", progress=False, rounds=3)
    assert torch.equal(again.tokens, three.tokens) and torch.equal(again.top, three.top)


def test_generation_rounds_hold_only_the_targets_continuations_and_stay_cached(setup, tmp_path):
    """`--gen-rounds`: each such round is the target's greedy continuations of corpus prompts, and no
    corpus window; its cache file does not depend on ``--rounds``, so raising the corpus rounds keeps it."""
    target, tokenizer, corpus = setup
    plan = DataPlan([corpus], tokens=8 * SEQ, gen_tokens=0, seq_len=SEQ, heldout_tokens=2 * SEQ, prompt_len=8)
    cache = tmp_path / "cache"
    base, _ = build_teacher_data(target, tokenizer, plan, None, "d", progress=False)
    data, _ = build_teacher_data(
        target, tokenizer, plan, cache, "d", progress=False, gen_rounds=2, gen_round_tokens=4 * SEQ
    )
    gen = TeacherData(*(t[len(base.tokens) :] for t in (data.tokens, data.hidden, data.top)))
    assert torch.equal(data.tokens[: len(base.tokens)], base.tokens)
    assert 6 <= len(gen.tokens) <= 8  # 4 prompts a round, less one that would run past the text's end
    assert torch.equal(gen.tokens[:, 8:], gen.top[:, 7:-1, 0].long())  # every token after the prompt is greedy
    prompts = {tuple(row[:8]) for row in gen.tokens.tolist()}
    assert len(prompts) == len(gen.tokens)  # the two rounds' prompts lie apart
    tok, text = Tokenizer.from_file(str(tokenizer)), corpus.read_text()
    assert all(tok.decode(list(p)) in text for p in prompts)  # each prompt is corpus text

    files = {f.name: f.stat().st_mtime_ns for f in cache.iterdir()}
    assert len(files) == 3
    build_teacher_data(
        target, tokenizer, plan, cache, "d", progress=False, rounds=2, gen_rounds=2, gen_round_tokens=4 * SEQ
    )
    after = {f.name: f.stat().st_mtime_ns for f in cache.iterdir()}
    assert len(after) == 4 and all(after[name] == stamp for name, stamp in files.items())


def test_chat_rounds_are_the_targets_replies_to_requests_about_passages(setup):
    """`--chat-rounds`: each prompt is the chat template's frame around one of CHAT_REQUESTS and a corpus
    passage, CHAT_PROMPT_LEN tokens; the rest of the row is the target's greedy reply."""
    target, tokenizer, corpus = setup
    frame = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    plan = DataPlan([corpus], tokens=4 * 128, gen_tokens=0, seq_len=128, heldout_tokens=128)
    base, _ = build_teacher_data(target, tokenizer, plan, None, "d", progress=False)
    data, _ = build_teacher_data(
        target, tokenizer, plan, None, "d", progress=False, chat_rounds=1, gen_round_tokens=6 * 128, chat=frame
    )
    chat = data.tokens[len(base.tokens) :]
    top = data.top[len(base.tokens) :]
    assert len(chat) >= 5
    p = CHAT_PROMPT_LEN
    assert torch.equal(chat[:, p:], top[:, p - 1 : -1, 0].long())  # the reply is the target's greedy choice
    tok, text = Tokenizer.from_file(str(tokenizer)), corpus.read_text()
    for i, row in enumerate(chat.tolist()):
        prompt = tok.decode(row[:p], skip_special_tokens=False)
        assert prompt.startswith(frame[0] + CHAT_REQUESTS[i] + "\n\n") and prompt.endswith(frame[1])
        passage = prompt[len(frame[0] + CHAT_REQUESTS[i] + "\n\n") : -len(frame[1])]
        assert len(passage) >= 8 and passage in text
    with pytest.raises(ValueError, match="chat template"):
        build_teacher_data(target, tokenizer, plan, None, "d", progress=False, chat_rounds=1)


def test_open_rounds_are_the_targets_replies_to_requests_with_no_passage(setup):
    """`--open-rounds`: each row is the chat frame around an open request (a template and a training topic),
    then the target's greedy reply to the row's end; the prompts differ in length, each round asks the
    requests after the last round's, and the held-out topics are never asked."""
    target, tokenizer, corpus = setup
    frame = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    seq = 192
    plan = DataPlan([corpus], tokens=2 * seq, gen_tokens=0, seq_len=seq, heldout_tokens=seq)
    base, _ = build_teacher_data(target, tokenizer, plan, None, "d", progress=False)
    data, _ = build_teacher_data(
        target, tokenizer, plan, None, "d", progress=False, open_rounds=2, gen_round_tokens=6 * seq, chat=frame
    )
    rows = data.tokens[len(base.tokens) :]
    top = data.top[len(base.tokens) :]
    assert rows.shape == (12, seq)
    tok = Tokenizer.from_file(str(tokenizer))
    asked, lengths = [], set()
    for row, row_top in zip(rows.tolist(), top):
        text = tok.decode(row, skip_special_tokens=False)
        assert text.startswith(frame[0])
        request, _, _ = text[len(frame[0]) :].partition(frame[1])
        p = len(tok.encode(frame[0] + request + frame[1], add_special_tokens=False).ids)
        assert row[p:] == row_top[p - 1 : -1, 0].tolist()  # the reply is the target's greedy choice
        asked.append(request)
        lengths.add(p)
    assert len(lengths) > 1
    assert sorted(asked) == sorted(open_requests(12))  # round 2 asks requests 6-11
    heldout = set(open_requests(len(TEMPLATES) * len(TOPICS), heldout=True))
    assert not heldout & set(open_requests(len(TEMPLATES) * len(TOPICS)))
    bench_topics = ("sea", "ocean", "bicycle", "dog", "pet", "water", "cook", "rain")
    assert not [t for t in TOPICS if any(b in t.split() or b + "s" in t.split() for b in bench_topics)]
