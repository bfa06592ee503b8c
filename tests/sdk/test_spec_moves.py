"""The speculative modules moved into inferlet.spec: each old path still imports, re-exports the same objects
and says where they went with a DeprecationWarning."""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = {
    "inferlet.decode": {"speculate": "inferlet.spec.host_rounds", "Run": "inferlet.spec.rounds"},
    "inferlet.device_rounds": {"verify_rounds": "inferlet.spec.device_rounds"},
    "inferlet.draft_length": {
        "DraftPlanner": "inferlet.spec.draft_policy",
        "DraftPolicy": "inferlet.spec.draft_policy",
    },
    "inferlet.chained": {"ChainedDrafter": "inferlet.spec.chained"},
    "inferlet.drafter": {"Drafter": "inferlet.spec.drafter", "Proposal": "inferlet.spec.drafter"},
    "inferlet.run_ahead": {"RunAhead": "inferlet.spec.run_ahead"},
    "inferlet.speculative": {
        "filter_distribution": "inferlet.spec.distribution",
        "verify_greedy": "inferlet.spec.verify",
        "SpecStats": "inferlet.spec.stats",
    },
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_re_exports_the_moved_names(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match="moved to inferlet.spec"):
        module = importlib.import_module(old)
    for name, new in MOVED[old].items():
        target = "DraftPolicy" if name == "DraftPlanner" else name
        assert getattr(module, name) is getattr(importlib.import_module(new), target)


def test_the_verifier_moved_out_of_the_samplers():
    import inferlet.sampler
    from inferlet.spec.verifier import Verifier

    with pytest.warns(DeprecationWarning, match="inferlet.spec.verifier"):
        assert inferlet.sampler.Verifier is Verifier
