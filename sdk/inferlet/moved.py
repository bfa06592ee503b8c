"""The old import paths of the modules that moved into :mod:`inferlet.spec` and :mod:`inferlet.text`.

Each old module (``inferlet.args``, ``inferlet.tree``, ...) re-exports its new home and warns once
(``DeprecationWarning``) when code outside the SDK imports it. They go in the next release.
"""

from __future__ import annotations

import sys
import warnings

# old module → its new home
MOVED = {
    "inferlet.args": "inferlet.text.arguments",
    "inferlet.output": "inferlet.text.output",
    "inferlet.choices": "inferlet.text.choices",
    "inferlet.grammar": "inferlet.text.grammar",
    "inferlet.tool_calls": "inferlet.text.tool_calls",
    "inferlet.lookup": "inferlet.spec.ngram_lookup",
    "inferlet.suffix": "inferlet.spec.suffix_index",
    "inferlet.tree": "inferlet.spec.token_tree",
}


def warn_moved(old: str) -> None:
    """Warns that ``old`` moved (to ``MOVED[old]``), at the line that imported it. The SDK's own modules that
    still import an old path do not warn: the user did not write that import."""
    frame = sys._getframe(2)  # 0: here, 1: the old module's body, 2: importlib or the importer
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        frame = frame.f_back
    if frame is None:
        return
    importer = str(frame.f_globals.get("__name__", ""))
    if importer.split(".")[0] == "inferlet":
        return
    warnings.warn_explicit(
        f"{old} moved to {MOVED[old]}: import from there (or from its package); the old path goes in the next release",
        DeprecationWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=importer,
        registry=frame.f_globals.setdefault("__warningregistry__", {}),
    )
