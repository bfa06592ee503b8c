"""Engine fuzzer: seeded hostile messages (the cases: ``examples/fuzz_cases.py``) over a raw ZeroMQ socket,
checked against the hardening aims of the engine (no crash, no hang, no ``internal`` error, no leaked page,
RSS back near its baseline, a valid client's greedy answer unchanged).

It speaks the wire protocol directly (docs/architecture.md, "The wire"): one DEALER, one msgpack map per
message, not the SDK. After ``hello`` it opens working sets, channels and a program so that there are real
handles to abuse, then sends seeded cases (``KINDS``): random bytes, non-map msgpack, wrong types, huge and
negative numbers, foreign handles, lying arrays, deep and huge programs, sampler extremes, oversized readouts,
channel takes that cannot be served, overflowing speculation reports and floods of fires. Each case's
messages must all be answered within a bound (documented waits included). Between cases a second, valid
client checks that ``ping`` answers and that a fixed greedy request gives the same token as before.

    .venv/bin/python examples/fuzz_engine.py --messages 20000 [--seed 0] [--model tiny-smol] [--engine ADDR]

Without ``--engine`` it starts an engine (``--kv-pages 256``) on ``--model`` and also reports its RSS.
``fuzz()`` is what ``tests/engine/test_fuzz.py`` runs.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from pie_runtime.protocol.messages import PROTOCOL_VERSION

if not __package__:  # run as a script: the repository root, so that `examples.fuzz_cases` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.fuzz_cases import KINDS, case_flood
from examples.fuzz_conn import (
    BOUND_S,
    GREEDY_PROMPT,
    CallError,
    Conn,
    EngineDied,
    Handles,
    Msg,
    pack,
    reply_key,
    short_repr,
)
from examples.fuzz_report import FuzzReport, print_report


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Victim:
    """The valid client: pings, a fixed greedy request, and handles the fuzzer must not be able to touch."""

    def __init__(self, conn: Conn, model: str):
        self.c = conn
        self.model = model
        self.ws = conn.call("ws_open", model=model)["ws"]
        conn.call("fire", ws=self.ws, tokens=GREEDY_PROMPT[:3])
        self.channel = conn.call("channel_open", model=model, shape=[1], dtype="int32", capacity=2)["channel"]
        conn.call(
            "channel_put", channel=self.channel, value={"dtype": "int32", "shape": [1], "data": b"\x2a\x00\x00\x00"}
        )

    def greedy(self) -> Any:
        ws = self.c.call("ws_open", model=self.model)["ws"]
        n = len(GREEDY_PROMPT)
        reply = self.c.call("fire", ws=ws, tokens=GREEDY_PROMPT, readouts=[{"rows": [n - 1], "kind": "argmax"}])
        self.c.call("ws_release", ws=ws)
        return reply["results"]

    def intact(self) -> bool:
        """Its working set still holds its 3 rows and its channel its one cell of 42."""
        try:
            fork = self.c.call("ws_fork", ws=self.ws)
            self.c.call("ws_release", ws=fork["ws"])
            cell = self.c.call("channel_read", channel=self.channel)
        except (RuntimeError, TimeoutError):
            return False
        return fork["committed"] == 3 and b"\x2a\x00\x00\x00" in pack(cell)

    def release(self) -> None:
        self.c.call("ws_release", ws=self.ws)
        self.c.call("channel_close", channel=self.channel)


def _pages(conn: Conn, model: str) -> tuple[int, int]:
    m = conn.call("stats")["models"][model]
    return m["pages_total"], m["pages_free"]


class Fuzzer:
    def __init__(self, ctx: zmq.Context, address: str, alive: Callable[[], bool], report: FuzzReport, bound_s: float):
        self.ctx, self.address, self.alive, self.report, self.bound_s = ctx, address, alive, report, bound_s
        self.c = Conn(ctx, address, alive, first_id=10_000_000)
        hello = self.c.call("hello", version=PROTOCOL_VERSION, client="fuzz")
        self.model = hello["default_model"]
        self.info = next(mi for mi in hello["models"] if mi["name"] == self.model)
        self.owned_ws: set[int] = set()
        self.owned_channels: set[int] = set()
        self.handles: Handles | None = None
        self.followups: list[Msg] = []  # messages a reply calls for, sent once the case is answered
        self.history: deque[str] = deque(maxlen=12)  # the last messages sent, for a failure's context

    def refresh(self, victim: Victim) -> Handles:
        """Releases what the last cases left and opens fresh working sets, channels and the program."""
        self.release_all()
        ws = [self.c.call("ws_open", model=self.model)["ws"] for _ in range(3)]
        self.owned_ws.update(ws)
        chans = [
            self.c.call("channel_open", model=self.model, shape=[1], dtype="int32", capacity=1)["channel"]
            for _ in range(2)
        ]
        self.owned_channels.update(chans)
        nodes = [
            {"op": "logits", "attrs": {"rows": [0]}},
            {"op": "argmax", "inputs": [0]},
            {"op": "put", "inputs": [1], "attrs": {"slot": 0, "shape": [1], "dtype": "int32"}},
        ]
        program = self.c.call("program_register", model=self.model, nodes=nodes)["program"]
        self.handles = Handles(self.model, self.info["vocab_size"], ws, chans, program, victim.ws, victim.channel)
        return self.handles

    def release_all(self) -> None:
        for ws in sorted(self.owned_ws):
            self._quiet("ws_release", ws=ws)
        for ch in sorted(self.owned_channels):
            self._quiet("channel_close", channel=ch)
        self.owned_ws.clear()
        self.owned_channels.clear()

    def _quiet(self, op: str, **fields: Any) -> None:
        try:
            self.c.call(op, **fields)
        except RuntimeError:
            pass  # already gone (a hostile release, or a foreign handle)

    def run_case(self, msgs: list[Msg]) -> None:
        """Sends the case's messages at once; each must be answered within the bound."""
        r = self.report
        pending: dict[Any, list[tuple[Msg, float]]] = {}
        for msg in msgs:
            self.c.sock.send(msg.payload)
            self.history.append(f"{msg.kind}: {msg.desc}")
            pending.setdefault(reply_key(msg.payload), []).append((msg, time.monotonic()))
            r.messages += 1
            r.sent_by_kind[msg.kind] += 1
        progress = time.monotonic()  # the last send or reply: a case fails when the engine stops answering it
        while any(pending.values()):
            left = progress + self.bound_s - time.monotonic()
            try:
                reply = self.c.recv(max(0.0, left))
            except EngineDied:
                inflight = [f"{m.kind}: {m.desc}" for q in pending.values() for m, _ in q]
                r.crashed = "; ".join(inflight[:3]) + (f" (+{len(inflight) - 3} more)" if len(inflight) > 3 else "")
                for q in pending.values():
                    for m, _ in q:
                        r.fail(m.kind, f"crash: the engine exited with {m.desc} in flight")
                        r.context.setdefault(m.kind, list(self.history))
                raise
            if reply is None:  # no reply for the bound: what is still pending hangs
                for q in pending.values():
                    for m, _ in q:
                        r.timeouts.append(f"{m.kind}: {m.desc}")
                        r.fail(m.kind, f"hang: no reply within {self.bound_s:.0f} s to {m.desc}")
                        r.context.setdefault(m.kind, list(self.history))
                pending.clear()
                break
            progress = time.monotonic()
            q = pending.get(reply.get("id"))
            if not q:
                r.stray_replies += 1
                continue
            msg, t0 = q.pop(0)
            r.max_latency_s = max(r.max_latency_s, time.monotonic() - t0)
            self._account(msg, reply)
        if self.followups:
            more, self.followups = self.followups, []
            self.run_case(more)

    def _account(self, msg: Msg, reply: dict) -> None:
        r = self.report
        if reply.get("ok"):
            r.ok_by_kind[msg.kind] += 1
            if msg.op in ("ws_open", "ws_fork") and isinstance(reply.get("ws"), int):
                self.owned_ws.add(reply["ws"])
            if msg.op == "channel_open" and isinstance(reply.get("channel"), int):
                self.owned_channels.add(reply["channel"])
            if msg.kind == "program_memory" and isinstance(reply.get("program"), str) and self.handles:
                # registered: fire it, so that its intermediates are made (and must be freed)
                fire = {"id": self.c.new_id(), "op": "fire", "ws": self.handles.ws[0], "tokens": [1],
                        "program": reply["program"], "fold": 0}  # fmt: skip
                self.followups.append(self.c.build("program_memory", fire))
            return
        err = reply.get("error") or {}
        code = str(err.get("code"))
        r.errors_by_code[code] += 1
        if code == "internal":
            r.internal.append(f"{msg.kind}: {err.get('message')} ← {msg.desc}")
            r.fail(msg.kind, f"internal: {err.get('message')} ← {msg.desc}")


