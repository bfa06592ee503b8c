"""Soak `pie serve` with mixed traffic for a stated time and say whether it stayed flat.

    python examples/soak_serve.py --minutes 5 [--model NAME] [--concurrency 4] [--json OUT] [-- SERVE FLAGS...]
    python examples/soak_serve.py --url http://127.0.0.1:8000 --seconds 20

Without ``--url`` it starts `pie serve` on a free loopback port (the flags after ``--`` go to it) and stops it
at the end. ``--concurrency`` clients send, for the whole time, a weighted mix of: streamed and whole chat
and completion requests (read to the end), cancelled ones (a stream dropped after its first chunks, a whole
request abandoned after 0.2 s: the client disconnects), oversized ones (a body past ``--oversize-bytes``: 413;
a prompt past the model's context: 400) and malformed ones (bad JSON, wrong types, an unknown model, an empty
prompt, a negative max_tokens, deeply nested JSON: 4xx with an error object).

After a warm-up (a few requests of each kind, and with ``--hostile`` one hostile round, so that its sandbox
is up) and again at the end, once no request runs, it reads: the engine's KV pages in use
(``pie_kv_pages_used`` from /metrics), and the RSS and open file descriptors of every process of the server's
tree: the server, the engine (its pid from /health) and each inferlet host below the server (a sandbox's bwrap
and its host; "hosts" sums them). Between the two it samples the same every ``--sample-seconds``. It prints
both snapshots, each role's first, last and largest RSS and fds and its RSS slope over the run's last half
(MiB a minute), every outcome by kind, status and error code, and a verdict: FLAT when the pages are back to
their start value, no host process more than at the start, the descriptors grew by at most 4 a role, RSS by at
most 10% + 32 MiB a role (the engine's also by its KV pool: ``--kv-mib``, see below), and no request got an
answer it should not have (a 5xx, a refused good request, an accepted bad one, a dropped connection). The
samples and their slope are not in the verdict: they are taken with requests in flight (a hog run's host holds
its readouts for a moment), so they show a trend, not a level.

``--hostile``: the server it starts has four API keys; the clients take turns with three of them, and the
fourth runs examples/hostile_tenant.py's loop for the whole time (uploads allowed). The verdict is the same,
over the sandboxed hosts too; the hostile key's outcomes are listed, a fault among them is unexpected.

``--kv-mib M`` (default 128) is the KV pool of a server it starts (``--kv-memory M``, unless the flags after
``--`` name a pool). The pool's pages become resident as working sets first use them, so an engine's RSS grows
by up to the pool's size over a soak and then holds (the pool is a budget, not a leak): the verdict allows the
engine that much more. Against ``--url`` it allows the same ``--kv-mib``.

``--kill-engine-after S`` SIGKILLs the engine S seconds in: the 503s that follow (``engine_lost`` for the
requests in flight, ``engine_restarting`` until a new engine serves) are deliberate, and the report says how
soon the first came back and when /health said the server serves again. The end's "engine" is then the new
engine, compared with the old one's start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

if not __package__:  # run as a script: its neighbours import by name
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile_tenant import hostile_loop, hostile_round, tenant_flags, unexpected, upload
from soak_procs import Proc, engine_pid, listener_pid, sample, summarize, tree

FD_SLACK, RSS_SLACK, RSS_SLACK_BYTES = 4, 0.10, 32 << 20
WEIGHTS = {"stream": 30, "whole": 25, "cancel": 20, "oversized": 5, "malformed": 20}
DELIBERATE = {"engine_lost", "engine_restarting"}  # 503s expected after --kill-engine-after


@dataclass
class Snapshot:
    pages_used: float
    procs: dict[str, Proc]  # "server", "engine", "hosts" (summed; pid: the first's)
    each: dict[str, Proc] = field(default_factory=dict)  # every process alone, by "name pid"


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)  # "kind status code" -> count
    unexpected: Counter[str] = field(default_factory=Counter)
    sent: Counter[str] = field(default_factory=Counter)
    killed_at: float | None = None  # when --kill-engine-after killed the engine (monotonic)
    first_lost: float | None = None  # when the first answer saying so came back
    last_status: str = ""

    def add(self, kind: str, status: str, code: str | None, expected: bool) -> None:
        key = f"{kind} {status} {code or '-'}"
        self.outcomes[key] += 1
        self.last_status = status
        if self.killed_at is not None and code in DELIBERATE:  # the deliberate kill's answers
            expected = True
            self.first_lost = self.first_lost or time.monotonic()
        if not expected:
            self.unexpected[key] += 1


# ---- the server and its processes ----------------------------------------------------------------------------


def start_server(model: str | None, flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pie_runtime.cli.main", "serve", "--http", f"127.0.0.1:{port}"]
    cmd += (["--model", model] if model else []) + flags
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ})
    assert proc.stdout is not None
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], 900)
        line = proc.stdout.readline() if ready else ""
        if "pie serve ready" in line:
            return proc, f"http://127.0.0.1:{port}"
        if not line:
            proc.kill()
            raise SystemExit(f"pie serve did not start: {log.read_text()[-2000:]}")


async def snapshot(client: httpx.AsyncClient, server_pid: int | None) -> Snapshot:
    """Waits until no request runs or waits and the pages in use held still for a second (a cancelled run
    releases its pages just after its request ends; 60 s at most), then reads pages, RSS and descriptors."""
    deadline = time.monotonic() + 60
    held: tuple[float, float] | None = None  # (pages, since when)
    while True:
        page = (await client.get("/metrics")).text
        busy = sum(_sum(page, n) for n in ("pie_requests_running", "pie_requests_waiting"))
        pages, now = _sum(page, "pie_kv_pages_used"), time.monotonic()
        held = held if busy == 0 and held is not None and held[0] == pages else (pages, now)
        if (busy == 0 and now - held[1] >= 1.0) or now > deadline:
            break
        await asyncio.sleep(0.25)
    roles, each = tree(server_pid, await engine_pid(client))
    return Snapshot(_sum(page, "pie_kv_pages_used"), roles, each)


def _sum(page: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in page.splitlines() if ln.startswith((name + "{", name + " ")))


# ---- the traffic ---------------------------------------------------------------------------------------------


@dataclass
class Target:
    model: str
    max_model_len: int
    oversize_bytes: int


def malformed(t: Target, rng: random.Random) -> tuple[str, bytes]:
    """A bad request: (path, body)."""
    deep = "[" * 5000 + "]" * 5000
    cases = [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", json.dumps({"model": t.model, "prompt": 5}).encode()),
        ("/v1/completions", json.dumps({"model": "no-such-model", "prompt": "x"}).encode()),
        ("/v1/completions", json.dumps({"model": t.model, "prompt": ""}).encode()),
        ("/v1/completions", json.dumps({"model": t.model, "prompt": "x", "max_tokens": -1}).encode()),
        ("/v1/chat/completions", json.dumps({"model": t.model, "messages": []}).encode()),
        ("/v1/chat/completions", f'{{"model": "{t.model}", "messages": {deep}}}'.encode()),
    ]
    return rng.choice(cases)


def good_body(t: Target, rng: random.Random, chat: bool) -> dict:
    words = " ".join(rng.choice(["red", "blue", "cat", "sea", "run", "tree", "one", "two"]) for _ in range(12))
    body: dict = {"model": t.model, "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.7])}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Continue: {words}"}]
    else:
        body["prompt"] = words
    return body


async def one(client: httpx.AsyncClient, t: Target, kind: str, rng: random.Random, tally: Tally) -> None:
    """Sends one request of ``kind`` and records its outcome."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    tally.sent[kind] += 1
    try:
        if kind == "stream":
            await _stream(client, path, {**good_body(t, rng, chat), "stream": True}, tally)
        elif kind == "whole":
            r = await client.post(path, json=good_body(t, rng, chat))
            _record(tally, kind, r, r.status_code == 200 and "choices" in r.json())
        elif kind == "cancel":
            await _cancel(client, path, good_body(t, rng, chat), rng, tally)
        elif kind == "oversized":
            await _oversized(client, t, rng, tally)
        else:
            path, raw = malformed(t, rng)
            r = await client.post(path, content=raw, headers={"content-type": "application/json"})
            _record(tally, kind, r, 400 <= r.status_code < 500 and "error" in r.json())
    except httpx.HTTPError as e:
        tally.add(kind, type(e).__name__, None, expected=False)


