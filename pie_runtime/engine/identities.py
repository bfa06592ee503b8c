"""Who a client is, for the engine's per-client limits: its identity, and the totals charged to it.

A client (a ROUTER routing id: one connection) belongs to one identity, fixed by the connection it speaks on
(connections.py), never by anything the client says:

- ``listen:PATH``: every connection made to a tenant listener (``pie engine --tenant-listen ipc://PATH``; `pie
  serve` binds one per API key and shows it only inside that key's upload sandbox, sandbox.py);
- ``uid:N``: every ``ipc://`` connection from a process of a uid other than the engine's own (``SO_PEERCRED``;
  a root `pie serve` runs each key's sandbox under a uid of its own);
- ``client:HEX``: any other connection is its own identity (the operator's own hosts, a ``--token`` holder on
  tcp): its limits are per connection, as they always were.

So a tenant that opens more connections, or runs many inferlets in one host, shares one set of limits:

    working sets held                 MAX_WORKING_SETS (ws_requests.py)
    channels held, and their bytes    MAX_CHANNELS, MAX_IDENTITY_CHANNEL_BYTES (capacities in full, channels.py)
    programs held                     --max-programs (least recently used evicted, programs/registry.py)
    readout bytes of queued fires     MAX_IDENTITY_READOUT_BYTES (replies not yet sent, attention included)
    evict spans between two steps     MAX_IDENTITY_EVICT_SPANS (rows and ranges of its ws_evicts)

Each is refused ``limit_exceeded`` naming the limit; another identity's totals are untouched. The readout
bytes of one fire are also bounded alone (``MAX_FIRE_READOUT_BYTES``).
"""

from __future__ import annotations

from ..protocol import ErrorCode, PieError
from ..protocol import messages as m

MAX_IDENTITY_CHANNEL_BYTES = 1 << 28  # bytes of the channels one identity holds open (cell bytes x capacity)
MAX_FIRE_READOUT_BYTES = 1 << 28  # a fire's readout replies: 1024 rows of a 49,152-token vocab's logits fit
MAX_IDENTITY_READOUT_BYTES = 1 << 29  # readout replies of the fires one identity has queued, all together
MAX_IDENTITY_EVICT_SPANS = 4 * m.MAX_EVICT_SPANS  # ws_evict rows and ranges an identity sends between two steps

Identity = str


def readout_bytes(r: m.Readout, vocab: int, hidden: int, layers: int, width: int) -> int:
    """The bytes of a readout's reply (float32 logits, probabilities, hidden states or attention mass; int32
    tokens) at a model's sizes; ``width``: the keys an attention readout reads (rows up to the window's end)."""
    rows = len(r.rows)
    if r.kind in ("logits", "distribution"):
        return 4 * rows * vocab
    if r.kind == "hidden":
        return 4 * rows * hidden
    if r.kind == "attention":
        return 4 * rows * (layers if r.per_layer else 1) * width
    if r.kind in ("mtp", "eagle"):
        return 4 * rows * (1 + r.k) + (4 * rows * r.k * vocab if r.with_probs else 0)
    return 4 * rows  # argmax, sample: a token a row


class Identities:
    """Each client's identity (set when its connection is first heard, kept until the client is dropped) and
    the per-round evict spans charged to each identity."""

    def __init__(self) -> None:
        self._of: dict[bytes, Identity] = {}
        self._evict_spans: dict[Identity, int] = {}

    def set(self, client: bytes, identity: Identity | None) -> None:
        """Records ``client``'s identity (None: the client is its own)."""
        if identity is not None:
            self._of[client] = identity

    def of(self, client: bytes) -> Identity:
        return self._of.get(client) or "client:" + client.hex()

    def forget(self, client: bytes) -> None:
        self._of.pop(client, None)

    def new_round(self) -> None:
        """A step ran (or the loop went round idle): every identity's evict spans start from zero."""
        self._evict_spans.clear()

    def charge_evict(self, client: bytes, spans: int) -> None:
        """Charges an evict's rows and ranges to its identity; ``limit_exceeded`` past MAX_IDENTITY_EVICT_SPANS
        in this round (nothing charged then)."""
        identity = self.of(client)
        held = self._evict_spans.get(identity, 0)
        if held + spans > MAX_IDENTITY_EVICT_SPANS:
            raise PieError(
                ErrorCode.LIMIT_EXCEEDED,
                f"MAX_IDENTITY_EVICT_SPANS: this client's identity sends at most {MAX_IDENTITY_EVICT_SPANS} evict "
                f"rows and ranges between two engine steps; it sent {held} and asks {spans} more: retry after a step",
            )
        self._evict_spans[identity] = held + spans
