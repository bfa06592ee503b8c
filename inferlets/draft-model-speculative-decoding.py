"""draft-model-speculative-decoding: a small model with the target's tokenizer drafts, the target verifies.

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling".

    draft ws: feed the tokens it lacks, then k times: d_i ~ q_i (argmax when greedy); embed d_i
    res = fire(target ws, [last, d_1..d_k], readout every row, fold=DEFERRED)
    v = verify(drafts, p, q)          # accept with min(1, p/q), resample max(0, p - q) on rejection
    target: ws.fold(1 + v.accepted);  draft ws: truncate to the target's committed rows
"""

from __future__ import annotations

import numpy as np

import inferlet
from inferlet.decode import DecodeArgs, Drafter, Proposal, Verifier, draw, speculate


class Args(DecodeArgs):
    draft: str  # a model in the store, served by the same engine
    draft_length: int = 4


class ModelDrafter(Drafter):
    """Drafts with a second model in its own working set, kept at the target's committed rows."""

    def __init__(self, model: inferlet.Model, verifier: Verifier):
        self.ws = model.working_set()
        self.verifier = verifier
        # a draft is one 1-row pass of the draft model plus its round trip (for the draft-length planner)
        self.draft_cost_ms = model.pass_cost_ms[0] + 1.0 if model.pass_cost_ms else 0.0

    async def prefill(self, prompt: list[int]) -> None:
        if len(prompt) > 1:
            await inferlet.ForwardPass(self.ws).embed(prompt[:-1]).submit()  # its last token comes with a round

    async def commit(self, new_tokens: list[int], seq: list[int], committed: int) -> None:
        if self.ws.committed > committed:  # rows of drafts the target rejected
            await self.ws.truncate(committed)

    async def propose(self, seq: list[int], k: int) -> Proposal:
        feed = seq[self.ws.committed:]  # the rows the draft lacks, ending with `last`
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        for _ in range(k):
            fp = inferlet.ForwardPass(self.ws).embed(feed)
            fp.readout([len(feed) - 1], self.verifier.kind())
            res = await fp.submit()
            if self.verifier.greedy:
                drafts.append(int(res.tokens[0]))
            else:
                qs.append(res.probs[0])
                drafts.append(draw(qs[-1], self.verifier.rng))
            feed = [drafts[-1]]
        return Proposal(drafts, np.stack(qs) if qs else None)

    async def close(self) -> None:
        await self.ws.release()


@inferlet.main
async def main(args: Args) -> dict:
    target, draft = inferlet.model(), inferlet.model(args.draft)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft {draft.name} has vocab {draft.vocab_size}, target {target.vocab_size}")
    verifier = Verifier(args)
    return await speculate(target, args, ModelDrafter(draft, verifier), args.draft_length, verifier)
