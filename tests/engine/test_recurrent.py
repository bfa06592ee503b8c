"""Working sets of models with recurrent state (tiny random Mamba and LFM2), in process: the state slot a
working set holds, fork and release, an exhausted pool, and the fold of fewer rows than a fire ran — by the
fire's own count, by ``ws_fold``, by the next fire's ``settle`` and by an epilogue — which either copies the
state the fire kept after the last folded row (``--recurrent-fold per-row``) or restores the state from before
the fire and replays the folded rows (``replay``, and per-row past its cap), so that what follows equals
decoding one row at a time, and the state equals that of running only the folded rows."""

from __future__ import annotations

import numpy as np
import pytest

from pie_runtime.engine.build import build_served_model
from pie_runtime.engine.core import EngineCore
from pie_runtime.engine.options import ServeOptions
from pie_runtime.protocol import ErrorCode
from pie_runtime.protocol.arrays import decode_array
from pie_runtime.protocol.codec import pack, parse_request
from pie_runtime.store import ModelStore, import_model
from tests.models.tiny_models import RECURRENT_FAMILIES, write_tiny_checkpoint

A = b"client-a"
PROMPT = [(11 * i + 5) % 250 for i in range(13)]
ATOL = 1e-4


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ModelStore:
    root = tmp_path_factory.mktemp("recurrent")
    store = ModelStore(root / "home" / "models")
    for family in (*RECURRENT_FAMILIES, "llama"):
        write_tiny_checkpoint(root / family, family)
        import_model(str(root / family), name=f"tiny-{family}", store=store, progress=False)
    return store


FOLDS = ("per-row", "replay")


def replayed(fold: str, rows: int) -> int:
    """The rows a partial fold of ``rows`` replays under ``fold`` (per-row states serve these tests' folds)."""
    return rows if fold == "replay" else 0


class Core:
    def __init__(
        self,
        store: ModelStore,
        family: str,
        slots: int = 8,
        max_batch_tokens: int = 256,
        fold: str = "replay",
        per_row_states: int = 8,
    ):
        opts = ServeOptions(
            page_size=4,
            kv_pages=64,
            prepack_lm_head=False,
            state_slots=slots,
            recurrent_fold=fold,
            per_row_states=per_row_states,
        )
        sm = build_served_model(f"tiny-{family}", opts, store=store)
        self.sm = sm
        self.core = EngineCore([sm], max_batch_tokens)
        self.ids = iter(range(1, 1_000_000))

    def request(self, op: str, **fields) -> tuple[int, dict | None]:
        req_id = next(self.ids)
        _, req = parse_request(pack({"id": req_id, "op": op, **fields}))
        return req_id, self.core.handle(A, req)

    def call(self, op: str, **fields) -> dict:
        _, reply = self.request(op, **fields)
        assert reply is not None
        return reply

    def fire(self, ws: int, tokens: list[int], **fields) -> dict:
        """One fire run to its reply (logits of every row)."""
        fields.setdefault("readouts", [{"kind": "logits", "rows": list(range(len(tokens)))}])
        req_id, reply = self.request("fire", ws=ws, tokens=tokens, **fields)
        assert reply is None
        replies: dict[int, dict] = {}
        while self.core.has_work():
            replies.update({r["id"]: r for _, r in self.core.step()})
        assert replies[req_id]["ok"], replies[req_id]
        return replies[req_id]


def logits(reply: dict) -> np.ndarray:
    return decode_array(reply["results"][0]["logits"])


def plain_logits(c: Core, tokens: list[int]) -> np.ndarray:
    """The reference: the prompt in one fire, then one row a fire."""
    ws = c.call("ws_open")["ws"]
    out = [logits(c.fire(ws, PROMPT))[-1]]
    for t in tokens:
        out.append(logits(c.fire(ws, [t]))[0])
    c.call("ws_release", ws=ws)
    return np.stack(out)


