"""The model runner: one batched forward over ragged rows on the device, then the readouts of the rows
asked for. It turns engine-side plans (page tables, row lists) into tensors and tensors into numpy.

With an EAGLE head (models/eagle.py) every forward also writes the draft layer's K/V of its rows into the
pool's extra layer. Row p's input pairs the feature of row p-1 with token p: inside a segment that is the
row before it; for a segment's first row it is the :class:`FeatureTail` its working set kept from the
rows it ran last (execute.py), or zeros where that row is not among them (a fork's or a fresh working set's
first row after prefix-cached pages, or a truncate back past them). Zeros cost only that row's draft-layer
K/V some quality, never exactness: drafts are verified."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..models.attention_scores import PassScores, ScoreRow
from ..models.context import ForwardContext, Segment
from ..models.eagle import EagleHead
from ..models.families import CausalLM
from ..models.kv_cache import KVCache
from ..models.mtp import MTPHead
from ..models.state_cache import StateCache
from ..protocol.messages import Readout
from . import sampling


@dataclass
class ReadoutRequest:
    """A readout of one fire: its spec and the final hidden states of its rows."""

    spec: Readout
    hidden: torch.Tensor  # (R, H)
    mask: np.ndarray | None  # packed allowed-token bitmask (R, W)
    next_tokens: list[int] | None = None  # at_accepted MTP/EAGLE: the window's token after each row (-1 past it)
    pages: list[int] | None = None  # EAGLE: the working set's page table (its chains read the pool layer)
    start: int = 0  # EAGLE: the sequence index of the fire's row 0
    scores: list[torch.Tensor] | None = None  # attention: each row's mass, (width,) or (layers, width)


# The last rows of a working set's forward whose features an EAGLE head keeps: a verify window's rows (its
# deferred fold picks one of them as the last folded row) and a prefill chunk's last.
TAIL_ROWS = 64


@dataclass(frozen=True)
class FeatureTail:
    """EAGLE features of the last rows a working set ran: rows ``start .. start + len(features) - 1``."""

    start: int
    features: torch.Tensor  # (n, H)

    def at(self, index: int) -> torch.Tensor | None:
        """The feature of sequence index ``index``, or None when it is not among these rows."""
        i = index - self.start
        return self.features[i] if 0 <= i < len(self.features) else None


class ModelRunner:
    kv_transfer = True  # whether the pool's rows can be read and written whole here (a tensor-parallel rank: no)

    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device, state: StateCache | None = None):
        self.model = model
        self.kv = kv
        self.state = state  # the recurrent-state pool's tensors (models with recurrent state only)
        self.device = device
        self.vocab = model.config.vocab_size
        self.mtp: MTPHead | None = None  # the model's MTP drafter, when it has one
        self.eagle: EagleHead | None = None  # the model's EAGLE drafter, when it has one

    def forward(
        self,
        segments: list[Segment],
        tokens: list[int],
        positions: list[int],
        tails: Sequence[object] | None = None,
        scores: PassScores | None = None,
    ) -> torch.Tensor:
        """Embeds ``tokens`` (rows of ``segments`` concatenated), writes their K/V and advances the recurrent
        state of the slot each segment names (``Segment.state``), returns (N, H) hidden. With an EAGLE head it
        writes the draft layer's K/V too; ``tails``: each segment's working set's :class:`FeatureTail` (module
        docstring). ``scores`` (:meth:`pass_scores`) receives the attention readout's mass at its rows."""
        if self.state is not None:  # slot → its live entry; a segment of no working set runs on the scratch
            segments = [replace(s, state=self.state.scratch if s.state is None else s.state) for s in segments]
        native = getattr(self.model, "attends_natively", False)  # reads the page tables itself: no torch groups
        ctx = ForwardContext.build(
            segments,
            self.kv.page_size,
            self.device,
            positions,
            torch_groups=not native,
            scores=scores,
            layout=self.kv.layout,
        )
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            hidden = self.model(self.model.embed(ids), ctx, self.kv, self.state)  # type: ignore[arg-type]
            if self.eagle is not None:
                self._eagle_kv(segments, ids, hidden, ctx, tails or [None] * len(segments))
        return hidden

    @property
    def attention_scores(self) -> bool:
        """Whether a pass can read the attention mass out (a model whose every layer attends, here: the Llama
        family in torch or on the native step)."""
        return getattr(self.model, "attention_scores", False)

    def pass_scores(self, segments: list[Segment], rows: list[ScoreRow]) -> PassScores:
        """The buffers of one pass's attention readout at ``rows`` (``forward``'s ``scores``)."""
        layers = self.model.config.num_hidden_layers
        return PassScores(rows, segments, self.kv.page_size, layers, self.device, self.kv.layout)

    # ---- the recurrent-state pool's tensors, by slot (engine/state_slots.py's StateOps) ------------

    def _states(self) -> StateCache:
        assert self.state is not None, "only a model with recurrent state has a state pool"
        return self.state

    def zero_state(self, slot: int) -> None:
        self._states().zero([slot])

    def copy_state(self, src: int, dst: int) -> None:
        self._states().copy([src], [dst])

    def snapshot_state(self, slot: int) -> None:
        s = self._states()
        s.copy([slot], [s.snapshot_of(slot)])

    def restore_state(self, slot: int) -> None:
        s = self._states()
        s.copy([s.snapshot_of(slot)], [slot])

    def take_row_state(self, slot: int, row: int) -> None:
        s = self._states()
        s.copy([s.row_entry(slot, row)], [slot])

    def row_state_entries(self, slot: int, first: int, count: int) -> tuple[int, ...]:
        """The entries receiving the state after rows ``first .. first+count-1`` of ``slot``'s fire."""
        s = self._states()
        return tuple(s.row_entry(slot, r) for r in range(first, first + count))

    def _eagle_kv(
        self,
        segments: list[Segment],
        ids: torch.Tensor,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        tails: Sequence[object],
    ) -> None:
        assert self.eagle is not None
        u = self.eagle.feature(hidden)
        prev = torch.empty_like(u)
        r = 0
        for seg, tail in zip(segments, tails):
            before = tail.at(seg.start - 1) if isinstance(tail, FeatureTail) else None
            prev[r] = before if before is not None else 0.0
            prev[r + 1 : r + seg.n_rows] = u[r : r + seg.n_rows - 1]
            r += seg.n_rows
        self.eagle.write_kv(prev, ids, ctx, self.kv)

    @torch.inference_mode()
    def tails(self, segments: list[Segment], hidden: torch.Tensor) -> list[FeatureTail | None]:
        """Each segment's new :class:`FeatureTail` after a forward returned ``hidden``; None without EAGLE."""
        if self.eagle is None:
            return [None] * len(segments)
        out: list[FeatureTail | None] = []
        r = 0
        for seg in segments:
            keep = min(seg.n_rows, TAIL_ROWS)
            rows = hidden[r + seg.n_rows - keep : r + seg.n_rows]
            out.append(FeatureTail(seg.start + seg.n_rows - keep, self.eagle.feature(rows).clone()))
            r += seg.n_rows
        return out

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.kv.copy_pages(src, dst)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        self.kv.copy_slots(src, dst)

    def read_slots(self, slots: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """K and V of some rows, every KV layer in order, from ``slots`` (per page group, one slot per row; -1: a
        row the group no longer holds, read as zeros): two (layers, kv_heads, rows, head_dim) host arrays holding
        the pool's bits (a bfloat16 pool's as uint16)."""
        layout, dev = self.kv.layout, self.kv.k.device
        index = [torch.tensor(s, dtype=torch.int64, device=dev) for s in slots]
        out = []
        for pool in (self.kv.k, self.kv.v):
            rows = []
            for row, group in zip(layout.layer_row, layout.layer_group):
                got = pool[row][:, index[group].clamp(min=0)]
                rows.append(got.masked_fill((index[group] < 0).view(1, -1, 1), 0))
            out.append(_host_bits(torch.stack(rows)))
        return out[0], out[1]

    def write_slots(self, slots: list[list[int]], k: np.ndarray, v: np.ndarray) -> None:
        """Writes ``k`` and ``v`` (as :meth:`read_slots` gives them) into ``slots`` (per page group; -1: a row
        the group does not keep, not written), every KV layer."""
        layout, dev = self.kv.layout, self.kv.k.device
        index = [torch.tensor(s, dtype=torch.int64, device=dev) for s in slots]
        keep = [(i >= 0).nonzero().flatten() for i in index]
        for pool, bits in ((self.kv.k, k), (self.kv.v, v)):
            t = torch.from_numpy(np.array(bits, order="C"))  # a writable copy (wire arrays are read-only)
            if pool.dtype == torch.bfloat16:
                t = t.view(torch.int16).view(torch.bfloat16)
            t = t.to(pool.device)
            for layer, (row, group) in enumerate(zip(layout.layer_row, layout.layer_group)):
                pool[row][:, index[group][keep[group]]] = t[layer][:, keep[group]]

    @torch.inference_mode()
    def readouts(self, requests: list[ReadoutRequest]) -> tuple[list[dict[str, np.ndarray]], list[torch.Tensor | None]]:
        """Runs the lm head once over every row that needs logits (all but Hidden readouts), then each
        readout's kernel. Returns the results and each request's raw (unmasked) logits, which the fire's
        epilogue reuses instead of running the lm head again."""
        needs_logits = [r for r in requests if r.spec.kind not in ("hidden", "attention")]
        logits_all = self.model.logits(torch.cat([r.hidden for r in needs_logits])) if needs_logits else None
        out: list[dict[str, np.ndarray]] = []
        raw: list[torch.Tensor | None] = []
        offset = 0
        for r in requests:
            kind = r.spec.kind
            if kind in ("hidden", "attention"):
                out.append(_no_logits(r))
                raw.append(None)
                continue
            assert logits_all is not None  # this request is one of needs_logits
            n = r.hidden.shape[0]
            logits = logits_all[offset : offset + n]
            offset += n
            raw.append(logits)
            mask = None
            if r.mask is not None:
                mask = sampling.unpack_mask(torch.from_numpy(r.mask.astype(np.int32)).to(self.device), self.vocab)
            if kind == "mtp":
                out.append(self._mtp(r, logits, mask))
            elif kind == "eagle":
                out.append(self._eagle(r, logits, mask))
            else:
                out.append(self._kernel(r.spec, logits, mask))
        return out, raw

    def _kernel(self, spec: Readout, logits: torch.Tensor, mask: torch.Tensor | None) -> dict[str, np.ndarray]:
        if spec.kind == "logits":
            return {"logits": sampling.masked_logits(logits, mask).cpu().numpy()}
        if spec.kind == "argmax":
            return {"tokens": sampling.argmax(logits, mask).to(torch.int32).cpu().numpy()}
        probs = sampling.filtered_probs(logits, spec.temperature, spec.top_k, spec.top_p, mask)
        if spec.kind == "distribution":
            return {"probs": probs.cpu().numpy()}
        return {"tokens": sampling.sample(probs, spec.seed).to(torch.int32).cpu().numpy()}

    def _mtp(self, r: ReadoutRequest, logits: torch.Tensor, mask: torch.Tensor | None) -> dict[str, np.ndarray]:
        """tokens (R, 1+k): the target's greedy next token (under the row's mask), then k chained MTP
        drafts (argmax each); with_probs adds probs (R, k, V), each step's filtered draft distribution.
        at_accepted chains only from the row a greedy verifier stops at; other rows' drafts are -1."""
        mtp = self.mtp
        assert mtp is not None, "fire admission refuses MTP readouts on a model without a head"
        return _chained(
            r,
            sampling.argmax(logits, mask),
            lambda rows, first, with_logits: mtp.draft(r.hidden[rows], first, r.spec.k, with_logits),
        )

    def _eagle(self, r: ReadoutRequest, logits: torch.Tensor, mask: torch.Tensor | None) -> dict[str, np.ndarray]:
        """As ``_mtp``, the drafts chained by the EAGLE head from each row's feature and the pool layer's K/V
        of the rows up to it."""
        eagle = self.eagle
        assert eagle is not None and r.pages is not None, "fire admission refuses EAGLE readouts without a head"
        index = torch.tensor(r.spec.rows, dtype=torch.int64, device=self.device) + r.start

        def chain(rows: slice, first: torch.Tensor, with_logits: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
            assert eagle is not None and r.pages is not None
            feature = eagle.feature(r.hidden[rows])
            return eagle.draft(feature, first, index[rows], r.pages, self.kv, r.spec.k, with_logits)

        return _chained(r, sampling.argmax(logits, mask), chain)


def _no_logits(r: ReadoutRequest) -> dict[str, np.ndarray]:
    """A readout that needs no lm head: Hidden's (R, H), or the attention mass, (R, width) or (R, layers, width)."""
    if r.spec.kind == "hidden":
        return {"hidden": r.hidden.float().cpu().numpy()}
    assert r.scores is not None  # execute gives every attention readout its rows' mass
    return {"scores": torch.stack(r.scores).cpu().numpy()}


def _host_bits(t: torch.Tensor) -> np.ndarray:
    """A pool tensor's bits on the host in a numpy dtype (bfloat16, which numpy lacks, as uint16)."""
    t = t.cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _chained(r: ReadoutRequest, first: torch.Tensor, draft) -> dict[str, np.ndarray]:
    """An MTP or EAGLE readout's result from the target's greedy tokens ``first`` (R,) and ``draft(rows,
    first, with_logits)`` (R', k) drafts and their k logits (only when asked: with_probs). tokens (R, 1+k):
    ``first``, then the k chained drafts; with_probs adds probs (R, k, V). at_accepted chains only from the
    row a greedy verifier stops at (the other rows' drafts are -1)."""
    spec = r.spec
    steps: list[torch.Tensor] = []
    if spec.at_accepted:
        assert r.next_tokens is not None  # execute passes them for every at_accepted readout
        agree = first[:-1].cpu() == torch.tensor(r.next_tokens[:-1], dtype=first.dtype)
        n = int(torch.cumprod(agree.to(torch.int64), 0).sum()) if agree.numel() else 0
        drafts = torch.full((first.shape[0], spec.k), -1, dtype=first.dtype, device=first.device)
        drafts[n] = draft(slice(n, n + 1), first[n : n + 1], False)[0][0]
    else:
        drafts, steps = draft(slice(None), first, spec.with_probs)
    out = {"tokens": torch.cat([first.unsqueeze(1), drafts], dim=1).to(torch.int32).cpu().numpy()}
    if spec.with_probs:
        probs = [sampling.filtered_probs(lg, spec.temperature, spec.top_k, spec.top_p) for lg in steps]
        out["probs"] = torch.stack(probs, dim=1).cpu().numpy()
    return out
