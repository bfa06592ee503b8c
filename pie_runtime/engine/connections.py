"""Which client (ROUTER routing id) sits on which connection, so that a connection's end releases what the
clients heard on it held.

A connection is named by its file descriptor: the key of the socket monitor's DISCONNECTED event, and the
descriptor libzmq records in the metadata of every message it reads from a ZMTP 3 peer (``zmq.SRCFD``).
libzmq's ROUTER_NOTIFY and ``zmq_socket_get_peer_state`` would say the same without the descriptor, but both
are draft APIs that the bundled libzmq refuses (``EINVAL``), and the ``Peer-Address`` property names a host,
not a connection. So the descriptor stays the key, read so that it can never fail:

- the server refuses ZMTP 1.0/2.0 peers at the handshake (a ZAP domain on the socket): their messages carry
  no metadata, and one such message (random bytes on a raw socket) was what killed the receive loop;
- :func:`message_fd` answers None where a message carries no descriptor (a peer gone before libzmq could
  name it) instead of raising;
- a client is tracked from its first message that names its connection; a client never tracked is refused
  (:meth:`Connections.note` says False), since nothing it held could be released when it leaves;
- a client's messages read after its connection's end was handled (a request sent just before it closed,
  still queued in the socket) are dropped unanswered (:meth:`Connections.departed`): handling one would track
  the departed client again on a descriptor that is closed, or reused by another connection, so what it then
  opened would be held until that descriptor closes again, and a newcomer on the descriptor would take the
  departed client's identity (a tenant's connection the operator's, and the per-client limits with it).

Each connection also has an identity (identities.py), which the engine's per-client limits are charged to:
a connection made to a tenant listener (``--tenant-listen``: the kernel names the listener's path as the
accepted socket's own address) is ``listen:PATH``, whatever its uid; else, over ``ipc://``, one whose peer is
a uid other than the engine's own (the kernel's ``SO_PEERCRED``; a root `pie serve` runs each key's sandboxed
hosts as a uid of their own) is ``uid:N``; any other connection (the operator's own hosts, a token holder on
tcp) is None: its clients are each their own identity. A tenant identity holds at most
``MAX_IDENTITY_CONNECTIONS`` connections at once (:meth:`Connections.admit`): its limits are its identity's
whatever it opens, and the cap bounds the descriptors it can make the engine hold.

Routing ids are the engine's own (:func:`chosen_routing_id`): a peer may announce one of its own at the
handshake (``ZMQ_ROUTING_ID``), and the engine's state and replies are keyed by it, so a tenant that picked a
name another client uses could wait for it. libzmq already ignores a second live connection announcing a
routing id in use (``ZMQ_ROUTER_HANDOVER`` off, set so explicitly in server.py: a handover would move the
victim's replies to the newcomer); a routing id that was not libzmq's own is refused ``unsupported`` before
anything else, so every client the engine serves has a name libzmq drew, which no other client can know.
"""

from __future__ import annotations

import os
import socket
import struct
from collections import OrderedDict

import zmq

MAX_IDENTITY_CONNECTIONS = 4  # connections one tenant identity holds at once (a sandboxed host needs one)
# routing ids of departed clients remembered, so that their messages still queued when their connection's end
# was handled are dropped (Connections.departed): more than the messages one socket queues (ZMQ_RCVHWM)
REMEMBER_DEPARTED = 4096


def message_fd(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection ``frame`` was read from, or None when libzmq did not record one."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


def chosen_routing_id(client: bytes) -> bool:
    """Whether ``client`` is a routing id its peer chose: libzmq names a peer that announces none with 5 bytes,
    a zero byte and a counter from a random start (router.cpp ``identify_peer``)."""
    return len(client) != 5 or client[0] != 0


def ipc_path(address: str) -> str | None:
    """The socket path of an ``ipc://`` address, as the kernel names it (None for another transport)."""
    return os.path.abspath(address.removeprefix("ipc://")) if address.startswith("ipc://") else None


def peer(fd: int) -> tuple[int | None, str | None]:
    """The uid of the process at the other end of a unix-socket connection and the path of the listener it
    connected to ((None, None) for tcp or when unknown)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None, None
    with dup:
        if dup.family != socket.AF_UNIX:
            return None, None
        try:
            creds = dup.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            local = dup.getsockname()
        except OSError:
            return None, None
    return struct.unpack("3i", creds)[1], local if isinstance(local, str) and local else None


def identity_of(fd: int, tenants: frozenset[str]) -> str | None:
    """The identity of the connection on ``fd`` (the module's docstring), None: not a tenant's."""
    uid, local = peer(fd)
    if local is not None and local in tenants:
        return f"listen:{local}"
    if uid is not None and uid != os.geteuid():
        return f"uid:{uid}"
    return None


class Connections:
    def __init__(self, tenants: frozenset[str] = frozenset()) -> None:
        """``tenants``: the socket paths of the tenant listeners (``ipc_path`` of each ``--tenant-listen``)."""
        self.tenants = tenants
        self.clients_on: dict[int, set[bytes]] = {}  # descriptor → the routing ids heard on it
        self.fd_of: dict[bytes, int] = {}
        self.identity_on: dict[int, str | None] = {}  # descriptor → its identity, None: not a tenant's
        self._departed: OrderedDict[bytes, None] = OrderedDict()  # the latest departed clients, oldest first

    def admit(self, fd: int | None) -> str | None:
        """Why a message on ``fd`` is refused (its tenant identity holds too many connections), else None."""
        if fd is None or fd in self.identity_on:
            return None
        identity = identity_of(fd, self.tenants)
        if identity is not None:
            held = sum(1 for i in self.identity_on.values() if i == identity)
            if held >= MAX_IDENTITY_CONNECTIONS:
                return f"MAX_IDENTITY_CONNECTIONS: {identity} holds {held} connections to this engine already"
        self.identity_on[fd] = identity
        return None

    def identity(self, client: bytes) -> str | None:
        """The identity of the connection ``client`` speaks on (None: its own, or not known)."""
        fd = self.fd_of.get(client)
        return self.identity_on.get(fd) if fd is not None else None

    def note(self, client: bytes, fd: int | None) -> bool:
        """Records that ``client`` spoke on ``fd``. Returns whether the client is tracked: it is once any of its
        messages named its connection."""
        if fd is None:
            return client in self.fd_of
        old = self.fd_of.get(client)
        if old is not None and old != fd:  # a reused routing id on a new connection: the old one has ended
            self.clients_on.get(old, set()).discard(client)
        self.fd_of[client] = fd
        self.clients_on.setdefault(fd, set()).add(client)
        return True

    def closed(self, fd: int) -> set[bytes]:
        """The clients of a connection that has just closed; they are forgotten (and remembered as departed)."""
        self.identity_on.pop(fd, None)
        gone = self.clients_on.pop(fd, set())
        for client in gone:
            self.fd_of.pop(client, None)
            self._departed[client] = None
        while len(self._departed) > REMEMBER_DEPARTED:
            self._departed.popitem(last=False)
        return gone

    def departed(self, client: bytes) -> bool:
        """Whether ``client``'s connection has ended: its messages still queued are dropped. Routing ids are
        libzmq's counter (chosen ones are refused), so a departed one does not come back on a new connection."""
        return client in self._departed
