"""How many drafts to verify next round: the count with the most expected tokens per millisecond.

Leviathan et al. 2023, §3.1: if each draft is accepted with probability α given that the ones before it
were, a round of k drafts emits (1 - α^(k+1)) / (1 - α) tokens on average. Drafters are not that uniform
(an MTP head's second draft is kept far less often than its first; a lookup that matched once tends to
keep matching), so the planner keeps a conditional acceptance α_i per draft position, shrunk toward the
pooled α where a position has little evidence: a round of k drafts emits 1 + Σ_{j<=k} Π_{i<=j} α_i.
What the round costs is this engine's business, so the engine measures it at start (``Model.pass_cost_ms``,
one sequence's pass of w rows); the planner adds the drafter's own cost per draft and a round's fixed
overhead, then picks

    k* = argmax over 0 <= k <= max_k of  E[tokens | k, α] / (pass_cost(1 + k) + k * draft_cost + overhead)

The overhead is not a guess either: a round's wall time past the curve's pass and the drafts' cost is what
the loop spends besides (the engine's step bookkeeping, the messages, the verification on the host, and the
attention over a context longer than the curve was measured at), and on a CPU it is a third of a 1-row pass.
``observe_time`` keeps the median of the last rounds' residuals as ``overhead_ms``. Priced at a fixed guess
instead, a draft row looked dearer than it is, and the planner drafted one after most misses where two pay.

The α's come from recent rounds with exponential forgetting, and each is conditioned on how the last
drafting round ended: all its drafts kept, or one rejected. A prompt lookup's hits come in runs (a copied
passage) and its misses too, so after a full round α|full is high and after a rejection α|rejected low, and k
follows the runs: on a CPU in float32, where a few rows cost about one (engine/pass_costs.py), short probes while
the drafter misses and long windows while it hits; where wide windows are nearly free (bf16 with AMX, GPUs), k
at the maximum. An MTP head's verdicts are nearly independent from round to round, so the two estimates
agree and k holds where it pays on average. Each state's counts forget slowly (``state_decay``, about twenty
rounds), toward the per-position α of the last few rounds (``decay``) where a state has little evidence.
Forgetting fast without the state (as this planner first did) made an independent drafter's k swing with
every miss: one halved α, and the next round drafted one or none where two pay on average. With the state an
MTP head's simulated rounds come near a fixed 2's, and on a lookup's runs of hits the state gains on it as well
(docs/performance.md, "The draft-length planner").

A drafter that knows its acceptance before the run passes it as ``prior``: an MTP or EAGLE head's training
record holds its acceptance per position on held-out text (``Model.mtp_acceptance``), and each position's
estimate holds it with the weight of ``prior_weight`` rounds, never forgotten. Without it the first rounds
decided alone: two misses at the second position made that draft look like a loss, and a position the planner
stops drafting at is not measured again, so chat replies ran at one draft a round where two pay (the shipped
head: 2.1 rows a round, the second position shown as 0.0). With the record they draft two, a small gain on
average over the benchmark prompts, and little where the second draft is kept far less often than the record
says (docs/performance.md, "The draft-length planner"). About twenty rounds of evidence outweigh the prior: a
head its record flatters that much drafts its second near break-even, where the second row costs a few percent
of a round.

Under load the round is not alone in its step: other sequences' rows share the pass. The planner then
prices a round by what it adds to the step, ``pass_cost(load + 1 + k) - pass_cost(load)`` (``load``: the other
rows of the step its last fire ran in, from the fire reply's ``step_rows``). Where the curve is flat (a few
rows on a CPU) that is about what it costs alone; in a full step every extra row costs its full share, so a
round drafts less, or nothing, and speculation does not slow a busy server.

On a model with recurrent state (``replay``: Mamba, LFM2) a rejection may not be free: unless the engine kept
the state after each row (``free_fold_rows``: folds of up to that many rows copy a per-row state, at no pass),
it restores the state from before the round and replays the rows it keeps (engine/fold.py), one more pass over
them. The planner adds that pass, weighted by the chance the round rejects a draft where the kept rows exceed
``free_fold_rows``: for k drafts, ``P(replay) * pass_cost(E[rows kept | a replay])``, which shortens windows where
drafts miss.

A drafter that can also propose a token tree (inferlet.tree, ``--tree`` widths per depth) asks ``use_tree``
each round: the tree of ``rows`` draft rows and ``depth`` levels emits 1 + Σ_d Π_{i<=d} β_i tokens, β_d the
acceptance of depth d given depth d-1 was kept, observed on tree rounds (``observe_tree``) with the prior
1 - (1 - α_d)^w_d (at least one of the w_d candidates at that depth right, each as likely as the chain's
draft). It takes the tree when that, over the tree's cost, beats the best chain's tokens per millisecond.

Whether to draft at all is decided on a slower estimate (``slow_decay``, about twenty drafting rounds): a
drafter near break-even (a draft model that costs a third of a target step and is right 40% of the time) would
otherwise flip to plain steps after two unlucky rounds, and not drafting where it pays costs more than drafting
where it does not (a kept draft is a whole token, a draft row a few percent of a round). Forgotten within five
rounds, as it first was, a sentence the head got wrong stopped a chat reply's drafting for the next eight
rounds; in simulation the longer memory gains for an MTP head and a lookup and costs a drafter that is rarely
right nothing (docs/performance.md, "The draft-length planner"). When drafting does not pay the round is a plain
step, except every ``probe_every``-th one, which drafts one token: without rounds that draft, the planner would
never see the drafter start hitting again.

Plain rounds are priced apart. The curve is timed at engine start, alone, and a round in a running engine costs
what the curve does not say, a drafting round more so than a plain one; with one overhead for both the planner
priced a draft row below its cost and drafted where plain steps were faster (docs/performance.md, "The
draft-length planner"). ``observe_time`` keeps the residuals of rounds that verified drafts and of
those that verified none apart (negative where the curve overstates a pass, down to ``MAX_DISCOUNT`` of a 1-row
pass), and while drafting pays a plain round is timed every ``TIMING_EVERY`` rounds (the first after
``FIRST_TIMING``; its fire chains no head step), so that what drafting is weighed against is measured as well.
Whether drafting pays then asks about every count, not one draft only: where a drafting round costs much more
than a plain one, one draft can lose where two win.

A head's chain (MTP, EAGLE: inferlet.chained) is read in the fire before the round it drafts for, before that
fire's verdict, and each of its steps is paid whatever the verdict: ``chain_depth`` picks the depth with the most
expected tokens per ms over the verdicts, each verdict's next round drafting at most that depth. Chaining the
most any verdict could ask for (``most_next``, as the planner first did) paid on every fire for steps only a
full round would use (docs/performance.md, "The draft-length planner").
"""

