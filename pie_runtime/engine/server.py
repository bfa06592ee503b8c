"""The engine's ZeroMQ ROUTER loop: drain every pending request, answer control ops at once, then run one
batched step over all ready fires and answer those.

Client departure (even kill -9) releases everything the client held: the socket monitor's DISCONNECTED
event names the connection that ended, and connections.py knows the clients heard on it. The monitor is
drained before every receive, so a connection's end is always handled before a newcomer reusing its
descriptor is heard.

Nothing about one message ends the loop: a message is one frame after the routing id (else ``bad_message``),
from a client libzmq named itself (a routing id the client chose is refused ``unsupported``: connections.py)
whose connection is known (else ``unsupported``), and any exception while handling it is
logged and answered ``internal``; the loop goes on to the next message.

Auth (tcp://, ``--token``): a client is unauthenticated until a hello that fully succeeds (the engine's token
and the engine's protocol version). Until then every message is refused ``unauthorized`` after a cheap look
at its raw map (its ``op`` and ``token``), before the full validation of ``parse_request``: an
unauthenticated client costs the engine one msgpack unpack of at most ``PRE_AUTH_BYTES`` a message (a larger
one is refused unread), never a schema walk or a request.

``simulate_step_s`` (the hidden ``--simulate-step-ms``, for scale-out measurements on few cores): each step
also sleeps that long before its replies go out, as if its forward ran on a device of its own. The CPU is
free meanwhile, so several such engines on one machine scale as separate devices would.
"""

from __future__ import annotations

import hmac
import logging
import signal
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..protocol import ErrorCode, PieError
from ..protocol.codec import MAX_MESSAGE_BYTES, pack, parse_request, unpack
from .connections import Connections, chosen_routing_id, ipc_path, message_fd
from .core import EngineCore
from .jobs import Reply

log = logging.getLogger("pie.engine")
PRE_AUTH_BYTES = 4096  # the largest message an unauthenticated client may send (its hello)
CHOSEN_ID = "the engine names its clients: connect without setting a routing id (ZMQ_ROUTING_ID)"


