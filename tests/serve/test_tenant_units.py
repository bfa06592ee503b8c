"""Tenants' fences that need no server (issue 57). Every shipped inferlet's arguments are bounded before a run
starts: each integer and each list of its ``Args`` model has an upper bound, so no request sizes a run's work
or memory past what a shared host can hold, and a tree shape is checked (depth and nodes) with the arguments.
The prefix cache's salt: a working set opened with a salt maps only pages cached under the same salt (in
process, the tiny random Llama of tests/engine/test_core.py). Secrets come from a file or the environment."""

from __future__ import annotations

import asyncio
import contextvars
import random

import annotated_types
import pytest
from pydantic import ValidationError

from inferlet.runtime import load_module
from inferlet.spec.token_tree import MAX_TREE_NODES, parse_shape
from inferlet.text.arguments import MAX_NEW_TOKENS, CompletionArgs, args_model
from inferlet.working_set import CACHE_SALT
from pie_runtime.cli.secrets import secret, secret_list
from pie_runtime.engine.identities import MAX_IDENTITY_CHANNEL_BYTES
from pie_runtime.engine.ws_requests import rows_named
from pie_runtime.launcher import SHIPPED
from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol import messages as m
from pie_runtime.serve.errors import APIError
from pie_runtime.serve.host_pool import RunEvent
from pie_runtime.serve.metrics import Metrics
from pie_runtime.serve.runs import Runs, RunSlots
from tests.engine.test_core import PROMPT, A, B, Core

SHIPPED_FILES = sorted(p for p in SHIPPED.glob("*.py") if not p.stem.startswith("_"))


def _bounded(field) -> bool:
    return any(isinstance(m, (annotated_types.Le, annotated_types.Lt, annotated_types.MaxLen)) for m in field.metadata)


def _sized(annotation) -> bool:
    """Whether a field's values can size a run: ints, lists and dicts (a bool is an int but sizes nothing)."""
    text = str(annotation)
    return annotation is not bool and ("int" in text or "list" in text or "dict" in text) and "bool" not in text


@pytest.mark.parametrize("path", SHIPPED_FILES, ids=lambda p: p.stem)
def test_every_sizing_argument_of_a_shipped_inferlet_has_an_upper_bound(path):
    _, entry = load_module(path, f"bounds_{path.stem.replace('-', '_')}")
    model = args_model(entry)
    assert model is not None
    unbounded = [name for name, f in model.model_fields.items() if _sized(f.annotation) and not _bounded(f)]
    assert unbounded == [], f"{path.stem}: {unbounded}"


def test_the_bounds_refuse_before_a_run():
    with pytest.raises(ValidationError):
        CompletionArgs(prompt="x", max_tokens=MAX_NEW_TOKENS + 1)
    with pytest.raises(ValidationError):
        CompletionArgs(prompt="x", n=65)
    with pytest.raises(ValueError, match="nodes"):
        parse_shape("64,64")
    assert len(parse_shape("4,2,1")) == 3 and MAX_TREE_NODES >= 4 + 8 + 8


def _cached_rows(c: Core, client: bytes, salt: str | None) -> int:
    ws = c.call(client, "ws_open", **({"cache_salt": salt} if salt else {}))["ws"]
    req = c.fire(client, ws, PROMPT, readouts=[{"rows": [len(PROMPT) - 1], "kind": "argmax"}])
    return c.run()[req]["cached_rows"]


def test_a_salted_working_set_maps_only_pages_of_its_own_salt():
    c = Core(num_pages=64)
    assert _cached_rows(c, A, "key-a") == 0
    assert _cached_rows(c, B, "key-b") == 0  # the same tokens under another salt: no hit
    assert _cached_rows(c, B, None) == 0  # nor unsalted
    assert _cached_rows(c, B, "key-a") > 0  # the same salt shares
    assert _cached_rows(c, A, None) > 0  # the unsalted chain it cached just before


def test_secrets_come_from_files_or_the_environment(tmp_path, monkeypatch, capsys):
    f = tmp_path / "keys"
    f.write_text("a\nb\n\n")
    monkeypatch.setenv("PIE_API_KEYS", "c, d")
    assert secret_list([f"@{f}"], "--api-key", "PIE_API_KEYS") == ["a", "b", "c", "d"]
    assert capsys.readouterr().err == ""
    assert secret_list(["lit"], "--api-key", "NONE_SET") == ["lit"]
    assert "warning" in capsys.readouterr().err
    monkeypatch.setenv("PIE_ENGINE_TOKEN", "tok")
    assert secret(None, "--token", "PIE_ENGINE_TOKEN") == "tok"
    with pytest.raises(ValueError, match="cannot read"):
        secret(f"@{tmp_path / 'missing'}", "--token", "PIE_ENGINE_TOKEN")


