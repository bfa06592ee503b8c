"""The engine's RSS under the hostile tenant's hog, without `pie serve` around it: engines started side by side
with different environments (glibc's allocator settings), the hog's rounds (examples/hostile_tenant.py: 8
connections, 64 MiB channels to the limit, 300 programs, 64 fires whose readouts reply 64 rows of logits each,
evicts of 4,096 ranges) sent to each in turn, and after each round every engine's RSS and what it holds
(working sets, channels, programs from its ``stats``). It tells an allocator's high-water mark (RSS up after
the first round, then level) from a leak (RSS and holdings growing round after round).

    python examples/engine_rss_probe.py [--rounds 6] [--variant NAME=VAR=VALUE ...]

Without ``--variant`` it compares glibc's defaults with ``MALLOC_ARENA_MAX=2``. Nothing is asserted: the
figures go to docs/measurements-tenants.md with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import time
from pathlib import Path

import zmq
import zmq.asyncio

if not __package__:  # run as a script: its neighbours import by name
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile_tenant import HOG

from pie_runtime.launcher import EmbeddedEngine
from pie_runtime.protocol.codec import pack, unpack


def hog_round():
    """The hog's ``one_round(ctx, seen, rng)`` and its namespace (whose ENGINE says where it goes)."""
    ns: dict = {}
    exec(HOG.split("@inferlet.main")[0].replace("import inferlet\n", ""), ns)  # the hog's code but its main
    return ns


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) >> 10
    return 0


def holdings(address: str) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(pack({"id": 1, "op": "stats"}))
    reply = unpack(sock.recv())
    sock.close(0)
    ctx.term()
    return {k: reply[k] for k in ("working_sets", "channels", "programs")}


async def probe(engines: dict[str, EmbeddedEngine], rounds: int) -> None:
    ns = hog_round()
    ctx = zmq.asyncio.Context()
    rng = random.Random(0)
    print("start: " + ", ".join(f"{k} {rss_mib(e.proc.pid)} MiB" for k, e in engines.items()), flush=True)
    for i in range(rounds):
        for name, eng in engines.items():
            ns["ENGINE"] = eng.address
            seen: collections.Counter[str] = collections.Counter()
            began = time.monotonic()
            await ns["one_round"](ctx, seen, rng)
            await asyncio.sleep(0.5)
            print(
                f"round {i} {name}: RSS {rss_mib(eng.proc.pid)} MiB, holds {holdings(eng.address)}, "
                f"fires {seen['fire ok']}, {time.monotonic() - began:.0f} s",
                flush=True,
            )
    ctx.destroy(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--model", default=None, help="the engine's model (default: the default model)")
    p.add_argument("--variant", action="append", default=None, help="NAME=VAR=VALUE: an engine with VAR=VALUE")
    a = p.parse_args()
    variants: dict[str, dict[str, str]] = {"glibc-default": {}}
    for v in a.variant or ["arena-max-2=MALLOC_ARENA_MAX=2"]:
        name, var, value = v.split("=", 2)
        variants[name] = {var: value}
    engines = {k: EmbeddedEngine([a.model] if a.model else None, [], env=env) for k, env in variants.items()}
    try:
        asyncio.run(probe(engines, a.rounds))
    finally:
        for e in engines.values():
            e.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
