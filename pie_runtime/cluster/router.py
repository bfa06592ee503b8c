"""The router's policy: which engine runs a new *run* (never a single fire: a run's working sets stay on one
engine). Pure Python, no Ray: ``ray_actors.RouterActor`` wraps one instance.

Candidates are ordered, and the first engine that does not refuse gets the run:

1. **Imbalance guard** (SGLang's ``cache_aware`` router, ``balance_abs_threshold`` and
   ``balance_rel_threshold``): when ``max - min`` of the live engines' in-flight runs is over
   ``balance_abs`` **and** ``max`` is over ``balance_rel * min``, the least loaded engines come first.
2. **Session key** (a header or field): the key's rendezvous order (``rendezvous.py``), a soft preference
   that only a refusal or the guard overrides.
3. **Cache-aware** (SGLang's ``cache_aware``; Ray Serve's ``PrefixCacheAffinityRouter`` the same with a match
   rate threshold): the engine whose remembered prefixes (``prefix_tree.py``) cover more than
   ``cache_threshold`` of the prompt comes first; otherwise the engine that holds the least in the tree
   (SGLang: "the worker with the smallest tree"), ties to the least loaded.

``policy="round_robin"`` (the baseline the cache-aware policy is measured against) takes the live engines in
turn, after the guard and the session key.

An engine **refuses** when its last reported free KV pages are fewer than the run needs; the caller may
also exclude engines that refused for real (an ``out_of_pages`` answer, a lost engine) and place again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .prefix_tree import PrefixTree
from .rendezvous import rendezvous_order

Reason = Literal["balance", "session", "cache", "least_cached", "round_robin"]


class RouterConfig(BaseModel):
    """The policy's knobs (SGLang's names and defaults where it has them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["cache_aware", "round_robin"] = "cache_aware"
    cache_threshold: float = Field(default=0.5, ge=0.0, le=1.0)  # share of the prompt a match must cover
    balance_abs: int = Field(default=64, ge=0)  # in-flight runs: max - min over this ...
    balance_rel: float = Field(default=1.5, ge=1.0)  # ... and max over this times min: imbalanced
    block: int = Field(default=16, ge=1)  # tokens a tree node holds: the engines' page size
    max_tree_blocks: int = Field(default=65536, ge=1)  # blocks remembered per engine before LRU eviction


class NoEngine(Exception):
    """No live engine would take the run."""


@dataclass
class EngineState:
    """What the router knows of one engine."""

    in_flight: int = 0  # runs placed there and not yet done
    free_pages: int | None = None  # last reported; None: not known yet (never refuses)
    live: bool = True


@dataclass(frozen=True)
class Placement:
    engine: str
    reason: Reason
    matched_tokens: int  # of the prompt, on the chosen engine, by the tree
    candidates: tuple[str, ...] = field(default=())  # the order tried, refusals included


class Router:
    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.tree = PrefixTree(self.config.block, self.config.max_tree_blocks)
        self.engines: dict[str, EngineState] = {}
        self._turn = 0  # round robin's next index

    # --- the engine set ---

    def add(self, engine: str) -> None:
        """An engine joins (or rejoins after a restart: with an empty cache and no runs)."""
        self.tree.remove(engine)
        self.engines[engine] = EngineState()

    def lose(self, engine: str) -> None:
        """An engine is gone: nothing is placed there, and what the tree remembered of it is dropped."""
        state = self.engines.get(engine)
        if state is not None:
            state.live = False
            state.in_flight = 0
        self.tree.remove(engine)

    def report(self, engine: str, free_pages: int | None) -> None:
        """An engine's load report."""
        state = self.engines.get(engine)
        if state is not None:
            state.free_pages = free_pages

    def live(self) -> list[str]:
        return sorted(e for e, s in self.engines.items() if s.live)

    # --- placing ---

    def imbalanced(self, engines: Sequence[str]) -> bool:
        loads = [self.engines[e].in_flight for e in engines]
        if len(loads) < 2:
            return False
        hi, lo = max(loads), min(loads)
        return hi - lo > self.config.balance_abs and hi > self.config.balance_rel * lo

    def order(self, tokens: Sequence[int], session: str | None = None, exclude: Iterable[str] = ()) -> Placement:
        """The candidates in the order the policy prefers them (refusals not applied); raises NoEngine."""
        skip = set(exclude)
        engines = [e for e in self.live() if e not in skip]
        if not engines:
            raise NoEngine("no live engine")
        matched = self.tree.match(tokens)
        load = {e: self.engines[e].in_flight for e in engines}
        if self.imbalanced(engines):
            order, reason = sorted(engines, key=lambda e: (load[e], e)), "balance"
        elif session is not None:
            order, reason = rendezvous_order(session, engines), "session"
        elif self.config.policy == "round_robin":
            self._turn += 1
            i = self._turn % len(engines)
            order, reason = engines[i:] + engines[:i], "round_robin"
        else:
            best = max(engines, key=lambda e: (matched.get(e, 0), -load[e]))
            if tokens and matched.get(best, 0) > self.config.cache_threshold * len(tokens):
                rest = sorted((e for e in engines if e != best), key=lambda e: (-matched.get(e, 0), load[e], e))
                order, reason = [best, *rest], "cache"
            else:
                order = sorted(engines, key=lambda e: (self.tree.size(e), load[e], e))
                reason = "least_cached"
        return Placement(order[0], reason, matched.get(order[0], 0), tuple(order))

    def refuses(self, engine: str, pages: int) -> bool:
        free = self.engines[engine].free_pages
        return free is not None and free < pages

    def place(
        self, tokens: Sequence[int], session: str | None = None, pages: int = 0, exclude: Iterable[str] = ()
    ) -> Placement:
        """Places a run of prompt ``tokens`` needing ``pages`` KV pages on the first candidate that does not
        refuse, and records it (tree, in-flight, and the pages it will take); raises NoEngine."""
        first = self.order(tokens, session, exclude)
        for engine in first.candidates:
            if not self.refuses(engine, pages):
                break
        else:
            raise NoEngine(f"every live engine refused a run of {pages} pages: {', '.join(first.candidates)}")
        matched = self.tree.match(tokens).get(engine, 0)
        state = self.engines[engine]
        state.in_flight += 1
        if state.free_pages is not None:
            state.free_pages -= pages  # until the next report says otherwise
        self.tree.insert(tokens, engine)
        return Placement(engine, first.reason, matched, first.candidates)

    def done(self, engine: str) -> None:
        """A run placed on ``engine`` ended."""
        state = self.engines.get(engine)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1
