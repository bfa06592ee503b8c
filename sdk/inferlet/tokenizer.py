"""The model's tokenizer on the inferlet side (the engine sends its tokenizer.json), with the chat template
rendered by jinja2 the way Hugging Face renders it.

Two encodings: :meth:`Tokenizer.encode` gives a text's own ids (pieces of a prompt, stop strings, counts);
:meth:`Tokenizer.encode_prompt` gives what the model reads for a whole prompt, with the BOS (and EOS) the
model asks for (``add_bos_token``: Llama, Gemma) added once. A prompt whose ids already start with BOS (a
chat template that writes ``{{ bos_token }}``, or a prompt rendered so) does not get a second one: llama.cpp
strips the template's BOS and adds its own, the same ids."""

from __future__ import annotations

from functools import cached_property

from tokenizers import Tokenizer as _HFTokenizer

from pie_runtime.protocol import ModelInfo

from .errors import UsageError


class NoChatTemplate(UsageError, ValueError):
    """The model has no chat template, so chat messages cannot be rendered (``--chat``, /v1/chat/completions)."""


class Tokenizer:
    """The model's tokenizer (``model.tokenizer``): ``encode`` a text's own ids, ``encode_prompt`` a whole
    prompt with the BOS the model asks for, ``decode`` ids, ``chat`` to render messages with the model's chat
    template, and the special ids (``eos_token_ids``)."""

    def __init__(
        self,
        tokenizer_json: str,
        eos_token_ids: list[int],
        bos_token_id: int | None,
        chat_template: str | None,
        *,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
    ):
        self._json = tokenizer_json
        self._tok = _HFTokenizer.from_str(tokenizer_json)
        self.eos_token_ids = list(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.add_eos_token = add_eos_token and bool(eos_token_ids)

    @classmethod
    def for_model(cls, tokenizer_json: str, info: ModelInfo, chat_template: str | None = None) -> Tokenizer:
        """The tokenizer of a served model (``hello``'s model info), its chat template or ``chat_template``."""
        return cls(
            tokenizer_json,
            info.eos_token_ids,
            info.bos_token_id,
            chat_template or info.chat_template,
            add_bos_token=info.add_bos_token,
            add_eos_token=info.add_eos_token,
        )

    def to_json(self) -> str:
        """The tokenizer.json text the engine sent (for tools that build their own tokenizer, e.g. llguidance)."""
        return self._json

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` alone, no BOS; special-token strings in it (``<|im_start|>``) become their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """The ids the model reads for the whole prompt ``text``: :meth:`encode`'s, with BOS first where the model
        adds it and the ids do not already start with it, and EOS last likewise."""
        ids = self.encode(text)
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        if self.add_eos_token and ids[-1:] != [self.eos_token_ids[0]]:
            ids.append(self.eos_token_ids[0])
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @cached_property
    def _env(self):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not self.chat_template:
            raise NoChatTemplate(
                "this model has no chat template (its GGUF or tokenizer_config.json carries none): give the prompt "
                "as plain text in the model's own format instead of chat messages (no --chat), or serve it with "
                "`pie serve --chat-template FILE`"
            )
        return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    @cached_property
    def _template(self):
        return self._env.from_string(self.chat_template or "")

    @cached_property
    def takes_tools(self) -> bool:
        """Whether the chat template reads a ``tools`` variable (renders tool definitions itself, as Hugging Face
        templates with a tools branch do)."""
        from jinja2 import meta

        if not self.chat_template:
            return False
        return "tools" in meta.find_undeclared_variables(self._env.parse(self.chat_template))

    def chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """Renders ``messages`` ([{"role", "content"}]) with the model's chat template; ``tools`` (OpenAI's tool
        objects) go to a template that takes them (``takes_tools``)."""
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        extra = {"tools": tools} if tools else {}
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, **extra
        )


class StreamDecoder:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences.

    Incremental, as vLLM's detokenizer: each push decodes only a window of the ids, from ``prefix`` (where the
    previous delta's tokens start) to the end, and returns what that window's text adds past the text of
    ``ids[prefix:read]`` (``read``: where the previous delta ended). Decoding both from the same ``prefix``
    keeps what a tokenizer does at a sequence's start (a stripped leading space, say) out of the delta, so the
    deltas join up to ``tokenizer.decode(ids)``; a push costs the window, not the whole output."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] decoded to the text just before the pending tokens
        self._read = 0

    def push(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        window = self.tokenizer.decode(self.ids[self._prefix :])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""  # nothing new yet, or a character whose bytes are not all here
        delta = window[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta
