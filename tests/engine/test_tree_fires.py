"""Tree fires in the engine core (docs/architecture.md, "Tree windows"): parents checked with typed errors,
rows positioned by depth and attending their ancestors, and a fold path — fixed, settled by ``ws_fold`` or
the next fire's ``settle``, or chosen by the epilogue — moving the path's K/V into consecutive committed rows,
so the sequence then decodes exactly as if the path had been a chain."""

from __future__ import annotations

import numpy as np
import pytest

from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol import messages as m
from pie_runtime.protocol.tree import MAX_TREE_ROWS
from tests.engine.test_core import PROMPT, A, Core, logits_of

#   0 ─ 1 ─ 3
#    └─ 2 ─ 4 ─ 5
PARENTS = [-1, 0, 0, 1, 2, 4]
TOKENS = [11, 21, 22, 31, 32, 41]
PATH = [0, 2, 4, 5]
NEXT = 50


def logits_read(c: Core, ws: int, rows: list[int], tokens: list[int], **fields) -> np.ndarray:
    req = c.fire(A, ws, tokens, readouts=[{"rows": rows, "kind": "logits"}], **fields)
    reply = c.run()[req]
    return logits_of(reply)


def prefilled(c: Core) -> int:
    ws = c.call(A, "ws_open")["ws"]
    c.fire(A, ws, PROMPT[:10])
    c.run()
    return ws


def chain_reference(c: Core) -> tuple[np.ndarray, np.ndarray]:
    """The path decoded as a chain, then one more token: the logits of the path's rows and of NEXT."""
    ws = prefilled(c)
    path_logits = logits_read(c, ws, list(range(len(PATH))), [TOKENS[r] for r in PATH])
    return path_logits, logits_read(c, ws, [0], [NEXT])


def test_tree_rows_read_what_their_paths_read_as_chains_and_a_fixed_path_fold_commits_them():
    c = Core()
    want_rows, want_next = chain_reference(c)
    ws = prefilled(c)
    tree = logits_read(c, ws, list(range(len(TOKENS))), TOKENS, parents=PARENTS, fold=PATH)
    np.testing.assert_allclose(tree[PATH], want_rows, rtol=1e-5, atol=1e-5)
    assert c.call(A, "stats")["working_sets"] == 2
    np.testing.assert_allclose(logits_read(c, ws, [0], [NEXT]), want_next, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["ws_fold", "settle", "epilogue"])
def test_a_deferred_path_fold_moves_the_path_into_place(how):
    c = Core()
    _, want_next = chain_reference(c)
    ws = prefilled(c)
    fields: dict = {"parents": PARENTS, "fold": m.DEFERRED}
    if how == "epilogue":
        nodes = [{"op": "const", "attrs": {"value": [*PATH, -1, -1], "dtype": "int"}}, {"op": "fold", "inputs": [0]}]
        fields["program"] = c.call(A, "program_register", nodes=nodes)["program"]
    req = c.fire(A, ws, TOKENS, **fields)
    reply = c.run()[req]
    if how == "epilogue":
        assert reply["fold"] == len(PATH) and reply["fold_path"] == PATH and reply["committed"] == 10 + len(PATH)
    else:
        assert reply["pending_fold"] == len(TOKENS)
    if how == "ws_fold":
        assert c.call(A, "ws_fold", ws=ws, n=PATH)["committed"] == 10 + len(PATH)
    got = logits_read(c, ws, [0], [NEXT], **({"settle": PATH} if how == "settle" else {}))
    np.testing.assert_allclose(got, want_next, rtol=1e-5, atol=1e-5)


def test_the_empty_path_folds_nothing_and_a_chain_takes_a_path_of_its_leading_rows():
    c = Core()
    ws = prefilled(c)
    req = c.fire(A, ws, TOKENS, parents=PARENTS)  # a tree fire's default fold is the empty path
    assert c.run()[req]["committed"] == 10
    req = c.fire(A, ws, [1, 2, 3], fold=[0, 1])
    assert c.run()[req]["committed"] == 12


def refusal(c: Core, ws: int, **fields) -> ErrorCode:
    with pytest.raises(PieError) as e:
        c.request(A, "fire", ws=ws, **fields)
    return e.value.code


@pytest.mark.parametrize(
    ("parents", "code"),
    [
        ([-1, 0, 2], ErrorCode.INVALID_TREE),  # a row its own parent
        ([-1, 2, 0], ErrorCode.INVALID_TREE),  # a parent after its child
        ([-1, 0, 7], ErrorCode.INVALID_TREE),  # out of range
        ([-1, -2, 0], ErrorCode.INVALID_TREE),  # below -1
        ([-1, 0], ErrorCode.INVALID_TREE),  # one row short
    ],
)
def test_parents_that_form_no_tree_are_refused(parents, code):
    c = Core()
    ws = prefilled(c)
    assert refusal(c, ws, tokens=[1, 2, 3], parents=parents) == code
    assert not c.core.has_work()  # nothing was queued


def test_too_many_tree_rows_and_bad_paths_are_refused_with_typed_errors():
    c = Core(num_pages=64)
    ws = prefilled(c)
    wide = MAX_TREE_ROWS + 1
    assert refusal(c, ws, tokens=[1] * wide, parents=[-1] * wide) == ErrorCode.LIMIT_EXCEEDED
    assert refusal(c, ws, tokens=TOKENS, parents=PARENTS, fold=[0, 3]) == ErrorCode.INVALID_TREE  # 3 follows 1
    assert refusal(c, ws, tokens=TOKENS, parents=PARENTS, fold=[2]) == ErrorCode.INVALID_TREE  # 2 is no root
    assert refusal(c, ws, tokens=TOKENS, parents=PARENTS, fold=[0, 9]) == ErrorCode.INVALID_TREE
    assert refusal(c, ws, tokens=TOKENS, parents=PARENTS, fold=3) == ErrorCode.INVALID_TREE  # a count on a tree
    assert refusal(c, ws, tokens=[1, 2, 3], fold=[1, 2]) == ErrorCode.INVALID_TREE  # a chain's path starts at 0
    mtp = {"rows": [0], "kind": "mtp", "at_accepted": True}
    assert refusal(c, ws, tokens=TOKENS, parents=PARENTS, readouts=[mtp]) in (
        ErrorCode.INVALID_ARGUMENT,
        ErrorCode.UNSUPPORTED,  # the tiny model has no MTP head: refused before the tree check
    )
    c.fire(A, ws, TOKENS, parents=PARENTS, fold=m.DEFERRED)
    c.run()

    with pytest.raises(PieError) as e:
        c.call(A, "ws_fold", ws=ws, n=[0, 1, 2])
    assert e.value.code == ErrorCode.INVALID_TREE
    assert refusal(c, ws, tokens=[NEXT], settle=[1]) == ErrorCode.INVALID_TREE
    assert c.call(A, "ws_fold", ws=ws, n=[0, 1, 3])["committed"] == 13  # still settleable


def test_a_tree_window_may_run_in_chunks():
    c = Core(max_batch_tokens=4)
    want_rows, want_next = chain_reference(c)
    ws = prefilled(c)
    tree = logits_read(c, ws, list(range(len(TOKENS))), TOKENS, parents=PARENTS, fold=PATH)
    np.testing.assert_allclose(tree[PATH], want_rows, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits_read(c, ws, [0], [NEXT]), want_next, rtol=1e-5, atol=1e-5)
