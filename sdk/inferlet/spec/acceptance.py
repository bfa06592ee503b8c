"""How often a drafter's drafts are kept: the acceptance estimate a draft-length policy plans with.

Leviathan et al. 2023, §3.1: if each draft is kept with probability α given that the ones before it were, a
round of k drafts emits (1 - α^(k+1)) / (1 - α) tokens on average. Drafters are not that uniform (an MTP head's
second draft is kept far less often than its first; a prompt lookup that matched once tends to keep matching),
so the estimate keeps a conditional acceptance α_i per draft position and a round of k drafts emits
1 + Σ_{j<=k} Π_{i<=j} α_i tokens. Terms:

    pooled α       kept drafts over geometric trials (kept + rejected), forgotten fast (``decay``);
    recent α_i     position i's counts over the last few rounds, with one round of the pooled α as prior;
    α_i            position i's counts after a round that ended as the last one did (all its drafts kept, or
                   one rejected: a lookup's hits and misses come in runs), forgotten slowly (``state_decay``),
                   with one round of recent α_i as prior, and the drafter's training record (``prior``: held-out
                   acceptance per position) worth ``prior_weight`` rounds that are never forgotten;
    slow α         the pooled counts forgotten slowly (``slow_decay``): whether drafting pays at all is decided
                   on it, so two unlucky rounds do not stop a drafter near break-even;
    β_d            a token tree's acceptance at depth d+1 given depth d was kept, with the prior
                   1 - (1 - α_d)^w_d (one of the w_d candidates right, each as likely as the chain's draft).
"""

from __future__ import annotations

from collections.abc import Sequence

CAP = 0.999  # no estimate is certain: a round of k drafts at α = 1 would be priced as free tokens


