"""Speculative rounds verified on the device (greedy; docs/architecture.md, "Programs and channels"): the
accept rule is an epilogue program, so a round's fold is decided where its logits are, with no message to
settle it.

    target = argmax(logits of every window row)        # (k+1,) the target's greedy token after each row
    n = cumprod(drafts == target[:k]).sum()            # accepted drafts: the longest agreeing prefix
    fold(n + 1)                                        # commit `last` and the accepted drafts only

Two kinds of rounds use it, each driven by the one round loop (inferlet.spec.rounds.drive):
    verify_rounds   drafts come from the host (prompt lookup; the drafting of inferlet.spec.drafting); each round
                    is one fire whose epilogue verifies and folds and whose Argmax readout tells the host the
                    target tokens (n = the fold - 1).
    mtp_run_ahead   the whole loop stays in the engine (inferlet.spec.run_ahead): the window [last, d1..dk] comes
                    from a channel; the epilogue verifies, folds, writes the round's target tokens to an output
                    cell (entries past n are -1) and the next window [target[n], MTP drafts at row n] to the
                    input channel; only row n's MTP chain is computed (the host loop reads one from every row).
                    The host replays the output cells as its rounds (``RunAheadRounds``): the tokens, and the
                    exact stats of the host loop; once the run ends at the model's capacity, plain steps.

Both run greedy only; a sampled run, or one whose sampler needs every step's logits, uses host-verified rounds
(``speculate``).
"""

from __future__ import annotations

from ..channels import Channel
from ..forward import ForwardPass
from ..model import Model
from ..programs import Builder, Program, Sym, concat, trace, where
from ..readouts import Argmax
from ..text.arguments import DecodeArgs
from .drafter import Drafter, Proposal
from .drafting import drive_rounds
from .host_rounds import speculate
from .rounds import Rounds, Run, drive
from .run_ahead import RunAhead
from .verify import VerifyResult, verify_greedy


def accept(p: Builder, k: int) -> tuple[Sym, Sym]:
    """Traces the greedy accept rule over a window of ``k`` drafts; folds n + 1. Returns (target (k+1,), n)."""
    target = p.logits(range(k + 1)).argmax()
    drafts = p.tokens(k + 1)[1:]
    n = (drafts == target[:k]).cumprod().sum()
    p.fold(n + 1)
    return target, n


def on_device(args: DecodeArgs) -> str | None:
    """Why a run may not verify on the device; None when it may."""
    if args.temperature != 0:
        return "sampled"
    reasons = args.fallback_reasons()
    return reasons[0] if reasons else None


async def host_loop(model: Model, args: DecodeArgs, drafter: Drafter, k: int, why: str) -> dict:
    """The host-driven loop, noting in the stats why the device path was not taken."""
    res = await speculate(model, args, drafter, k)
    res["stats"]["device"] = f"host loop: {why} runs are verified on the host"
    return res


# ---- host drafts, device verifies: one fire a round --------------------------------------------------------


async def verify_rounds(model: Model, args: DecodeArgs, drafter: Drafter, k: int) -> dict:
    """``speculate``'s round loop (greedy) with the verify and the fold in one fire's epilogue."""
    if (why := on_device(args)) is not None:
        return await host_loop(model, args, drafter, k, why)
    run = Run.start(model, args)
    stats, ws = run.stats, run.ws
    programs: dict[int, Program] = {}  # drafts → the accept rule over that window

    async def step(window: list[int], proposal: Proposal) -> list[int]:
        assert proposal.tree is None, "device rounds verify chains"
        drafts = proposal.tokens
        fp = ForwardPass(ws).embed(window)
        m = len(drafts)
        if m == 0:  # the prefill or a plain step: read the last row, fold all
            fp.readout([len(window) - 1], Argmax()).fold(len(window))
        else:
            if m not in programs:
                programs[m] = trace(model, lambda p: accept(p, m))
            fp.readout(range(m + 1), Argmax()).epilogue(programs[m])
        res = await run.fire(fp)
        tokens = res.tokens
        assert tokens is not None  # the Argmax readout
        if m == 0:
            return [int(tokens[0])]
        v = verify_greedy(drafts, tokens)
        assert res.fold == v.accepted + 1, "the epilogue and the host disagree on the accepted drafts"
        stats.record(v)
        return v.tokens

    await drive_rounds(run, drafter, k, step, [])
    result = await run.finish()
    result["stats"]["device"] = "verify"
    return result


