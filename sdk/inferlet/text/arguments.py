"""Turns the words after ``--`` into an inferlet's arguments: its pydantic model's fields, or a dict; and
``CompletionArgs``, the arguments every text-generating inferlet takes (OpenAI's and vLLM's request fields,
with their meanings), and ``DecodeArgs``, those plus the options of the speculative inferlets.

``--max-tokens 8`` → ``max_tokens=8``; a bare ``--chat`` → ``chat=True``; a repeated flag gives a list.
Values are typed by the pydantic model; in a dict, the names ``CompletionArgs`` types as text (``--prompt 42``,
``--stop 1``) stay text, other numbers become numbers and the rest stays text.
"""

from __future__ import annotations

import difflib
import inspect
import json
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self, get_args, get_origin

import numpy as np
from pydantic import AfterValidator, BaseModel, Field, ValidationError, field_validator, model_validator

from ..errors import ArgumentError

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

# upper bounds of what one run may ask (a server's --max-n/--max-tokens are usually lower): no argument sizes
# a run's work or memory past what a host can hold for every tenant beside it
MAX_CHOICES = 64
"""The most ``n``: forks of one prompt."""
MAX_NEW_TOKENS = 1 << 17
"""The most ``max_tokens``."""
MAX_LIST = 1024
"""The most entries of a list argument: stop strings, stop token ids, ``logit_bias``."""
MAX_PROMPT_IDS = 1 << 20
"""The most ``prompt_token_ids``."""
MAX_DRAFT = 64
"""The most tokens one round drafts: the bound of a speculative inferlet's ``draft_length`` (and ``lookup``)."""
MAX_NGRAM = 16
"""The longest n-gram of the lookup drafters."""
MAX_MATCH = 1024
"""The longest match of the suffix drafter."""
MAX_TOP_LOGPROBS = 20
"""The most ``top_logprobs`` (OpenAI's and vLLM's limit)."""
LOGIT_BIAS_RANGE = 100.0


class CompletionArgs(BaseModel):
    """A completion request, as text-completion and every speculative inferlet take it. Same meanings as
    OpenAI/vLLM: ``n`` choices (forks of the prompt's working set after one prefill, inferlet.text.choices);
    ``stop`` strings and ``stop_token_ids`` end a choice with finish_reason "stop" (the text is cut before the
    string; a stop token, like EOS, is not kept); ``ignore_eos`` keeps decoding past EOS (kept as a token);
    presence/frequency penalties count the generated tokens only; ``logit_bias`` adds to token logits;
    ``logprobs`` (a count, or true) records each token's logprob and ``top_logprobs`` (or the count) alternatives.
    Penalties and the logit bias make the run sample on the host from each step's logits (inferlet.sampler)."""

    prompt: str
    # the prompt as token ids (OpenAI allows it): used as they are
    prompt_token_ids: list[int] | None = Field(default=None, max_length=MAX_PROMPT_IDS)
    max_tokens: int = Field(default=128, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(default=0.0, ge=0.0)
    top_k: int = Field(default=0, ge=0, le=1 << 20)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # stored as seed mod 2**63 (numpy needs >= 0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: list[str] = Field(default=[], max_length=MAX_LIST)
    stop_token_ids: list[int] = Field(default=[], max_length=MAX_LIST)
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)  # subtracted once from every generated token
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)  # subtracted per occurrence in the output
    repetition_penalty: float = Field(default=1.0, ge=0.0)  # Hugging Face's: seen tokens (prompt too) / r or * r
    logit_bias: dict[int, float] = Field(
        default={}, max_length=MAX_LIST
    )  # token id → added to its logit; JSON text on the command line
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # bare flag or true: 0 alternatives
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # needs logprobs; overrides its count
    chat: bool = False
    stream: bool = True

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _json_bias(cls, v: Any) -> Any:
        return json.loads(v) if isinstance(v, str) else v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float]) -> dict[int, float]:
        bad = {t: b for t, b in v.items() if t < 0 or not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE}
        if bad:
            raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {bad}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed_non_negative(cls, v: int | None) -> int | None:
        return None if v is None else v % 2**63

    @field_validator("logprobs", mode="before")
    @classmethod
    def _bare_logprobs(cls, v: Any) -> Any:
        return {True: 0, False: None}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> Self:
        if self.top_logprobs and self.logprobs is None:  # OpenAI's rule; top_logprobs=0 alone asks nothing
            raise ValueError("top_logprobs needs logprobs")
        return self

    def prompt_ids(self, tok: Tokenizer) -> list[int]:
        """The prompt's token ids: ``prompt_token_ids`` when given (as they are), else ``prompt``'s (rendered with
        the chat template first with ``--chat``) with the model's BOS once (:meth:`Tokenizer.encode_prompt`)."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        text = tok.chat([{"role": "user", "content": self.prompt}]) if self.chat else self.prompt
        return tok.encode_prompt(text)

    @property
    def top_count(self) -> int | None:
        """How many alternatives each logprobs entry lists; None when logprobs were not asked for."""
        if self.logprobs is None:
            return None
        return self.top_logprobs if self.top_logprobs is not None else self.logprobs

    def host_sampling(self) -> bool:
        """Whether each token must be picked on the host from the step's logits (penalties, logit bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias) or (
            self.repetition_penalty not in (0.0, 1.0)
        )

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

    def for_choice(self, i: int) -> Self:
        """The arguments of choice ``i`` of ``n``: choice 0 is this run itself; the others stream nothing and
        draw from a seed of their own (derived from ``seed``, so a seeded request is reproducible)."""
        if i == 0:
            return self
        seed = None if self.seed is None else int(np.random.SeedSequence([self.seed, i]).generate_state(1)[0])
        return self.model_copy(update={"seed": seed, "stream": False})


