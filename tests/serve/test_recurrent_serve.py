"""`pie serve` on a model with recurrent state: a tiny random LFM2 (short convolutions and attention) served
over the OpenAI HTTP API gives the same greedy text as `pie run text-completion` on it, whole and streamed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai
import pytest

from pie_runtime.store import ModelStore, import_model
from tests.conftest import REPO
from tests.models.tiny_models import write_tiny_checkpoint
from tests.serve.server_proc import start_serve

pytestmark = pytest.mark.e2e

MODEL = "tiny-lfm2"
PROMPT = "the cat sat on the mat, the cat sat on the"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-lfm2")
    write_tiny_checkpoint(root / "ckpt", "lfm2")
    import_model(str(root / "ckpt"), name=MODEL, store=ModelStore(root / "home" / "models"), progress=False)
    return root / "home"


def pie_run_text(home) -> str:
    """`pie run text-completion` on the model, greedy, with an embedded engine."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pie_runtime.cli.main",
            "run",
            "text-completion",
            "--model",
            MODEL,
            "--json",
            "--kv-pages",
            "256",
            "--pass-cost-rows",
            "0",
            "--",
            "--prompt",
            PROMPT,
            "--max-tokens",
            str(MAX_TOKENS),
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PIE_HOME": str(home)},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["text"]


def test_served_greedy_text_equals_pie_run(home):
    want = pie_run_text(home)
    server = start_serve(home, MODEL, "--kv-pages", "256", "--pass-cost-rows", "0", "--no-prefix-cache")
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
        kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        got = client.completions.create(**kw, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        streamed = client.completions.create(**kw, extra_body={"ignore_eos": True}, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want
        assert [m.id for m in client.models.list().data] == [MODEL]
    finally:
        assert server.stop() == 0
