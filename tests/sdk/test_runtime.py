"""The SDK's runtime at its edges: connecting to an address where no engine answers."""

from __future__ import annotations

import pytest

import inferlet
from inferlet import runtime
from inferlet.errors import EngineUnreachable, UsageError


async def test_an_address_no_engine_answers_is_one_line_naming_the_command(monkeypatch):
    """A tcp:// address with nothing behind it would be waited on forever: it is a UsageError (one line in
    `pie run`, no traceback) that names the address, the command that starts an engine there and the token."""
    monkeypatch.setattr(runtime, "HELLO_TIMEOUT_S", 0.3)
    address = "tcp://127.0.0.1:9"  # the discard port: nothing listens there
    with pytest.raises(EngineUnreachable) as caught:
        await inferlet.connect(address)
    assert isinstance(caught.value, UsageError)
    assert str(caught.value) == (
        f"no engine answered at {address} within 0.3 s: start one with `pie engine --listen {address}` (and pass its"
        " --token), or leave out --engine and pie run starts one for this run"
    )
