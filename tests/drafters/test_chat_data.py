"""`pie drafter data`: the seeded chat prompt set and its held-out split, and the answers a real engine gives,
stored resumably (a second run continues, never repeats an answer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pie_runtime.distill.answer_data import answers_to_teacher, split_answers
from pie_runtime.distill.answer_shards import Manifest, read_answers
from pie_runtime.distill.chat_prompts import (
    HELDOUT_TEMPLATES,
    PASSAGE_TEMPLATES,
    heldout_prompts,
    training_prompts,
)
from pie_runtime.distill.data import find_corpus
from pie_runtime.distill.open_requests import TEMPLATES, TOPICS

CORPORA = [p for p in (find_corpus("austen.txt"), find_corpus("kjv.txt")) if p is not None]
needs_corpus = pytest.mark.skipif(len(CORPORA) < 2, reason="no corpus in ../shared/corpus/ or $PIE_CORPUS_DIR")


@needs_corpus
def test_prompt_set_is_seeded_and_heldout_never_trains():
    train, held = training_prompts(CORPORA, 600, seed=3), heldout_prompts(CORPORA, 40, seed=3)
    assert [p.id for p in train] == [p.id for p in training_prompts(CORPORA, 600, seed=3)]
    assert [p.id for p in train] != [p.id for p in training_prompts(CORPORA, 600, seed=4)]
    assert len(train) > 550 and len(held) == 40
    assert {p.kind for p in train} >= {"question", "summary", "continuation", "rewrite", "list", "code", "open"}
    assert not {p.text for p in train} & {p.text for p in held}
    # no held-out template's fixed words start a training prompt, and no training template a held-out one
    heads = [t.split("{")[0].strip() for _, t in HELDOUT_TEMPLATES if not t.startswith("{")]
    assert not [p for p in train for h in heads if h and p.text.startswith(h)]
    train_heads = [t.split("{")[0].strip() for t in TEMPLATES] + [t.split("{")[0] for _, t in PASSAGE_TEMPLATES]
    assert not [p for p in held for h in train_heads if h and p.text.startswith(h)]
    # held-out passages come from the held-out end of the corpus: none is found in its training part
    texts = [" ".join(c.read_text(errors="replace").split()) for c in CORPORA]
    passages = [p.text.split("\n\n")[-1] for p in held if "\n\n" in p.text]
    assert passages
    for passage in passages:
        spots = [t.rfind(passage[:80]) / len(t) for t in texts if passage[:80] in t]
        assert spots and max(spots) > 0.9


def _data(home: Path, address: str, folder: Path, tokens: int) -> str:
    cmd = [sys.executable, "-m", "pie_runtime.cli.main", "drafter", "data", "--engine", address, "--out", str(folder)]
    cmd += ["--tokens", str(tokens), "--prompts", "6", "--heldout", "2", "--max-new", "6", "--concurrency", "3"]
    cmd += ["--flush", "2", "--quiet"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PIE_HOME": str(home)}, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


@needs_corpus
def test_data_command_answers_on_the_engine_and_resumes(pie_home, engine, tmp_path):
    import torch

    folder = tmp_path / "chat"
    _data(pie_home, engine.address, folder, tokens=12)
    first = Manifest.model_validate_json((folder / "manifest.json").read_text())
    assert first.answer_tokens > 0 and first.answers < 8
    _data(pie_home, engine.address, folder, tokens=1000)  # continues: every prompt once
    answers = read_answers(folder)
    keys = [(a.prompt_id, a.temperature) for a in answers]
    assert len(keys) == len(set(keys)) == 8  # 2 held-out greedy + 6 training, none twice
    assert [(a.prompt_id, a.temperature) for a in answers[: first.answers]] == keys[: first.answers]
    assert {a.temperature for a in answers if a.prompt_id.startswith("h-")} == {0.0}
    assert {a.temperature for a in answers} == {0.0, 0.7, 1.0}
    for a in answers:
        assert a.hidden.shape == (len(a.tokens) - 1, 576) and a.hidden.dtype == np.float16
        assert 0 < len(a.tokens) - a.prompt_len <= 6
    assert "nothing to do" in _data(pie_home, engine.address, folder, tokens=1000)
    # the engine's hidden state ranks the greedy answer's next token first (fp32 engine, float32 head)
    from pie_runtime.store import load_model

    os.environ["PIE_HOME"] = str(pie_home)
    try:
        model = load_model("smollm2-135m").model
    finally:
        del os.environ["PIE_HOME"]
    train, held = split_answers(answers)
    data = answers_to_teacher(held, model, 4, depth=1, answer_only=True)
    assert data is not None
    assert torch.equal(data.tokens[:, 1:], data.top[:, :-1, 0].long())
    assert len(train) == 6
    # training windows (`pie drafter train --data-positions answers`, the default) lie in the answers alone
    answer_windows = answers_to_teacher(train, model, 2, depth=1, answer_only=True)
    every_window = answers_to_teacher(train, model, 2, depth=1)
    assert answer_windows is not None and every_window is not None
    assert answer_windows.num_tokens < every_window.num_tokens
    answer_spans = [a.tokens[a.prompt_len - 1 :] for a in train]
    for row in answer_windows.tokens.tolist():
        assert any(row == span[i : i + 2] for span in answer_spans for i in range(len(span) - 1))


@needs_corpus
def test_bench_chat_prompts_are_not_training_prompts():
    from pie_runtime.bench.prompts import expand_prompts

    chat = expand_prompts(["chat"])
    assert len(chat) >= 4 and all(name.startswith("chat/") for name, _ in chat)
    requests = [text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0] for _, text in chat]
    train = training_prompts(CORPORA, 3000, seed=0)
    assert not [r for r in requests for p in train if r in p.text]
    # their topics are in neither topic list (open_requests.py leaves them out for the benchmarks)
    assert not {"colors", "drinking water", "bicycles", "the sea", "dogs", "rain"} & set(TOPICS)


def test_shards_resume_without_repeats_and_refuse_other_settings(tmp_path):
    from pie_runtime.distill.answer_shards import Answer, DataError, append_shard, done_keys, open_folder
    from pie_runtime.distill.chat_prompts import ChatPrompt
    from pie_runtime.distill.self_answers import plan_jobs

    def answer(pid: str, t: float, n: int) -> Answer:
        return Answer(pid, t, 3, list(range(3 + n)), np.ones((2 + n, 4), dtype=np.float16))

    train = [ChatPrompt(id=f"t-{i}", split="train", kind="open", text=str(i)) for i in range(4)]
    held = [ChatPrompt(id="h-0", split="heldout", kind="open", text="h")]
    settings = {"model": "m", "seed": 0}
    manifest = open_folder(tmp_path, settings)
    jobs = plan_jobs(train, held, 0, done_keys(tmp_path))
    assert [(j.prompt.id, j.temperature) for j in jobs] == [
        ("h-0", 0.0),
        ("t-0", 0.0),
        ("t-1", 0.7),
        ("t-2", 1.0),
        ("t-3", 0.0),
    ]
    append_shard(tmp_path, manifest, [answer(j.prompt.id, j.key[1], 2) for j in jobs[:2]])
    (tmp_path / "shard-00001.npz").write_bytes(b"a shard the manifest never named")  # a run killed mid-write
    again = open_folder(tmp_path, settings)
    assert again.answers == 2 and again.answer_tokens == 4
    left = plan_jobs(train, held, 0, done_keys(tmp_path))
    assert [j.prompt.id for j in left] == ["t-1", "t-2", "t-3"]
    append_shard(tmp_path, again, [answer(j.prompt.id, j.key[1], 1) for j in left])
    answers = read_answers(tmp_path)
    assert [a.prompt_id for a in answers] == ["h-0", "t-0", "t-1", "t-2", "t-3"]
    assert all(a.hidden.shape == (len(a.tokens) - 1, 4) for a in answers)
    with pytest.raises(DataError, match="other settings"):
        open_folder(tmp_path, {"model": "m", "seed": 1})
