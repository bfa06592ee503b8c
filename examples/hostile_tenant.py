"""A hostile API key against `pie serve --allow-upload`: the heavy cases of tests/serve/test_tenants.py, in a
loop, for examples/soak_serve.py (``--hostile``) and examples/tenant_interference.py.

Each round the key, in turn:

- runs ``hog``, an uploaded inferlet that speaks the engine protocol itself from its sandbox: it opens as many
  connections as the engine lets in, opens 64 MiB channels until its identity's bytes are spent, registers
  more programs than ``--max-programs`` (evicting its own), queues fires whose readouts reply 64 rows of
  logits each until its identity's readout bytes are spent, and sends evicts of thousands of ranges; it
  reports every refusal by code;
- starts a stream of an uploaded inferlet that emits without end and never reads it (the server cancels it
  after ``--stream-stall-timeout``);
- asks what admission refuses: ``n`` past ``--max-n`` (400), a KV-page flood past its quota (429: the key
  needs a page quota, ``key_file``), an MTP tree past its Args' bounds (400).

Every answer is an expected one unless it is a 5xx or a dropped connection: the hostile key's own runs may
fail (their limits are the point), other keys' must not.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections import Counter
from pathlib import Path

import httpx

HOSTILE_PAGES = 64  # the hostile key's KV-page quota


def plus(k: int) -> list[dict]:
    """A program that puts the greedy token of row 0 plus ``k`` into slot 0: one hash per ``k`` (the hog
    registers many; tests/engine import it too)."""
    return [
        {"op": "logits", "attrs": {"rows": [0]}},
        {"op": "argmax", "inputs": [0], "attrs": {"dim": -1, "keepdim": False}},
        {"op": "const", "attrs": {"value": [k], "dtype": "int"}},
        {"op": "add", "inputs": [1, 2]},
        {"op": "put", "inputs": [3], "attrs": {"slot": 0, "shape": [1], "dtype": "int32"}},
    ]


# the hog's source: its own code around plus() (the same function, so its programs are the tests')
HOG = (
    """
import asyncio
import collections
import random
import time

import zmq
import zmq.asyncio

import inferlet
from pie_runtime.protocol import messages as m
from pie_runtime.protocol.codec import pack, unpack

ENGINE = "ipc:///run/pie/engine.sock"
BIG = {"op": "channel_open", "shape": [1 << 20], "dtype": "float32", "capacity": 16}


"""
    + inspect.getsource(plus)
    + """


class Conn:
    def __init__(self, ctx):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(ENGINE)
        self.next = 0
        self.got = {}  # replies read while waiting for another (a fire's come after a step)

    async def send(self, op, **fields):
        self.next += 1
        await self.sock.send(pack({"id": self.next, "op": op, **fields}))
        return self.next

    async def wait(self, rid, timeout=120):
        while rid not in self.got:
            if not await self.sock.poll(timeout * 1000):
                return {"ok": False, "error": {"code": "silent"}}
            reply = unpack(await self.sock.recv())
            if reply.get("id") is None:  # refused before its id was read: the answer to what it waits for
                return reply
            self.got[reply["id"]] = reply
        return self.got.pop(rid)

    async def call(self, op, **fields):
        return await self.wait(await self.send(op, **fields))


def code(reply):
    return "ok" if reply.get("ok") else reply["error"]["code"]


async def one_round(ctx, seen, rng):
    conns = []
    try:
        live, info = [], None
        for _ in range(8):
            c = Conn(ctx)
            conns.append(c)
            answer = await c.call("hello", version=m.PROTOCOL_VERSION)
            seen["hello " + code(answer)] += 1
            if not answer.get("ok"):
                break
            live.append(c)
            info = answer["models"][0]
        if not live:
            return
        vocab = info["vocab_size"]
        for c in live:
            for _ in range(6):
                seen["channel " + code(await c.call(**BIG))] += 1
        for k in range(300):
            seen["program " + code(await live[k % len(live)].call("program_register", nodes=plus(k)))] += 1
        sets = []
        for i in range(64):
            c = live[i % len(live)]
            opened = await c.call("ws_open")
            if not opened.get("ok"):
                seen["ws_open " + code(opened)] += 1
                break
            # one row run, its logits read out 64 times (a readout may repeat a row): replies of 64 rows of
            # logits a fire for the compute of one row, so the identity's readout bytes run out first
            tokens = [rng.randrange(vocab)]
            readouts = [{"rows": [0] * 64, "kind": "logits"}]
            rid = await c.send("fire", ws=opened["ws"], tokens=tokens, readouts=readouts)
            sets.append((c, opened["ws"], rid))
        for c, _, rid in sets:
            seen["fire " + code(await c.wait(rid))] += 1
        for c, ws, _ in sets[:8]:
            ranges = [[0, 1]] * 4096  # thousands of overlapping ranges over its one row
            seen["evict " + code(await c.call("ws_evict", ws=ws, ranges=ranges))] += 1
    finally:
        for c in conns:
            c.sock.close(0)  # the engine releases what each held


