"""The engine's RSS as its prefix cache keeps pages: distinct 200-token prompts fired into fresh working sets,
each released after its fire, and every 5 the engine's RSS, its free and cached KV pages. The KV pool is an
anonymous mapping made resident page by page as pages are first written (pie_runtime/models/kv_cache.py), so
RSS grows by a page's bytes for each page the cache keeps, up to the pool (``--kv-memory``).

    python examples/kv_resident_probe.py [PROMPTS]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import zmq

from pie_runtime.launcher import EmbeddedEngine
from pie_runtime.protocol import messages as m
from pie_runtime.protocol.codec import pack, unpack


def rss_mib(pid: int) -> int:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(int(line.split()[1]) >> 10 for line in lines if line.startswith("VmRSS:"))


def main(prompts: int) -> None:
    eng = EmbeddedEngine(None, [])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(eng.address)
    ids = iter(range(1, 1 << 30))

    def call(op: str, **fields) -> dict:
        rid = next(ids)
        sock.send(pack({"id": rid, "op": op, **fields}))
        while (reply := unpack(sock.recv())).get("id") != rid:
            pass
        return reply

    try:
        call("hello", version=m.PROTOCOL_VERSION)
        rng = random.Random(0)
        print(f"start: RSS {rss_mib(eng.proc.pid)} MiB", flush=True)
        for i in range(prompts):
            ws = call("ws_open")["ws"]
            call("fire", ws=ws, tokens=[rng.randrange(1000, 20000) for _ in range(200)])
            call("ws_release", ws=ws)
            if i % 5 == 4:
                model = next(iter(call("stats")["models"].values()))
                cached = model["prefix_cache"]["cached_pages"]
                print(f"{i + 1}: RSS {rss_mib(eng.proc.pid)} MiB, pages free {model['pages_free']}, cached {cached}")
    finally:
        sock.close(0)
        ctx.term()
        eng.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
