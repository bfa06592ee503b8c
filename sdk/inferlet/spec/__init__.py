"""Speculative decoding: reach for ``inferlet.spec`` when a cheaper guess (a drafter) should propose several
tokens that one pass of the target model then checks, so a run emits more than one token a pass.

The short path is a :class:`Drafter` subclass whose ``propose`` returns a :class:`Proposal` (a chain of
drafts, or a :class:`TokenTree` of alternatives), handed to :func:`speculate`, which runs the rounds: draft,
verify on the target, fold what was accepted, and plan how many tokens the next round drafts
(:class:`DraftPolicy`, from an :class:`AcceptanceEstimate` and a :class:`PassCostModel`). Greedy output
equals plain decoding; sampled output follows the target's distribution (:class:`Verifier`).

Pieces for drafters: :class:`ChainedDrafter` (a head that drafts on the verify pass, MTP or EAGLE),
:class:`NgramIndex` and :func:`lookup_drafts` (prompt lookup), :class:`SuffixIndex` (suffix decoding), the
tree helpers (:func:`parse_shape`, :func:`shape_rows`, :func:`draw_without_replacement`). Rounds that stay
on the device: :func:`verify_rounds`, :func:`mtp_run_ahead`, :class:`RunAhead`.

    from inferlet.spec import Drafter, Proposal, speculate
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..facade import lazy_exports

if TYPE_CHECKING:
    from .acceptance import AcceptanceEstimate
    from .chained import ChainedDrafter
    from .device_rounds import mtp_run_ahead, verify_rounds
    from .draft_policy import DraftPolicy
    from .drafter import Drafter, Proposal
    from .host_rounds import speculate
    from .ngram_lookup import NgramIndex, lookup_drafts
    from .pass_cost import PassCostModel
    from .run_ahead import RunAhead
    from .suffix_index import Candidates, SuffixIndex
    from .token_tree import (
        MAX_TREE_NODES,
        ROOT,
        TokenTree,
        TreeVerdict,
        draw_without_replacement,
        parse_shape,
        shape_rows,
    )
    from .verifier import Verifier
    from .verify import VerifyResult, verify_greedy

_HOMES = {
    "inferlet.spec.acceptance": ["AcceptanceEstimate"],
    "inferlet.spec.chained": ["ChainedDrafter"],
    "inferlet.spec.device_rounds": ["mtp_run_ahead", "verify_rounds"],
    "inferlet.spec.draft_policy": ["DraftPolicy"],
    "inferlet.spec.drafter": ["Drafter", "Proposal"],
    "inferlet.spec.host_rounds": ["speculate"],
    "inferlet.spec.ngram_lookup": ["NgramIndex", "lookup_drafts"],
    "inferlet.spec.pass_cost": ["PassCostModel"],
    "inferlet.spec.run_ahead": ["RunAhead"],
    "inferlet.spec.suffix_index": ["Candidates", "SuffixIndex"],
    "inferlet.spec.token_tree": [
        "MAX_TREE_NODES",
        "ROOT",
        "TokenTree",
        "TreeVerdict",
        "draw_without_replacement",
        "parse_shape",
        "shape_rows",
    ],
    "inferlet.spec.verifier": ["Verifier"],
    "inferlet.spec.verify": ["VerifyResult", "verify_greedy"],
}

__all__ = [
    "Drafter",
    "Proposal",
    "speculate",
    "ChainedDrafter",
    "Verifier",
    "VerifyResult",
    "verify_greedy",
    "DraftPolicy",
    "AcceptanceEstimate",
    "PassCostModel",
    "TokenTree",
    "TreeVerdict",
    "ROOT",
    "MAX_TREE_NODES",
    "parse_shape",
    "shape_rows",
    "draw_without_replacement",
    "NgramIndex",
    "lookup_drafts",
    "SuffixIndex",
    "Candidates",
    "RunAhead",
    "verify_rounds",
    "mtp_run_ahead",
]

__getattr__, __dir__ = lazy_exports(__name__, {n: m for m, names in _HOMES.items() for n in names})