from __future__ import annotations

import copy
import itertools
import statistics
from collections import deque
from collections.abc import Sequence

OVERHEAD_ROUNDS = (
    15  # rounds whose median residual is the overhead: a slow spell of the machine moves it, one pause does not
)
# A plain round timed at least this often while drafting pays (docstring, "Plain rounds are priced apart"), and
# the first after this many drafting rounds: the plain rate the drafting one is weighed against is measured too.
TIMING_EVERY = 32
FIRST_TIMING = 8
# The most a measured residual may take off the curve's price of a pass, as a share of a 1-row pass: the curve
# may overstate every pass (timed at start on a busy machine), but a round never costs nothing.
MAX_DISCOUNT = 0.5
# The least a round is priced at. Under load on a flat stretch of the curve, with no measured overhead and a
# drafter that costs nothing (a lookup), a round adds nothing to its step; priced at 0 the rates divide by it.
MIN_ROUND_MS = 1e-3


class DraftPlanner:
    """Per-round draft counts for one run: ``next()`` before a round, ``observe()`` after its verification."""

    def __init__(
        self,
        max_k: int,
        pass_cost_ms: list[float],
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
        self.probe_every = probe_every
        self.idle = 0  # plain rounds in a row the planner chose since the last drafting round
        # a wider pass never costs less: timed at start on a busy machine, the curve may dip, and a dip under
        # load would price a round's rows below nothing
        self.costs = list(itertools.accumulate(pass_cost_ms, max))
        self.draft_cost_ms = draft_cost_ms
        self.overhead_ms = overhead_ms  # the prior, until observe_time has timed a round
        self.residuals: deque[float] = deque(maxlen=OVERHEAD_ROUNDS)  # of rounds that verified drafts
        self.plain_residuals: deque[float] = deque(maxlen=OVERHEAD_ROUNDS)  # of rounds that verified none
        self.since_plain = TIMING_EVERY - FIRST_TIMING  # drafting rounds since the last plain one
        self.chained: int | None = None  # head steps the fire being built chains (a chained drafter says so)
        self.timing = False  # this round is a timed plain one: its fire chains no head steps either
        self.decay = decay
        self.state_decay = state_decay
        self.slow_decay = slow_decay
        # [i]: the drafter's own acceptance of draft i+1 given 1..i kept, from its training record (held-out
        # text), worth prior_weight rounds that are never forgotten; empty: none known
        self.prior = [prior[min(i, len(prior) - 1)] for i in range(self.max_k)] if prior else []
        self.prior_weight = prior_weight
        if self.prior:
            prior_alpha = self.prior[0]
        self.slow_hits, self.slow_trials = prior_alpha, 1.0  # the same counts, forgotten slowly
        self.hits = prior_alpha  # discounted accepted drafts
        self.trials = 1.0  # discounted accepted drafts + rejections (geometric trials)
        self.pos_hits = [0.0] * self.max_k  # [i]: discounted rounds that kept draft i+1
        self.pos_trials = [0.0] * self.max_k  # [i]: discounted rounds that verified draft i+1 after keeping i
        self.full = False  # the last drafting round kept all its drafts (the state the α's are conditioned on)
        # [full][i]: the same counts, forgotten slowly, of the rounds that followed a rejection (0) or a full round (1)
        self.state_hits = [[0.0] * self.max_k for _ in range(2)]
        self.state_trials = [[0.0] * self.max_k for _ in range(2)]
        self.load = 0  # other sequences' rows in the engine's last step (see the module docstring)
        self.replay = replay  # a rejecting round costs a replay of its kept rows (recurrent state)
        self.free_fold_rows = free_fold_rows  # ... unless they are this many or fewer (per-row states)
        self.tree_hits: list[float] = []  # [d]: discounted tree rounds whose kept path reached depth d+1
        self.tree_trials: list[float] = []  # [d]: discounted tree rounds that tried depth d+1 (reached depth d)

    @property
    def adaptive(self) -> bool:
        """False without a cost curve (the engine did not measure one): then every round drafts ``max_k``."""
        return bool(self.costs)

    @property
    def alpha(self) -> float:
        """Pooled acceptance of a draft given the ones before it were kept."""
        return self.hits / self.trials

    def recent_alpha(self, i: int) -> float:
        """Acceptance of draft i+1 given drafts 1..i were kept, over the last few rounds whatever their state; one
        round's worth of the pooled α as prior."""
        return min((self.pos_hits[i] + self.alpha) / (self.pos_trials[i] + 1.0), 0.999)

    def position_alpha(self, i: int) -> float:
        """Acceptance of draft i+1 given drafts 1..i were kept, after a round that ended as the last one did; one
        round's worth of :meth:`recent_alpha` as prior."""
        hits, trials = self.state_hits[self.full][i], self.state_trials[self.full][i]
        if self.prior:
            hits, trials = hits + self.prior_weight * self.prior[i], trials + self.prior_weight
        return min((hits + self.recent_alpha(i)) / (trials + 1.0), 0.999)

    def pass_cost(self, rows: int) -> float:
        """Measured cost of a ``rows``-row pass; extended linearly past the measured widths."""
        c = self.costs
        if rows <= len(c):
            return c[rows - 1]
        slope = c[-1] - c[-2] if len(c) >= 2 else c[-1]
        return c[-1] + slope * (rows - len(c))

    def expected_tokens(self, k: int) -> float:
        """1 (the target's own token) + the expected number of the k drafts kept."""
        total, survive = 1.0, 1.0
        for i in range(k):
            survive *= self.position_alpha(i)
            total += survive
        return total

    def round_cost(self, k: int, steps: int | None = None) -> float:
        """ms a round of k draft rows adds: its rows' share of the step, the drafting (``steps`` draft steps,
        default k), a round's overhead, and with recurrent state the expected replay of the kept rows after a
        rejection."""
        drafting = (k if steps is None else steps) * self.draft_cost_ms
        return max(MIN_ROUND_MS, self.step_share(k) + drafting + self.overhead(k) + self.replay_cost(k))

    def overhead(self, k: int) -> float:
        """ms a round of k drafts costs past the curve's pass and the drafts' cost: a drafting round's measured
        overhead, or a plain round's once one is timed (module docstring)."""
        measured = statistics.median(self.plain_residuals) if k == 0 and self.plain_residuals else self.overhead_ms
        # a discount says the curve overstates a pass alone; under load a round is priced by its share of the step
        return max(0.0, measured) if self.load else measured

    def step_share(self, drafts: int) -> float:
        """ms a round's rows (``last`` and ``drafts`` draft rows) add to a pass that carries ``load`` other rows."""
        return self.pass_cost(self.load + 1 + drafts) - (self.pass_cost(self.load) if self.load else 0.0)

    def replay_cost(self, k: int) -> float:
        """Expected ms of the replay a round of k drafts causes: 0 without recurrent state or drafts, or when
        per-row states serve every fold it can make."""
        if not self.replay or k == 0:
            return 0.0
        survive, p_reject, kept_if_rejected = 1.0, 0.0, 0.0
        for i in range(k):  # draft i+1 rejected after i kept: the replay runs `last` and those i drafts
            reject = survive * (1 - self.position_alpha(i))
            if 1 + i > self.free_fold_rows:  # fewer kept rows are a per-row state's copy, no pass
                p_reject += reject
                kept_if_rejected += reject * (1 + i)
            survive *= self.position_alpha(i)
        if p_reject <= 0:
            return 0.0
        return p_reject * self.pass_cost(max(1, round(kept_if_rejected / p_reject)))

    def observe_load(self, step_rows: int, own_rows: int) -> None:
        """The engine ran this run's last fire (``own_rows`` rows) in a step of ``step_rows`` rows."""
        self.load = max(0, step_rows - own_rows)

    def best(self) -> int:
        """k*: the draft count with the most expected tokens per ms now (0: a plain step is faster)."""
        best_k, best = 0, -1.0
        for k in range(self.max_k + 1):
            rate = self.expected_tokens(k) / self.round_cost(k)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def tree_alpha(self, d: int, width: int) -> float:
        """β_d: acceptance at depth d+1 of a tree given depth d was kept, with one round's worth of prior."""
        alpha = self.position_alpha(min(d, self.max_k - 1)) if self.max_k else self.alpha
        prior = 1.0 - (1.0 - alpha) ** width
        hits = self.tree_hits[d] if d < len(self.tree_hits) else 0.0
        trials = self.tree_trials[d] if d < len(self.tree_trials) else 0.0
        return min((hits + prior) / (trials + 1.0), 0.999)

    def tree_expected_tokens(self, widths: list[int]) -> float:
        total, survive = 1.0, 1.0
        for d, w in enumerate(widths):
            survive *= self.tree_alpha(d, w)
            total += survive
        return total

    def use_tree(self, widths: list[int], rows: int, draft_fires: int = 0) -> bool:
        """Whether a tree of ``widths`` (``rows`` draft rows, ``draft_fires`` drafter steps) is expected to emit
        more tokens per ms than the best chain. Without a cost curve, always; with recurrent state (``replay``),
        never: the engine refuses tree fires there (a state advances through rows in order), so rounds are chains."""
        if self.replay:
            return False
        if not self.adaptive:
            return True
        k = self.best()
        chain = self.expected_tokens(k) / self.round_cost(k)
        tree = self.tree_expected_tokens(widths) / self.round_cost(rows, draft_fires)  # no replay: checked above
        return tree >= chain

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

    def observe_time(self, elapsed_ms: float, step_rows: int, drafts: int) -> None:
        """A round took ``elapsed_ms`` of wall time, from the end of the last round to the end of its own, in an
        engine step of ``step_rows`` rows (its own included) with ``drafts`` draft steps (a chained drafter's
        fire: the head steps it read, ``chained``): what the pass and the drafts do not explain is the round's
        overhead, kept apart for plain rounds and drafting ones (module docstring). It may be negative, down to
        ``MAX_DISCOUNT`` of a 1-row pass, where the curve overstates what a pass costs now."""
        steps = drafts if self.chained is None else self.chained
        self.chained = None
        if not self.adaptive:
            return
        residual = elapsed_ms - self.pass_cost(max(1, step_rows)) - steps * self.draft_cost_ms
        residual = max(-MAX_DISCOUNT * self.costs[0], residual)
        plain = step_rows - self.load <= 1  # no draft rows (a head's chain, if any, is priced above)
        (self.plain_residuals if plain else self.residuals).append(residual)
        if plain:
            self.since_plain = 0  # also a round the drafter had nothing for (a lookup that found no match)
        else:
            self.overhead_ms = statistics.median(self.residuals)

    def drafting_pays(self) -> bool:
        """Some count of drafts beats a plain step with the first draft kept at the slowly forgotten acceptance
        (the later ones at their own). Not one draft only: where a drafting round costs much more than a plain
        one (a head's chain, a second row, the verification), one draft may lose where two win."""
        plain = 1 / self.round_cost(0)
        first, total, survive = self.slow_hits / self.slow_trials, 1.0, 1.0
        for k in range(1, max(1, self.max_k) + 1):
            survive *= first if k == 1 else self.position_alpha(k - 1)
            total += survive
            if total / self.round_cost(k) > plain:
                return True
        return False

    def upcoming(self) -> int:
        """What ``next()`` would return if asked now, without counting as asking."""
        return self._choose()[0]

    def _choose(self) -> tuple[int, bool]:
        """The count ``next()`` asks for now, and whether it is a timed plain round."""
        if not self.adaptive or self.max_k == 0:
            return self.max_k, False
        if self.drafting_pays():
            if self.since_plain >= TIMING_EVERY:
                return 0, True  # now and then a timed plain round
            return max(1, self.best()), False
        probe = self.idle + 1 >= self.probe_every  # a one-draft probe after probe_every plain rounds
        return (1 if probe else 0), False

    def will_draft(self) -> bool:
        """Whether ``next()`` would draft if asked now (it does not count as asking)."""
        return self.upcoming() > 0

    def after_verdicts(self, proposed: int) -> list[tuple[float, DraftPlanner]]:
        """Each verdict of the round now being verified (``proposed`` chain drafts): its probability at the
        current per-position α's and the planner as it would be after observing it, for 0..proposed kept."""
        outcomes, survive = [], 1.0
        for accepted in range(proposed + 1):
            alpha = self.position_alpha(min(accepted, self.max_k - 1)) if accepted < proposed else 0.0
            after = copy.copy(self)  # observe() rebinds the floats but updates these lists in place
            after.pos_hits, after.pos_trials = list(self.pos_hits), list(self.pos_trials)
            after.state_hits = [list(h) for h in self.state_hits]
            after.state_trials = [list(t) for t in self.state_trials]
            after.observe(proposed, accepted)
            outcomes.append((survive * (1.0 - alpha), after))
            survive *= alpha
        return outcomes

    def chain_depth(self, proposed: int) -> int:
        """How many drafts a head should chain in the fire of the round now being verified (``proposed`` chain
        drafts), for the next round: the depth with the most expected tokens per ms over this round's verdicts.
        The chain is computed before the verdict and every step of it is paid whatever the verdict, so a depth
        is worth what the next round makes of ``min(depth, what the verdict leads the planner to ask)`` drafts,
        priced with all ``depth`` steps (module docstring). While drafting does not pay under any verdict, the
        depth a probe needs."""
        if not self.adaptive or self.max_k == 0 or proposed <= 0:
            return 0 if self.timing else self.upcoming()
        outcomes = self.after_verdicts(proposed)
        wants = [after.upcoming() for _, after in outcomes]
        if not any(after.drafting_pays() for _, after in outcomes):
            return max(wants)
        # at least one wherever every verdict drafts: a round the planner drafts in must have a draft to verify
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
        """The most drafts ``next()`` could ask for after the round now being verified (``proposed`` chain
        drafts), whatever its verdict: the most a head's chain could be asked for (``chain_depth`` weighs it)."""
        if not self.adaptive or self.max_k == 0 or proposed <= 0:
            return self.upcoming()
        return max(after.upcoming() for _, after in self.after_verdicts(proposed))

    def next(self) -> int:
        """Drafts to ask for this round: k*, or a one-draft probe after ``probe_every`` plain rounds."""
        k, self.timing = self._choose()
        if self.adaptive and self.max_k:
            self.idle = 0 if k else self.idle + 1
            self.since_plain = self.since_plain + 1 if k else 0
        return k

    def observe(self, proposed: int, accepted: int) -> None:
        """A verified round: ``accepted`` of ``proposed`` drafts kept (a full acceptance is no rejection)."""
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