def fuzz(
    address: str,
    messages: int,
    seed: int = 0,
    proc: subprocess.Popen | None = None,
    bound_s: float = BOUND_S,
    check_every: int = 250,
    kinds: list[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> FuzzReport:
    """Sends at least ``messages`` hostile messages to the engine at ``address``; ``proc`` (its process, when
    known) is watched for exits and measured for RSS. Stops early, with ``crashed`` set, if the engine dies."""
    rng = random.Random(seed)
    report = FuzzReport(seed=seed)
    alive: Callable[[], bool] = (lambda: proc.poll() is None) if proc is not None else (lambda: True)
    pid = proc.pid if proc is not None else None
    table = {k: v for k, v in KINDS.items() if kinds is None or k in kinds}
    names, weights = list(table), [w for _, w in table.values()]
    ctx = zmq.Context()
    t0 = time.monotonic()
    vc = Conn(ctx, address, alive, first_id=1000)
    fz: Fuzzer | None = None
    try:
        vc.call("hello", version=PROTOCOL_VERSION, client="fuzz-victim")
        fz = Fuzzer(ctx, address, alive, report, bound_s)
        victim = Victim(vc, fz.model)
        report.greedy_before = victim.greedy()
        report.stats_bytes_before = len(pack(vc.call("stats")))
        h = fz.refresh(victim)
        _warm_up(report, fz, victim, h, pid)
        last_check = 0
        while report.messages < messages:
            kind = rng.choices(names, weights)[0]
            before = len(report.first_failure)
            started = time.monotonic()
            fz.run_case(table[kind][0](fz.c, h, rng))
            report.seconds_by_kind[kind] += time.monotonic() - started
            if log and len(report.first_failure) > before:
                for k in list(report.first_failure)[before:]:
                    log(f"first failure of {k}: {report.first_failure[k]}")
                    for line in report.context.get(k, []):
                        log(f"    after: {line}")
            if report.messages - last_check >= check_every or report.messages >= messages:
                last_check = report.messages
                _check(report, victim, fz, log)
                h = fz.refresh(victim)
        report.foreign_intact = victim.intact()
        fz.release_all()
        victim.release()
        report.pages_total, report.pages_free_after = _pages(vc, fz.model)
        fz.c.close()  # the fuzzer leaves: what the engine keeps for it must go (spec totals by name, say)
        time.sleep(0.3)
        report.stats_bytes_after = len(pack(vc.call("stats")))
    except EngineDied:
        report.engine_alive = False
    except (CallError, TimeoutError) as e:  # a valid request failed: the run cannot go on
        report.control_errors.append(f"after {report.messages} messages: {e}")
        report.fail("control", str(e))
        if isinstance(e, CallError) and e.code == "internal":
            report.internal.append(f"control: {e}")
        if fz is not None:
            report.context.setdefault("control", list(fz.history))
        if log:
            log(f"a valid request failed after {report.messages} messages: {e}")
            for line in report.context.get("control", [])[-12:]:
                log(f"    after: {line}")
    finally:
        report.engine_alive = report.engine_alive and alive()
        if report.engine_alive and pid:
            time.sleep(0.5)
            report.rss_after_kb = rss_kb(pid)
        if fz is not None:
            fz.c.close()
        vc.close()
        ctx.term()
        report.elapsed_s = time.monotonic() - t0
    return report


def _warm_up(report: FuzzReport, fz: Fuzzer, victim: Victim, h: Handles, pid: int | None) -> None:
    """A flood not counted, so that the baselines (the valid client's latency, RSS) hold the step's buffers."""
    fz.run_case(case_flood(fz.c, h, random.Random(-1)))
    report.messages = 0
    for counter in (report.sent_by_kind, report.ok_by_kind, report.errors_by_code):
        counter.clear()
    started = time.monotonic()
    victim.greedy()
    report.greedy_ms_before = 1e3 * (time.monotonic() - started)
    report.rss_before_kb = rss_kb(pid) if pid else None


def _check(report: FuzzReport, victim: Victim, fz: Fuzzer, log: Callable[[str], None] | None) -> None:
    try:
        victim.c.call("ping", timeout_s=fz.bound_s)
    except (RuntimeError, TimeoutError) as e:
        report.ping_failures += 1
        if log:
            log(f"ping failed: {e}")
    started = time.monotonic()
    try:
        got = victim.greedy()
        report.greedy_ms_max = max(report.greedy_ms_max, 1e3 * (time.monotonic() - started))
    except (RuntimeError, TimeoutError) as e:
        got = f"failed: {e}"
    if got != report.greedy_before:
        report.greedy_mismatches.append(f"after {report.messages} messages: {short_repr(got)}")
        if log:
            log(f"greedy answer changed after {report.messages} messages: {short_repr(got)}")


# ---- the script ----------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="the model to start an engine on (default: the store's default)")
    p.add_argument("--engine", default=None, help="fuzz a running engine at this address instead")
    p.add_argument("--bound", type=float, default=BOUND_S, help="seconds each message may take to be answered")
    p.add_argument("--kinds", nargs="+", default=None, choices=sorted(KINDS), help="only these kinds")
    args = p.parse_args()
    from rich.console import Console

    console = Console(stderr=True)
    if args.engine:
        report = fuzz(args.engine, args.messages, args.seed, bound_s=args.bound, kinds=args.kinds, log=console.print)
    else:
        from pie_runtime.launcher import EmbeddedEngine

        with EmbeddedEngine([args.model] if args.model else None, ["--kv-pages", "256"]) as engine:
            report = fuzz(
                engine.address,
                args.messages,
                args.seed,
                proc=engine.proc,
                bound_s=args.bound,
                kinds=args.kinds,
                log=console.print,
            )
            if not report.engine_alive:
                console.print("engine log tail:\n" + "".join(engine.log.splitlines(keepends=True)[-15:]))
    print_report(report)


if __name__ == "__main__":
    main()
