"""BOS on plain prompts where the model says so, never twice with a chat template that writes its own, and a
clear refusal of chat messages for a model without a chat template: the SDK tokenizer on GGUF vocabularies,
no engine."""

from __future__ import annotations

import pytest

from inferlet.errors import UsageError
from inferlet.text.arguments import CompletionArgs as Args
from inferlet.tokenizer import NoChatTemplate, Tokenizer
from pie_runtime.models.hf_import import adds_bos_eos
from pie_runtime.protocol import ModelInfo
from tests.models.gguf_vocabs import sdk_tokenizer

# Gemma's own chat template opens with {{ bos_token }} (its GGUF here is the base model's, which has none)
GEMMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PLAIN_CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok.to_json(), tok.eos_token_ids, tok.bos_token_id, template, add_bos_token=tok.add_bos_token)


def test_plain_prompts_get_bos_where_the_model_adds_it():
    gemma, _ = sdk_tokenizer("gemma3")
    assert gemma.encode_prompt("The capital of France is") == [2, *gemma.encode("The capital of France is")]
    assert Args(prompt="The capital of France is").prompt_ids(gemma)[0] == 2
    smollm, _ = sdk_tokenizer("smollm")  # add_bos_token false: the prompt's own ids
    assert smollm.encode_prompt("Hello") == smollm.encode("Hello") == Args(prompt="Hello").prompt_ids(smollm)
    assert Args(prompt="x", prompt_token_ids=[5, 6]).prompt_ids(gemma) == [5, 6]  # given ids are kept as they are


def test_bos_is_never_doubled():
    gemma, _ = sdk_tokenizer("gemma3")
    assert gemma.encode_prompt("<bos>Hello").count(2) == 1
    chat = with_template(gemma, GEMMA_CHAT)
    text = chat.chat([{"role": "user", "content": "Hi"}])
    assert text.startswith("<bos><start_of_turn>user\nHi")
    ids = Args(prompt="Hi", chat=True).prompt_ids(chat)
    assert ids[:2] == [2, 105] and ids.count(2) == 1  # <bos> <start_of_turn>, one BOS


def test_a_template_without_bos_gets_the_models_bos_once():
    """As llama.cpp: a rendered chat is tokenized with the model's BOS rule (it strips a template's own BOS
    first, so either way the prompt starts with exactly one)."""
    gemma, _ = sdk_tokenizer("gemma3")
    ids = Args(prompt="Hi", chat=True).prompt_ids(with_template(gemma, PLAIN_CHAT))
    assert ids == [2, *gemma.encode("user: Hi\n")]


def test_chat_without_a_template_is_refused_clearly():
    gemma, _ = sdk_tokenizer("gemma3")
    assert gemma.chat_template is None  # the GGUF carries none
    with pytest.raises(NoChatTemplate, match="this model has no chat template") as e:
        Args(prompt="Hi", chat=True).prompt_ids(gemma)
    assert isinstance(e.value, UsageError) and isinstance(e.value, ValueError)  # one line in `pie run`; 400 in serve
    assert "--chat" in str(e.value)


def test_the_chat_template_of_the_default_model_renders():
    smollm, _ = sdk_tokenizer("smollm")
    ids = Args(prompt="What is 2+2?", chat=True).prompt_ids(smollm)
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> system, user, assistant; no BOS added (none asked)


def test_the_add_bos_rule_reaches_the_sdk_through_hello():
    """The engine's hello carries the rule (ModelInfo.add_bos_token) and the SDK's tokenizer applies it."""
    gemma, _ = sdk_tokenizer("gemma3")
    fields = dict(name="g", vocab_size=262144, max_positions=32768, page_size=16, bos_token_id=2)
    info = ModelInfo.model_validate({**fields, "eos_token_ids": [1], "chat_template": None, "add_bos_token": True})
    assert Tokenizer.for_model(gemma.to_json(), info).encode_prompt("Hi")[0] == 2
    old = ModelInfo.model_validate({**fields, "eos_token_ids": [1], "chat_template": None})  # an older engine's
    assert old.add_bos_token is False and Tokenizer.for_model(gemma.to_json(), old).encode_prompt("Hi")[0] != 2


def test_hugging_face_tokenizers_say_add_bos_by_their_post_processor():
    gemma, _ = sdk_tokenizer("gemma3")
    smollm, _ = sdk_tokenizer("smollm")
    assert adds_bos_eos(gemma.to_json(), 2, 1) == (True, False)
    assert adds_bos_eos(smollm.to_json(), 1, 2) == (False, False)


def test_chat_run_without_a_template_fails_with_one_line(tiny_engine):
    """Through an engine: `pie run text-completion --chat` on a model without a chat template (the tiny random
    model's folder has none) fails with the refusal, not a traceback or a guessed template."""
    import subprocess

    from pie_runtime.launcher import resolve_inferlet, run_inferlet

    words = ["--prompt", "Hi", "--chat", "--max-tokens", "2"]
    outcome = run_inferlet(resolve_inferlet("text-completion"), tiny_engine.address, words, stdout=subprocess.DEVNULL)
    assert not outcome["ok"]
    assert "this model has no chat template" in str(outcome["error"]) and "Traceback" not in str(outcome["error"])
