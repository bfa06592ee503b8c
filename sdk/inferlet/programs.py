"""Epilogue programs: trace a Python function over symbolic tensors into a program the engine runs right
after a fire's forward, on its device, with no round trip.

    def accept(p, window, out):                    # p: the Builder; window, out: Channels
        target = p.logits(rows=range(5)).argmax()  # (5,) the target's greedy token at each row
        drafts = p.tokens(5)[1:]                   # (4,) what the window guessed
        n = (drafts == target[:4]).cumprod().sum() # accepted drafts
        p.fold(n + 1)
        p.put(out, where(p.iota(5) <= n, target, -1))

    prog = inferlet.trace(model, accept, window, out)

Only the closed op set of ``pie_runtime.protocol.programs`` exists; shapes and dtypes are checked while
tracing by the same rules the engine enforces, so a mistake fails here, at the line that made it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pie_runtime.protocol.dtypes import CHANNEL_DTYPES
from pie_runtime.protocol.programs import ModelDims, Spec, infer, program_hash

if TYPE_CHECKING:
    from .channels import Channel
    from .model import Model

# a public module of the core: the tracer and its free ops (``Program`` and ``trace`` are also ``inferlet``'s)
__all__ = [
    "Builder",
    "Sym",
    "Program",
    "trace",
    "where",
    "maximum",
    "minimum",
    "concat",
    "masked_argmax",
    "sample",
    "uniform",
]


class Sym:
    """A symbolic tensor: a node of the program being traced, with a static shape and dtype kind."""

    __hash__ = object.__hash__

    def __init__(self, b: Builder, node: int, spec: Spec):
        self.b, self.node, self.spec = b, node, spec

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def kind(self) -> str:
        return self.spec.kind

    def __repr__(self) -> str:
        return f"Sym(node={self.node}, shape={self.shape}, {self.kind})"

    def __bool__(self):
        raise TypeError("a traced value has no truth value while tracing; use inferlet.programs.where")

    def _bin(self, op: str, other, swap: bool = False) -> Sym:
        other = self.b.lift(other)
        return self.b.op(op, *((other, self) if swap else (self, other)))

    __add__ = lambda s, o: s._bin("add", o)  # noqa: E731
    __radd__ = lambda s, o: s._bin("add", o, True)  # noqa: E731
    __sub__ = lambda s, o: s._bin("sub", o)  # noqa: E731
    __rsub__ = lambda s, o: s._bin("sub", o, True)  # noqa: E731
    __mul__ = lambda s, o: s._bin("mul", o)  # noqa: E731
    __rmul__ = lambda s, o: s._bin("mul", o, True)  # noqa: E731
    __truediv__ = lambda s, o: s._bin("div", o)  # noqa: E731
    __rtruediv__ = lambda s, o: s._bin("div", o, True)  # noqa: E731
    __floordiv__ = lambda s, o: s._bin("floordiv", o)  # noqa: E731
    __mod__ = lambda s, o: s._bin("mod", o)  # noqa: E731
    __lt__ = lambda s, o: s._bin("lt", o)  # noqa: E731
    __le__ = lambda s, o: s._bin("le", o)  # noqa: E731
    __gt__ = lambda s, o: s._bin("gt", o)  # noqa: E731
    __ge__ = lambda s, o: s._bin("ge", o)  # noqa: E731
    __and__ = lambda s, o: s._bin("and", o)  # noqa: E731
    __or__ = lambda s, o: s._bin("or", o)  # noqa: E731
    __xor__ = lambda s, o: s._bin("xor", o)  # noqa: E731
    __neg__ = lambda s: s.b.op("neg", s)  # noqa: E731
    __abs__ = lambda s: s.b.op("abs", s)  # noqa: E731
    __invert__ = lambda s: s.b.op("not", s)  # noqa: E731

    def __eq__(self, other) -> Sym:  # a traced comparison, not a truth value
        return self._bin("eq", other)

    def __ne__(self, other) -> Sym:
        return self._bin("ne", other)

    def exp(self) -> Sym:
        return self.b.op("exp", self)

    def log(self) -> Sym:
        return self.b.op("log", self)

    def _reduce(self, op: str, dim: int, keepdim: bool = False) -> Sym:
        return self.b.op(op, self, dim=dim, keepdim=keepdim)

    def sum(self, dim: int = -1, keepdim: bool = False) -> Sym:
        return self._reduce("sum", dim, keepdim)

    def max(self, dim: int = -1, keepdim: bool = False) -> Sym:
        return self._reduce("max", dim, keepdim)

    def min(self, dim: int = -1, keepdim: bool = False) -> Sym:
        return self._reduce("min", dim, keepdim)

    def argmax(self, dim: int = -1, keepdim: bool = False) -> Sym:
        return self._reduce("argmax", dim, keepdim)

    def any(self, dim: int = -1, keepdim: bool = False) -> Sym:
        return self._reduce("any", dim, keepdim)

    def all(self, dim: int = -1, keepdim: bool = False) -> Sym:
        return self._reduce("all", dim, keepdim)

    def cumsum(self, dim: int = -1) -> Sym:
        return self.b.op("cumsum", self, dim=dim)

    def cumprod(self, dim: int = -1) -> Sym:
        return self.b.op("cumprod", self, dim=dim)

    def softmax(self, dim: int = -1) -> Sym:
        return self.b.op("softmax", self, dim=dim)

    def log_softmax(self, dim: int = -1) -> Sym:
        return self.b.op("log_softmax", self, dim=dim)

    def cast(self, kind: str) -> Sym:
        return self.b.op("cast", self, dtype=kind)

    def int(self) -> Sym:
        return self.cast("int")

    def float(self) -> Sym:
        return self.cast("float")

    def bool(self) -> Sym:
        return self.cast("bool")

    def reshape(self, *shape: int) -> Sym:
        return self.b.op("reshape", self, shape=[int(d) for d in shape])

    def gather(self, dim: int, index: Sym) -> Sym:
        return self.b.op("gather", self, index, dim=dim)

    def scatter(self, dim: int, index: Sym, src) -> Sym:
        return self.b.op("scatter", self, index, self.b.lift(src), dim=dim)

    def __getitem__(self, key) -> Sym:
        """Integer indexes and step-1 slices, one per leading dim (``x[0]``, ``x[1:]``, ``x[:, 2]``)."""
        keys = key if isinstance(key, tuple) else (key,)
        out, dim = self, 0
        for k in keys:
            n = out.shape[dim]
            if isinstance(k, int):
                out = out.b.op("index", out, dim=dim, index=k + n if k < 0 else k)
            elif isinstance(k, slice) and k.step in (None, 1):
                start, stop, _ = k.indices(n)
                if (start, stop) != (0, n):
                    out = out.b.op("slice", out, dim=dim, start=start, stop=stop)
                dim += 1
            else:
                raise TypeError(f"index with ints and step-1 slices, not {k!r}")
        return out


class Builder:
    """Records nodes while a function is traced; the readout intrinsics and channel effects live here."""

    def __init__(self, dims: ModelDims):
        self.dims = dims
        self.nodes: list[dict] = []
        self.channels: list[Channel] = []  # slot i binds channels[i] unless rebound at fire time

    def op(self, op: str, *ins: Sym, **attrs: Any) -> Sym:
        """Records a node that makes a value."""
        spec = self._record(op, ins, attrs)
        assert spec is not None, f"{op} is an effect: record it with effect()"
        return Sym(self, len(self.nodes) - 1, spec)

    def effect(self, op: str, *ins: Sym, **attrs: Any) -> None:
        """Records a node that makes no value (``put``, ``set``, ``fold``)."""
        self._record(op, ins, attrs)

    def _record(self, op: str, ins: tuple[Sym, ...], attrs: dict[str, Any]) -> Spec | None:
        spec = infer(len(self.nodes), op, [s.spec for s in ins], attrs, self.dims)
        self.nodes.append({"op": op, "inputs": [s.node for s in ins], "attrs": attrs})
        return spec

    def lift(self, x) -> Sym:
        if isinstance(x, Sym):
            return x
        return self.const(x)

    def const(self, value, kind: str | None = None) -> Sym:
        value = value.tolist() if hasattr(value, "tolist") else value
        if kind is None:
            flat = value
            while isinstance(flat, list):
                flat = flat[0]
            kind = "bool" if isinstance(flat, bool) else "float" if isinstance(flat, float) else "int"
        return self.op("const", value=value, dtype=kind)

    def iota(self, n: int) -> Sym:
        return self.op("iota", n=int(n))

    def logits(self, rows) -> Sym:
        """(R, V) float logits at window rows ``rows``."""
        return self.op("logits", rows=[int(r) for r in rows])

    def hidden(self, rows) -> Sym:
        return self.op("hidden", rows=[int(r) for r in rows])

    def mtp_logits(self, rows, k: int) -> Sym:
        """(R, k, V): the model's MTP chain from each row, seeded with the target's greedy next token."""
        return self.op("mtp_logits", rows=[int(r) for r in rows], k=int(k))

    def mtp_logits_at(self, rows, k: int, index: Sym) -> Sym:
        """(k, V): the MTP chain from row ``rows[index]`` only, ``index`` a scalar int decided on the device
        (e.g. the last accepted row): k MTP steps for one row instead of for every row."""
        return self.op("mtp_logits_at", index, rows=[int(r) for r in rows], k=int(k))

    def tokens(self, n: int) -> Sym:
        """(n,) the fire's window tokens (the fire must embed exactly n)."""
        return self.op("tokens", n=int(n))

    def _slot(self, ch: Channel) -> dict:
        if not any(c is ch for c in self.channels):
            self.channels.append(ch)
        slot = next(i for i, c in enumerate(self.channels) if c is ch)
        return {"slot": slot, "shape": list(ch.shape), "dtype": ch.dtype}

    def take(self, ch: Channel) -> Sym:
        return self.op("take", **self._slot(ch))

    def read(self, ch: Channel) -> Sym:
        return self.op("read", **self._slot(ch))

    def put(self, ch: Channel, x) -> None:
        self.effect("put", self._cast_for(ch, x), **self._slot(ch))

    def set(self, ch: Channel, x) -> None:
        self.effect("set", self._cast_for(ch, x), **self._slot(ch))

    def _cast_for(self, ch: Channel, x) -> Sym:
        return x if isinstance(x, Sym) else self.const(x, CHANNEL_DTYPES[ch.dtype])

    def fold(self, n) -> None:
        """Commits the first ``n`` rows of the window (n: a scalar int), or, for a tree window, the path of rows
        ``n`` holds before its first negative entry (n: a 1-d int), decided on the device."""
        self.effect("fold", self.lift(n))


