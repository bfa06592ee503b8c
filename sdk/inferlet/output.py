"""The tokens a run returns, cut where text-completion stops: the first EOS, a stop string, ``max_tokens``, or
the model's capacity. Every text-generating inferlet pushes what it decodes through an ``Output``, one token a
step or a round's worth at a time, so all of them end (and stream) a run the same way."""

from __future__ import annotations

from .args import CompletionArgs
from .runtime import emit
from .tokenizer import StreamDecoder, Tokenizer


class Output:
    """The tokens a run returns, cut exactly where text-completion stops: at the first EOS (not kept), a
    stop string (the token that completes it is kept, the text is cut before it), max_tokens, or when the
    sequence reaches the model's capacity. Streams each token's text when ``args.stream``."""

    def __init__(self, tok: Tokenizer, args: CompletionArgs, prompt_len: int, max_positions: int):
        self.args = args
        self.eos = set(tok.eos_token_ids)
        self.stream = StreamDecoder(tok)
        self.capacity = max_positions - prompt_len  # text-completion stops when prompt + out reaches it
        self.ids: list[int] = []
        self.finish: str | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def room(self) -> int:
        """Tokens the output may still take before max_tokens."""
        return self.args.max_tokens - len(self.ids)

    def push(self, tokens: list[int]) -> int:
        """Appends tokens until the output ends; returns how many it took (EOS counts as taken)."""
        for n, t in enumerate(tokens, 1):
            t = int(t)
            if t in self.eos:
                self.finish = "eos"
                return n
            self.ids.append(t)
            delta = self.stream.push([t])
            if self.args.stop and any(s in self.stream.text for s in self.args.stop):
                self.finish = "stop"
                return n
            if self.args.stream and delta:
                emit(delta)
            if len(self.ids) >= self.args.max_tokens or len(self.ids) >= self.capacity:
                self.finish = "length"
                return n
        return len(tokens)

    def text(self) -> str:
        text = self.stream.tokenizer.decode(self.ids)
        if self.finish == "stop":
            text = text[: min(text.find(s) for s in self.args.stop if s in text)]
        return text
