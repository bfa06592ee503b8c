"""The suffix policy's pieces (``--draft-suffix K[:ROWS]``, ``--suffix-index FILE``): its static index checked
before the listener binds, and the arguments each request's run of suffix-speculative-decoding gets.

Every run a server starts under the policy sends the same store arguments (bound, min match, index file), so the
inferlet's ``Model.shared`` key is the same in every run of a host: one cross-request store per host and model,
started from the index file by the host's first suffix run. The file is read whole here first, so a file that is
missing, is not a suffix index, or holds token ids past the model's vocabulary stops `pie serve` before it binds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inferlet.spec.suffix_index import SuffixIndex

STORE_TOKENS = 1_000_000  # the store's bound in tokens (the inferlet's default: ~155 MB, docs/performance.md)


def check_suffix_index(path: str, vocab_size: int) -> str:
    """The index file's absolute path once it loads and fits the model's vocabulary; raises ValueError."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"--suffix-index {path}: no such file")
    try:
        index = SuffixIndex.load(file)
    except (OSError, ValueError, KeyError) as e:  # numpy's errors for a file that is not an .npz among them
        raise ValueError(f"--suffix-index {path}: not a suffix index ({type(e).__name__}: {e})") from None
    top = max((max(doc) for doc in index.documents() if doc), default=-1)
    if top >= vocab_size:
        raise ValueError(f"--suffix-index {path}: token id {top} is past the model's vocabulary ({vocab_size})")
    return str(file.resolve())


def suffix_args(k: int, tree_rows: int, suffix_index: str | None) -> dict[str, Any]:
    """The inferlet arguments of the policy (read from suffix-speculative-decoding's Args)."""
    args: dict[str, Any] = {"draft_length": k, "store_tokens": STORE_TOKENS}
    if tree_rows:
        args["tree_rows"] = tree_rows
    if suffix_index:
        args["suffix_index"] = suffix_index
    return args
