"""constrained-speculative-decoding: output held to a JSON schema, regex or Lark grammar (llguidance), with
prompt-lookup and grammar-forced drafts.

Saxena 2023, "Prompt Lookup Decoding" (drafts); Willard & Louf 2023, "Efficient Guided Generation for Large
Language Models" (token masks); Leviathan et al. 2023 (verification).

    drafts = forced tokens (compute_ff_tokens), then lookup drafts after them
    drafts = drafts cut at the first token the grammar refuses
    masks  = [mask(state)] + [mask(state after d_1..d_i) for i in 1..k];  rollback k
    res = fire([last] + drafts, readout every row under its mask, fold=DEFERRED)
    keep the longest agreeing prefix + the target's own (masked) next token; ws.fold(1 + accepted); consume them
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

import inferlet
from inferlet.args import MAX_DRAFT, MAX_NGRAM, DecodeArgs
from inferlet.choices import run_choices
from inferlet.grammar import Constraint, grammar_text
from inferlet.lookup import lookup_drafts
from inferlet.spec.drafter import Drafter, Proposal
from inferlet.spec.host_rounds import speculate


class Args(DecodeArgs):
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None  # Lark
    # the most a round drafts (forced tokens come in long runs)
    # (0 never drafts: the control of `pie bench speculation --control draft-length-0`)
    draft_length: int = Field(default=16, ge=0, le=MAX_DRAFT)
    max_ngram: int = Field(default=3, ge=1, le=MAX_NGRAM)
    min_ngram: int = Field(default=1, ge=1, le=MAX_NGRAM)


class GrammarDrafter(Drafter):
    def __init__(self, constraint: Constraint, args: Args):
        self.constraint = constraint
        self.args = args

    def masks(self, drafts: list[int]) -> np.ndarray:
        return self.constraint.masks(drafts)

    async def commit(self, new_tokens: list[int], seq: list[int], committed: int) -> None:
        self.constraint.consume(new_tokens)

    async def propose(self, seq: list[int], k: int) -> Proposal:
        a = self.args
        forced = self.constraint.forced()[:k]
        looked = lookup_drafts(seq + forced, a.max_ngram, a.min_ngram, k - len(forced)) if len(forced) < k else []
        return Proposal(self.constraint.legal_prefix(forced + looked))


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    grammar = grammar_text(json_schema=args.json_schema, regex=args.regex, lark=args.grammar)

    async def choice(a: Args, ws: inferlet.WorkingSet) -> dict:
        constraint = Constraint(model.tokenizer, model.vocab_size, grammar)
        result = await speculate(model, a, GrammarDrafter(constraint, a), a.draft_length, ws=ws)
        result["stats"]["grammar_accepting"] = constraint.is_accepting()
        return result

    return await run_choices(model, args, choice)
