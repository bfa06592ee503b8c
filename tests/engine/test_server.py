"""The engine's receive loop over a real ROUTER socket, in process (a tiny core, see test_core.py): hostile
bytes and malformed messages cost only themselves, and a valid client is served after them; a client's
connection ending releases what it held.

The first test is the failure a hostile-message run found: bytes on a raw socket that libzmq takes for a
ZMTP 1.0 peer arrive as messages without metadata, whose ``zmq.SRCFD`` raised ``ZMQError: Invalid argument``
out of ``_drain`` and ended the engine for every client."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator

import pytest
import zmq

from pie_runtime.engine.server import EngineServer
from pie_runtime.protocol.codec import MAX_MESSAGE_BYTES, pack, unpack

from .test_core import PROMPT, Core

BOUND_S = 10.0


@pytest.fixture
def server() -> Iterator[EngineServer]:
    folder = tempfile.mkdtemp(prefix="pie-srv-", dir="/tmp")  # an ipc path must stay short
    srv = EngineServer(Core().core, f"ipc://{folder}/engine.sock")
    yield srv
    srv.sock.disable_monitor()
    srv.monitor.close(0)
    srv.sock.close(0)


def dealer(srv: EngineServer) -> zmq.Socket:
    sock = srv.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.address)
    return sock


def pump(srv: EngineServer, seconds: float = 0.2) -> None:
    """Runs the loop's body (drain, then a step while there is work) for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        srv._drain()
        if srv.core.has_work():
            for client, reply in srv.core.step():
                srv._send(client, reply)
        time.sleep(0.005)


def ask(srv: EngineServer, sock: zmq.Socket, *frames: bytes) -> dict:
    """Sends one message of ``frames`` and runs the loop until its reply arrives."""
    sock.send_multipart(list(frames))
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        pump(srv, 0.01)
        if sock.poll(0):
            return unpack(sock.recv())
    raise AssertionError(f"no reply within {BOUND_S} s")


def serves_a_valid_client(srv: EngineServer) -> None:
    """A fresh client opens a working set and fires a prompt: the engine still does its work."""
    sock = dealer(srv)
    try:
        assert ask(srv, sock, pack({"id": 1, "op": "ping"})) == {"id": 1, "ok": True}
        ws = ask(srv, sock, pack({"id": 2, "op": "ws_open"}))["ws"]
        fire = {"id": 3, "op": "fire", "ws": ws, "tokens": PROMPT, "readouts": [{"rows": [29], "kind": "argmax"}]}
        reply = ask(srv, sock, pack(fire))
        assert reply["ok"] and reply["committed"] == len(PROMPT), reply
    finally:
        sock.close(0)


def raw_unix(srv: EngineServer) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.connect(srv.address.removeprefix("ipc://"))
    return s


def test_bytes_of_a_legacy_or_random_peer_never_end_the_loop(server):
    # a ZMTP 1.0 peer: an empty identity, then one message "ping" (libzmq attaches no metadata to it)
    legacy = raw_unix(server)
    legacy.sendall(bytes([1, 0]) + bytes([5, 0]) + b"ping")
    rng = random.Random(3)
    randoms = []
    for _ in range(4):  # 3 MB of random bytes, the size the failing run sent, each on its own connection
        s = raw_unix(server)
        randoms.append(s)
        try:
            s.sendall(rng.randbytes(3 << 20))
        except OSError:
            pass  # the engine hung up on it, as it should
        pump(server, 0.05)
    pump(server, 0.3)
    for s in [legacy, *randoms]:
        s.close()
    assert not server.connections.fd_of, "a peer that never spoke ZMTP 3 became a client"
    serves_a_valid_client(server)


def test_malformed_messages_are_answered_and_a_valid_client_is_served(server):
    sock = dealer(server)
    ping = pack({"id": 7, "op": "ping"})
    for frames, code in (
        ([os.urandom(3 << 20)], "bad_message"),  # 3 MB of random bytes in one frame
        ([b""], "bad_message"),
        ([b"", ping], "bad_message"),  # a REQ-style empty delimiter
        ([ping, ping], "bad_message"),
        ([b"x"] * 50, "bad_message"),
        ([pack({"id": 8, "op": "ping", "pad": b"\0" * MAX_MESSAGE_BYTES})], "message_too_large"),
    ):
        reply = ask(server, sock, *frames)
        assert not reply["ok"] and reply["error"]["code"] == code, (len(frames), reply)
    assert ask(server, sock, ping) == {"id": 7, "ok": True}  # the same connection goes on
    sock.close(0)
    serves_a_valid_client(server)


