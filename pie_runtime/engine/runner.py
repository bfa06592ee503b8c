"""The model runner: one batched forward over ragged rows on the device, then the readouts of the rows
asked for. It turns engine-side plans (page tables, row lists) into tensors and tensors into numpy."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..models.context import ForwardContext, Segment
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
    next_tokens: list[int] | None = None  # at_accepted MTP: the window's token after each row (-1 past it)


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device, state: StateCache | None = None):
        self.model = model
        self.kv = kv
        self.state = state  # the recurrent-state pool's tensors (models with recurrent state only)
        self.device = device
        self.vocab = model.config.vocab_size
        self.mtp: MTPHead | None = None  # the model's MTP drafter, when it has one

    def forward(self, segments: list[Segment], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Embeds ``tokens`` (rows of ``segments`` concatenated), writes their K/V and advances the recurrent
        state of the slot each segment names (``Segment.state``), returns (N, H) hidden."""
        if self.state is not None:  # slot → its live entry; a segment of no working set runs on the scratch
            segments = [replace(s, state=self.state.scratch if s.state is None else s.state) for s in segments]
        ctx = ForwardContext.build(segments, self.kv.page_size, self.device, positions)
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            return self.model(self.model.embed(ids), ctx, self.kv, self.state)  # type: ignore[arg-type]

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

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.kv.copy_pages(src, dst)

    @torch.inference_mode()
    def readouts(self, requests: list[ReadoutRequest]) -> tuple[list[dict[str, np.ndarray]], list[torch.Tensor | None]]:
        """Runs the lm head once over every row that needs logits (all but Hidden readouts), then each
        readout's kernel. Returns the results and each request's raw (unmasked) logits, which the fire's
        epilogue reuses instead of running the lm head again."""
        needs_logits = [r for r in requests if r.spec.kind != "hidden"]
        logits_all = self.model.logits(torch.cat([r.hidden for r in needs_logits])) if needs_logits else None
        out: list[dict[str, np.ndarray]] = []
        raw: list[torch.Tensor | None] = []
        offset = 0
        for r in requests:
            kind = r.spec.kind
            if kind == "hidden":
                out.append({"hidden": r.hidden.float().cpu().numpy()})
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
            out.append(self._mtp(r, logits, mask) if kind == "mtp" else self._kernel(r.spec, logits, mask))
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
        spec, mtp = r.spec, self.mtp
        assert mtp is not None, "fire admission refuses MTP readouts on a model without a head"
        first = sampling.argmax(logits, mask)
        steps: list[torch.Tensor] = []
        if spec.at_accepted:
            assert r.next_tokens is not None  # execute passes them for every at_accepted readout
            agree = first[:-1].cpu() == torch.tensor(r.next_tokens[:-1], dtype=first.dtype)
            n = int(torch.cumprod(agree.to(torch.int64), 0).sum()) if agree.numel() else 0
            drafts = torch.full((first.shape[0], spec.k), -1, dtype=first.dtype, device=first.device)
            drafts[n] = mtp.draft(r.hidden[n : n + 1], first[n : n + 1], spec.k)[0][0]
        else:
            drafts, steps = mtp.draft(r.hidden, first, spec.k)
        out = {"tokens": torch.cat([first.unsqueeze(1), drafts], dim=1).to(torch.int32).cpu().numpy()}
        if spec.with_probs:
            probs = [sampling.filtered_probs(lg, spec.temperature, spec.top_k, spec.top_p) for lg in steps]
            out["probs"] = torch.stack(probs, dim=1).cpu().numpy()
        return out
