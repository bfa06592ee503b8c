"""Generating text: reach for ``inferlet.text`` when an inferlet answers a completion request, with the same
arguments, streaming, stop strings, logprobs and ``n`` choices as the shipped ones (and OpenAI's routes).

- :class:`CompletionArgs` (and :class:`DecodeArgs` for speculative inferlets): the request's fields, checked,
  with the ``MAX_*`` bounds; a bad one raises :class:`ArgumentError`. :data:`TreeShape` types a ``--tree``.
- :class:`StepSampler` picks each token (on the engine, or on the host for penalties and logit bias) and
  :class:`Output` streams the text, applies stops and ``max_tokens``, and records logprobs; :func:`draw`
  samples one token from weights.
- :func:`run_choices` runs a decode loop once per choice on forks of one prefilled prompt.
- :class:`Constraint` and :func:`grammar_text` restrict tokens to a JSON schema, regex or Lark grammar;
  :func:`tool_call_grammar`, :func:`render_call` and :func:`parse_tool_calls` are the tool-call format.
- :class:`StreamDecoder` turns tokens into text piece by piece (a multi-byte character is never split).

    from inferlet.text import CompletionArgs, Output, StepSampler
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..facade import lazy_exports

if TYPE_CHECKING:
    from ..errors import ArgumentError
    from ..sampler import StepSampler, draw
    from ..tokenizer import StreamDecoder
    from .arguments import (
        MAX_CHOICES,
        MAX_DRAFT,
        MAX_LIST,
        MAX_MATCH,
        MAX_NEW_TOKENS,
        MAX_NGRAM,
        MAX_PROMPT_IDS,
        MAX_TOP_LOGPROBS,
        CompletionArgs,
        DecodeArgs,
        TreeShape,
    )
    from .choices import run_choices
    from .grammar import Constraint, grammar_text
    from .output import Output
    from .tool_calls import ToolCallParser, parse_tool_calls, render_call, tool_call_grammar

_HOMES = {
    "inferlet.errors": ["ArgumentError"],
    "inferlet.sampler": ["StepSampler", "draw"],
    "inferlet.tokenizer": ["StreamDecoder"],
    "inferlet.text.arguments": [
        "MAX_CHOICES",
        "MAX_DRAFT",
        "MAX_LIST",
        "MAX_MATCH",
        "MAX_NEW_TOKENS",
        "MAX_NGRAM",
        "MAX_PROMPT_IDS",
        "MAX_TOP_LOGPROBS",
        "CompletionArgs",
        "DecodeArgs",
        "TreeShape",
    ],
    "inferlet.text.choices": ["run_choices"],
    "inferlet.text.grammar": ["Constraint", "grammar_text"],
    "inferlet.text.output": ["Output"],
    "inferlet.text.tool_calls": ["ToolCallParser", "parse_tool_calls", "render_call", "tool_call_grammar"],
}

__all__ = [
    "CompletionArgs",
    "DecodeArgs",
    "TreeShape",
    "ArgumentError",
    "MAX_CHOICES",
    "MAX_NEW_TOKENS",
    "MAX_LIST",
    "MAX_PROMPT_IDS",
    "MAX_DRAFT",
    "MAX_NGRAM",
    "MAX_MATCH",
    "MAX_TOP_LOGPROBS",
    "Output",
    "StepSampler",
    "draw",
    "run_choices",
    "Constraint",
    "grammar_text",
    "tool_call_grammar",
    "render_call",
    "parse_tool_calls",
    "ToolCallParser",
    "StreamDecoder",
]

__getattr__, __dir__ = lazy_exports(__name__, {n: m for m, names in _HOMES.items() for n in names})