def where(cond: Sym, a, b) -> Sym:
    """``a`` where ``cond`` holds, else ``b``, element-wise (``a`` or ``b`` may be a Python number)."""
    bld = cond.b
    return bld.op("where", cond, bld.lift(a), bld.lift(b))


def maximum(a: Sym, b) -> Sym:
    """The element-wise larger of ``a`` and ``b``."""
    return a.b.op("maximum", a, a.b.lift(b))


def minimum(a: Sym, b) -> Sym:
    """The element-wise smaller of ``a`` and ``b``."""
    return a.b.op("minimum", a, a.b.lift(b))


def concat(xs: list, dim: int = -1) -> Sym:
    """``xs`` joined along ``dim`` (at least one must be a Sym; numbers become constants)."""
    bld = next(x.b for x in xs if isinstance(x, Sym))
    return bld.op("concat", *[bld.lift(x) for x in xs], dim=dim)


def masked_argmax(x: Sym, mask: Sym, dim: int = -1) -> Sym:
    """The argmax of ``x`` along ``dim`` among the entries ``mask`` allows."""
    return x.b.op("masked_argmax", x, mask, dim=dim)


def sample(logits: Sym, rng: Sym, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Sym:
    """Gumbel-max sampling over the last dim after temperature → top-k → top-p. ``rng`` is an int (2,)
    state (seed, counter): the same state gives the same tokens; advance it yourself (``rng + [0, 1]``)."""
    return logits.b.op("sample", logits, rng, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))


