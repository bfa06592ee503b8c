"""How long (or how wide) to draft next round, given an acceptance estimate (inferlet.spec.acceptance) and a
pass-cost model (inferlet.spec.pass_cost): the count with the most expected tokens per millisecond,

    k* = argmax over 0 <= k <= max_k of  E[tokens | k] / round_cost(k)

Rules on top of it:
    drafting at all  decided on the slowly forgotten acceptance of the first draft (the later ones at their own),
                     asking every count, not one draft only (where a drafting round costs much more than a plain
                     one, one draft may lose where two win); while it does not pay, rounds are plain steps but a
                     one-draft probe every ``probe_every``-th, so the policy sees the drafter start hitting again;
    timed plain      while drafting pays, a plain round every ``TIMING_EVERY`` rounds (the first after
                     ``FIRST_TIMING``), so what drafting is weighed against is measured too;
    tree or chain    a token tree of ``rows`` draft rows is taken when its expected tokens per ms beat the best
                     chain's; never with recurrent state (the engine refuses tree fires there);
    chain depth      a head's chain (MTP, EAGLE: inferlet.spec.chained) is read in the fire before the round it
                     drafts for, before that fire's verdict, and each step of it is paid whatever the verdict:
                     ``chain_depth`` weighs each depth over the verdicts, each verdict's next round drafting at
                     most that depth.

Without a cost curve (a fixed schedule, or an engine that measured none) every round drafts ``max_k``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from .acceptance import AcceptanceEstimate
from .pass_cost import PassCostModel

# A plain round timed at least this often while drafting pays, and the first after this many drafting rounds.
TIMING_EVERY = 32
FIRST_TIMING = 8


class DraftPolicy:
    """Per-round draft counts for one run: ``next()`` before a round; ``observe()`` (or ``observe_tree``),
    ``observe_load`` and ``observe_time`` after it. ``estimate`` and ``cost`` are its two parts; the keyword
    arguments not its own go to them."""

    def __init__(
        self,
        max_k: int,
        pass_cost_ms: Sequence[float],
        draft_cost_ms: float = 0.0,
        *,
        probe_every: int = 8,
        decay: float = 0.5,
        state_decay: float = 0.95,
        slow_decay: float = 0.95,
        prior_alpha: float = 0.5,
        overhead_ms: float = 1.0,
        replay: bool = False,
        free_fold_rows: int = 0,
        prior: Sequence[float] = (),
        prior_weight: float = 3.0,
    ):
        self.max_k = max(0, max_k)
        self.estimate = AcceptanceEstimate(
            self.max_k,
            decay=decay,
            state_decay=state_decay,
            slow_decay=slow_decay,
            prior_alpha=prior_alpha,
            prior=prior,
            prior_weight=prior_weight,
        )
        self.cost = PassCostModel(
            pass_cost_ms, draft_cost_ms, overhead_ms=overhead_ms, replay=replay, free_fold_rows=free_fold_rows
        )
        self.probe_every = probe_every
        self.idle = 0  # plain rounds in a row the policy chose since the last drafting round
        self.since_plain = TIMING_EVERY - FIRST_TIMING  # drafting rounds since the last plain one
        self.timing = False  # this round is a timed plain one: its fire chains no head steps either

    @property
    def adaptive(self) -> bool:
        """False without a cost curve: then every round drafts ``max_k``."""
        return self.cost.measured

    def expected_tokens(self, k: int) -> float:
        return self.estimate.expected_tokens(k)

    def round_cost(self, k: int, steps: int | None = None) -> float:
        """ms a round of k drafts (``steps`` draft steps, default k) adds, replay included."""
        return self.cost.round_cost(k, steps, self.estimate.alphas(k) if self.cost.replay else ())

    def best(self) -> int:
        """k*: the draft count with the most expected tokens per ms now (0: a plain step is faster)."""
        best_k, best = 0, -1.0
        for k in range(self.max_k + 1):
            rate = self.expected_tokens(k) / self.round_cost(k)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def drafting_pays(self) -> bool:
        """Some count of drafts beats a plain step, the first draft kept at the slow acceptance (module docstring)."""
        plain = 1 / self.round_cost(0)
        first, total, survive = self.estimate.slow_alpha, 1.0, 1.0
        for k in range(1, max(1, self.max_k) + 1):
            survive *= first if k == 1 else self.estimate.position_alpha(k - 1)
            total += survive
            if total / self.round_cost(k) > plain:
                return True
        return False

    def choose(self) -> tuple[int, bool]:
        """The count ``next()`` asks for now, and whether it is a timed plain round; counts as nothing."""
        if not self.adaptive or self.max_k == 0:
            return self.max_k, False
        if self.drafting_pays():
            if self.since_plain >= TIMING_EVERY:
                return 0, True
            return max(1, self.best()), False
        probe = self.idle + 1 >= self.probe_every
        return (1 if probe else 0), False

    def upcoming(self) -> int:
        """What ``next()`` would return if asked now, without counting as asking."""
        return self.choose()[0]

    def will_draft(self) -> bool:
        return self.upcoming() > 0

    def next(self) -> int:
        """Drafts to ask for this round: k*, a probe, or 0 for a plain (or timed plain) round."""
        k, self.timing = self.choose()
        if self.adaptive and self.max_k:
            self.idle = 0 if k else self.idle + 1
            self.since_plain = self.since_plain + 1 if k else 0
        return k

    def use_tree(self, widths: list[int], rows: int, draft_fires: int = 0) -> bool:
        """Whether a tree of ``widths`` (``rows`` draft rows, ``draft_fires`` drafter steps) is expected to emit
        more tokens per ms than the best chain; always without a curve, never with recurrent state."""
        if self.cost.replay:
            return False
        if not self.adaptive:
            return True
        k = self.best()
        chain = self.expected_tokens(k) / self.round_cost(k)
        tree = self.estimate.tree_expected_tokens(widths) / self.cost.round_cost(rows, draft_fires)
        return tree >= chain

    def after_verdicts(self, proposed: int) -> list[tuple[float, DraftPolicy]]:
        """Each verdict of the round being verified (``proposed`` chain drafts): its probability and the policy
        after observing it (the cost model is shared: a verdict does not change it)."""
        outcomes = []
        for p, estimate in self.estimate.verdicts(proposed):
            after = copy.copy(self)
            after.estimate = estimate
            outcomes.append((p, after))
        return outcomes

    def chain_depth(self, proposed: int) -> int:
        """How many drafts a head should chain in the fire of the round being verified (``proposed`` chain
        drafts), for the next round: the depth with the most expected tokens per ms over this round's verdicts,
        each step priced whatever the verdict. While drafting does not pay under any verdict, what a probe needs."""
        if not self.adaptive or self.max_k == 0 or proposed <= 0:
            return 0 if self.timing else self.upcoming()
        outcomes = self.after_verdicts(proposed)
        wants = [after.upcoming() for _, after in outcomes]
        if not any(after.drafting_pays() for _, after in outcomes):
            return max(wants)
        # at least one wherever every verdict drafts: a round the policy drafts in must have a draft to verify
        best_d, best = 0, -1.0
        for depth in range(1 if min(wants) > 0 else 0, max(wants) + 1):
            rate = 0.0
            for (p, after), want in zip(outcomes, wants):
                k = min(depth, want)
                rate += p * after.expected_tokens(k) / after.round_cost(k, depth)
            if rate > best:
                best_d, best = depth, rate
        return best_d

    def most_next(self, proposed: int) -> int:
        """The most drafts ``next()`` could ask for after the round being verified, whatever its verdict."""
        if not self.adaptive or self.max_k == 0 or proposed <= 0:
            return self.upcoming()
        return max(after.upcoming() for _, after in self.after_verdicts(proposed))

    def observe(self, proposed: int, accepted: int) -> None:
        """A verified chain round: ``accepted`` of ``proposed`` drafts kept."""
        self.estimate.observe(proposed, accepted)

    def observe_tree(self, depth: int, accepted: int) -> None:
        """A verified tree round of ``depth`` levels whose kept path is ``accepted`` nodes deep."""
        self.estimate.observe_tree(depth, accepted)

    def observe_load(self, step_rows: int, own_rows: int) -> None:
        self.cost.observe_load(step_rows, own_rows)

    def observe_time(self, elapsed_ms: float, step_rows: int, steps: int) -> None:
        """A round's wall time, in a step of ``step_rows`` rows, after ``steps`` draft steps (a chained head's:
        the steps its fire read, ``Drafter.draft_steps``)."""
        if self.cost.observe_time(elapsed_ms, step_rows, steps):
            self.since_plain = 0  # also a round the drafter had nothing for (a lookup that found no match)
