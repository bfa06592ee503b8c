"""``--tensor-parallel 2`` over gloo (two ranks, one thread each) against one rank: the same greedy tokens over
64 steps with an eviction halfway, and float32 logits within 1e-4, on the tiny model; fp32 only, other formats
refused. A worker rank does not outlive a rank 0 that failed mid-step (it leaves by itself) or that was killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import inferlet
from pie_runtime.launcher import LaunchError
from tests.conftest import REPO, TINY, start_engine
from tests.serve.server_proc import alive, children

PROMPT = [1, 420, 77, 3141, 5926, 535, 8979, 3238, 4626, 4338]


async def greedy_logits(address: str, steps: int = 64, evict_at: int = 32) -> tuple[list[int], np.ndarray]:
    """Greedy steps with their logits; after ``evict_at`` steps rows 3..19 are evicted (pages rebuilt from
    moved rows: every rank's shard must move them)."""
    session = await inferlet.connect(address)
    try:
        ws = inferlet.model(TINY).working_set()
        window, tokens, rows = list(PROMPT), [], []
        for step in range(steps):
            if step == evict_at:
                await ws.evict(ranges=[(3, 20)])
            fp = inferlet.ForwardPass(ws)
            fp.embed(window).readout([len(window) - 1], inferlet.Logits())
            logits = (await fp.submit()).logits
            assert logits is not None
            rows.append(logits[0])
            tokens.append(int(np.argmax(logits[0])))
            window = [tokens[-1]]
        await ws.release()
        return tokens, np.stack(rows)
    finally:
        session.client.close()


async def test_two_ranks_equal_one(pie_home):
    one = start_engine(pie_home, [TINY], "--threads", "1", "--pass-cost-rows", "0")
    two = start_engine(pie_home, [TINY], "--threads", "1", "--pass-cost-rows", "4", "--tensor-parallel", "2")
    try:
        tokens1, logits1 = await greedy_logits(one.address)
        tokens2, logits2 = await greedy_logits(two.address)
    finally:
        one.stop()
        two.stop()
    assert tokens2 == tokens1
    assert logits2.shape == logits1.shape == (64, 49152)
    assert float(np.abs(logits2 - logits1).max()) < 1e-4


def test_other_weight_formats_are_refused(pie_home):
    with pytest.raises(LaunchError, match="fp32 only"):
        start_engine(pie_home, [TINY], "--tensor-parallel", "2", "--weights", "bf16")


def test_workers_leave_when_rank_0_fails_mid_step(pie_home):
    env = {**os.environ, "PIE_HOME": str(pie_home)}
    cmd = [sys.executable, "-m", "tests.engine.tp_fault", TINY]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    first, second, third = r["calls"]
    assert first == "ok"
    why = "rank 0 failed in a forward step: RuntimeError: injected fault on rank 0"
    assert second == f"TensorParallelBroken: {why}"
    assert third == second  # the group is over: later steps fail at once, none waits on a collective
    assert r["heard"] == [why]  # the engine is told, so it stops (and its supervisor starts a new one)
    assert r["exits"] == [1]  # the worker left by itself (its collective failed), rank 0 did not have to kill it
    assert "pie tensor-parallel rank 1: leaving the group" in out.stderr


def test_workers_die_with_a_killed_rank_0(pie_home):
    engine = start_engine(pie_home, [TINY], "--threads", "1", "--pass-cost-rows", "0", "--tensor-parallel", "2")
    try:
        workers = [p for p in children(engine.proc.pid) if b"spawn_main" in _cmdline(p)]
        assert len(workers) == 1
        os.kill(engine.proc.pid, signal.SIGKILL)
        engine.proc.wait()
        deadline = time.monotonic() + 60  # a safety net, not a bound under test: the kernel kills it at once
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in workers)
    finally:
        engine.stop()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
