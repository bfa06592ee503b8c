"""`pie run` end to end: shipped and user inferlets through the launcher, on the real default model."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pie_runtime.reference import greedy_continuation, transformers_llama
from pie_runtime.store import ModelStore
from tests.conftest import REPO, run
from tests.procs import expect_line
from tests.serve.server_proc import alive, children

pytestmark = pytest.mark.e2e  # some tests start `pie run` themselves, without a process fixture

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def hf_smollm(engine, tmp_path_factory):
    store = ModelStore()
    manifest = store.get("smollm2-135m")
    return transformers_llama(store.path(manifest.name), manifest.config, tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_completion_greedy_equals_transformers(engine, hf_smollm, prompt):
    result = run("text-completion", engine.address, "--prompt", prompt, "--max-tokens", "32", "--temperature", "0")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ModelStore().path("smollm2-135m") / "tokenizer.json"))
    ids = tok.encode(prompt, add_special_tokens=False).ids
    expected = greedy_continuation(hf_smollm, ids, 32)
    assert result["token_ids"] == expected[: len(result["token_ids"])]
    assert result["finish_reason"] in ("length", "stop")
    if result["finish_reason"] == "length":
        assert len(result["token_ids"]) == 32
    assert result["text"] == tok.decode(result["token_ids"], skip_special_tokens=False)
    assert result["stats"]["prefill_ms"] > 0 and result["stats"]["decode_tokens_per_s"] > 0


def test_seeded_sampling_reproducible_and_two_inferlets_at_once(engine):
    args = ["--prompt", "Tell me about the sea.", "--max-tokens", "12", "--temperature", "0.9", "--chat"]

    async def both():
        loop = asyncio.get_running_loop()
        jobs = [
            loop.run_in_executor(None, lambda s=s: run("text-completion", engine.address, *args, "--seed", s))
            for s in ("1", "1", "2")
        ]
        return await asyncio.gather(*jobs)

    a, b, c = asyncio.run(both())
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]


def test_stop_string_cuts_the_text(engine):
    result = run(
        "text-completion", engine.address, "--prompt", "Count: 1, 2, 3, 4,", "--max-tokens", "30", "--stop", " 7"
    )
    assert result["finish_reason"] == "stop"
    assert " 7" not in result["text"] and result["text"].rstrip().endswith("6,")


CUSTOM = """
import inferlet
@inferlet.main
async def main(args):
    model = inferlet.model()
    ids = model.tokenizer.encode(args["prompt"])
    ws = model.working_set()
    fp = inferlet.ForwardPass(ws)
    fp.embed(ids)
    fp.readout(list(range(len(ids))), inferlet.Logits())
    res = await fp.submit()
    return {"shape": list(res.logits.shape)}
