"""Token trees in a fire's window (docs/architecture.md, "Tree windows"), one definition for both sides.

A fire may carry ``parents``: one entry per window row, the window row it follows, or ``-1`` when it follows
the committed sequence (a root). Every parent lies before its child, so the rows are in topological order
and a row's *depth* (0 for a root) is one more than its parent's. A row's position is ``committed + depth``
and its attention sees the committed rows and its own ancestors only.

A *path* is the fold of a tree fire: window rows from a root down to some row, each the parent of the next.
Folding it makes those rows the next committed rows, in order; the empty path folds nothing. A chain window
(no parents) is the tree whose row ``i`` follows row ``i - 1``: its paths are ``[0 .. n-1]``, the plain fold
of ``n`` rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ErrorCode, PieError

MAX_TREE_ROWS = 64  # rows of one tree window; a wider verify window would not run batch-invariant attention

Fold = int | Sequence[int]  # a fold: a count of leading rows, or a path of window rows


def chain_parents(w: int) -> list[int]:
    """The parents of a chain window of ``w`` rows."""
    return list(range(-1, w - 1))


def tree_depths(parents: Sequence[int], w: int) -> list[int]:
    """Checks ``parents`` against a window of ``w`` rows and returns each row's depth.

    INVALID_TREE: not one parent per row, or a parent out of range or at/after its child;
    LIMIT_EXCEEDED: more than MAX_TREE_ROWS rows."""
    if len(parents) != w:
        raise PieError(ErrorCode.INVALID_TREE, f"parents need one entry per window row: {len(parents)} for {w} rows")
    if w > MAX_TREE_ROWS:
        raise PieError(ErrorCode.LIMIT_EXCEEDED, f"MAX_TREE_ROWS: a tree window holds at most {MAX_TREE_ROWS} rows")
    depths: list[int] = []
    for row, parent in enumerate(parents):
        if not -1 <= parent < row:
            raise PieError(
                ErrorCode.INVALID_TREE,
                f"row {row}'s parent {parent} must be -1 (the committed sequence) or a row before it",
            )
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def ancestors(parents: Sequence[int], row: int) -> list[int]:
    """``row`` and its ancestors in the window, root first."""
    out = [row]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def fold_path(fold: Fold, parents: Sequence[int] | None, w: int) -> list[int]:
    """The window rows a fold commits, in order: ``fold`` rows of a chain, or a checked path of the tree.

    INVALID_ARGUMENT: a count outside [0, w], or a count on a tree window (it names no path there);
    INVALID_TREE: a path whose rows are out of range or do not descend from a root one parent at a time."""
    if isinstance(fold, int):
        if not 0 <= fold <= w:
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"fold {fold} outside [0, {w}]")
        if parents is not None and fold and parents[:fold] != chain_parents(fold):
            raise PieError(ErrorCode.INVALID_TREE, f"fold {fold} of a tree window: fold a path of rows instead")
        return list(range(fold))
    path = [int(r) for r in fold]
    tree = chain_parents(w) if parents is None else parents
    expected = -1
    for row in path:
        if not 0 <= row < w:
            raise PieError(ErrorCode.INVALID_TREE, f"fold path row {row} outside the window [0, {w})")
        if tree[row] != expected:
            raise PieError(
                ErrorCode.INVALID_TREE, f"fold path row {row} follows row {tree[row]}, not {expected}: not a path"
            )
        expected = row
    return path


def fold_count(fold: Fold) -> int:
    """How many rows ``fold`` commits."""
    return fold if isinstance(fold, int) else len(fold)