async def _stream(client: httpx.AsyncClient, path: str, body: dict, tally: Tally) -> None:
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            _record(tally, "stream", r, False)
            return
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    errors = [json.loads(x[6:])["error"] for x in lines[:-1] if '"error"' in x]
    ok = lines[-1:] == ["data: [DONE]"] and not errors
    tally.add("stream", "200" if ok else "200+error", errors[0].get("code") if errors else None, ok)


async def _cancel(client: httpx.AsyncClient, path: str, body: dict, rng: random.Random, tally: Tally) -> None:
    """A stream dropped after its first chunk, or a whole request abandoned after 0.2 s."""
    if rng.random() < 0.5:
        async with client.stream("POST", path, json={**body, "max_tokens": 64, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                _record(tally, "cancel", r, False)
                return
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # leaving the block closes the connection mid-stream
        tally.add("cancel", "dropped-stream", None, True)
        return
    try:
        r = await asyncio.wait_for(client.post(path, json={**body, "max_tokens": 64}), 0.2)
        _record(tally, "cancel", r, r.status_code == 200)  # finished within 0.2 s
    except TimeoutError:
        tally.add("cancel", "abandoned", None, True)


async def _oversized(client: httpx.AsyncClient, t: Target, rng: random.Random, tally: Tally) -> None:
    if rng.random() < 0.5:
        raw = b'{"model": "%s", "prompt": "' % t.model.encode() + b"a" * t.oversize_bytes + b'"}'
        r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        _record(tally, "oversized", r, r.status_code == 413)
    else:
        body = {"model": t.model, "prompt": "hello " * (t.max_model_len + 64), "max_tokens": 4}
        r = await client.post("/v1/completions", json=body)
        _record(tally, "oversized", r, r.status_code == 400)


def _record(tally: Tally, kind: str, r: httpx.Response, expected: bool) -> None:
    code = None
    if r.status_code != 200:
        try:
            code = r.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "no-error-object"
            expected = False
    tally.add(kind, str(r.status_code), code, expected)


async def traffic(
    client: httpx.AsyncClient, t: Target, a: argparse.Namespace, seconds: float
) -> tuple[Tally, dict | None]:
    """The mix for ``seconds`` from ``a.concurrency`` clients; with ``a.kill_engine_after``, the engine is
    SIGKILLed then and the second item says what followed (None otherwise)."""
    tally = Tally()
    stop = time.monotonic() + seconds
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())

    async def worker(i: int) -> None:
        rng = random.Random(a.seed * 1000 + i)
        mine = client
        if a.honest_keys:  # each worker one of the honest keys, in turn
            key = a.honest_keys[i % len(a.honest_keys)]
            mine = httpx.AsyncClient(base_url=client.base_url, timeout=600, headers=_auth(key))
        async with mine if mine is not client else contextlib.nullcontext():
            while time.monotonic() < stop:
                await one(mine, t, rng.choices(kinds, weights)[0], rng, tally)
                if tally.last_status == "503":
                    await asyncio.sleep(0.25)  # as a client backs off: not a busy loop while the engine restarts

    kill = asyncio.create_task(kill_engine(client, a.kill_engine_after, tally)) if a.kill_engine_after else None
    hostile = asyncio.create_task(hostile_loop(str(client.base_url), a.hostile_key, stop)) if a.hostile_key else None
    await asyncio.gather(*(worker(i) for i in range(a.concurrency)))
    if hostile is not None:  # the hostile key's outcomes, as kind "hostile"; its faults are unexpected
        outcomes = await hostile
        bad = unexpected(outcomes)
        for key, n in outcomes.items():
            for _ in range(n):
                tally.add("hostile", key.replace(" ", ":"), None, key not in bad)
    return tally, (await kill if kill is not None else None)


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def kill_engine(client: httpx.AsyncClient, after: float, tally: Tally) -> dict:
    """SIGKILLs the engine ``after`` seconds in, then waits for /health to say a new one serves."""
    await asyncio.sleep(after)
    pid = (await client.get("/health")).json()["engine"]["pid"]
    os.kill(pid, signal.SIGKILL)
    tally.killed_at = killed = time.monotonic()
    print(f"killed the engine (pid {pid}) with SIGKILL at {after:g} s", flush=True)
    while (h := await client.get("/health")).status_code != 200 or h.json()["engine"]["pid"] == pid:
        if h.json().get("status") == "failed":  # the old pid may still show until the server sees the death
            return {"pid": pid, "restarted": False, "health": h.json()}
        await asyncio.sleep(0.05)
    engine = h.json()["engine"]
    return {
        "pid": pid,
        "restarted": True,
        "new_pid": engine["pid"],
        "serving_again_s": round(time.monotonic() - killed, 2),
        "health": h.json(),
    }


# ---- the report ----------------------------------------------------------------------------------------------


def verdict(start: Snapshot, end: Snapshot, tally: Tally, pool_bytes: int = 0) -> tuple[bool, list[str]]:
    why = []
    if end.pages_used != start.pages_used:
        why.append(f"KV pages in use {start.pages_used:g} -> {end.pages_used:g}")
    hosts = [sum(not k.startswith(("server", "engine")) for k in s.each) for s in (start, end)]
    if hosts[1] > hosts[0]:
        why.append(f"host processes {hosts[0]} -> {hosts[1]}")
    for name, a in start.procs.items():
        b = end.procs.get(name)
        if b is None:
            why.append(f"no {name} (pid {a.pid} was)")
            continue
        if b.open_fds > a.open_fds + FD_SLACK:
            why.append(f"{name} open fds {a.open_fds} -> {b.open_fds}")
        slack = a.rss_bytes * RSS_SLACK + RSS_SLACK_BYTES + (pool_bytes if name == "engine" else 0)
        if b.rss_bytes > a.rss_bytes + slack:
            why.append(f"{name} RSS {a.rss_bytes >> 20} -> {b.rss_bytes >> 20} MiB")
    if tally.unexpected:
        why.append(f"{sum(tally.unexpected.values())} unexpected answers")
    return not why, why


def show(label: str, s: Snapshot) -> str:
    procs = ", ".join(
        f"{n} (pid {p.pid}) RSS {p.rss_bytes / 2**20:.0f} MiB, {p.open_fds} fds" for n, p in s.procs.items()
    )
    each = "; ".join(f"{n} {p.rss_bytes / 2**20:.0f} MiB {p.open_fds} fds" for n, p in s.each.items())
    return f"{label}: KV pages in use {s.pages_used:g}; {procs}\n  each: {each}"


def report(
    start: Snapshot, end: Snapshot, tally: Tally, seconds: float, samples: dict[str, list], pool_bytes: int
) -> dict:
    series = summarize(start.procs, end.procs, samples, seconds)
    flat, why = verdict(start, end, tally, pool_bytes)
    print(show("start", start))
    print(show("end  ", end))
    for role, s in series.items():
        r, f = s["rss_mib"], s["fds"]
        print(
            f"{role}: RSS first/last/max {r['first']:g}/{r['last']:g}/{r['max']:g} MiB, fds {f['first']}/{f['last']}/"
            f"{f['max']}, last-half slope {s['slope_mib_per_min_last_half']} MiB/min ({s['samples']} samples)"
        )
    print(f"sent in {seconds:.0f} s: " + ", ".join(f"{k} {n}" for k, n in sorted(tally.sent.items())))
    print("outcomes (kind status code: count):")
    for key, n in sorted(tally.outcomes.items()):
        print(f"  {key}: {n}" + ("   <- unexpected" if key in tally.unexpected else ""))
    print(f"verdict: {'FLAT' if flat else 'NOT FLAT'}" + ("" if flat else " (" + "; ".join(why) + ")"))
    return {
        "seconds": seconds,
        "start": asdict(start),
        "end": asdict(end),
        "sent": dict(tally.sent),
        "outcomes": dict(tally.outcomes),
        "unexpected": dict(tally.unexpected),
        "series": series,
        "flat": flat,
        "why": why,
    }


async def soak(url: str, server_pid: int | None, a: argparse.Namespace) -> dict:
    seconds = a.seconds if a.seconds is not None else a.minutes * 60
    keyed = _auth(a.honest_keys[0]) if a.honest_keys else {}  # /metrics and /v1/models need a key then
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=keyed) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        t = Target(card["id"], card["max_model_len"], a.oversize_bytes)
        warm = Tally()
        for kind in WEIGHTS:  # warm-up: the first requests of each kind allocate what later ones reuse
            for i in range(3):
                await one(client, t, kind, random.Random(i), warm)
        if a.hostile_key:  # its sandboxed host starts on its first run: up before the baseline
            await upload(client, a.hostile_key)
            print(f"hostile warm-up round: {dict(await hostile_round(client, a.hostile_key, 5.0, 5.0))}", flush=True)
        start = await snapshot(client, server_pid)
        print(show("start", start), flush=True)
        samples: dict[str, list] = {}
        sampler = asyncio.create_task(sample(client, server_pid, a.sample_seconds, samples))
        began = time.monotonic()
        tally, killed = await traffic(client, t, a, seconds)
        elapsed = time.monotonic() - began
        sampler.cancel()
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=keyed) as client:  # fresh: the soak's are closed
        end = await snapshot(client, server_pid)
    if killed is not None:
        first = tally.first_lost
        killed["first_503_ms"] = (
            None if first is None or tally.killed_at is None else round((first - tally.killed_at) * 1e3)
        )
        print(f"engine kill: {json.dumps({k: v for k, v in killed.items() if k != 'health'})}")
    return {**report(start, end, tally, elapsed, samples, a.kv_mib << 20), "engine_kill": killed}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running pie serve (default: start one)")
    p.add_argument("--model", default=None, help="the model a started server serves (default: the default model)")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-seconds", type=float, default=10.0, help="how often RSS and fds are sampled")
    p.add_argument("--oversize-bytes", type=int, default=9 << 20, help="a body past the server's --max-body-bytes")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    p.add_argument("--kv-mib", type=int, default=128, help="a started server's KV pool (MiB), allowed as RSS growth")
    p.add_argument(
        "--kill-engine-after",
        type=float,
        default=None,
        help="SIGKILL the engine this many seconds in: its 503s (engine_lost, engine_restarting) are deliberate",
    )
    p.add_argument(
        "--hostile",
        action="store_true",
        help="a started server gets three honest keys (the clients take turns) and a hostile one running "
        "examples/hostile_tenant.py's loop beside them (--allow-upload); its faults count as unexpected",
    )
    a = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    a.honest_keys, a.hostile_key = [], None
    proc = None
    if a.hostile:
        if a.url is not None:
            raise SystemExit("--hostile starts its own server (its keys): no --url")
        extra, a.honest_keys, a.hostile_key = tenant_flags(Path(tempfile.mkdtemp(prefix="pie-soak-keys-")))
        flags = [*extra, *flags]
    if a.url is None and not any(f.startswith(("--kv-memory", "--kv-pages")) for f in flags):
        flags = [*flags, "--kv-memory", str(a.kv_mib)]
    if a.url is None:
        log = Path(tempfile.mkstemp(prefix="pie-soak-", suffix=".log")[1])
        proc, url = start_server(a.model, flags, log)
        print(f"pie serve (pid {proc.pid}) on {url}, its log in {log}", flush=True)
        server_pid: int | None = proc.pid
    else:
        url = a.url.rstrip("/")
        server_pid = listener_pid(httpx.URL(url).port or 80)
    try:
        out = asyncio.run(soak(url, server_pid, a))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0 if out["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
