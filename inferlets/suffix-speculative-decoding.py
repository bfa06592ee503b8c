"""suffix-speculative-decoding: drafts from what followed the same words before, in this request or earlier ones.

Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications"
(arXiv:2411.04975; vLLM ships it through arctic-inference); Leviathan et al. 2023 / Chen et al. 2023
(verification). Two suffix indexes (inferlet.spec.SuffixIndex): this run's prompt + output, and a store of earlier
runs' outputs shared by the runs of this process (``Model.shared``), bounded by --store-tokens (LRU).

    for index in (this run's, the shared store):                                 # draft
        L, occ = the longest suffix of (prompt + output) that occurred in index, and where
        cand[index] = trie of what followed occ, prob(node) = count(node) / |occ|, nodes with prob >= min_prob
    c = the cand with the higher score (Σ probs: the expected drafts kept)
    drafts = c's most frequent path, at most min(k, spec_factor * L) deep      # k: the planner's (pass costs)
           (--tree-rows R: c's best R nodes as a token tree, if the planner expects more tokens/ms from it)
    res = fire([last] + drafts, readout every row, fold=DEFERRED)               # verify, as cacheback
    keep the longest agreeing prefix + the target's own next token; ws.fold(1 + accepted)
    at the end: the store adds this run's output (--save-index FILE writes the store)

--suffix-index FILE starts the store from a static index (``python -m inferlet.spec.suffix_index build CORPUS FILE
--tokenizer tokenizer.json``). Sampled runs verify the point-mass drafts exactly (speculative sampling; a
tree's children by the target's draw). n > 1 runs a choice per fork (inferlet.text.run_choices).
"""

from __future__ import annotations

import math

from pydantic import Field

import inferlet
from inferlet import Model
from inferlet.kv import CACHE_SALT
from inferlet.spec import MAX_TREE_NODES, Candidates, Drafter, Proposal, SuffixIndex, TokenTree, speculate
from inferlet.text import MAX_DRAFT, MAX_MATCH, DecodeArgs, run_choices


class Args(DecodeArgs):
    # the most a round drafts; the planner and the match length pick fewer
    # (0 never drafts: the control of `pie bench speculation --control draft-length-0`)
    draft_length: int = Field(default=16, ge=0, le=MAX_DRAFT)
    min_match: int = Field(default=2, ge=1, le=MAX_MATCH)  # tokens a match needs at least
    max_match: int = Field(default=32, ge=1, le=MAX_MATCH)  # the longest suffix matched
    min_prob: float = Field(default=0.1, ge=0.0, le=1.0)  # a draft node's least frequency among the occurrences
    spec_factor: float = Field(default=1.0, gt=0.0, le=64.0)  # a round drafts at most spec_factor * match length tokens
    tree_rows: int = Field(default=0, ge=0, le=MAX_TREE_NODES)  # > 0: draft a token tree of up to this many nodes
    store_tokens: int = Field(default=1_000_000, ge=0, le=4_000_000)  # the shared store's bound in tokens; 0: no store
    suffix_index: str | None = None  # a static index file the store starts from
    save_index: str | None = None  # write the store here when the run ends


def shared_store(model: Model, args: Args) -> SuffixIndex | None:
    """The store of earlier outputs the runs of this process share (one per model, bound, start file and cache
    salt: under `pie serve` each API key's runs share a store of their own, so no key drafts from another's
    outputs)."""
    if args.store_tokens == 0:
        return None
    salt = CACHE_SALT.get() or ""
    key = f"suffix-store:{salt}:{args.min_match}:{args.store_tokens}:{args.suffix_index or ''}"

    def make() -> SuffixIndex:
        if args.suffix_index:
            return SuffixIndex.load(args.suffix_index, args.min_match, args.store_tokens)
        return SuffixIndex(args.min_match, args.store_tokens)

    return model.shared(key, make)


class SuffixDrafter(Drafter):
    def __init__(self, args: Args, store: SuffixIndex | None, counts: dict[str, int]):
        self.args = args
        self.local = SuffixIndex(args.min_match)
        self.doc = self.local.add()
        self.store = store
        self.output: list[int] = []
        self.counts = counts  # rounds drafted from each index, summed over the run's choices

    async def prefill(self, prompt: list[int]) -> None:
        self.local.extend(self.doc, prompt)

    async def commit(self, new_tokens: list[int], seq: list[int], committed: int) -> None:
        self.local.extend(self.doc, new_tokens)
        self.output += new_tokens

    def _best(self, seq: list[int], k: int) -> tuple[str, Candidates]:
        a = self.args
        rows = a.tree_rows or 4 * k  # a chain: room for the siblings of its nodes, taken best first
        found = []
        for name, index in (("prompt", self.local), ("store", self.store)):
            if index is not None:
                found.append((name, index.candidates(seq, k, rows, a.min_prob, a.max_match)))
        return max(found, key=lambda f: f[1].score)

    async def propose(self, seq: list[int], k: int) -> Proposal:
        name, cand = self._best(seq, k)
        depth = min(k, math.ceil(self.args.spec_factor * cand.match_len))
        if not len(cand.tree) or depth <= 0:
            return Proposal()
        self.counts[name] += 1
        if self.args.tree_rows:
            tree = cand.tree.pruned(depth, self.args.tree_rows)
            if not tree.is_chain() and self.tree_pays(widths(tree), len(tree)):
                return Proposal(tree=tree)
        return Proposal(cand.chain()[0][:depth])

    async def close(self) -> None:
        if self.store is not None and self.output:
            self.store.add(self.output)
            if self.args.save_index:
                self.store.save(self.args.save_index)


def widths(tree: TokenTree) -> list[int]:
    """The most children a node at each depth has (depth 1: the root's), the tree's shape for the planner."""
    out: list[int] = []
    for node in [-1, *range(len(tree))]:
        d = 0 if node == -1 else tree.depth(node)
        n = len(tree.children(node))
        if n:
            out.extend([0] * (d + 1 - len(out)))
            out[d] = max(out[d], n)
    return out


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    store = shared_store(model, args)
    counts = {"prompt": 0, "store": 0}
    res = await run_choices(
        model, args, lambda a, ws: speculate(model, a, SuffixDrafter(a, store, counts), a.draft_length, ws=ws)
    )
    res["suffix"] = {
        "drafted_from": counts,
        "store_documents": len(store) if store is not None else 0,
        "store_tokens": store.tokens if store is not None else 0,
    }
    if isinstance(res.get("speculation"), dict):  # `pie serve` answers it as the response's speculation object
        res["speculation"]["drafted_from"] = dict(counts)
    return res
