"""The wire contract: golden round trips and typed refusals, without an engine."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from pie_runtime.protocol import ErrorCode, PieError, decode_array, encode_array, pack, parse_request
from pie_runtime.protocol.codec import MAX_MESSAGE_BYTES
from pie_runtime.protocol.messages import Fire


@pytest.mark.parametrize("dtype", ["float32", "int32", "int64", "uint8", "bool", "float16"])
def test_array_round_trip(dtype):
    a = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    wire = encode_array(a)
    assert isinstance(wire["data"], bytes) and wire["shape"] == [2, 3, 4]
    b = decode_array(msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False))
    assert b.dtype == a.dtype and np.array_equal(a, b)


def test_fire_golden_bytes_parse():
    golden = pack({"id": 7, "op": "fire", "ws": 3, "tokens": [1, 2, 3],
                   "readouts": [{"rows": [2], "kind": "sample", "temperature": 0.7, "seed": 5}], "fold": "deferred"})
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
        (pack({"id": 1, "op": "fire", "ws": 1, "tokens": [1], "readouts": [{"rows": [0], "kind": "magic"}]}),
         ErrorCode.BAD_MESSAGE),
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

    code = "import sys, pie_runtime.protocol; bad = {'torch', 'zmq'} & set(sys.modules); print(sorted(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