def test_an_evict_merges_its_ranges_before_it_names_rows():
    rng = random.Random(7)
    for _ in range(200):
        ranges = [sorted(rng.sample(range(300), 2)) for _ in range(rng.randrange(0, 40))]
        rows = rng.sample(range(300), rng.randrange(0, 10))
        naive = set(rows).union(*(range(a, b) for a, b in ranges))
        assert rows_named(rows, ranges) == naive
    # thousands of ranges over the same rows: each row named once (the merge's work, not 4096 times its rows)
    assert rows_named([], [[0, 8000]] * 4096) == set(range(8000))


def test_one_fires_attention_readouts_are_bounded_together(monkeypatch):
    c = Core(num_pages=32)
    ws = c.call(A, "ws_open")["ws"]
    width = len(PROMPT)
    one = {"rows": list(range(10)), "kind": "attention"}
    monkeypatch.setattr(m, "MAX_ATTENTION_BYTES", 4 * 10 * width * 3)  # three such readouts fit, not four
    with pytest.raises(PieError, match="MAX_ATTENTION_BYTES") as e:
        c.request(A, "fire", ws=ws, tokens=PROMPT, readouts=[one] * 4)
    assert e.value.code == ErrorCode.LIMIT_EXCEEDED
    req = c.fire(A, ws, PROMPT, readouts=[one] * 3)
    assert c.run()[req]["ok"]


def test_a_clients_open_channels_are_bounded_together():
    c = Core(num_pages=32)
    big = {"shape": [1 << 20], "dtype": "float32", "capacity": 16}  # MAX_CHANNEL_ELEMENTS: allowed alone
    opened = [c.call(A, "channel_open", **big)["channel"] for _ in range(MAX_IDENTITY_CHANNEL_BYTES // (64 << 20))]
    with pytest.raises(PieError, match="MAX_IDENTITY_CHANNEL_BYTES"):
        c.call(A, "channel_open", **big)
    assert c.call(B, "channel_open", **big)["channel"]  # another client has its own budget
    c.call(A, "channel_close", channel=opened[0])
    assert c.call(A, "channel_open", **big)["channel"]  # a closed channel's elements come back


def test_each_keys_suffix_runs_share_a_store_of_their_own():
    module, _ = load_module(SHIPPED / "suffix-speculative-decoding.py", "units_suffix")
    stores: dict[str, object] = {}

    class Stub:  # a Model's shared(): one object a key, made once
        def shared(self, key, make):
            return stores.setdefault(key, make())

    args = module.Args(prompt="x")

    def store_of(salt: str | None) -> object:
        def get() -> object:
            CACHE_SALT.set(salt)
            return module.shared_store(Stub(), args)

        return contextvars.copy_context().run(get)

    assert store_of("key-a") is store_of("key-a")
    assert store_of("key-a") is not store_of("key-b") and store_of(None) is not store_of("key-a")


class _Pool:
    """A host pool whose runs wait for ``go`` and then end with a result."""

    def __init__(self) -> None:
        self.go = asyncio.Event()

    async def run(self, inferlet: str, args: dict, **_: object):
        await self.go.wait()
        yield RunEvent("result", result={"ok": True})

    async def cancel(self, run_id: str) -> bool:
        return False


async def test_uploaded_runs_take_the_servers_run_slots():
    """A key's uploaded-inferlet runs (their own pool, their own Runs) wait for the same --max-running slots as
    the main hosts' runs: uploading buys no slots. With one slot and no queue, a second run on another pool is
    refused 503 overloaded while the first holds it, and runs once it is given back."""
    slots = RunSlots(max_running=1, max_waiting=0)
    main_pool, upload_pool = _Pool(), _Pool()
    main = Runs(main_pool, Metrics(), "m", slots)  # type: ignore[arg-type]  # the pool's duck type
    uploads = Runs(upload_pool, Metrics(), "m", slots)  # type: ignore[arg-type]
    first = asyncio.create_task(main.collect(main.events("text-completion", {})))
    while slots.running == 0:
        await asyncio.sleep(0)
    with pytest.raises(APIError) as e:
        await uploads.collect(uploads.events("mine", {}))
    assert e.value.status == 503 and e.value.code == "overloaded"
    assert uploads.running == main.running == 1
    main_pool.go.set()
    assert await first == {"ok": True}
    upload_pool.go.set()
    assert await uploads.collect(uploads.events("mine", {})) == {"ok": True}
    assert slots.running == slots.waiting == 0