@inferlet.main
async def main(args: dict) -> dict:
    ctx = zmq.asyncio.Context()
    seen = {}
    counts = collections.Counter()
    rng = random.Random(args.get("seed", 0))
    stop = time.monotonic() + float(args.get("seconds", 5))
    rounds = 0
    try:
        while time.monotonic() < stop:
            await one_round(ctx, counts, rng)
            rounds += 1
            await asyncio.sleep(0.2)
    finally:
        ctx.destroy(0)
    seen.update(counts)
    return {"rounds": rounds, "seen": seen}
"""
)

FLOOD = """
import asyncio

import inferlet


@inferlet.main
async def main(args: dict) -> dict:
    while True:
        inferlet.emit("x" * 65536)
        await asyncio.sleep(0.01)
"""


async def upload(client: httpx.AsyncClient, key: str) -> None:
    for name, source in (("hog", HOG), ("flood", FLOOD)):
        r = await client.post("/v1/inferlets", json={"name": name, "source": source}, headers=_auth(key))
        r.raise_for_status()


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def hostile_round(client: httpx.AsyncClient, key: str, hog_seconds: float, stall_s: float) -> Counter[str]:
    """One round of the hostile key's cases; its outcomes ("case status[:code]" -> count)."""
    out: Counter[str] = Counter()
    try:
        r = await client.post(
            "/v1/inferlets/hog/runs", json={"args": {"seconds": hog_seconds}}, headers=_auth(key), timeout=900
        )
        out[f"hog {r.status_code}"] += 1
        if r.status_code == 200:
            for what, n in r.json()["result"]["seen"].items():
                out[f"hog.{what}"] += n
    except httpx.HTTPError as e:
        out[f"hog {type(e).__name__}"] += 1
    try:  # a stream nobody reads: the server cancels it after its stall timeout
        async with client.stream(
            "POST", "/v1/inferlets/flood/runs", json={"args": {}, "stream": True}, headers=_auth(key)
        ) as s:
            out[f"flood {s.status_code}"] += 1
            await asyncio.sleep(stall_s + 2)
    except httpx.HTTPError as e:
        out[f"flood {type(e).__name__}"] += 1
    floods = [
        ("text-completion", {"prompt": "hi", "n": 64, "max_tokens": 200, "ignore_eos": True}),
        ("text-completion", {"prompt": "hi", "n": 8, "max_tokens": 4000, "ignore_eos": True}),
        ("mtp-speculative-decoding", {"prompt": "hi", "tree": "64,64,64"}),
    ]
    for name, args in floods:
        try:
            r = await client.post(f"/v1/inferlets/{name}/runs", json={"args": args}, headers=_auth(key), timeout=600)
            out[f"{name} {r.status_code}"] += 1
        except httpx.HTTPError as e:  # a refusal comes at once: no answer is a fault
            out[f"{name} {type(e).__name__}"] += 1
    return out


def unexpected(outcomes: Counter[str]) -> Counter[str]:
    """The hostile key's outcomes that show a fault (a 5xx other than its own run's failure, a drop)."""
    bad: Counter[str] = Counter()
    for key, n in outcomes.items():
        case, _, status = key.rpartition(" ")
        own = case.startswith(("hog", "flood"))  # its own code's runs: their failures are its own
        if not own and (status.startswith("5") or not status[:1].isdigit()):
            bad[key] += n
    return bad


async def hostile_loop(url: str, key: str, stop: float, hog_seconds: float = 5.0, stall_s: float = 5.0) -> Counter[str]:
    """Rounds of the hostile cases until ``stop`` (monotonic); every outcome, summed."""
    total: Counter[str] = Counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await upload(client, key)
        while time.monotonic() < stop:
            total.update(await hostile_round(client, key, hog_seconds, stall_s))
    return total


def tenant_flags(folder: Path) -> tuple[list[str], list[str], str]:
    """`pie serve` flags for three honest keys and a hostile one (a key file in ``folder``, not argv), with
    uploads allowed and a short stall timeout; and the honest keys and the hostile one."""
    honest = [f"honest-{i}-{n}" for i, n in enumerate(("4e1a", "77c2", "b0d9"))]
    hostile = "hostile-3f8e"
    keys = folder / "keys.json"
    keys.write_text(json.dumps(key_file(honest, hostile)))
    return ["--keys", str(keys), "--allow-upload", "--stream-stall-timeout", "5"], honest, hostile


def key_file(honest: list[str], hostile: str) -> dict:
    """The ``--keys`` file: the honest keys unlimited, the hostile one under a 64-page KV quota (as
    tests/serve/test_tenants.py's key: its page flood is refused 429, not run)."""
    return {"keys": {**{k: {} for k in honest}, hostile: {"kv_pages": HOSTILE_PAGES}}}
