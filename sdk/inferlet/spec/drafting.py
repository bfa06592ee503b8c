"""The drafting half of a round, shared by host-verified and device-verified rounds (``DraftRounds``): per
round, choose the drafts (or say in ``stats.skipped`` why there are none), fire them through the verifying
``step``, and tell the draft-length policy what the round kept and cost.

    k = policy.next()                                    # 0: a plain step (``draft_cost``)
    proposal = drafter.propose(seq, min(k, room - 1))    # [] → a plain step (``no_draft``)
    tokens = step([last] + proposal.tokens, proposal)    # the verifying fire: emitted tokens
    policy.observe(proposal, kept); policy.observe_load(...); policy.observe_time(round's wall ms, ...)

Terms:
    room          tokens the output may still take (max_tokens minus those emitted);
    plain step    a round without drafts; its reason is counted in ``stats.skipped`` (``no_draft``: the drafter
                  had none; ``draft_cost``: the policy expected drafting to be slower; ``last_token``: only the
                  target's own token is left to emit; ``near_capacity``: a full verify window would not fit);
    fallback      reasons a run never speculates (its sampler needs every step's logits; a model that folds
                  in granules): every round is a plain step and counts them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from .draft_policy import DraftPolicy
from .drafter import Drafter, Proposal
from .rounds import Rounds, Run, drive

# step(window, proposal) fires ``window`` (its last proposal.tokens rows are a chain's drafts; a tree proposal's
# window is [last] and the tree's rows follow it) and returns the emitted tokens
Step = Callable[[list[int], Proposal], Awaitable[list[int]]]


def policy_for(run: Run, drafter: Drafter, k: int) -> DraftPolicy:
    """The run's draft-length policy: up to ``k`` drafts a round, priced by the engine's pass-cost curve with
    ``draft_schedule=adaptive``, always ``k`` with ``fixed``."""
    model = run.model
    costs = model.pass_cost_ms if run.args.draft_schedule == "adaptive" else []
    return DraftPolicy(
        k,
        costs,
        drafter.draft_cost_ms,
        replay=model.recurrent,
        free_fold_rows=model.per_row_states,
        prior=drafter.acceptance_prior,
    )


def fit_tree(proposal: Proposal, depth: int, rows: int) -> Proposal:
    """A tree proposal cut to what the round may use: no node deeper than ``depth`` (the output's room less the
    target's own token), at most ``rows`` draft rows (the model's capacity). A tree that is a chain becomes one."""
    tree = proposal.tree
    if tree is None:
        return proposal
    tree = tree.pruned(depth, rows)
    if not len(tree):
        return Proposal()
    if tree.is_chain() and not tree.child_q:
        return Proposal(tree.chain())
    return Proposal(tree=tree)


class DraftRounds(Rounds):
    """Rounds whose drafts come from a ``Drafter`` and are verified by ``step`` (module docstring)."""

    def __init__(self, run: Run, drafter: Drafter, k: int, step: Step, fallback: list[str]):
        self.run, self.drafter, self.k, self.step = run, drafter, k, step
        self.policy = drafter.planner = policy_for(run, drafter, k)
        if run.model.state_granule > 1:  # every fire folds all its rows: no round can leave a draft out
            fallback = [*fallback, "granule"]
        self.fallback = fallback
        self.seq = list(run.prompt)
        self.t_round = 0.0

    async def prefill(self) -> list[int]:
        run, prompt = self.run, self.run.prompt
        window = prompt[run.ws.committed :]  # a fork holds all but the prompt's last token already
        if self.fallback:
            new = await self.step(window, Proposal())
        else:
            new, _ = await asyncio.gather(self.step(window, Proposal()), self.drafter.prefill(prompt))
        self.t_round = time.perf_counter()
        return new

    async def taken(self, tokens: list[int]) -> None:
        self.seq += tokens
        await self.drafter.commit(tokens, self.seq, self.run.ws.committed)

    async def propose(self) -> Proposal:
        """This round's drafts, or none with the reason counted."""
        run, k, stats = self.run, self.k, self.run.stats
        out, model, ws = run.out, run.model, run.ws
        if self.fallback:
            for reason in self.fallback:
                stats.skip(reason)
        elif out.room <= 1:
            stats.skip("last_token")
        elif ws.committed + 1 + k > model.max_positions:
            stats.skip("near_capacity")
        elif (want := self.policy.next()) == 0 and k > 0:
            stats.skip("draft_cost")
        else:
            t = time.perf_counter()
            proposal = await self.drafter.propose(self.seq, min(want, out.room - 1))
            proposal = fit_tree(proposal, out.room - 1, model.max_positions - ws.committed - 1)
            run.draft_ms.append((time.perf_counter() - t) * 1e3)
            if not proposal.rows:
                stats.skip("no_draft")
            return proposal
        return Proposal()

    async def next(self) -> list[int]:
        proposal = await self.propose()
        new = await self.step([self.seq[-1]] + proposal.tokens, proposal)
        policy, ws = self.policy, self.run.ws
        if proposal.tree is not None:
            policy.observe_tree(proposal.tree.max_depth, len(new) - 1)
        else:
            policy.observe(len(proposal.tokens), len(new) - 1)
        policy.observe_load(ws.step_rows, 1 + proposal.rows)
        t_now = time.perf_counter()
        policy.observe_time((t_now - self.t_round) * 1e3, ws.step_rows, self.drafter.draft_steps(proposal))
        self.t_round = t_now
        return new

    async def end(self) -> None:
        cost, run = self.policy.cost, self.run
        run.overhead_ms = cost.overhead_ms if cost.measured and cost.residuals else None
        run.plain_overhead_ms = cost.overhead(0) if cost.measured and cost.plain_residuals else None

    async def close(self) -> None:
        await self.drafter.close()


async def drive_rounds(run: Run, drafter: Drafter, k: int, step: Step, fallback: list[str]) -> None:
    """The round loop (inferlet.spec.rounds.drive) with a drafter's rounds verified by ``step``: up to ``k``
    drafts a round; ``fallback`` (reasons a run never speculates) makes every round a plain step."""
    await drive(run, DraftRounds(run, drafter, k, step, fallback))
