"""Speculative rounds verified on the device, on the default model with the session's MTP head: MTP as a
run-ahead and cacheback with one fire a round return exactly text-completion's greedy tokens, and report
exactly the host loop's stats; a sampled run falls back to the host loop and says so; a client that dies
mid MTP run-ahead has its fires stopped and its pages and channels returned."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import inferlet
from pie_runtime.store import DEFAULT_MODEL
from tests.inferlets.conftest import call, call_many
from tests.inferlets.test_speculative_inferlets import MAX, PROMPTS, REPETITIVE
from tests.procs import expect_line

STATS = ("rounds", "proposed", "accepted", "acceptance_per_position", "rejecting_round_share", "skipped")
# run-ahead drafts --draft-length every round (its loop is in the engine), so its host twin is fixed too
DEVICE = [
    ("mtp-speculative-decoding", {"draft_length": 2, "draft_schedule": "fixed"}, {"run_ahead": True}),
    ("cacheback-speculative-decoding", {}, {"device_verify": True}),
]
IDS = ["mtp-run-ahead", "cacheback-device-verify"]


@pytest.fixture(scope="module")
def reference(spec_engine) -> list[dict]:
    return call_many(spec_engine.address, "text-completion", [{**p, "max_tokens": MAX} for p in PROMPTS])


def stats(res: dict) -> dict:
    return {k: res["stats"][k] for k in STATS}


@pytest.mark.parametrize("name,base,flag", DEVICE, ids=IDS)
def test_greedy_equals_text_completion_and_the_host_loop_stats(spec_engine, reference, name, base, flag):
    runs = [{**p, "max_tokens": MAX, **base} for p in PROMPTS]
    # one at a time: the adaptive planner prices a round by the engine's load (the rows of the step its fire
    # ran in), which runs in flight together would make depend on timing
    host = [call(spec_engine.address, name, **r) for r in runs]
    device = [call(spec_engine.address, name, **r, **flag) for r in runs]
    for want, h, d in zip(reference, host, device):
        assert d["token_ids"] == want["token_ids"]
        assert (d["text"], d["finish_reason"]) == (want["text"], want["finish_reason"])
        assert stats(d) == stats(h)
        assert d["stats"]["device"] in ("run_ahead", "verify")
    assert sum(r["stats"]["proposed"] for r in device) > 0 and sum(r["stats"]["accepted"] for r in device) > 0


@pytest.mark.parametrize("name,base,flag", DEVICE, ids=IDS)
@pytest.mark.parametrize("max_tokens", [2, 5, 9])
def test_max_tokens_and_stop_strings_cut_device_rounds(spec_engine, name, base, flag, max_tokens):
    args = {**REPETITIVE, **base, "max_tokens": max_tokens}
    host, device = call(spec_engine.address, name, **args), call(spec_engine.address, name, **args, **flag)
    assert device["token_ids"] == host["token_ids"] and len(device["token_ids"]) == max_tokens
    assert stats(device) == stats(host)
    if max_tokens == 9:
        stop = host["text"][len(host["text"]) // 2 :][:5]
        host = call(spec_engine.address, name, **{**args, "max_tokens": MAX}, stop=[stop])
        device = call(spec_engine.address, name, **{**args, "max_tokens": MAX}, stop=[stop], **flag)
        assert host["finish_reason"] == device["finish_reason"] == "stop"
        assert (device["token_ids"], device["text"]) == (host["token_ids"], host["text"])
        assert stats(device) == stats(host)


@pytest.mark.parametrize("name,base,flag", DEVICE, ids=IDS)
def test_sampled_runs_use_the_host_loop_and_say_so(spec_engine, name, base, flag):
    args = {**REPETITIVE, **base, "max_tokens": 8, "temperature": 0.8, "seed": 3}
    host, device = call(spec_engine.address, name, **args), call(spec_engine.address, name, **args, **flag)
    assert device["token_ids"] == host["token_ids"]
    assert device["stats"]["device"].startswith("host loop: sampled")


DYING_CLIENT = textwrap.dedent(
    """
    import asyncio, sys, inferlet
    from tests.inferlets.conftest import load
    async def go():
        session = await inferlet.connect(sys.argv[1])
        main, Args = load("mtp-speculative-decoding")
        task = asyncio.ensure_future(main(Args(prompt="Once upon a time", max_tokens=1500, draft_length=2,
                                               run_ahead=True, stream=False)))
        m = inferlet.model()
        while (await m.client.request("stats"))["run_ahead"] == 0:
            await asyncio.sleep(0.02)
        print("running", flush=True)
        await asyncio.sleep(600)
    asyncio.run(go())
    """
)


async def _stats(address: str) -> dict:
    session = await inferlet.connect(address)
    try:
        return await inferlet.model().client.request("stats")
    finally:
        session.client.close()


def test_a_client_dying_mid_mtp_run_ahead_returns_its_pages(spec_engine):
    before = asyncio.run(_stats(spec_engine.address))
    proc = subprocess.Popen(
        [sys.executable, "-c", DYING_CLIENT, spec_engine.address], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        expect_line(proc, "running")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    deadline = time.monotonic() + 20
    after = asyncio.run(_stats(spec_engine.address))
    while after["run_ahead"] and time.monotonic() < deadline:
        time.sleep(0.05)
        after = asyncio.run(_stats(spec_engine.address))
    assert after["run_ahead"] == 0 and after["models"][DEFAULT_MODEL]["queued"] == 0
    assert after["models"][DEFAULT_MODEL]["pages_free"] == before["models"][DEFAULT_MODEL]["pages_free"]
    assert after["channels"] == before["channels"] and after["working_sets"] == before["working_sets"]
