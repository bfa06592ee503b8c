"""A custom speculative inferlet: a bigram drafter, built in the three steps of docs/writing-inferlets.md.

The drafter guesses that a token is followed by what followed it most often so far in this run (prompt and
output): from the last token it chains up to k such guesses. The target verifies them in one fire by the SDK's
speculative rule (inferlet.spec.verify), so greedy output equals plain decoding's token for token.

    pie run examples/bigram_drafter.py -- --prompt "1, 2, 3, 1, 2, 3, 1, 2," --max-tokens 32
    pie run examples/bigram_drafter.py -- --prompt "..." --by-hand      # step 2's hand-written loop (greedy)
"""

from __future__ import annotations

from collections import Counter, defaultdict

import inferlet
from inferlet.spec import Drafter, Proposal, speculate, verify_greedy
from inferlet.text import DecodeArgs


# --8<-- [start:table]
class BigramTable:
    """For each token, how often each other token followed it."""

    def __init__(self) -> None:
        self.follow: defaultdict[int, Counter[int]] = defaultdict(Counter)

    def extend(self, previous: int | None, tokens: list[int]) -> None:
        """Counts the pairs in ``tokens``, and the pair (``previous``, first of ``tokens``)."""
        pairs = zip([previous, *tokens], tokens) if previous is not None else zip(tokens, tokens[1:])
        for a, b in pairs:
            self.follow[a][b] += 1

    def draft(self, last: int, k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``last``: each the most frequent follower of the one before."""
        out: list[int] = []
        while len(out) < k and self.follow[last]:
            last = self.follow[last].most_common(1)[0][0]
            out.append(last)
        return out


# --8<-- [end:table]


# --8<-- [start:args]
class Args(DecodeArgs):  # --prompt, --max-tokens, --temperature, --stop, --chat, ... as text-completion takes
    draft_length: int = 8  # the most a round drafts
    by_hand: bool = False  # run step 2's hand-written greedy loop instead of the SDK's round loop


# --8<-- [end:args]


# --8<-- [start:by_hand]
async def by_hand(model: inferlet.Model, args: Args) -> dict:
    """Greedy speculation written out: draft, verify in one fire, fold what was kept."""
    prompt = model.tokenizer.encode_prompt(args.prompt)
    table = BigramTable()
    table.extend(None, prompt)
    ws = model.working_set()
    await inferlet.ForwardPass(ws).embed(prompt[:-1]).submit()  # prefill all but the last prompt token
    last, out, rounds, accepted = prompt[-1], [], 0, 0
    while len(out) < args.max_tokens:
        drafts = table.draft(last, args.draft_length)
        window = [last, *drafts]  # row i's argmax judges drafts[i]; the last row gives one more token
        fp = inferlet.ForwardPass(ws).embed(window)
        fp.readout(range(len(window)), inferlet.Argmax()).fold(inferlet.DEFERRED)
        target = (await fp.submit()).tokens  # the target's argmax at each row of the window
        assert target is not None  # (the Argmax readout asked for it)
        verdict = verify_greedy(drafts, target)  # the kept drafts, then the target's own next token
        await ws.fold(1 + verdict.accepted)  # commit `last` and the kept drafts; later rows are overwritten
        table.extend(last, verdict.tokens)
        out += verdict.tokens
        last, rounds, accepted = out[-1], rounds + 1, accepted + verdict.accepted
    await ws.release()
    out = out[: args.max_tokens]
    text = model.tokenizer.decode(out)
    return {"text": text, "token_ids": out, "stats": {"rounds": rounds, "accepted": accepted}}


# --8<-- [end:by_hand]


# --8<-- [start:drafter]
class BigramDrafter(Drafter):
    """The table as a ``Drafter``: the SDK's round loop calls these around each verify fire."""

    def __init__(self) -> None:
        self.table = BigramTable()
        self.last: int | None = None

    async def prefill(self, prompt: list[int]) -> None:
        self.table.extend(None, prompt)
        self.last = prompt[-1]

    async def propose(self, seq: list[int], k: int) -> Proposal:
        return Proposal(self.table.draft(seq[-1], k))  # point-mass drafts: q is one-hot

    async def commit(self, new_tokens: list[int], seq: list[int], committed: int) -> None:
        self.table.extend(self.last, new_tokens)
        self.last = seq[-1]


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    if args.by_hand:
        return await by_hand(model, args)
    return await speculate(model, args, BigramDrafter(), args.draft_length)


# --8<-- [end:drafter]