class EngineServer:
    def __init__(
        self,
        core: EngineCore,
        address: str,
        token: str | None = None,
        simulate_step_s: float = 0.0,
        also: list[str] | None = None,
        tenants: list[str] | None = None,
    ):
        """``also``: more addresses the one socket binds (``--also-listen``), e.g. an ``ipc://`` one for the
        inferlet hosts beside a ``tcp://`` one; the token, when there is one, is asked on every one.
        ``tenants``: ``ipc://`` addresses bound as well, each one client identity (``--tenant-listen``: every
        connection made to it shares one set of the engine's per-client limits, connections.py)."""
        tenants = tenants or []
        if any(not a.startswith("ipc://") for a in tenants):
            raise ValueError("a tenant listener is an ipc:// address (its connections are named by its path)")
        if any(a.startswith("tcp://") for a in [address, *(also or [])]) and not token:
            raise ValueError("a tcp:// address needs an auth token (--token)")
        self.core = core
        self.address = address
        self.token = token
        self.simulate_step_s = simulate_step_s
        self.authed: set[bytes] = set()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        # far above the protocol limit, so oversize messages still arrive and get a typed error
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a ZAP domain refuses ZMTP 1.0/2.0 peers at the handshake, whose messages name no connection
        # (connections.py); with no ZAP handler bound, ZMTP 3 peers pass as before
        self.sock.setsockopt(zmq.ZAP_DOMAIN, b"pie")
        # a second connection announcing a routing id in use is ignored, never given the first one's replies
        # (libzmq's default, set so that nobody turns it on; connections.py)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        self.sock.bind(address)
        for extra in [*(also or []), *tenants]:
            self.sock.bind(extra)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.connections = Connections(frozenset(p for p in map(ipc_path, tenants) if p is not None))
        self._running = False

    def serve_forever(self) -> None:
        self._running = True
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        try:
            while self._running:
                timeout = 0 if self.core.has_work() else 100
                poller.poll(timeout)
                self.core.new_round()
                self._drain()
                if self.core.has_work():
                    self._answer(self.core.step())
        finally:
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(0)

    def _answer(self, replies: list[Reply]) -> None:
        if self.simulate_step_s:
            time.sleep(self.simulate_step_s)
        for client, reply in replies:
            self._send(client, reply)

    def stop(self) -> None:
        self._running = False

    def _drain(self) -> None:
        while True:
            self._drain_departures()
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._receive(frames)
            except Exception as e:  # one message must never end the loop: it costs that message alone
                log.exception("a message could not be handled")
                self._refuse(frames[0].bytes, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")

    def _receive(self, frames: list[zmq.Frame]) -> None:
        """One message off the ROUTER: its routing id, then (for a well-formed request) one payload frame."""
        client = frames[0].bytes
        if chosen_routing_id(client):  # tracked by nothing: its connection holds no identity or state
            self._refuse(client, ErrorCode.UNSUPPORTED, CHOSEN_ID)
            return
        if self.connections.departed(client):  # sent just before its connection ended: nobody to answer
            log.debug("dropped a message of departed client %s", client.hex())
            return
        fd = message_fd(frames[-1])
        refused = self.connections.admit(fd)
        if refused is not None:
            self._refuse(client, ErrorCode.LIMIT_EXCEEDED, refused)
            return
        if not self.connections.note(client, fd):
            self._refuse(client, ErrorCode.UNSUPPORTED, "the engine cannot tell which connection this came on")
            return
        self.core.identify(client, self.connections.identity(client))
        if len(frames) != 2:
            self._refuse(client, ErrorCode.BAD_MESSAGE, f"a request is one frame, got {len(frames) - 1}")
            return
        self._handle(client, frames[1].bytes)

    def _drain_departures(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            for client in self.connections.closed(event["value"]):
                try:
                    released = self.core.drop_client(client)
                    log.info("client %s left; released %d working sets", client.hex(), released)
                except Exception:  # a departure must never end the loop either
                    log.exception("releasing what client %s held failed", client.hex())
                self.authed.discard(client)

    def _handle(self, client: bytes, payload: bytes) -> None:
        req_id = None
        try:
            authenticating = self.token is not None and client not in self.authed
            if authenticating:
                req_id = self._check_hello(payload)
            req_id, req = parse_request(payload)
            reply = self.core.handle(client, req)
            if authenticating:
                self.authed.add(client)  # a hello with the token that the core accepted (right version)
            if reply is not None:
                self._send(client, {"id": req.id, "ok": True, **reply})
            for other, owed in self.core.drain_outbox():  # e.g. takes a host put has fulfilled
                self._send(other, owed)
        except PieError as e:
            if req_id is None:
                req_id = e.request_id
            self._refuse(client, e.code, e.message, req_id)
        except Exception as e:  # a bug must cost one request, never the engine
            log.exception("internal error")
            self._refuse(client, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", req_id)

    def _refuse(self, client: bytes, code: ErrorCode, message: str, req_id: object = None) -> None:
        error = PieError(code, message).to_wire()
        self._send(client, {"id": req_id if isinstance(req_id, int) else None, "ok": False, "error": error})

    def _check_hello(self, payload: bytes) -> int | None:
        """For an unauthenticated client: refuses ``unauthorized`` anything but a hello carrying the engine's
        token, from the raw map, before any schema validation. Returns the request id it could read."""
        if len(payload) > PRE_AUTH_BYTES:  # not even unpacked: a hello is a few hundred bytes
            raise PieError(
                ErrorCode.UNAUTHORIZED, f"before its hello a client sends at most {PRE_AUTH_BYTES} bytes a message"
            )
        try:
            obj = unpack(payload)
        except Exception:  # noqa: BLE001 - msgpack raises several unrelated types
            obj = None
        req_id = obj.get("id") if isinstance(obj, dict) else None
        req_id = req_id if isinstance(req_id, int) and not isinstance(req_id, bool) else None
        token = obj.get("token") if isinstance(obj, dict) else None
        if not (
            isinstance(obj, dict)
            and obj.get("op") == "hello"
            and isinstance(token, str)
            and self.token is not None
            and hmac.compare_digest(token.encode(), self.token.encode())
        ):
            err = PieError(ErrorCode.UNAUTHORIZED, "say hello with the engine's token first")
            err.request_id = req_id
            raise err
        return req_id

    def _send(self, client: bytes, reply: dict) -> None:
        try:
            data = pack(reply)
        except Exception as e:  # a reply that cannot be packed is a bug: it costs that reply
            log.exception("a reply could not be packed")
            error = PieError(ErrorCode.INTERNAL, f"the reply could not be packed: {type(e).__name__}").to_wire()
            data = pack(
                {"id": reply.get("id") if isinstance(reply.get("id"), int) else None, "ok": False, "error": error}
            )
        try:
            self.sock.send_multipart([client, data], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the client is gone; the socket monitor reports its departure
