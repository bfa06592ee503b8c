"""The SDK's runtime: the ``@inferlet.main`` marker, sessions (one engine connection, its models and their
tokenizers) and the per-run context that lets many runs share one process.

A run's context (a ``contextvars`` variable, so each asyncio task of an inferlet host has its own) names its
session, where ``emit()`` writes, the inferlet's name, and the working sets and channels the run opened
(``client.Holdings``): ``run_in_context`` releases whatever the run left open when it ends, cancelled or not.
Outside any run (``pie run``'s child, scripts and tests that call ``inferlet.connect``) the process-wide
session from ``connect()`` is used and ``emit()`` writes to stdout.

``run_file`` is ``pie run``'s child: one inferlet file in its own process, the result written as JSON where the
launcher asked. An inferlet host (``pie_runtime/serve/inferlet_host.py``) loads each file once (``load_module``)
and runs many runs of it through ``run_in_context``.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib.util
import json
import sys
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from pie_runtime.protocol.errors import ErrorCode, PieError
from pie_runtime.protocol.messages import PROTOCOL_VERSION, ModelInfo

from .client import Client, Holdings, holding, release_holding
from .errors import EngineUnreachable, UsageError
from .model import Model
from .text.arguments import parse_args
from .tokenizer import Tokenizer
from .working_set import CACHE_SALT

Entry = Callable[[Any], Awaitable[Any]]

_entry: Entry | None = None  # the function marked with @inferlet.main by the module being loaded
_session: Session | None = None  # the process-wide session, for code outside a run context


def main(fn: Entry) -> Entry:
    """Marks ``async def main(args)`` as the inferlet's entry point."""
    global _entry
    _entry = fn
    return fn


class Session:
    """One connection to the engine and the models it serves (each with its tokenizer, fetched once)."""

    def __init__(self, client: Client, models: dict[str, Model], default: str):
        self.client = client
        self.models = models
        self.default = default
        self.inferlet = ""  # the running inferlet's name outside a run context (`pie run`), for the engine's stats

    @classmethod
    async def open(cls, address: str, token: str | None = None) -> Session:
        """Says hello and fetches each model's tokenizer."""
        client = Client(address)
        try:
            hello = await _hello(client, address, token)
            models = {}
            for fields in hello["models"]:
                info = ModelInfo.model_validate(fields)
                tok_json = (await client.request("tokenizer", model=info.name))["tokenizer_json"]
                tok = Tokenizer.for_model(tok_json, info)
                models[info.name] = Model(info, client, tok)
        except BaseException:
            client.close()
            raise
        return cls(client, models, hello["default_model"])

    def model(self, name: str | None = None) -> Model:
        key = name or self.default
        if key not in self.models:
            raise UsageError(
                f"the engine serves no model {key!r} (it serves {', '.join(self.models)}); a draft model is "
                f"served when attached to the target: `pie model drafter attach TARGET draft:{key}`, then restart "
                "the engine"
            )
        return self.models[key]

    def close(self) -> None:
        self.client.close()


@dataclass
class RunContext:
    """What one run sees as "its" runtime: the session, its inferlet's name and where its text goes."""

    session: Session
    inferlet: str
    sink: Callable[[str, list[dict] | None], None]  # (text, its tokens' logprobs entries or None)
    run_id: str = ""
    holdings: Holdings = field(default_factory=Holdings)


_current: contextvars.ContextVar[RunContext | None] = contextvars.ContextVar("inferlet_run", default=None)


def current_run() -> RunContext | None:
    """The run this code belongs to, or None outside a run context."""
    return _current.get()


# An engine answers hello between two steps, well within this even on a loaded machine; a socket with no engine
# behind it (a tcp:// address, or an ipc:// file a dead engine left) would otherwise be waited on forever.
HELLO_TIMEOUT_S = 30.0


async def _hello(client: Client, address: str, token: str | None) -> dict:
    try:
        return await asyncio.wait_for(
            client.request("hello", version=PROTOCOL_VERSION, client="inferlet", token=token), HELLO_TIMEOUT_S
        )
    except TimeoutError:
        raise EngineUnreachable(
            f"no engine answered at {address} within {HELLO_TIMEOUT_S:g} s: start one with `pie engine --listen"
            f" {address}`{' (and pass its --token)' if address.startswith('tcp://') else ''}, or leave out --engine"
            " and pie run starts one for this run"
        ) from None
    except PieError as e:
        if e.code != ErrorCode.UNAUTHORIZED:
            raise
        raise EngineUnreachable(
            f"the engine at {address} refused the token ({e.message}): pass the one it was started with,"
            " pie run --token @FILE or $PIE_TOKEN"
        ) from None


