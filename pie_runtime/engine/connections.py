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
  (:meth:`Connections.note` says False), since nothing it held could be released when it leaves.

Each connection also has an identity: over ``ipc://``, the uid of the process at its other end (the kernel's
``SO_PEERCRED``), else None. A uid other than the engine's own (`pie serve`'s sandboxed upload hosts run as one
uid per API key) may hold at most ``MAX_FOREIGN_CONNECTIONS`` connections at once, so a tenant cannot multiply
the engine's per-client limits by opening more connections (:meth:`Connections.admit`). (Under a server that
is not root, its sandboxes keep its uid: no cap.)
"""

from __future__ import annotations

import os
import socket
import struct

import zmq

MAX_FOREIGN_CONNECTIONS = 4  # connections one foreign uid holds at once (a sandboxed host needs one)


def message_fd(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection ``frame`` was read from, or None when libzmq did not record one."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


def peer_uid(fd: int) -> int | None:
    """The uid of the process at the other end of a unix-socket connection (None for tcp or when unknown)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    with dup:
        if dup.family != socket.AF_UNIX:
            return None
        try:
            creds = dup.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return None
    return struct.unpack("3i", creds)[1]


class Connections:
    def __init__(self) -> None:
        self.clients_on: dict[int, set[bytes]] = {}  # descriptor → the routing ids heard on it
        self.fd_of: dict[bytes, int] = {}
        self.uid_on: dict[int, int | None] = {}  # descriptor → its peer's uid (ipc), None (tcp)

    def admit(self, fd: int | None) -> str | None:
        """Why a message on ``fd`` is refused (its peer, a foreign uid, holds too many connections), else None."""
        if fd is None or fd in self.uid_on:
            return None
        uid = peer_uid(fd)
        if uid is not None and uid != os.geteuid():
            held = sum(1 for u in self.uid_on.values() if u == uid)
            if held >= MAX_FOREIGN_CONNECTIONS:
                return f"MAX_FOREIGN_CONNECTIONS: uid {uid} holds {held} connections to this engine already"
        self.uid_on[fd] = uid
        return None

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
        """The clients of a connection that has just closed; they are forgotten."""
        self.uid_on.pop(fd, None)
        gone = self.clients_on.pop(fd, set())
        for client in gone:
            self.fd_of.pop(client, None)
        return gone