def test_a_message_from_an_unknown_connection_is_refused_and_holds_nothing(server, monkeypatch):
    monkeypatch.setattr("pie_runtime.engine.server.message_fd", lambda frame: None)
    sock = dealer(server)
    reply = ask(server, sock, pack({"id": 1, "op": "ws_open"}))
    assert reply["error"]["code"] == "unsupported"
    assert len(server.core.sets) == 0
    monkeypatch.undo()
    assert ask(server, sock, pack({"id": 2, "op": "ping"}))["ok"]  # tracked from its first message that says where
    sock.close(0)


def test_an_exception_while_handling_one_message_costs_only_that_message(server, monkeypatch):
    calls = []
    real = server._handle

    def faulty(client: bytes, payload: bytes) -> None:
        calls.append(payload)
        if len(calls) == 1:
            raise RuntimeError("a bug outside the request's own handling")
        real(client, payload)

    monkeypatch.setattr(server, "_handle", faulty)
    sock = dealer(server)
    reply = ask(server, sock, pack({"id": 1, "op": "ping"}))  # the first message is lost to the bug, answered
    assert reply["error"]["code"] == "internal" and "a bug outside" in reply["error"]["message"]
    assert ask(server, sock, pack({"id": 2, "op": "ping"})) == {"id": 2, "ok": True}  # and the loop goes on
    assert len(calls) == 2
    sock.close(0)


def test_a_closed_connection_releases_what_its_client_held(server):
    pages = server.core.models["tiny"].pages
    free = pages.free
    sock = dealer(server)
    ws = ask(server, sock, pack({"id": 1, "op": "ws_open"}))["ws"]
    assert ask(server, sock, pack({"id": 2, "op": "fire", "ws": ws, "tokens": PROMPT}))["ok"]
    assert pages.free < free
    sock.close(0)
    deadline = time.monotonic() + BOUND_S
    while pages.free != free and time.monotonic() < deadline:
        pump(server, 0.05)
    assert pages.free == free
    assert not server.connections.fd_of


def test_over_tcp_a_client_with_the_token_is_served_and_released_when_it_leaves():
    """The ZAP domain that turns legacy peers away lets a ZMTP 3 client with the token through on tcp://."""
    from pie_runtime.protocol import messages as m

    srv = EngineServer(Core().core, "tcp://127.0.0.1:*", token="sesame")
    sock = srv.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    try:
        assert ask(srv, sock, pack({"id": 1, "op": "hello", "version": m.PROTOCOL_VERSION, "token": "sesame"}))["ok"]
        assert ask(srv, sock, pack({"id": 2, "op": "ws_open"}))["ok"]
        assert len(srv.core.sets) == 1 and len(srv.authed) == 1
        sock.close(0)
        deadline = time.monotonic() + BOUND_S
        while len(srv.core.sets) and time.monotonic() < deadline:
            pump(srv, 0.05)
        assert len(srv.core.sets) == 0 and not srv.authed and not srv.connections.fd_of
    finally:
        sock.close(0)
        srv.sock.disable_monitor()
        srv.monitor.close(0)
        srv.sock.close(0)


def test_a_routing_id_a_client_chose_is_refused_and_takes_no_other_clients_replies(server):
    """Routing ids are libzmq's (engine/connections.py): a client announcing its own is refused, and one
    announcing the name of a live client (as if it had learnt it) is ignored while that client keeps its
    replies: a handover would have moved them to the newcomer."""
    victim = dealer(server)
    ws = ask(server, victim, pack({"id": 1, "op": "ws_open"}))["ws"]
    [name] = server.connections.fd_of  # the name libzmq drew for the victim
    assert name[0] == 0 and len(name) == 5

    def chooser(routing_id: bytes) -> zmq.Socket:
        sock = server.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.connect(server.address)
        return sock

    own = chooser(b"tenant-picked-name")
    reply = ask(server, own, pack({"id": 5, "op": "ws_open"}))
    assert reply["error"]["code"] == "unsupported" and "ZMQ_ROUTING_ID" in reply["error"]["message"], reply
    assert set(server.connections.fd_of) == {name} and len(server.core.sets) == 1  # it holds nothing

    thief = chooser(name)
    thief.send(pack({"id": 9, "op": "ws_release", "ws": ws}))  # would release the victim's set if it got through
    fire = {"id": 2, "op": "fire", "ws": ws, "tokens": PROMPT, "readouts": [{"rows": [29], "kind": "argmax"}]}
    reply = ask(server, victim, pack(fire))
    assert reply["ok"] and reply["id"] == 2 and reply["committed"] == len(PROMPT), reply
    pump(server, 0.3)
    assert not thief.poll(0), "the duplicate routing id got a reply"
    closed = ask(server, victim, pack({"id": 3, "op": "ws_release", "ws": ws}))
    assert closed["ok"], closed  # its set was still its own
    for sock in (victim, own, thief):
        sock.close(0)
