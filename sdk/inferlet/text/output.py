"""The tokens a run returns, cut where text-completion stops: the first EOS (unless ``ignore_eos``), a stop
token id, a stop string, ``max_tokens``, or the model's capacity. Every text-generating inferlet pushes what it
decodes through an ``Output``, one token a step or a round's worth at a time, so all of them end (and stream) a
run the same way."""

from __future__ import annotations

from typing import Literal

from ..runtime import emit
from ..tokenizer import StreamDecoder, Tokenizer
from .arguments import CompletionArgs

FinishReason = Literal["stop", "length"]


class Output:
    """The tokens a run returns, cut exactly where text-completion stops, with OpenAI's finish reasons:
    "stop" at the first EOS or stop token id (neither kept; ``ignore_eos`` keeps EOS as a token and goes on) or a
    stop string (the token that completes it is kept, the text is cut before it); "length" at max_tokens or when
    the sequence reaches the model's capacity. ``stop_reason`` says which stop: the string, the token id, or
    None for EOS (vLLM's field). Streams each token's text when ``args.stream``, with its logprobs entries
    when ``track_logprobs`` was called."""

    def __init__(self, tok: Tokenizer, args: CompletionArgs, prompt_len: int, max_positions: int):
        self.args = args
        self.eos = set() if args.ignore_eos else set(tok.eos_token_ids)
        self.stop_ids = set(args.stop_token_ids)
        self.stream = StreamDecoder(tok)
        self.capacity = max_positions - prompt_len  # text-completion stops when prompt + out reaches it
        self.ids: list[int] = []
        self.finish: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict] | None = None  # the sampler's entries, one per token pushed (track_logprobs)
        self._streamed = 0  # how many of them went out with emitted text

    def track_logprobs(self, entries: list[dict]) -> None:
        """Streams ``entries`` (a list the sampler appends each token's logprobs to before it is pushed) with
        the text of their tokens."""
        self.logprobs = entries

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def room(self) -> int:
        """Tokens the output may still take before max_tokens."""
        return self.args.max_tokens - len(self.ids)

    def push(self, tokens: list[int]) -> int:
        """Appends tokens until the output ends; returns how many it took (EOS and a stop id count as taken)."""
        for n, t in enumerate(tokens, 1):
            t = int(t)
            if t in self.stop_ids or t in self.eos:
                self.finish = "stop"
                self.stop_reason = t if t in self.stop_ids else None
                return n
            self.ids.append(t)
            delta = self.stream.push([t])
            stop = self._stop_in(delta)
            if stop is not None:
                self.finish = "stop"
                self.stop_reason = stop
                return n
            if self.args.stream and delta:
                emit(delta, self._unsent_logprobs())
            if len(self.ids) >= self.args.max_tokens or len(self.ids) >= self.capacity:
                self.finish = "length"
                return n
        return len(tokens)

    def _stop_in(self, delta: str) -> str | None:
        """The stop string that starts first in the text, looked for only where ``delta`` could complete one (an
        earlier push found none), so a step costs the delta, not the whole output."""
        if not delta or not self.args.stop:
            return None
        text = self.stream.text
        start = len(text) - len(delta)
        found = [(i, s) for s in self.args.stop if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
        return min(found, key=lambda f: f[0])[1] if found else None

    def _unsent_logprobs(self) -> list[dict] | None:
        """The entries of the tokens pushed since the last emitted text (None when not tracked)."""
        if self.logprobs is None:
            return None
        sent, self._streamed = self._streamed, len(self.ids)
        return self.logprobs[sent : len(self.ids)]

    def text(self) -> str:
        text = self.stream.tokenizer.decode(self.ids)
        if isinstance(self.stop_reason, str):
            text = text[: min(text.find(s) for s in self.args.stop if s in text)]
        return text

    def result(self) -> dict:
        """The result fields of this output: text, token_ids, finish_reason, stop_reason."""
        return {
            "text": self.text(),
            "token_ids": self.ids,
            "finish_reason": self.finish or "length",
            "stop_reason": self.stop_reason,
        }
