"""The prompt-cache inferlet (inferlets/prompt-cache.py) on the real default model, across engine processes: a
prompt saved by one fp32 engine and loaded by another decodes text-completion's greedy tokens, its rows travelling
in several messages (a prompt longer than one message's rows); an int4 engine's file (bfloat16 K/V, a standard
safetensors file) loads back into an int4 engine and is refused ``kv_mismatch`` by an fp32 one; and the command
line path, ``pie run prompt-cache -- --prompt P --save F`` then ``--load F``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import inferlet
from pie_runtime.protocol import ErrorCode
from pie_runtime.protocol.messages import MAX_KV_TRANSFER_BYTES
from pie_runtime.store import DEFAULT_MODEL
from tests.conftest import start_engine
from tests.inferlets.conftest import call

SHORT = "Once upon a time, there was a little girl named Emma who loved to play"
LONG = " ".join([SHORT] * 14)  # ~250 tokens: more rows than one message carries in fp32
MAX = 24


def engine_in(pie_home, weights: str):
    return start_engine(pie_home, [DEFAULT_MODEL], "--weights", weights, "--pass-cost-rows", "0")


@pytest.fixture(scope="module")
def fp32_pair(pie_home):
    first, second = engine_in(pie_home, "fp32"), engine_in(pie_home, "fp32")
    yield first, second
    first.stop()
    second.stop()


@pytest.fixture(scope="module")
def int4_engine(pie_home):
    eng = engine_in(pie_home, "int4")
    yield eng
    eng.stop()


def test_a_prompt_saved_in_one_engine_continues_in_another_as_text_completion(fp32_pair, tmp_path):
    first, second = fp32_pair
    path = str(tmp_path / "long.kv")
    saved = call(first.address, "prompt-cache", prompt=LONG, save=path)
    rows = saved["stats"]["saved_rows"]
    assert rows == saved["stats"]["prompt_tokens"] - 1 and saved["kv_dtype"] == "float32"
    assert rows * 2 * 30 * 3 * 64 * 4 > MAX_KV_TRANSFER_BYTES  # read and appended in several messages
    got = call(second.address, "prompt-cache", load=path, max_tokens=MAX, ignore_eos=True)
    want = call(second.address, "text-completion", prompt=LONG, max_tokens=MAX, ignore_eos=True)
    assert got["token_ids"] == want["token_ids"] and len(got["token_ids"]) == MAX
    s = got["stats"]
    assert s["loaded_rows"] == rows and s["kv_pages"] == s["kv_pages_max"] == want["stats"]["kv_pages_max"]


def test_an_int4_file_loads_into_int4_and_is_refused_by_fp32(fp32_pair, int4_engine, tmp_path):
    from safetensors.torch import load_file

    path = str(tmp_path / "int4.kv")
    saved = call(int4_engine.address, "prompt-cache", prompt=SHORT, save=path)
    assert saved["weights"] == "int4" and saved["kv_dtype"] == "bfloat16"
    tensors = load_file(path)  # a standard safetensors file: the pool's bfloat16 K/V as they were
    assert str(tensors["k"].dtype) == "torch.bfloat16" and tensors["k"].shape[2] == saved["stats"]["saved_rows"]
    got = call(int4_engine.address, "prompt-cache", load=path, max_tokens=MAX, ignore_eos=True)
    want = call(int4_engine.address, "text-completion", prompt=SHORT, max_tokens=MAX, ignore_eos=True)
    assert got["token_ids"] == want["token_ids"]
    with pytest.raises(inferlet.SavedKVMismatch) as e:
        call(fp32_pair[0].address, "prompt-cache", load=path, max_tokens=4)
    assert e.value.code == ErrorCode.KV_MISMATCH and "int4" in e.value.message


def pie_run(address: str, *words: str) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pie_runtime.cli.main",
            "run",
            "prompt-cache",
            "--engine",
            address,
            "--json",
            "--",
            *words,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pie_run_saves_then_loads_from_the_command_line(fp32_pair, tmp_path):
    first, second = fp32_pair
    path = str(tmp_path / "cli.kv")
    saved = pie_run(first.address, "--prompt", SHORT, "--save", path)
    assert saved["saved"] == path and saved["stats"]["kv_pages"] >= 1
    got = pie_run(second.address, "--load", path, "--max-tokens", "8", "--ignore-eos")
    want = call(second.address, "text-completion", prompt=SHORT, max_tokens=8, ignore_eos=True)
    assert got["token_ids"] == want["token_ids"] and got["stats"]["kv_pages_max"] >= 1


def test_a_prompt_given_with_load_continues_from_the_longest_shared_prefix(fp32_pair, tmp_path):
    """``--load F --prompt P`` (what pie serve's prompt_cache runs): P extending the saved prompt keeps every
    loaded row; P parting from it midway keeps the shared rows, drops the rest, and computes its own; both decode
    text-completion's tokens on P."""
    first, second = fp32_pair
    path = str(tmp_path / "prefix.kv")
    rows = call(first.address, "prompt-cache", prompt=SHORT, save=path)["stats"]["saved_rows"]
    for prompt, cached in ((SHORT + " outside with her friends.", rows), ("Once upon a time, there was a boy", 8)):
        got = call(second.address, "prompt-cache", load=path, prompt=prompt, max_tokens=MAX, ignore_eos=True)
        want = call(second.address, "text-completion", prompt=prompt, max_tokens=MAX, ignore_eos=True)
        assert got["token_ids"] == want["token_ids"]
        assert got["stats"]["cached_tokens"] == cached and got["stats"]["loaded_rows"] == rows
