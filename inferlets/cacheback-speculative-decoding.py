"""cacheback-speculative-decoding: prompt-lookup drafts verified by the target in one fire a round.

Saxena 2023, "Prompt Lookup Decoding" (drafting); Leviathan et al. 2023 / Chen et al. 2023 (verification).

    for n in max_ngram down to min_ngram:                       # draft
        if the last n tokens of (prompt + output) occurred earlier: drafts = the K tokens after it; break
    res = fire([last] + drafts, readout every row, fold=DEFERRED)   # verify
    keep the longest agreeing prefix + the target's own next token; ws.fold(1 + accepted)

With --tree W1,W2,.. (widths per depth) the drafts are a token tree instead (inferlet.spec.TokenTree): the
continuations of several earlier occurrences of the match, merged into a trie whose depth-d nodes keep at
most W_(d+1) children, verified in one tree window; the draft-length planner takes a chain instead when it
expects more tokens per millisecond from one.

With --device-verify (greedy) a round is one fire: its epilogue verifies and folds 1 + accepted on the
device, and an Argmax readout on every row tells this inferlet what was kept (sdk/inferlet/device_rounds.py).
Sampled runs, and n > 1 (forks of the prompt, inferlet.text.run_choices), use the host loop.
"""

from __future__ import annotations

from pydantic import Field

import inferlet
from inferlet.spec import Drafter, NgramIndex, Proposal, TokenTree, parse_shape, speculate, verify_rounds
from inferlet.text import MAX_DRAFT, MAX_NGRAM, DecodeArgs, TreeShape, run_choices


class Args(DecodeArgs):
    # the most a round drafts; the adaptive schedule picks fewer while lookups miss
    # (0 never drafts: the control of `pie bench speculation --control draft-length-0`)
    draft_length: int = Field(default=16, ge=0, le=MAX_DRAFT)
    max_ngram: int = Field(default=3, ge=1, le=MAX_NGRAM)
    min_ngram: int = Field(default=1, ge=1, le=MAX_NGRAM)
    device_verify: bool = False  # greedy: verify and fold in the fire's epilogue
    tree: TreeShape = None  # widths per depth, e.g. "4,2,1,1,1,1,1,1": draft a token tree of earlier occurrences


class LookupDrafter(Drafter):
    def __init__(self, args: Args):
        self.index = NgramIndex(args.max_ngram, args.min_ngram)
        self.widths = parse_shape(args.tree) if args.tree else None

    async def prefill(self, prompt: list[int]) -> None:
        self.index.extend(prompt)

    async def commit(self, new_tokens: list[int], seq: list[int], committed: int) -> None:
        self.index.extend(new_tokens)

    async def propose(self, seq: list[int], k: int) -> Proposal:
        if self.widths is not None:
            paths = self.index.draft_paths(len(self.widths), self.widths[0] * 2)
            tree = TokenTree.from_paths(paths, self.widths)
            if len(tree) and self.tree_pays(self.widths, len(tree)):
                return Proposal(tree=tree)
        return Proposal(self.index.draft(k))


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    if args.device_verify and args.n == 1 and args.tree is None:
        return await verify_rounds(model, args, LookupDrafter(args), args.draft_length)
    return await run_choices(model, args, lambda a, ws: speculate(model, a, LookupDrafter(a), a.draft_length, ws=ws))
