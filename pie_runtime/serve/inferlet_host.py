"""An inferlet host: one process that runs many inferlet runs as asyncio tasks over one engine connection.

    python -m pie_runtime.serve.inferlet_host --control ADDR --engine ADDR --id ID [--parent PID] [--limits JSON]
        [--heartbeat S]          (the engine's token, if any, in $PIE_TOKEN)

It first applies its ``HostLimits`` to itself and asks to die with its server (``limits.py``).

The host opens one SDK session (hello, each model's tokenizer: once per host), connects its control socket
to the server (``control.py``) and says ``ready``. Each ``run`` message loads the inferlet file once (a module
per file, reloaded only when the file changes), validates the args dict with the inferlet's own Args model
(``bad_arguments``) and starts a task under its own run context (``inferlet.runtime.run_in_context``): its
``emit()`` text streams back as ``text`` messages, its end as ``result`` or ``error``. A ``cancel`` cancels
the task; the run context releases the working sets and channels the run left open.

The engine sees one client per host, so a host's death (a crash, ``os._exit``, an rlimit, the server killing
it for missed heartbeats) releases all its runs' working sets at once; the server restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from inferlet.errors import UsageError
from inferlet.runtime import Entry, Session, jsonable, load_module, run_in_context
from inferlet.text.arguments import parse_arg_dict

from . import control as c
from .limits import HostLimits, apply, die_with_parent, reap_strays


@dataclass(slots=True)
class Chunk:
    """Text a run emitted, on its way out as a ``text`` message (``control.encode_text``): a plain record, as
    a token's text is queued for every token and its fields are the host's own, not to be validated."""

    run: str
    text: str
    logprobs: list[dict] | None = None


@dataclass
class _Loaded:
    mtime_ns: int
    entry: Entry


@dataclass
class Host:
    session: Session
    sock: zmq.asyncio.Socket
    heartbeat_s: float
    reap: bool = False  # after each run, kill what it forked (a sandboxed host: alone in its pid namespace)
    modules: dict[str, _Loaded] = field(default_factory=dict)
    runs: dict[str, asyncio.Task] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)  # runs whose task was cancelled (once)
    outbox: asyncio.Queue[Chunk | c.Result | c.Error | c.Ready | c.Heartbeat] = field(default_factory=asyncio.Queue)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    def entry(self, path: Path) -> Entry:
        """The file's ``@inferlet.main``, executing the file once (again only when it changed on disk)."""
        key = str(path)
        mtime = path.stat().st_mtime_ns
        loaded = self.modules.get(key)
        if loaded is None or loaded.mtime_ns != mtime:
            module_name = f"inferlet_host_{len(self.modules)}_{path.stem.replace('-', '_')}"
            loaded = _Loaded(mtime, load_module(path, module_name)[1])
            self.modules[key] = loaded
        return loaded.entry

    def start(self, msg: c.StartRun) -> None:
        if msg.run in self.runs:
            self.outbox.put_nowait(c.Error(run=msg.run, code="bad_arguments", message="duplicate run id"))
            return
        try:
            fn = self.entry(Path(msg.path))
        except FileNotFoundError:
            self.outbox.put_nowait(c.Error(run=msg.run, code="not_found", message=f"no inferlet file {msg.path}"))
            return
        except Exception as e:  # noqa: BLE001 -- the inferlet module failed to load: its fault, not the host's
            traceback.print_exc()
            self.outbox.put_nowait(c.Error(run=msg.run, code="inferlet_error", message=_describe(e)))
            return
        try:
            args = parse_arg_dict(msg.args, fn)
        except ValueError as e:  # pydantic's ValidationError is one
            self.outbox.put_nowait(c.Error(run=msg.run, code="bad_arguments", message=str(e)))
            return
        task = asyncio.get_running_loop().create_task(self._run(msg.run, msg.inferlet, fn, args, msg.cache_salt))
        task.add_done_callback(lambda t, run_id=msg.run: self._cancelled_before_start(t, run_id))
        self.runs[msg.run] = task

    async def _run(self, run_id: str, inferlet: str, fn: Entry, args: Any, salt: str | None = None) -> None:
        def sink(text: str, logprobs: list[dict] | None = None) -> None:
            if text:
                self.outbox.put_nowait(Chunk(run_id, text, logprobs))

        try:
            salted = {"cache_salt": salt} if salt else {}  # unsalted runs ask nothing new of the SDK
            result = await run_in_context(
                fn, args, session=self.session, inferlet=inferlet, sink=sink, run_id=run_id, **salted
            )
            reply: c.Result | c.Error = c.Result(run=run_id, result=jsonable(result))
        except asyncio.CancelledError:
            reply = c.Error(run=run_id, code="cancelled", message="the run was cancelled")
        except UsageError as e:  # what the request asks cannot be served here: the caller's to change
            reply = c.Error(run=run_id, code="bad_arguments", message=str(e))
        except Exception as e:  # noqa: BLE001 -- whatever the inferlet raised fails its run only
            traceback.print_exc()
            reply = c.Error(run=run_id, code="inferlet_error", message=_describe(e))
        finally:
            self.runs.pop(run_id, None)
            self.cancelled.discard(run_id)
            if self.reap:
                reap_strays()
        try:
            c.encode(reply)
        except (TypeError, ValueError) as e:  # a result msgpack cannot carry
            reply = c.Error(run=run_id, code="inferlet_error", message=f"the result is not serializable: {e}")
        self.outbox.put_nowait(reply)

    def _cancelled_before_start(self, task: asyncio.Task, run_id: str) -> None:
        """A task cancelled before its first step never enters ``_run``: answer for it here."""
        if task.cancelled():
            self.runs.pop(run_id, None)
            self.cancelled.discard(run_id)
            self.outbox.put_nowait(c.Error(run=run_id, code="cancelled", message="the run was cancelled"))

    def cancel(self, run_id: str) -> None:
        """Cancels the run's task once: a second cancel could cut short the release of what it held."""
        task = self.runs.get(run_id)
        if task is not None and run_id not in self.cancelled:
            self.cancelled.add(run_id)
            task.cancel()

    async def receive(self) -> None:
        while not self.stopping.is_set():
            data = await self.sock.recv()
            try:
                msg = c.decode_to_host(data)
            except ValueError as e:
                print(f"pie host: dropped a control message that does not validate: {e}", file=sys.stderr)
                continue
            if isinstance(msg, c.StartRun):
                self.start(msg)
            elif isinstance(msg, c.CancelRun):
                self.cancel(msg.run)
            else:
                self.stopping.set()

    async def send(self) -> None:
        """Sends the outbox in order; consecutive text of one run that queued up goes as one message."""
        while True:
            batch = [await self.outbox.get()]
            while not self.outbox.empty():
                batch.append(self.outbox.get_nowait())
            for msg in _coalesce(batch):
                data = c.encode_text(msg.run, msg.text, msg.logprobs) if isinstance(msg, Chunk) else c.encode(msg)
                await self.sock.send(data)

    async def heartbeat(self) -> None:
        while True:
            self.outbox.put_nowait(c.Heartbeat())
            await asyncio.sleep(self.heartbeat_s)