async def connect(address: str, token: str | None = None) -> Session:
    """Opens a session and makes it the process-wide one that ``inferlet.model()`` uses outside a run."""
    global _session
    _session = await Session.open(address, token)
    return _session


def _current_session() -> Session:
    ctx = _current.get()
    if ctx is not None:
        return ctx.session
    if _session is None:
        raise RuntimeError("not connected to an engine (run this file with `pie run`)")
    return _session


def inferlet_name() -> str:
    """The running inferlet's name ("" outside ``pie run`` and a host's runs)."""
    ctx = _current.get()
    if ctx is not None:
        return ctx.inferlet
    return _session.inferlet if _session is not None else ""


def model(name: str | None = None) -> Model:
    """The engine's model ``name`` (its default model without one), in this run's session."""
    return _current_session().model(name)


def emit(text: str, logprobs: list[dict] | None = None) -> None:
    """Streams text to the user as it is generated; ``logprobs``: the logprobs entries of the tokens it came
    from (``sampler.logprob_entry``), for a server that streams them (stdout shows only the text)."""
    ctx = _current.get()
    if ctx is not None:
        ctx.sink(text, logprobs)
        return
    sys.stdout.write(text)
    sys.stdout.flush()


async def run_in_context(
    fn: Entry,
    args: Any,
    *,
    session: Session,
    inferlet: str,
    sink: Callable[[str, list[dict] | None], None],
    run_id: str = "",
    cache_salt: str | None = None,
) -> Any:
    """Awaits ``fn(args)`` as one run: ``inferlet.model()``, ``emit()`` and ``inferlet_name()`` resolve to this
    run's context, and the working sets and channels it leaves open are released when it ends (cancelled too).
    ``cache_salt``: the prefix-cache salt of the working sets it opens (working_set.CACHE_SALT)."""
    ctx = RunContext(session, inferlet, sink, run_id)
    CACHE_SALT.set(cache_salt)  # this run's task has a context of its own: set for it alone
    run_token = _current.set(ctx)
    hold_token = holding(ctx.holdings)
    try:
        return await fn(args)
    finally:
        release_holding(hold_token)
        _current.reset(run_token)
        # shielded: a second cancel while releasing must not leave pages behind
        await asyncio.shield(session.client.release(ctx.holdings))


def jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON types: pydantic models dumped, numpy arrays and scalars as lists and numbers."""
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def load_module(path: Path, module_name: str | None = None) -> tuple[Any, Entry]:
    """Executes an inferlet file as a module; returns it and its ``@inferlet.main`` function."""
    global _entry
    name = module_name or f"inferlet_{path.stem.replace('-', '_')}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    _entry = None
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    entry, _entry = _entry, None
    if entry is None:
        sys.modules.pop(spec.name, None)
        raise RuntimeError(f"{path} has no function marked with @inferlet.main")
    return module, entry


def load_entry(path: Path) -> Entry:
    return load_module(path)[1]


async def _run(path: Path, engine: str, words: list[str], token: str | None) -> Any:
    fn = load_entry(path)
    args = parse_args(words, fn)
    session = await connect(engine, token)
    session.inferlet = path.stem
    try:
        return await fn(args)
    finally:
        session.close()


def run_file(path: str, engine: str, words: list[str], result_path: str | None, token: str | None = None) -> int:
    try:
        result = asyncio.run(_run(Path(path), engine, words, token))
        payload = {"ok": True, "result": jsonable(result)}
        code = 0
    except BaseException as e:  # any failure of user code is reported, not raised
        if isinstance(e, KeyboardInterrupt):
            raise
        if isinstance(e, UsageError):  # the user's to fix: one line, no traceback
            payload = {"ok": False, "error": str(e)}
        else:
            traceback.print_exc()
            payload = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        code = 1
    if result_path:
        Path(result_path).write_text(json.dumps(payload))
    else:
        print(json.dumps(payload))
    return code
