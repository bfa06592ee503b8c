"""Which custom inferlets take a completion request's arguments, asked in a process of its own:

    python -m pie_runtime.serve.inferlet_probe FILE...

loads each file as an inferlet host would (``inferlet.runtime.load_module``) and prints one JSON object on
stdout, ``{FILE: {"completion": bool, "why": str}}``. A file qualifies when its ``@inferlet.main`` takes a
pydantic model with every field of ``CompletionArgs`` (a subclass of it, usually ``DecodeArgs``) and needs no
field a completion request does not give; ``why`` says what is missing when it does not. The files are the
operator's code (``pie serve --inferlets DIR``): they run here, never in the server's own process, so what they
do when loaded (imports, module-level state, a crash) stays out of it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def probe(path: Path, index: int) -> dict[str, Any]:
    """One file's verdict: ``{"completion": bool, "why": str}``."""
    from inferlet.runtime import load_module
    from inferlet.text.arguments import CompletionArgs, args_model

    try:
        _, entry = load_module(path, f"inferlet_probe_{index}_{path.stem.replace('-', '_')}")
    except BaseException as e:  # noqa: BLE001 -- whatever loading the file raised is its verdict, not ours
        return {"completion": False, "why": f"it does not load: {type(e).__name__}: {e}"}
    model = args_model(entry)
    if model is None:
        return {"completion": False, "why": "its main takes a dict, not CompletionArgs"}
    wanted = set(CompletionArgs.model_fields)
    missing = sorted(wanted - set(model.model_fields))
    if missing:
        why = f"its {model.__name__} lacks {', '.join(missing)} (subclass inferlet.text.CompletionArgs)"
        return {"completion": False, "why": why}
    needed = sorted(n for n, f in model.model_fields.items() if f.is_required() and n not in wanted)
    if needed:
        return {"completion": False, "why": f"its {model.__name__} needs {', '.join(needed)}, which requests lack"}
    return {"completion": True, "why": ""}


def main(argv: list[str] | None = None) -> int:
    files = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the files print while loading goes to stderr, so stdout carries only the verdicts
    verdicts = {str(f): probe(f, i) for i, f in enumerate(files)}
    out.write(json.dumps(verdicts) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