# ---- MTP run-ahead: the whole loop in the engine --------------------------------------------------------------


def mtp_first(p: Builder, last: int, k: int, inp: Channel, out: Channel) -> None:
    """The prefill's epilogue: the first token, and the first window [t0, MTP drafts from the last row]."""
    t0 = p.logits([last]).argmax()  # (1,)
    drafts = p.mtp_logits([last], k).argmax().reshape(k)
    p.put(inp, concat([t0, drafts], dim=0))
    p.put(out, concat([t0, p.const([-1] * k)], dim=0))


def mtp_round(p: Builder, k: int, inp: Channel, out: Channel) -> None:
    """One round: verify and fold, emit target[0..n] (then -1s), feed [target[n], MTP drafts at row n]."""
    target, n = accept(p, k)
    p.put(out, where(p.iota(k + 1) <= n, target, -1))
    drafts = p.mtp_logits_at(range(k + 1), k, n).argmax()  # (k,) the chain from row n only
    p.put(inp, concat([target.gather(0, n.reshape(1)), drafts], dim=0))


def replay(run: Run, cell: list[int], k: int) -> list[int]:
    """What the host loop does with one device round: its stats, and the tokens it emits. Near max_tokens
    the host proposes min(k, room - 1) drafts (none at room 1) and keeps the agreeing prefix of those; the
    device always verified k, so the host's round is the device's, shortened."""
    targets = [t for t in cell if t >= 0]  # target[0..n]
    n = len(targets) - 1
    if run.out.room <= 1:
        run.stats.skip("last_token")
        return targets[:1]
    proposed = min(k, run.out.room - 1)
    accepted = min(n, proposed)
    v = VerifyResult(targets[: accepted + 1], accepted, proposed)
    run.stats.record(v)
    return v.tokens


class RunAheadRounds(Rounds):
    """The rounds of an MTP run-ahead as the host sees them: each output cell replayed (``replay``), taken a
    batch at a time; once the run has ended at the model's capacity, plain steps (module docstring)."""

    def __init__(self, run: Run, ra: RunAhead, k: int):
        self.run, self.ra, self.k = run, ra, k
        self.pending: list[list[int]] = []  # cells taken and not yet replayed
        self.reason: str | None = None  # why the run-ahead ended, once it has

    async def prefill(self) -> list[int]:
        run, ra, k = self.run, self.ra, self.k
        last = len(run.prompt) - 1
        await ra.launch(
            run.prompt,
            lambda p: mtp_first(p, last, k, ra.inp, ra.out),
            lambda p: mtp_round(p, k, ra.inp, ra.out),
            budget_tokens=run.args.max_tokens - 1,
        )
        return (await ra.first())[:1]

    async def next(self) -> list[int] | None:
        if not self.pending and self.reason is None:
            self.pending = (await self.ra.cells())[::-1]
            if not self.pending:
                self.reason = await self.ra.stop()
        if self.pending:
            return replay(self.run, self.pending.pop(), self.k)
        if self.reason != "capacity":
            return None
        out = self.run.out  # a verify window no longer fits: plain steps
        self.run.stats.skip("last_token" if out.room <= 1 else "near_capacity")
        fp = ForwardPass(self.run.ws).embed([out.ids[-1]]).readout([0], Argmax()).fold(1)
        tokens = (await fp.submit()).tokens
        assert tokens is not None  # the Argmax readout
        return [int(tokens[0])]

    async def end(self) -> None:
        if self.reason is None:
            self.reason = await self.ra.stop()

    async def close(self) -> None:
        await self.ra.close()


async def mtp_run_ahead(model: Model, args: DecodeArgs, drafter: Drafter, k: int) -> dict:
    """The MTP loop as a run-ahead; falls back to ``speculate`` for what it does not run (module docstring)."""
    why = on_device(args) or ("no_draft" if k == 0 else None)
    if why is not None:
        return await host_loop(model, args, drafter, k, why)
    run = Run.start(model, args)
    await drive(run, RunAheadRounds(run, await RunAhead.open(run.ws, k + 1), k))
    result = await run.finish()
    result["stats"]["device"] = "run_ahead"
    return result
