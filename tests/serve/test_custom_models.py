"""Custom inferlets as served models (serve/custom_models.py), without a server: which files take completion
requests (asked of a probe process: a dict-taking main, Args lacking a completion field or needing one a request
lacks, a file that fails or ends its process on load are not models), the routing of ``model`` MODEL:NAME and
the ``inferlet`` field with its typed refusals, a changed file probed again, and a custom file with a shipped
inferlet's name refused by `pie serve` before its port binds and never served in the shipped one's place."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest

from pie_runtime.launcher import SHIPPED
from pie_runtime.serve.custom_models import CustomModels, check_folders, custom_files
from pie_runtime.serve.errors import APIError
from pie_runtime.serve.generation import pick
from pie_runtime.serve.host_pool import HostPool
from pie_runtime.serve.openai_api import ChatRequest
from pie_runtime.serve.policies import Capabilities
from tests.conftest import REPO, TINY
from tests.serve.server_proc import assert_refused_before_bind

IDS = ("served-name", "store-name")
DICT_MAIN = "import inferlet\n\n@inferlet.main\nasync def main(args: dict) -> dict:\n    return {}\n"
PARTIAL = (
    "import inferlet\nfrom pydantic import BaseModel\n\nclass Args(BaseModel):\n    prompt: str\n\n"
    "@inferlet.main\nasync def main(args: Args) -> dict:\n    return {}\n"
)
NEEDY = (
    "import inferlet\nfrom inferlet.text import CompletionArgs\n\nclass Args(CompletionArgs):\n    corpus: str\n\n"
    "@inferlet.main\nasync def main(args: Args) -> dict:\n    return {}\n"
)


@pytest.fixture
def folder(tmp_path) -> Path:
    shutil.copy(REPO / "examples" / "bigram_drafter.py", tmp_path / "my-drafter.py")
    (tmp_path / "dicty.py").write_text(DICT_MAIN)
    (tmp_path / "partial.py").write_text(PARTIAL)
    (tmp_path / "needy.py").write_text(NEEDY)
    (tmp_path / "broken.py").write_text("raise RuntimeError('nope')\n")
    (tmp_path / "exits.py").write_text("import os\nos._exit(3)\n")
    (tmp_path / "_private.py").write_text(DICT_MAIN)
    return tmp_path


def refusal(coro) -> APIError:
    with pytest.raises(APIError) as e:
        asyncio.run(coro)
    return e.value


def test_only_files_taking_completion_arguments_are_models(folder):
    models = CustomModels([folder])
    verdicts = asyncio.run(models.verdicts())
    assert sorted(verdicts) == ["broken", "dicty", "exits", "my-drafter", "needy", "partial"]
    assert asyncio.run(models.served()) == ["my-drafter"]
    assert "takes a dict" in verdicts["dicty"].why
    assert "lacks" in verdicts["partial"].why and "max_tokens" in verdicts["partial"].why
    assert "needs corpus" in verdicts["needy"].why
    assert "RuntimeError: nope" in verdicts["broken"].why
    assert "ended the probe process" in verdicts["exits"].why  # and cost no other file its verdict


def test_routing_by_model_name_and_field(folder):
    models = CustomModels([folder])
    route = models.route
    assert asyncio.run(route("served-name", None, IDS)) is None  # the shipped path
    assert asyncio.run(route("store-name", None, IDS)) is None
    assert asyncio.run(route("served-name:my-drafter", None, IDS)) == "my-drafter"
    assert asyncio.run(route("store-name:my-drafter", "my-drafter", IDS)) == "my-drafter"
    assert asyncio.run(route("served-name", "my-drafter", IDS)) == "my-drafter"
    cases = [
        (("other", None), 404, "model_not_found", "model"),
        (("other:my-drafter", None), 404, "model_not_found", "model"),
        (("served-name:", None), 404, "model_not_found", "model"),
        (("served-name:nope", None), 404, "model_not_found", "model"),
        (("served-name", "nope"), 404, "inferlet_not_found", "inferlet"),
        (("served-name", "dicty"), 400, "inferlet_not_completion", "inferlet"),
        (("served-name:broken", None), 400, "inferlet_not_completion", "model"),
        (("served-name", "text-completion"), 400, "inferlet_not_custom", "inferlet"),
        (("served-name:my-drafter", "dicty"), 400, None, "inferlet"),
    ]
    for (model, field), status, code, param in cases:
        e = refusal(route(model, field, IDS))
        assert (e.status, e.code, e.param) == (status, code, param), (model, field, e.message)
    assert "served-name:my-drafter" in refusal(route("other", None, IDS)).message  # says what is served


def test_a_changed_file_is_probed_again(folder):
    models = CustomModels([folder])
    assert "dicty" not in asyncio.run(models.served())
    shutil.copy(folder / "my-drafter.py", folder / "dicty.py")
    later = time.time() + 5  # a new mtime even on a coarse clock
    os.utime(folder / "dicty.py", (later, later))
    assert asyncio.run(models.served()) == ["dicty", "my-drafter"]


def test_custom_inferlets_take_no_shipped_only_fields():
    def chat(**kw) -> ChatRequest:
        return ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})

    assert pick(chat(speculation=False), None, Capabilities(), None, "mine") == ("mine", {})
    for kw, grammar, param in [
        ({"speculation": {"method": "lookup", "k": 2}}, None, "speculation"),
        ({"response_format": {"type": "json_object"}}, None, "response_format"),
        ({}, "start: /x/", "tools"),
    ]:
        with pytest.raises(APIError) as e:
            pick(chat(**kw), None, Capabilities(), grammar, "mine")
        assert e.value.status == 400 and e.value.param == param


def test_a_shipped_name_in_a_custom_folder_is_refused(tmp_path):
    (tmp_path / "text-completion.py").write_text(DICT_MAIN)
    with pytest.raises(ValueError, match="text-completion.py has the name of a shipped inferlet"):
        check_folders([tmp_path])
    assert "text-completion" not in custom_files([tmp_path])
    # a file that appears after start still never replaces the shipped one in the hosts
    pool = HostPool("ipc:///nowhere", inferlet_dirs=[tmp_path])
    assert pool.inferlets()["text-completion"] == (SHIPPED / "text-completion.py").resolve()


@pytest.mark.e2e
def test_pie_serve_refuses_a_shipped_name_before_binding(pie_home, tmp_path):
    (tmp_path / "text-completion.py").write_text(DICT_MAIN)
    flags = ["--inferlets", str(tmp_path)]
    assert_refused_before_bind(pie_home, TINY, flags, "has the name of a shipped inferlet")
