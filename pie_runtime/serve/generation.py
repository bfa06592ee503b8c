"""From an OpenAI request to an inferlet run and back: the prompt (chat messages through the model's chat
template), the limits checked before a run starts (``n``, ``max_tokens``, the context), the inferlet and its
arguments, and the mapping of the run's result dict (text, token_ids, finish_reason, stats, logprobs,
choices, speculation) to OpenAI choices, logprobs and usage.

The server renders the chat template itself and hands the inferlet the rendered text (``chat`` false), so the
prompt it counts and checks is exactly the one the inferlet encodes. A token-id prompt goes to the inferlet as
its ids (``prompt_token_ids``), with its decoded text as ``prompt``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from inferlet.tokenizer import Tokenizer

from .errors import invalid_request
from .openai_api import (
    ChatLogprobs,
    ChatRequest,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    Speculation,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from .policies import Capabilities, Policy, choose

COUNT_PIECE = 1 << 14  # characters tokenized at a time when counting a long prompt


@dataclass
class Limits:
    """What one request may ask for."""

    max_model_len: int
    page_size: int
    max_n: int = 16
    max_tokens: int = 4096  # the most a request may generate per choice
    default_completion_tokens: int = 16  # OpenAI's default max_tokens for /v1/completions


@dataclass
class Job:
    """One request, ready to run: the inferlet, its arguments and what admission needs."""

    inferlet: str
    args: dict[str, Any]
    prompt_tokens: int
    max_tokens: int
    n: int
    echo: str | None = None  # completions' ``echo``: the prompt text each choice's text starts with


def completion_prompt(tok: Tokenizer, req: CompletionRequest) -> str | list[int]:
    """The prompt's text, or its token ids as given (checked against the vocabulary)."""
    p = req.prompt
    if isinstance(p, str):
        return p
    if isinstance(p[0], str):
        return str(p[0])
    ids = [int(i) for i in (p[0] if isinstance(p[0], list) else p)]  # type: ignore[union-attr]
    if any(i < 0 or i >= tok.vocab_size for i in ids):
        raise invalid_request("prompt token id out of the vocabulary", param="prompt")
    return ids


def count_tokens(tok: Tokenizer, text: str, most: int) -> int:
    """``len(tok.encode_prompt(text))`` (the model's BOS counted); for a text that cannot fit in ``most`` tokens, a
    count past ``most`` found from its first pieces, so a huge prompt costs the memory and time of tokenizing
    ``most`` tokens, not all of it. Summed over pieces a count runs over the whole's by at most a token or two a
    cut (a cut splits a word), hence the slack per piece."""
    if len(text) <= COUNT_PIECE:
        return len(tok.encode_prompt(text))
    seen = 0
    for cut, start in enumerate(range(0, len(text), COUNT_PIECE)):
        seen += len(tok.encode(text[start : start + COUNT_PIECE]))
        if seen > most + 2 * (cut + 1):
            return seen - 2 * (cut + 1)
    return len(tok.encode_prompt(text))


def build_job(
    req: CompletionRequest | ChatRequest,
    prompt: str | list[int],
    tok: Tokenizer,
    limits: Limits,
    policy: Policy | None,
    caps: Capabilities,
    grammar: str | None = None,
    custom: str | None = None,
) -> Job:
    """Checks the request against the limits and the context; picks the inferlet and its arguments
    (``grammar``: a Lark grammar the output is held to, tool calls'; ``custom``: the custom inferlet the request
    names, custom_models.py, which gets the completion arguments only)."""
    if req.n > limits.max_n:
        raise invalid_request(f"n={req.n} is past this server's limit {limits.max_n}", param="n")
    prompt_param = "messages" if isinstance(req, ChatRequest) else "prompt"
    ids = prompt if isinstance(prompt, list) else None
    if ids is None:
        check_text(str(prompt), prompt_param)
    prompt_tokens = len(ids) if ids is not None else count_tokens(tok, str(prompt), limits.max_model_len)
    if prompt_tokens == 0:
        raise invalid_request("the prompt is empty", param=prompt_param, code="empty_prompt")
    room = limits.max_model_len - prompt_tokens
    if room <= 0:
        raise invalid_request(
            f"the prompt has {prompt_tokens} tokens or more; this model's context is {limits.max_model_len}",
            param=prompt_param,
            code="context_length_exceeded",
        )
    asked = req.token_limit()
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    if asked is not None and asked > limits.max_tokens:
        raise invalid_request(f"{param}={asked} is past this server's limit {limits.max_tokens}", param=param)
    if asked is not None and asked > room:
        raise invalid_request(
            f"{prompt_tokens} prompt tokens + {param}={asked} exceed this model's context {limits.max_model_len}",
            param=param,
            code="context_length_exceeded",
        )
    check_unsupported(req)
    if asked is None:
        default = limits.default_completion_tokens if isinstance(req, CompletionRequest) else limits.max_tokens
        asked = min(default, room)
    inferlet, extra = pick(req, policy, caps, grammar, custom)
    args: dict[str, Any] = {
        "prompt": tok.decode(ids) if ids is not None else prompt,
        "max_tokens": asked,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": max(req.top_k, 0),
        "stop": req.stops(),
        "stream": True,  # text events give TTFT and inter-token latency, streamed or not
        "chat": False,
        **extra,
    }
    # fields past text-completion's basics go only when set, so an inferlet that lacks one still runs
    # the requests that do not use it (its Args validation names any field it refuses)
    optional = {
        "prompt_token_ids": ids,
        "seed": req.seed,
        "n": req.n if req.n > 1 else None,
        "stop_token_ids": req.stop_token_ids or None,
        "ignore_eos": req.ignore_eos or None,
        "presence_penalty": req.presence_penalty or None,
        "frequency_penalty": req.frequency_penalty or None,
        "logit_bias": check_bias(req.logit_bias, tok.vocab_size),
    }
    if isinstance(req, CompletionRequest) and req.logprobs is not None:
        optional["logprobs"] = req.logprobs
    elif isinstance(req, ChatRequest) and req.logprobs:
        optional["logprobs"] = req.top_logprobs or 0
    args.update({k: v for k, v in optional.items() if v is not None})
    echo = str(args["prompt"]) if isinstance(req, CompletionRequest) and req.echo else None
    return Job(inferlet, args, prompt_tokens, asked, req.n, echo)