def _coalesce(batch: list[Any]) -> list[Any]:
    out: list[Any] = []
    for msg in batch:
        prev = out[-1] if out else None
        if isinstance(msg, Chunk) and isinstance(prev, Chunk) and prev.run == msg.run:
            lps = (
                None if prev.logprobs is None and msg.logprobs is None else (prev.logprobs or []) + (msg.logprobs or [])
            )
            out[-1] = Chunk(msg.run, prev.text + msg.text, lps)
        else:
            out.append(msg)
    return out


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


async def serve(
    control: str, engine: str, host_id: str, heartbeat_s: float, token: str | None, reap: bool = False
) -> None:
    session = await Session.open(engine, token)
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, host_id.encode())
    sock.connect(control)
    host = Host(session, sock, heartbeat_s, reap)
    host.outbox.put_nowait(c.Ready(pid=os.getpid()))
    workers = [asyncio.create_task(w) for w in (host.receive(), host.send(), host.heartbeat())]
    stop = asyncio.create_task(host.stopping.wait())
    done, _ = await asyncio.wait([*workers, stop], return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        if task is not stop and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    for run in list(host.runs.values()):
        run.cancel()
    await asyncio.gather(*host.runs.values(), return_exceptions=True)
    for w in workers:
        w.cancel()
    session.close()
    sock.close(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pie_runtime.serve.inferlet_host")
    p.add_argument(
        "--control", required=True, help="the server's control address (ipc://..., or tcp:// from another node)"
    )
    p.add_argument("--engine", required=True, help="the engine's address")
    p.add_argument("--id", required=True, help="this host's identity on the control socket")
    p.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats")
    p.add_argument(
        "--parent",
        type=int,
        default=None,
        help="the pid of who started it (the server, or its host actor): die with it",
    )
    p.add_argument("--limits", default=None, help="HostLimits as JSON")
    p.add_argument("--reap", action="store_true", help="after each run, kill every other process of its pid namespace")
    a = p.parse_args(argv)
    if a.parent is not None:
        die_with_parent(a.parent)
    if a.limits:
        apply(HostLimits.model_validate_json(a.limits))
    asyncio.run(serve(a.control, a.engine, a.id, a.heartbeat, os.environ.get("PIE_TOKEN"), a.reap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