def uniform(rng: Sym, *shape: int) -> Sym:
    """Uniform [0, 1) floats of ``shape`` from an rng state (seed, counter)."""
    return rng.b.op("uniform", rng, shape=[int(d) for d in shape])


class Program:
    """A traced program: its nodes, the channels its slots bind by default, and its hash (its name)."""

    def __init__(self, model: Model, nodes: list[dict], channels: list[Channel]):
        self.model = model
        self.nodes = nodes
        self.channels = channels
        self.hash = program_hash(model.name, nodes)
        self.folds = any(n["op"] == "fold" for n in nodes)
        self._registered = False

    async def register(self) -> str:
        """Registers once per connection; the engine validates it and answers with the same hash. A fire sent
        with the program registers it by itself (again, if the engine has dropped it since)."""
        if not self._registered:
            reply = await self.model.client.request("program_register", model=self.model.name, nodes=self.nodes)
            assert reply["program"] == self.hash, "SDK and engine disagree on a program's hash"
            self._registered = True
        return self.hash

    async def unregister(self) -> bool:
        """Drops the program from the engine once you are done with it, so a long-lived connection (an
        inferlet host) holds only the programs in use::

            prog = inferlet.trace(model, accept, window, out)
            for _ in range(rounds):
                await inferlet.ForwardPass(ws).embed_from(window).epilogue(prog).submit()
            await prog.unregister()

        Fires already sent run to the end with it; a later fire with it registers it again by itself. The
        engine holds a bounded number of programs per connection (``pie engine --max-programs``) and evicts
        the least recently used one past it, so forgetting to unregister costs a slot, never an error. On a
        connection shared by several runs, another run still firing the same program (same hash) registers it
        again at its next fire. Returns whether the engine still held it."""
        self._registered = False
        reply = await self.model.client.request("program_unregister", program=self.hash)
        return bool(reply["removed"])

    def forget(self) -> None:
        """Marks the program as not registered, so the next fire with it registers it again."""
        self._registered = False


def trace(model: Model, fn: Callable[..., Any], *channels: Channel) -> Program:
    """Traces ``fn(builder, *channels)`` into a Program for ``model``."""
    b = Builder(ModelDims(model.vocab_size, model.hidden_size, model.mtp_depth))
    fn(b, *channels)
    return Program(model, b.nodes, b.channels)