def pick(
    req: CompletionRequest | ChatRequest,
    policy: Policy | None,
    caps: Capabilities,
    grammar: str | None,
    custom: str | None,
) -> tuple[str, dict[str, Any]]:
    """The inferlet and the arguments its policy adds (policies.choose); a custom inferlet gets none, and a 400
    for what only the shipped ones serve (speculation, a response format, tool calls)."""
    if custom is None:
        return choose(policy, caps, req.speculation, req.response_format, grammar)
    fmt = req.response_format.type if req.response_format is not None else "text"
    for param, asked in (
        ("speculation", req.speculation not in (None, False)),
        ("response_format", fmt != "text"),
        ("tools", grammar is not None),
    ):
        if asked:
            raise invalid_request(
                f"{param} is served by the shipped inferlets; the custom inferlet {custom!r} does not take it", param
            )
    return custom, {}


def check_text(text: str, param: str) -> None:
    """A 400 for text that is not Unicode a tokenizer takes (a lone surrogate, "\\ud800" in JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid_request(f"the text is not valid Unicode: {e.reason} at {e.start}", param=param) from None


def check_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[str, float] | None:
    """The logit bias as the inferlet takes it (token ids as decimal strings: the host's messages carry only
    string map keys); a 400 for a token id out of the vocabulary."""
    if not bias:
        return None
    ids = {str(int(k)): v for k, v in bias.items()}
    if any(not 0 <= int(k) < vocab_size for k in ids):
        raise invalid_request("a logit_bias token id is out of the vocabulary", param="logit_bias")
    return ids


def check_unsupported(req: CompletionRequest | ChatRequest) -> None:
    """A 400 for the OpenAI fields this server does not serve, rather than ignoring them."""
    if not isinstance(req, CompletionRequest):
        return
    if req.suffix:
        raise invalid_request("suffix is not supported (no fill-in-the-middle here)", param="suffix")
    if req.echo and req.logprobs is not None:
        raise invalid_request("echo with logprobs is not supported (no prompt logprobs here)", param="echo")


# ---- results ------------------------------------------------------------------------------------------------


def choices_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's choices: ``choices`` for n > 1, else the result itself as the one choice."""
    if result.get("choices"):
        return list(result["choices"])
    return [result]


def finish(choice: dict[str, Any]) -> Literal["stop", "length"]:
    return "stop" if choice.get("finish_reason") == "stop" else "length"


def usage(result: dict[str, Any], prompt_tokens: int) -> Usage:
    stats = result.get("stats") or {}
    completion = sum(len(c.get("token_ids") or []) for c in choices_of(result))
    prompt = int(stats.get("prompt_tokens", prompt_tokens))
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=int(stats.get("cached_tokens", 0) or 0)),
    )


def speculation(result: dict[str, Any]) -> Speculation | None:
    spec = result.get("speculation")
    return Speculation.model_validate(spec) if isinstance(spec, dict) else None


def entries(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A choice's (or a text event's) logprobs entries: ``{"token_id", "logprob", "top": [[id, lp], ...]}``."""
    return [e for e in choice.get("logprobs") or [] if isinstance(e, dict)]


def _piece(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id])


def completion_logprobs(tok: Tokenizer, chosen: list[dict[str, Any]], offset: int = 0) -> CompletionLogprobs | None:
    """Completions' logprobs of the entries ``chosen``; ``offset``: the text offset of the first one's token
    (a streamed chunk's continue the chunks' before it)."""
    if not chosen:
        return None
    out = CompletionLogprobs()
    for e in chosen:
        piece = _piece(tok, int(e["token_id"]))
        out.tokens.append(piece)
        out.token_logprobs.append(float(e["logprob"]))
        out.top_logprobs.append({_piece(tok, int(i)): float(lp) for i, lp in e.get("top") or []})
        out.text_offset.append(offset)
        offset += len(piece)
    return out


def chat_logprobs(tok: Tokenizer, chosen: list[dict[str, Any]]) -> ChatLogprobs | None:
    """Chat's logprobs (``content``) of the entries ``chosen``."""
    if not chosen:
        return None

    def top(token_id: int, lp: float) -> TopLogprob:
        piece = _piece(tok, token_id)
        return TopLogprob(token=piece, logprob=lp, bytes=list(piece.encode()))

    content = []
    for e in chosen:
        first = top(int(e["token_id"]), float(e["logprob"]))
        alts = [top(int(i), float(lp)) for i, lp in e.get("top") or []]
        content.append(TokenLogprob(**first.model_dump(), top_logprobs=alts))
    return ChatLogprobs(content=content)