@pytest.mark.parametrize("fold", FOLDS)
@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_every_way_of_folding_fewer_rows_restores_the_state(family, fold, store):
    c = Core(store, family, fold=fold)
    assert c.sm.info.recurrent and c.sm.info.state_slots == 8 and c.sm.pages.cache is None  # prefix cache off
    assert c.sm.info.recurrent_fold == fold and c.sm.info.per_row_states == (8 if fold == "per-row" else 0)
    ref = plain_logits(c, [3, 4, 5, 6, 7, 8, 9, 10])
    ws = c.call("ws_open")["ws"]
    got = [logits(c.fire(ws, PROMPT))[-1]]
    # the fire's own fold: [3, 4, 99, 98] keeps 2 rows; the state ran through 4
    r = c.fire(ws, [3, 4, 99, 98], fold=2)
    got += list(logits(r)[:2])
    assert r["committed"] == len(PROMPT) + 2 and r["replayed_rows"] == replayed(fold, 2)
    # a deferred fold settled by ws_fold
    r = c.fire(ws, [5, 6, 97], fold="deferred")
    got += list(logits(r)[:2])
    assert c.call("ws_fold", ws=ws, n=2) == {"committed": len(PROMPT) + 4, "replayed_rows": replayed(fold, 4)}
    # a deferred fold settled by the next fire, which then runs on the replayed state
    r = c.fire(ws, [7, 96], fold="deferred")
    got.append(logits(r)[0])
    r = c.fire(ws, [8, 9, 10], settle=1)
    got += list(logits(r)[:3])
    assert r["replayed_rows"] == replayed(fold, 5) and r["committed"] == len(PROMPT) + 8
    np.testing.assert_allclose(np.stack(got), ref, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("fold", FOLDS)
@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_an_epilogue_fold_restores_the_state_too(family, fold, store):
    from inferlet.programs import Builder
    from pie_runtime.protocol.programs import ModelDims

    c = Core(store, family, fold=fold)
    b = Builder(ModelDims(c.sm.info.vocab_size, c.sm.info.hidden_size, 0))
    b.fold(2)  # what a device-side verify decides; here a constant
    ref = plain_logits(c, [3, 4, 5])
    ws = c.call("ws_open")["ws"]
    c.fire(ws, PROMPT)
    prog = c.call("program_register", nodes=b.nodes)["program"]
    r = c.fire(ws, [3, 4, 77, 78], fold="deferred", program=prog)
    assert r["fold"] == 2 and r["committed"] == len(PROMPT) + 2 and r["replayed_rows"] == replayed(fold, 2)
    np.testing.assert_allclose(logits(c.fire(ws, [5]))[0], ref[3], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_fork_copies_the_state_and_release_frees_the_slot(family, store):
    c = Core(store, family, slots=2)
    ws = c.call("ws_open")["ws"]
    c.fire(ws, PROMPT)
    child = c.call("ws_fork", ws=ws)["ws"]
    with pytest.raises(Exception) as full:
        c.call("ws_open")
    assert getattr(full.value, "code", None) == ErrorCode.OUT_OF_STATE_SLOTS
    a, b = logits(c.fire(ws, [5, 6])), logits(c.fire(child, [5, 6]))
    np.testing.assert_allclose(a, b, atol=ATOL, rtol=1e-5)
    c.call("ws_release", ws=child)
    assert c.call("stats")["models"][f"tiny-{family}"]["state_slots"] == {"used": 1, "total": 2}
    first = logits(c.fire(ws, [7]))[0]
    fresh = c.call("ws_open")["ws"]  # the child's slot, zeroed: the prompt runs as in a new working set
    c.fire(fresh, PROMPT)
    c.fire(fresh, [5, 6])
    np.testing.assert_allclose(logits(c.fire(fresh, [7]))[0], first, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_truncate_evict_and_granules_are_refused_with_typed_errors(family, store):
    c = Core(store, family)
    ws = c.call("ws_open")["ws"]
    c.fire(ws, PROMPT)
    for op, fields in (("ws_truncate", {"n": 3}), ("ws_evict", {"rows": [1]})):
        with pytest.raises(Exception) as refused:
            c.call(op, ws=ws, **fields)
        assert getattr(refused.value, "code", None) == ErrorCode.UNSUPPORTED, op
    c.sm.info.state_granule = 4  # a model whose state advances 4 rows at a time
    for fold in ("deferred", 1):
        with pytest.raises(Exception) as refused:
            c.request("fire", ws=ws, tokens=[1, 2], fold=fold)
        assert getattr(refused.value, "code", None) == ErrorCode.GRANULE
    assert c.fire(ws, [1, 2, 3, 4])["committed"] == len(PROMPT) + 4  # whole fires still run


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_drafters_with_recurrent_state_are_refused_at_attach_and_at_engine_start(family, store, tmp_path):
    from pie_runtime.drafters import DrafterRefused, attach, check_mtp
    from pie_runtime.store import DrafterEntry

    with pytest.raises(DrafterRefused, match="recurrent state"):
        attach(store, "tiny-llama", f"draft:tiny-{family}")
    # attached by hand (an older store, a hand edit): the engine refuses to start with it
    target = store.get("tiny-llama")
    entry = DrafterEntry(kind="draft", name="stateful", path=f"tiny-{family}")
    store.write_manifest(target.model_copy(update={"drafters": [entry]}))
    try:
        with pytest.raises(DrafterRefused, match="recurrent state"):
            build_served_model("tiny-llama", ServeOptions(kv_pages=8, prepack_lm_head=False), store=store)
    finally:
        store.write_manifest(target)
    # an MTP head whose module says it carries state (ours never does: norm, projection and MLP only)
    (tmp_path / "head.safetensors").write_bytes(b"")
    (tmp_path / "head.json").write_text('{"recurrent": true, "hidden_size": 64}')
    with pytest.raises(DrafterRefused, match="carries recurrent state"):
        check_mtp(store.get(f"tiny-{family}"), tmp_path / "head.safetensors")


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_a_tree_fire_is_refused_and_a_chain_fold_still_replays(family, store):
    c = Core(store, family)
    ws = c.call("ws_open")["ws"]
    c.fire(ws, PROMPT)
    with pytest.raises(Exception) as refused:  # a state advances through rows in order, not along branches
        c.request("fire", ws=ws, tokens=[3, 4, 5], parents=[-1, 0, 0], fold=[0, 2])
    assert getattr(refused.value, "code", None) == ErrorCode.UNSUPPORTED
    r = c.fire(ws, [3, 4, 5], fold=[0, 1])  # a chain's path: the replay as for a count
    assert r["committed"] == len(PROMPT) + 2 and r["replayed_rows"] == 2


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_eagle_heads_and_tensor_parallelism_are_refused_on_a_recurrent_target(family, store, tmp_path):
    from pie_runtime.drafters import DrafterRefused, attach
    from pie_runtime.store import DrafterEntry

    (tmp_path / "head.safetensors").write_bytes(b"")
    with pytest.raises(DrafterRefused, match="recurrent state"):
        attach(store, f"tiny-{family}", f"eagle:{tmp_path / 'head.safetensors'}")
    target = store.get(f"tiny-{family}")
    entry = DrafterEntry(kind="eagle", name="eagle", path="drafters/eagle/head.safetensors")
    store.write_manifest(target.model_copy(update={"drafters": [entry]}))
    try:
        with pytest.raises(DrafterRefused, match="recurrent state"):
            build_served_model(f"tiny-{family}", ServeOptions(kv_pages=8, prepack_lm_head=False), store=store)
    finally:
        store.write_manifest(target)
    with pytest.raises(ValueError, match="recurrent state"):
        opts = ServeOptions(kv_pages=8, prepack_lm_head=False, tensor_parallel=2)
        build_served_model(f"tiny-{family}", opts, store=store)


def test_speculative_inferlets_fall_back_to_plain_steps_on_a_granule_model(store, tmp_path):
    """A model whose state advances 4 rows at a time: cacheback runs one token a step, counts each step in
    ``skipped["granule"]`` and returns text-completion's tokens (engine in this thread, inferlets in another)."""
    import asyncio
    import threading

    import inferlet
    from pie_runtime.engine.server import EngineServer
    from tests.inferlets.conftest import load

    c = Core(store, "lfm2")
    c.sm.info.state_granule = 4
    server = EngineServer(c.core, f"ipc://{tmp_path}/engine.sock")
    results: dict[str, dict] = {}

    def client() -> None:
        async def go():
            session = await inferlet.connect(f"ipc://{tmp_path}/engine.sock")
            try:
                assert inferlet.model().state_granule == 4
                for name in ("text-completion", "cacheback-speculative-decoding"):
                    main, Args = load(name)
                    args = Args(prompt="the cat sat on the mat, the cat sat on the", max_tokens=12, stream=False)
                    results[name] = await main(args)
            finally:
                session.client.close()

        try:
            asyncio.run(go())
        finally:
            server.stop()

    thread = threading.Thread(target=client)
    thread.start()
    server.serve_forever()
    thread.join()
    spec = results["cacheback-speculative-decoding"]
    assert spec["token_ids"] == results["text-completion"]["token_ids"]
    assert spec["stats"]["proposed"] == 0 and spec["stats"]["skipped"]["granule"] == 11


def live_state(c: Core, ws: int) -> list[np.ndarray]:
    """The working set's live recurrent state, every tensor of every recurrent layer."""
    hold = c.core.sets.get(A, ws).state
    assert hold is not None and hold.fire is None  # folded: the live state is the committed one
    pool = c.sm.runner.state
    assert pool is not None
    return [t[hold.slot].numpy().copy() for ts in pool.layers.values() for t in ts]


@pytest.mark.parametrize("how", ["count", "deferred"])
@pytest.mark.parametrize("fold", FOLDS)
@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_the_state_after_a_partial_fold_equals_running_only_the_folded_rows(family, fold, how, store):
    c = Core(store, family, fold=fold)
    ref = c.call("ws_open")["ws"]
    c.fire(ref, PROMPT)
    c.fire(ref, [3, 4])
    ws = c.call("ws_open")["ws"]
    c.fire(ws, PROMPT)
    if how == "count":
        r = c.fire(ws, [3, 4, 99, 98, 97], fold=2)
    else:
        c.fire(ws, [3, 4, 99, 98, 97], fold="deferred")
        r = c.call("ws_fold", ws=ws, n=2)
    assert r["committed"] == len(PROMPT) + 2 and r["replayed_rows"] == replayed(fold, 2)
    for got, want in zip(live_state(c, ws), live_state(c, ref), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_per_row_states_serve_a_fire_split_into_chunks_and_replay_past_their_cap(family, store):
    """A verify window of 6 rows run 2 rows a step keeps its per-row states across the chunks; with 2 per-row
    states a working set, a fold of 2 copies one and a fold of 4 restores and replays (the fallback)."""
    ref = plain_logits(Core(store, family), [3, 4, 5, 6, 7, 8, 9])
    for cap, kept, replays in ((8, 4, 0), (2, 2, 0), (2, 4, 4)):
        c = Core(store, family, max_batch_tokens=2, fold="per-row", per_row_states=cap)
        ws = c.call("ws_open")["ws"]
        got = [logits(c.fire(ws, PROMPT))[-1]]
        window = [3, 4, 5, 6, 7, 8][:kept] + [99] * (6 - kept)
        r = c.fire(ws, window, fold="deferred")
        got += list(logits(r)[:kept])
        assert c.call("ws_fold", ws=ws, n=kept)["replayed_rows"] == replays
        rest = [3, 4, 5, 6, 7, 8, 9][kept:]
        got += list(logits(c.fire(ws, rest))[: len(rest)])
        np.testing.assert_allclose(np.stack(got), ref[: len(got)], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_a_fire_that_folds_all_its_rows_keeps_no_per_row_states(family, store):
    c = Core(store, family, fold="per-row")
    ws = c.call("ws_open")["ws"]
    c.fire(ws, PROMPT)  # a prefill folds every row it runs: no state per row is written
    pool = c.sm.runner.state
    assert pool is not None
    slot = c.core.sets.get(A, ws).state.slot  # type: ignore[union-attr]
    rows = [pool.row_entry(slot, i) for i in range(pool.rows)]
    assert all(not t[rows].any() for ts in pool.layers.values() for t in ts)


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_per_row_states_survive_a_batched_forward_that_raised(family, store, monkeypatch):
    """Two verify fires share a step whose forward raises once: each runs again alone from its snapshot,
    keeps its per-row states again, and a fold of 2 copies one (nothing replayed), the state as if only the
    2 rows ran."""
    c = Core(store, family, fold="per-row")
    ref = c.call("ws_open")["ws"]
    c.fire(ref, PROMPT)
    c.fire(ref, [3, 4])
    sets = [c.call("ws_open")["ws"] for _ in range(2)]
    for ws in sets:
        c.fire(ws, PROMPT)
    forward, raised = c.sm.runner.forward, []

    def flaky(segments, *args, **kw):
        if len(segments) == 2 and not raised:
            raised.append(True)
            forward(segments, *args, **kw)  # the states advance, then the step fails
            raise RuntimeError("a flaky device")
        return forward(segments, *args, **kw)

    monkeypatch.setattr(c.sm.runner, "forward", flaky)
    ids = [c.request("fire", ws=ws, tokens=[3, 4, 99, 98], fold="deferred", readouts=[])[0] for ws in sets]
    replies: dict[int, dict] = {}
    while c.core.has_work():
        replies.update({r["id"]: r for _, r in c.core.step()})
    assert raised and all(replies[i]["ok"] for i in ids)
    for ws in sets:
        assert c.call("ws_fold", ws=ws, n=2)["replayed_rows"] == 0
        for got, want in zip(live_state(c, ws), live_state(c, ref), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