class AcceptanceEstimate:
    """Per-position acceptance of one run's drafter, learnt from its verdicts (module docstring)."""

    def __init__(
        self,
        max_k: int,
        *,
        decay: float = 0.5,
        state_decay: float = 0.95,
        slow_decay: float = 0.95,
        prior_alpha: float = 0.5,
        prior: Sequence[float] = (),
        prior_weight: float = 3.0,
    ):
        self.max_k = max(0, max_k)
        self.decay, self.state_decay, self.slow_decay = decay, state_decay, slow_decay
        # [i]: the record's acceptance of draft i+1 given 1..i kept (its last entry fills the positions it lacks)
        self.prior = [prior[min(i, len(prior) - 1)] for i in range(self.max_k)] if prior else []
        self.prior_weight = prior_weight
        if self.prior:
            prior_alpha = self.prior[0]
        self.hits, self.trials = prior_alpha, 1.0  # discounted kept drafts, and kept drafts + rejections
        self.slow_hits, self.slow_trials = prior_alpha, 1.0  # the same counts, forgotten slowly
        self.pos_hits = [0.0] * self.max_k  # [i]: discounted rounds that kept draft i+1
        self.pos_trials = [0.0] * self.max_k  # [i]: discounted rounds that verified draft i+1 after keeping i
        self.full = False  # the last drafting round kept all its drafts (the state the α_i are conditioned on)
        # [full][i]: per-position counts of the rounds that followed a rejection (0) or a full round (1)
        self.state_hits = [[0.0] * self.max_k for _ in range(2)]
        self.state_trials = [[0.0] * self.max_k for _ in range(2)]
        self.tree_hits: list[float] = []  # [d]: discounted tree rounds whose kept path reached depth d+1
        self.tree_trials: list[float] = []  # [d]: discounted tree rounds that tried depth d+1

    def copy(self) -> AcceptanceEstimate:
        """An estimate that observes apart from this one."""
        other = object.__new__(AcceptanceEstimate)
        other.__dict__.update(self.__dict__)
        other.pos_hits, other.pos_trials = list(self.pos_hits), list(self.pos_trials)
        other.state_hits = [list(h) for h in self.state_hits]
        other.state_trials = [list(t) for t in self.state_trials]
        other.tree_hits, other.tree_trials = list(self.tree_hits), list(self.tree_trials)
        return other

    @property
    def alpha(self) -> float:
        """Pooled acceptance of a draft given the ones before it were kept."""
        return self.hits / self.trials

    @property
    def slow_alpha(self) -> float:
        """The pooled acceptance, forgotten slowly."""
        return self.slow_hits / self.slow_trials

    def recent_alpha(self, i: int) -> float:
        """Acceptance of draft i+1 given 1..i kept, over the last few rounds whatever their state."""
        return min((self.pos_hits[i] + self.alpha) / (self.pos_trials[i] + 1.0), CAP)

    def position_alpha(self, i: int) -> float:
        """α_i: acceptance of draft i+1 given 1..i kept, after a round that ended as the last one did."""
        hits, trials = self.state_hits[self.full][i], self.state_trials[self.full][i]
        if self.prior:
            hits, trials = hits + self.prior_weight * self.prior[i], trials + self.prior_weight
        return min((hits + self.recent_alpha(i)) / (trials + 1.0), CAP)

    def alphas(self, k: int) -> list[float]:
        """α_0..α_{k-1}."""
        return [self.position_alpha(i) for i in range(k)]

    def expected_tokens(self, k: int) -> float:
        """1 (the target's own token) + the expected number of k drafts kept."""
        total, survive = 1.0, 1.0
        for i in range(k):
            survive *= self.position_alpha(i)
            total += survive
        return total

    def tree_alpha(self, d: int, width: int) -> float:
        """β_d for a tree with ``width`` candidates at depth d+1, with one round's worth of prior."""
        alpha = self.position_alpha(min(d, self.max_k - 1)) if self.max_k else self.alpha
        prior = 1.0 - (1.0 - alpha) ** width
        hits = self.tree_hits[d] if d < len(self.tree_hits) else 0.0
        trials = self.tree_trials[d] if d < len(self.tree_trials) else 0.0
        return min((hits + prior) / (trials + 1.0), CAP)

    def tree_expected_tokens(self, widths: Sequence[int]) -> float:
        """1 + the expected depth of the kept path of a tree of ``widths`` (candidates per depth)."""
        total, survive = 1.0, 1.0
        for d, w in enumerate(widths):
            survive *= self.tree_alpha(d, w)
            total += survive
        return total

    def verdicts(self, proposed: int) -> list[tuple[float, AcceptanceEstimate]]:
        """Each verdict of a round of ``proposed`` chain drafts (0..proposed kept): its probability at the current
        α_i and the estimate after observing it."""
        outcomes, survive = [], 1.0
        for accepted in range(proposed + 1):
            alpha = self.position_alpha(min(accepted, self.max_k - 1)) if accepted < proposed else 0.0
            after = self.copy()
            after.observe(proposed, accepted)
            outcomes.append((survive * (1.0 - alpha), after))
            survive *= alpha
        return outcomes

    def observe(self, proposed: int, accepted: int) -> None:
        """A verified chain round: ``accepted`` of ``proposed`` drafts kept (a full round rejected none)."""
        if proposed <= 0:
            return
        rejected = 1 if accepted < proposed else 0
        self.hits = self.hits * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + rejected
        self.slow_hits = self.slow_hits * self.slow_decay + accepted
        self.slow_trials = self.slow_trials * self.slow_decay + accepted + rejected
        for i in range(self.max_k):
            self.pos_hits[i] *= self.decay
            self.pos_trials[i] *= self.decay
        hits, trials = self.state_hits[self.full], self.state_trials[self.full]
        for i in range(self.max_k):
            hits[i] *= self.state_decay
            trials[i] *= self.state_decay
        for i in range(min(accepted + rejected, self.max_k)):  # drafts 1..accepted kept, the next one tried
            self.pos_trials[i] += 1.0
            self.pos_hits[i] += 1.0 if i < accepted else 0.0
            trials[i] += 1.0
            hits[i] += 1.0 if i < accepted else 0.0
        self.full = not rejected

    def observe_tree(self, depth: int, accepted: int) -> None:
        """A verified tree round of ``depth`` levels whose kept path is ``accepted`` nodes deep."""
        grow = depth - len(self.tree_hits)
        if grow > 0:
            self.tree_hits.extend([0.0] * grow)
            self.tree_trials.extend([0.0] * grow)
        for d in range(len(self.tree_hits)):
            self.tree_hits[d] *= self.decay
            self.tree_trials[d] *= self.decay
        for d in range(min(accepted + 1, depth)):
            self.tree_trials[d] += 1.0
            self.tree_hits[d] += 1.0 if d < accepted else 0.0
        rejected = 1 if accepted < depth else 0  # whether to draft at all: a tree round is a trial too
        self.full = not rejected
        self.slow_hits = self.slow_hits * self.slow_decay + accepted
        self.slow_trials = self.slow_trials * self.slow_decay + accepted + rejected