"""


def test_pie_run_custom_file_with_embedded_engine(tmp_path):
    path = tmp_path / "shape.py"
    path.write_text(CUSTOM)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pie_runtime.cli.main",
            "run",
            str(path),
            "--json",
            "--kv-pages",
            "64",
            "--",
            "--prompt",
            "Hello there world",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"shape": [3, 49152]}


def test_pie_run_reports_a_crashing_inferlet(engine, tmp_path):
    path = tmp_path / "crash.py"
    path.write_text("import inferlet\n@inferlet.main\nasync def main(args):\n    raise ValueError('boom')\n")
    out = subprocess.run(
        [sys.executable, "-m", "pie_runtime.cli.main", "run", str(path), "--engine", engine.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "ValueError: boom" in out.stderr


def test_pie_run_unknown_inferlet_is_one_line_error():
    out = subprocess.run(
        [sys.executable, "-m", "pie_runtime.cli.main", "run", "no-such-inferlet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.startswith("error: no shipped inferlet")


@pytest.mark.parametrize(
    ("inferlet", "words", "says"),
    [
        ("mtp-speculative-decoding", ["--draft-length", "2"], ["has no MTP head", "pie model drafter attach"]),
        ("mtp-speculative-decoding", [], ["has no MTP head", "pie model drafter attach"]),
        ("draft-model-speculative-decoding", [], ["has no draft model attached", "pie drafter train"]),
        ("draft-model-speculative-decoding", ["--draft", "nope"], ["serves no model 'nope'"]),
        ("eagle-speculative-decoding", [], ["has no EAGLE head", "pie drafter train --model", "--kind eagle"]),
    ],
)
def test_a_missing_drafter_is_one_line_naming_the_command(tiny_engine, inferlet, words, says):
    """The tiny model has no drafter: the inferlet says what is missing and how to get it, without a traceback."""
    assert_one_line_error(tiny_engine, inferlet, ["--prompt", "hi", *words], says)


@pytest.mark.parametrize(
    ("inferlet", "words", "says"),
    [
        ("text-completion", ["--prompt", "hi", "--max-tokenz", "3"], ["--max-tokenz (did you mean --max-tokens?)"]),
        ("mtp-speculative-decoding", ["--prompt-file", "p.txt"], ["unknown argument: --prompt-file"]),
        ("text-completion", ["--prompt", "hi", "--max-tokens", "0"], ["--max-tokens: ", "greater than or equal to 1"]),
        ("text-completion", ["--max-tokens", "3"], ["--prompt: Field required"]),
        (
            "mtp-speculative-decoding",
            ["--prompt", "hi", "--draft-length", "2", "--lookup", "8", "--tree", "2,1"],
            ["--lookup", "does not combine with --tree"],
        ),
    ],
)
def test_a_bad_argument_is_one_line_naming_it(tiny_engine, inferlet, words, says):
    """A misspelt, unknown, missing or out-of-range argument: one line naming it (a typo with the name it
    resembles), no traceback, and never silently ignored."""
    assert_one_line_error(tiny_engine, inferlet, words, says)


def assert_one_line_error(engine, inferlet: str, words: list[str], says: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pie_runtime.cli.main", "run", inferlet, "--engine", engine.address, "--", *words],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    error = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and all(s in error[0] for s in says), out.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="the engine follows its parent through PR_SET_PDEATHSIG")
def test_a_killed_pie_run_leaves_no_engine_behind(pie_home, tmp_path):
    """SIGTERM (Python's default: no cleanup, no with-block exits) on `pie run` while its inferlet runs: the
    embedded engine must not outlive it as an orphan holding the model."""
    import os
    import signal
    import time

    slow = tmp_path / "slow.py"
    slow.write_text(
        "import asyncio\n\nimport inferlet\n\n\n@inferlet.main\nasync def main(args: dict) -> dict:\n"
        "    print('up', flush=True)\n    await asyncio.sleep(600)\n    return {}\n"
    )
    words = ["run", str(slow), "--model", "tiny-smol", "--kv-pages", "64", "--weights", "fp32", "--no-compile"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pie_runtime.cli.main", *words, "--pass-cost-rows", "0"],
        env={**os.environ, "PIE_HOME": str(pie_home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        expect_line(proc, "up")  # the engine is up and the inferlet runs
        engines = [
            p for p in children(proc.pid) if b" engine " in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")
        ]
        assert len(engines) == 1
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while alive(engines[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(engines[0]), "the engine outlived `pie run`"
    finally:
        proc.kill()


def pie_run(*words: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pie_runtime.cli.main", "run", *words], capture_output=True, text=True, timeout=timeout
    )


STATS_LINE = re.compile(
    r"8 tokens, \d+\.\d tok/s; prompt 5 tokens, prefill \d+ ms; stopped at (the token limit|end of sequence)"
)


def test_pie_run_prints_the_text_then_one_line_of_stats(engine):
    """For people: stdout is the text (streamed, or printed at the end when the run streamed none) and stderr
    one readable line of stats; the raw stats as JSON only under --json."""
    words = ["--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0"]
    machine = pie_run("text-completion", "--engine", engine.address, "--json", "--", *words, "--stream", "false")
    assert machine.returncode == 0 and machine.stderr == "", machine.stderr
    result = json.loads(machine.stdout.splitlines()[-1])
    assert len(result["token_ids"]) == 8 and result["stats"]["generated_tokens"] == 8
    for stream in ("true", "false"):
        out = pie_run("text-completion", "--engine", engine.address, "--", *words, "--stream", stream)
        assert out.returncode == 0, out.stderr
        assert out.stdout == result["text"] + "\n"
        assert out.stderr.splitlines() == [out.stderr.strip()] and STATS_LINE.fullmatch(out.stderr.strip()), out.stderr


def test_a_speculative_run_s_stats_line_gives_rounds_and_acceptance():
    from pie_runtime.cli.run import stats_line

    result = {
        "finish_reason": "stop",
        "stop_reason": " 7",
        "stats": {"prompt_tokens": 9, "generated_tokens": 30, "cached_tokens": 4, "prefill_ms": 88.4},
        "speculation": {"rounds": 11, "proposed": 20, "accepted": 17, "acceptance": 0.85},
    }
    result["stats"]["decode_tokens_per_s"] = 41.26
    assert stats_line(result) == (
        "30 tokens, 41.3 tok/s, 11 rounds, acceptance 0.85 (17 of 20 drafts); prompt 9 tokens (4 cached), "
        "prefill 88 ms; stopped at ' 7'"
    )
    assert stats_line({"shape": [3, 4]}) is None


def test_pie_run_on_an_address_no_engine_listens_on_says_how_to_start_one(tmp_path):
    """An ipc:// address without its socket file would leave the inferlet waiting for ever."""
    address = f"ipc://{tmp_path}/none.sock"
    out = pie_run("text-completion", "--engine", address, "--", "--prompt", "hi", timeout=60)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith(f"error: no engine listens on {address}") and "pie engine --listen" in out.stderr
