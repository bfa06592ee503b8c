"""Grammar constraints with llguidance: a JSON schema, a regex or a Lark grammar → per-row token masks.

Terms:
    mask    the packed allowed-token bitmask a readout row takes (int32, (rows, ceil(V/32)), bit i of
            word j allows token 32 j + i), the format both llguidance and the engine use;
    forced  tokens the grammar allows as the only continuation (``compute_ff_tokens``): free drafts.

A `Constraint` holds one matcher whose state is "every emitted token consumed". For a verify window
[last, d_1..d_k] it builds k+1 masks by consuming the drafts one by one and rolls back after:

    masks[0] = mask(state);  for i in 1..k: consume d_i; masks[i] = mask(state)
    rollback k

and for a token tree's window [last, n_0..n_{m-1}] one mask per row: row 0 the state's, row n+1 the state after
the path root → n (``tree_masks``). Sampled verification (``speculative.verify_sampled``,
``tree.verify_tree_sampled``) then judges each draft by the target's distribution under its row's mask,
renormalized over the allowed tokens (``filter_distribution``'s step 1): what plain masked sampling draws from.
"""

from __future__ import annotations

import json
from functools import lru_cache

import numpy as np

from ..spec.token_tree import ROOT, TokenTree
from ..tokenizer import Tokenizer


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer_json: str, vocab_size: int, eos: tuple[int, ...]):
    import llguidance

    # Built from tokenizer JSON alone, llguidance guesses token 0 as EOS: pass the model's own.
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos))


def ll_tokenizer(tok: Tokenizer, vocab_size: int):
    """The llguidance tokenizer of ``tok`` (slow to build, so cached: docs/performance.md)."""
    return _ll_tokenizer(tok.to_json(), vocab_size, tuple(tok.eos_token_ids))


def grammar_text(json_schema: str | dict | None = None, regex: str | None = None, lark: str | None = None) -> str:
    """One llguidance grammar from exactly one of a JSON schema (text or dict), a regex or a Lark grammar.
    JSON output is compact (no free whitespace), so a small model cannot wander into blank space."""
    import llguidance

    given = [x is not None for x in (json_schema, regex, lark)]
    if sum(given) != 1:
        raise ValueError("give exactly one of json_schema, regex, grammar")
    if json_schema is not None:
        schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    if regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(regex)
    assert lark is not None  # exactly one was given
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Constraint:
    """An llguidance matcher over the emitted tokens; masks for verify windows; draft checking."""

    def __init__(self, tok: Tokenizer, vocab_size: int, grammar: str):
        import llguidance

        self.vocab_size = vocab_size
        self.eos = set(tok.eos_token_ids)
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tok, vocab_size), grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"bad grammar: {self.matcher.get_error()}")

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (may be empty)."""
        return list(self.matcher.compute_ff_tokens())

    def legal_prefix(self, drafts: list[int]) -> list[int]:
        """``drafts`` cut at the first token the grammar refuses here (and before any EOS)."""
        n = self.matcher.validate_tokens([int(t) for t in drafts]) if drafts else 0
        out = [int(t) for t in drafts[:n]]
        for i, t in enumerate(out):
            if t in self.eos:
                return out[:i]
        return out

    def masks(self, drafts: list[int]) -> np.ndarray:
        """(len(drafts)+1, words) int32: the mask of each verify row; the matcher is left as it was."""
        from llguidance.numpy import fill_next_token_bitmask

        out = np.zeros((len(drafts) + 1, self.words), dtype=np.int32)
        fill_next_token_bitmask(self.matcher, out, 0)
        for i, t in enumerate(drafts):
            if not self.matcher.consume_token(int(t)):
                self.matcher.rollback(i)
                raise ValueError(f"draft {t} is not legal here; check drafts with legal_prefix first")
            fill_next_token_bitmask(self.matcher, out, i + 1)
        if drafts:
            self.matcher.rollback(len(drafts))
        return out

    def tree_masks(self, tree: TokenTree) -> np.ndarray:
        """(len(tree)+1, words) int32: row 0's mask, then each node's (the state after its path); the matcher is
        left as it was. Raises ValueError for a node the grammar refuses after its path."""
        from llguidance.numpy import fill_next_token_bitmask

        out = np.zeros((len(tree) + 1, self.words), dtype=np.int32)
        fill_next_token_bitmask(self.matcher, out, 0)
        for node in range(len(tree)):
            path = [node]
            while tree.parents[path[-1]] != ROOT:
                path.append(tree.parents[path[-1]])
            tokens = [tree.tokens[n] for n in reversed(path)]
            if self.matcher.validate_tokens(tokens) != len(tokens):
                raise ValueError(f"tree node {node} ({tokens}) is not legal here")
            self.matcher.consume_tokens(tokens)
            fill_next_token_bitmask(self.matcher, out, node + 1)
            self.matcher.rollback(len(tokens))
        return out

    def consume(self, tokens: list[int]) -> None:
        """Advances the matcher over emitted tokens (EOS ends the output and is not consumed)."""
        for t in tokens:
            if int(t) in self.eos:
                return
            if not self.matcher.consume_token(int(t)):
                raise RuntimeError(f"token {t} broke the grammar: {self.matcher.get_error()}")

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()
