"""Turns the words after ``--`` into an inferlet's arguments: its pydantic model's fields, or a dict; and
``CompletionArgs``, the arguments every text-generating inferlet takes, and ``DecodeArgs``, those plus the
sampler options of the speculative inferlets.

``--max-tokens 8`` → ``max_tokens=8``; a bare ``--chat`` → ``chat=True``; a repeated flag gives a list.
Values are typed by the pydantic model; in a dict, numbers become numbers and the rest stays text.
"""

from __future__ import annotations

import inspect
import json
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

from pydantic import BaseModel, field_validator

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


class CompletionArgs(BaseModel):
    """text-completion's arguments; the speculative inferlets take them too (``DecodeArgs``)."""

    prompt: str
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    chat: bool = False
    stream: bool = True

    def prompt_ids(self, tok: Tokenizer) -> list[int]:
        """The prompt's token ids (rendered with the chat template first with ``--chat``)."""
        text = tok.chat([{"role": "user", "content": self.prompt}]) if self.chat else self.prompt
        return tok.encode(text)


class DecodeArgs(CompletionArgs):
    """text-completion's arguments plus the sampler options that turn speculation off."""

    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # Hugging Face's: logits of seen tokens (prompt too) / r if > 0 else * r
    logit_bias: dict[int, float] = {}  # token id → added to its logit; JSON text on the command line
    logprobs: int | None = None  # record each token's logprob and this many top alternatives (bare flag: 0)
    timing: bool = False  # per-round times in stats
    # adaptive: each round drafts the count with the most expected tokens per ms (inferlet.draft_length),
    # at most the inferlet's draft length; fixed: always the draft length
    draft_schedule: Literal["adaptive", "fixed"] = "adaptive"

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _json_bias(cls, v: Any) -> Any:
        return json.loads(v) if isinstance(v, str) else v

    @field_validator("logprobs", mode="before")
    @classmethod
    def _bare_logprobs(cls, v: Any) -> Any:
        return {True: 0, False: None}.get(v, v) if isinstance(v, bool) else v

    def fallback_reasons(self) -> list[str]:
        """Why this run may not speculate; [] when it may."""
        reasons = []
        if self.presence_penalty or self.frequency_penalty or self.repetition_penalty not in (0.0, 1.0):
            reasons.append("penalties")
        if self.logit_bias:
            reasons.append("logit_bias")
        if self.logprobs is not None:
            reasons.append("logprobs")
        return reasons


def split_words(words: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--") or len(word) == 2:
            raise ValueError(f"expected --name, got {word!r}")
        key, _, inline = word[2:].partition("=")
        key = key.replace("-", "_")
        if inline or "=" in word:
            value: Any = inline
            i += 1
        elif i + 1 < len(words) and not (words[i + 1].startswith("--") and len(words[i + 1]) > 2):
            value = words[i + 1]
            i += 2
        else:
            value = True
            i += 1
        if key in out:
            prev = out[key]
            out[key] = (prev if isinstance(prev, list) else [prev]) + [value]
        else:
            out[key] = value
    return out


def _guess(value: Any) -> Any:
    if isinstance(value, list):
        return [_guess(v) for v in value]
    if not isinstance(value, str):
        return value
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    if value in ("true", "false"):
        return value == "true"
    return value


def _wants_list(annotation) -> bool:
    if get_origin(annotation) in (list, tuple):
        return True
    return any(get_origin(a) in (list, tuple) for a in get_args(annotation))


def parse_args(words: list[str], fn) -> Any:
    """Parses ``words`` for ``fn(args)``: into its first parameter's pydantic model, or a dict."""
    raw = split_words(words)
    params = list(inspect.signature(fn).parameters.values())
    ann = params[0].annotation if params else inspect.Parameter.empty
    if isinstance(ann, str):
        ann = fn.__globals__.get(ann, inspect.Parameter.empty)
    if inspect.isclass(ann) and issubclass(ann, BaseModel):
        fields = ann.model_fields
        for key, value in list(raw.items()):
            if key in fields and _wants_list(fields[key].annotation) and not isinstance(value, list):
                raw[key] = [value]
            elif key in fields and fields[key].annotation is dict and isinstance(value, str):
                raw[key] = json.loads(value)
        return ann.model_validate(raw)
    return {k: _guess(v) for k, v in raw.items()}