class DecodeArgs(CompletionArgs):
    """The completion request plus the options of the speculative inferlets."""

    timing: bool = False  # per-round times in stats
    # adaptive: each round drafts the count with the most expected tokens per ms (inferlet.spec.draft_policy),
    # at most the inferlet's draft length; fixed: always the draft length
    draft_schedule: Literal["adaptive", "fixed"] = "adaptive"


def check_tree(shape: str | None) -> str | None:
    """A ``tree`` argument (widths per depth, ``"3,2,1"``), checked before the run starts (tree.parse_shape's
    bounds: depth and nodes)."""
    if shape is not None:
        from ..spec.token_tree import parse_shape

        parse_shape(shape)
    return shape


TreeShape = Annotated[str | None, AfterValidator(check_tree)]
"""The type of a ``tree`` argument: widths per depth (``"3,2,1"``), checked when the arguments are read, so a
bad shape is refused before the run starts."""


def split_words(words: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--") or len(word) == 2:
            raise ArgumentError(f"expected --name, got {word!r}")
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


def _text_fields() -> frozenset[str]:
    """The names ``CompletionArgs`` types as text (``str`` or ``list[str]``): a dict inferlet reading
    ``args["prompt"]`` gets the words it was given, ``"42"`` too, as a typed one would."""
    return frozenset(
        name for name, f in CompletionArgs.model_fields.items() if f.annotation in (str, list[str], str | None)
    )


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


def args_model(fn) -> type[BaseModel] | None:
    """The pydantic model of ``fn``'s first parameter, or None when it takes a plain dict."""
    params = list(inspect.signature(fn).parameters.values())
    ann = params[0].annotation if params else inspect.Parameter.empty
    if isinstance(ann, str):
        ann = fn.__globals__.get(ann, inspect.Parameter.empty)
    return ann if inspect.isclass(ann) and issubclass(ann, BaseModel) else None


def parse_arg_dict(raw: dict[str, Any], fn) -> Any:
    """The arguments for ``fn(args)`` from a JSON-like dict (an inferlet host's run request): validated by its
    pydantic model, or the dict itself when ``fn`` takes a dict. A name the model does not know is refused
    (``ArgumentError``, a ``ValueError``) unless the model allows extra fields: a caller must learn that its
    option was not applied."""
    model = args_model(fn)
    if model is None:
        return dict(raw)
    return validated(model, raw, flags=False)


def parse_args(words: list[str], fn) -> Any:
    """Parses ``words`` for ``fn(args)``: into its first parameter's pydantic model, or a dict. An unknown,
    missing or unreadable ``--name`` raises ``ArgumentError``, one line that ``pie run`` prints as it is."""
    raw = split_words(words)
    ann = args_model(fn)
    if ann is not None:
        fields = ann.model_fields
        for key, value in list(raw.items()):
            if key in fields and _wants_list(fields[key].annotation) and not isinstance(value, list):
                raw[key] = [value]
            elif key in fields and fields[key].annotation is dict and isinstance(value, str):
                raw[key] = json.loads(value)
        return validated(ann, raw, flags=True)
    text = _text_fields()
    return {k: v if k in text else _guess(v) for k, v in raw.items()}


def validated(model: type[BaseModel], raw: dict[str, Any], flags: bool) -> BaseModel:
    """``model`` from ``raw``, or ``ArgumentError`` naming what is wrong: a name the model does not know (unless
    it allows extra fields; with the known name nearest to it), or each field pydantic refused and why.
    ``flags``: name them as ``--max-tokens`` (the words after ``--``), else as ``max_tokens``."""

    def name(key: str) -> str:
        return "--" + key.replace("_", "-") if flags else key

    unknown = sorted(set(raw) - set(model.model_fields))
    if unknown and model.model_config.get("extra") != "allow":
        parts = []
        for key in unknown:
            near = difflib.get_close_matches(key, list(model.model_fields), n=1)
            parts.append(name(key) + (f" (did you mean {name(near[0])}?)" if near else ""))
        raise ArgumentError(f"unknown argument{'s' if len(unknown) > 1 else ''}: {', '.join(parts)}")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"] if not isinstance(p, int)) or "arguments"
            problems.append(f"{name(loc) if loc in model.model_fields else loc}: {err['msg']}")
        raise ArgumentError("; ".join(problems)) from None
