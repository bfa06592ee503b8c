"""The wire contract: golden round trips and typed refusals, without an engine."""

from __future__ import annotations

from typing import Any, cast, get_args

import msgpack
import numpy as np
import pytest

from inferlet.model import Model
from pie_runtime.protocol import ErrorCode, PieError, decode_array, encode_array, pack, parse_request
from pie_runtime.protocol.codec import MAX_MESSAGE_BYTES
from pie_runtime.protocol.dtypes import ALLOWED_DTYPES, CHANNEL_DTYPES, KINDS
from pie_runtime.protocol.messages import DEFERRED, REQUEST_OPS, ChannelOpen, Fire, ModelInfo, Request


@pytest.mark.parametrize("dtype", ["float32", "int32", "int64", "uint8", "bool", "float16"])
def test_array_round_trip(dtype):
    a = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    wire = encode_array(a)
    assert isinstance(wire["data"], bytes) and wire["shape"] == [2, 3, 4]
    b = decode_array(msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False))
    assert b.dtype == a.dtype and np.array_equal(a, b)


def test_fire_golden_bytes_parse():
    golden = pack(
        {
            "id": 7,
            "op": "fire",
            "ws": 3,
            "tokens": [1, 2, 3],
            "readouts": [{"rows": [2], "kind": "sample", "temperature": 0.7, "seed": 5}],
            "fold": "deferred",
        }
    )
    req_id, req = parse_request(golden)
    assert req_id == 7 and isinstance(req, Fire)
    assert req.tokens == [1, 2, 3] and req.fold == "deferred"
    assert req.readouts[0].kind == "sample" and req.readouts[0].seed == 5 and req.readouts[0].top_k == 0


@pytest.mark.parametrize(
    "payload, code",
    [
        (b"\xc1\xff not msgpack", ErrorCode.BAD_MESSAGE),
        (pack([1, 2, 3]), ErrorCode.BAD_MESSAGE),
        (pack({"id": 1, "op": "launch_missiles"}), ErrorCode.UNKNOWN_OP),
        (pack({"id": 1, "op": "fire", "ws": "one", "tokens": [1]}), ErrorCode.BAD_MESSAGE),
        (pack({"id": 1, "op": "fire", "ws": 1, "tokens": ["a"]}), ErrorCode.BAD_MESSAGE),
        (pack({"id": 1, "op": "fire", "ws": 1, "tokens": []}), ErrorCode.BAD_MESSAGE),
        (pack({"id": 1, "op": "fire", "ws": 1, "tokens": [1], "bogus": 1}), ErrorCode.BAD_MESSAGE),
        (
            pack({"id": 1, "op": "fire", "ws": 1, "tokens": [1], "readouts": [{"rows": [0], "kind": "magic"}]}),
            ErrorCode.BAD_MESSAGE,
        ),
        (pack({"id": 1, "op": "ws_fold", "ws": 1, "n": -1}), ErrorCode.BAD_MESSAGE),
        (b"\x00" * (MAX_MESSAGE_BYTES + 1), ErrorCode.MESSAGE_TOO_LARGE),
    ],
)
def test_refusals_are_typed(payload, code):
    with pytest.raises(PieError) as e:
        parse_request(payload)
    assert e.value.code == code
    assert "\n" not in e.value.message


def test_protocol_imports_no_torch_or_zmq():
    import subprocess
    import sys

    code = (
        "import sys, pie_runtime.protocol, pie_runtime.protocol.programs, pie_runtime.protocol.dtypes; "
        "bad = {'torch', 'zmq'} & set(sys.modules); print(sorted(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_request_ops_are_the_request_union():
    """The op table is derived from the request models: one op per model, each parses as its model."""
    models = get_args(get_args(Request)[0])
    assert len(REQUEST_OPS) == len(set(REQUEST_OPS)) == len(models)
    for op, model in zip(REQUEST_OPS, models):
        assert get_args(model.model_fields["op"].annotation) == (op,)
        with pytest.raises(PieError) as e:
            parse_request(pack({"id": 1, "op": op, "bogus": 1}))
        assert e.value.code == ErrorCode.BAD_MESSAGE  # known op, refused by its schema


def test_deferred_is_the_fire_fold_literal():
    fold_types = get_args(Fire.model_fields["fold"].annotation)
    assert any(get_args(t) == (DEFERRED,) for t in fold_types)
    _, req = parse_request(pack({"id": 1, "op": "fire", "ws": 1, "tokens": [1], "fold": DEFERRED}))
    assert req.fold == DEFERRED


def test_one_channel_dtype_table():
    """The channel-open schema, the program kinds, the wire arrays and the engine's torch dtypes all key on
    the protocol's channel dtypes."""
    from pie_runtime.engine.channels import TORCH_DTYPES

    assert get_args(ChannelOpen.model_fields["dtype"].annotation) == tuple(CHANNEL_DTYPES)
    assert CHANNEL_DTYPES == {"float32": "float", "float16": "float", "int32": "int", "int64": "int", "bool": "bool"}
    assert set(CHANNEL_DTYPES.values()) == set(KINDS) and set(CHANNEL_DTYPES) <= ALLOWED_DTYPES
    assert set(TORCH_DTYPES) == set(CHANNEL_DTYPES)
    assert all(str(t) == f"torch.{name}" for name, t in TORCH_DTYPES.items())


def test_sdk_model_reads_the_hello_model_info():
    info = ModelInfo(
        name="m",
        vocab_size=50,
        max_positions=64,
        page_size=16,
        bos_token_id=None,
        eos_token_ids=[2],
        chat_template=None,
        drafters=[{"name": "d"}],
        mtp_depth=2,
        hidden_size=8,
        pass_cost_ms=[1.0, 1.5],
        mtp_step_ms=0.25,
    )
    no_engine = cast(Any, None)  # the facts need neither a connection nor a tokenizer
    model = Model(ModelInfo.model_validate(info.model_dump()), client=no_engine, tokenizer=no_engine)
    for field in (
        "name",
        "vocab_size",
        "max_positions",
        "page_size",
        "drafters",
        "mtp_depth",
        "hidden_size",
        "pass_cost_ms",
        "mtp_step_ms",
    ):
        assert getattr(model, field) == getattr(info, field)
