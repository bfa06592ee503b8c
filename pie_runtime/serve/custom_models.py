"""Custom inferlets on the OpenAI routes: each file of ``pie serve --inferlets DIR`` whose ``main`` takes the
completion arguments (``CompletionArgs``, inferlet_probe.py) is served as the model ``MODEL:NAME`` (listed by
``/v1/models``, e.g. ``smollm2-135m:my-drafter``), and a request on the served model may name it in the
extension field ``inferlet`` instead. Completions, chat completions and responses then run it in place of
the shipped inferlet, with the same arguments, streaming, stop, logprobs and usage.

    model "MODEL"                      → the shipped inferlets (text-completion, or the speculation policy's)
    model "MODEL:NAME" or inferlet NAME → the custom inferlet NAME
    an unknown MODEL or NAME            → 404 model_not_found / inferlet_not_found
    NAME that takes other arguments     → 400 inferlet_not_completion (saying what its Args lack)
    NAME of a shipped inferlet          → 400 (shipped ones are picked by ``speculation`` and the policy)

A custom file may not take a shipped inferlet's name (``check_folders``: `pie serve` refuses to start), so a
``text-completion.py`` in DIR never replaces the shipped one. Which files qualify is asked of a separate process
(the files are code) once per file and again only when the file changes, so a file added while the server runs
is served from the next request on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from ..launcher import shipped_inferlets
from .errors import invalid_request, not_found

log = logging.getLogger("pie.serve")

SEP = ":"  # MODEL:NAME
PROBE_TIMEOUT_S = 120.0  # loading a file imports what it imports (numpy, torch...): generous, a safety net


def custom_files(folders: list[Path]) -> dict[str, Path]:
    """Name → file of the custom inferlets in ``folders`` (a later folder's file wins), shipped names left out."""
    shipped = set(shipped_inferlets())
    out: dict[str, Path] = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("*.py")):
            if not path.stem.startswith("_") and path.stem not in shipped:
                out[path.stem] = path.resolve()
    return out


def check_folders(folders: list[Path]) -> None:
    """A ValueError naming every file in ``folders`` that has a shipped inferlet's name (it would otherwise
    be mistaken for, or silently replace, the shipped one)."""
    shipped = set(shipped_inferlets())
    clashes = [p for f in folders for p in sorted(Path(f).glob("*.py")) if p.stem in shipped]
    if clashes:
        names = ", ".join(str(p) for p in clashes)
        raise ValueError(
            f"--inferlets: {names} has the name of a shipped inferlet; rename it (e.g. my-{clashes[0].stem}.py), "
            "then serve it as MODEL:NAME"
        )


@dataclass
class Verdict:
    """Whether a file takes the completion arguments (``why`` not, when it does not), as of its mtime."""

    mtime_ns: int
    completion: bool
    why: str


class CustomModels:
    """The custom inferlets of ``folders`` that serve as models, and the routing of a request to one."""

    def __init__(self, folders: list[Path], probe_timeout: float = PROBE_TIMEOUT_S) -> None:
        self.folders = [Path(f) for f in folders]
        self.probe_timeout = probe_timeout
        self._verdicts: dict[Path, Verdict] = {}
        self._lock = asyncio.Lock()

    async def verdicts(self) -> dict[str, Verdict]:
        """Name → verdict of every custom inferlet now (files new or changed since their last probe probed)."""
        files = custom_files(self.folders)
        async with self._lock:
            stale = [p for p in files.values() if self._stale(p)]
            if stale:
                for path, (ok, why) in (await self._probe(stale)).items():
                    self._verdicts[path] = Verdict(_mtime(path), ok, why)
                    log.info("custom inferlet %s: %s", path.stem, "served as a model" if ok else f"not a model: {why}")
        return {name: self._verdicts[path] for name, path in files.items() if path in self._verdicts}

    async def served(self) -> list[str]:
        """The names of the custom inferlets served as models, sorted."""
        return sorted(name for name, v in (await self.verdicts()).items() if v.completion)

    async def route(self, model: str, inferlet: str | None, ids: tuple[str, ...]) -> str | None:
        """The custom inferlet a request names (its ``model`` ``MODEL:NAME``, or its ``inferlet`` field), or None
        for the shipped ones; ``ids``: the served model's names. A typed 404 or 400 for what cannot be served."""
        named = None
        if model not in ids:
            base, sep, named = model.rpartition(SEP)
            if not sep or base not in ids or not named:
                served = ", ".join([ids[0], *(f"{ids[0]}{SEP}{n}" for n in await self.served())])
                raise not_found(f"the model {model!r} does not exist (served: {served})", "model_not_found", "model")
        if named is not None and inferlet is not None and inferlet != named:
            raise invalid_request(f"the model names the inferlet {named!r}, the request {inferlet!r}", "inferlet")
        name = named or inferlet
        if name is None:
            return None
        param = "model" if named is not None else "inferlet"
        if name in shipped_inferlets():
            raise invalid_request(
                f"{name!r} is a shipped inferlet: the server's speculation policy and a request's `speculation` "
                "choose among those; `inferlet` and MODEL:NAME name custom ones (--inferlets DIR)",
                param,
                "inferlet_not_custom",
            )
        verdict = (await self.verdicts()).get(name)
        if verdict is None:
            code = "model_not_found" if param == "model" else "inferlet_not_found"
            raise not_found(f"no custom inferlet {name!r} (served: {await self.served() or 'none'})", code, param)
        if not verdict.completion:
            raise invalid_request(
                f"the inferlet {name!r} does not take completion requests: {verdict.why}",
                param,
                "inferlet_not_completion",
            )
        return name

    def _stale(self, path: Path) -> bool:
        v = self._verdicts.get(path)
        return v is None or v.mtime_ns != _mtime(path)

    async def _probe(self, paths: list[Path]) -> dict[Path, tuple[bool, str]]:
        """Each file's verdict from a probe process; a batch whose process fails is probed again one file at a
        time, so one file that ends its process (``os._exit`` on load) costs only itself."""
        got = await self._run_probe(paths)
        if got is not None or len(paths) == 1:
            return got or {p: (False, "loading it ended the probe process") for p in paths}
        out: dict[Path, tuple[bool, str]] = {}
        for p in paths:
            out.update(await self._probe([p]))
        return out

    async def _run_probe(self, paths: list[Path]) -> dict[Path, tuple[bool, str]] | None:
        cmd = [sys.executable, "-m", "pie_runtime.serve.inferlet_probe", *map(str, paths)]
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, stdin=asyncio.subprocess.DEVNULL
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.probe_timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return None
        try:
            verdicts = json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            return None
        return {p: (bool(verdicts[str(p)]["completion"]), str(verdicts[str(p)]["why"])) for p in paths}


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return -1
