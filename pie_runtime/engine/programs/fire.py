"""What an epilogue sees of one finished fire (its readout rows' logits, hidden states, MTP logits and its
window's tokens), and the state of a run-ahead: budgets, stop conditions, and why it ended."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...protocol import messages as m


class FireIntrinsics:
    """Lazily computes the readout intrinsics of one fire from the final hidden states of its rows."""

    def __init__(
        self,
        runner,
        hidden: dict[int, torch.Tensor],
        tokens: list[int],
        logits: dict[tuple[int, ...], torch.Tensor] | None = None,
    ):
        self.runner = runner
        self._hidden = hidden  # window row → (H,)
        self._tokens = tokens
        self._logits: dict[tuple[int, ...], torch.Tensor] = dict(logits or {})  # rows → raw logits

    def hidden(self, rows: list[int]) -> torch.Tensor:
        return torch.stack([self._hidden[r] for r in rows]).float()

    def logits(self, rows: list[int]) -> torch.Tensor:
        key = tuple(rows)
        if key not in self._logits:
            h = torch.stack([self._hidden[r] for r in rows])
            self._logits[key] = self.runner.model.logits(h).float()
        return self._logits[key]

    def mtp_logits(self, rows: list[int], k: int) -> torch.Tensor:
        """(R, k, V): the MTP chain from each row, seeded with the target's greedy next token (as MTP(k))."""
        h = torch.stack([self._hidden[r] for r in rows])
        first = self.logits(rows).argmax(dim=-1)
        _, steps = self.runner.mtp.draft(h, first, k)
        return torch.stack([s.float() for s in steps], dim=1)

    def mtp_logits_at(self, rows: list[int], k: int, index: torch.Tensor) -> torch.Tensor:
        """(k, V): the MTP chain from row ``rows[index]`` alone (the index stays on the device)."""
        at = index.reshape(1)
        h = torch.stack([self._hidden[r] for r in rows]).index_select(0, at)
        first = self.logits(rows).index_select(0, at).argmax(dim=-1)
        _, steps = self.runner.mtp.draft(h, first, k)
        return torch.cat([s.float() for s in steps])

    def tokens(self) -> torch.Tensor:
        return torch.tensor(self._tokens, dtype=torch.int64, device=self.runner.device)


@dataclass
class RunState:
    """A run-ahead in progress: the request that started it is answered when it ends."""

    spec: m.RunAhead
    rounds: int = 0
    tokens: int = 0  # committed tokens seen in the output channel
    reason: str | None = None

    def after_round(self, output_cells: list[torch.Tensor]) -> str | None:
        """Counts a finished round's output; returns why the run stops now, if it does."""
        self.rounds += 1
        stops = set(self.spec.stop_tokens)
        for cell in output_cells:
            for t in cell.reshape(-1).tolist():
                if t < 0:
                    continue
                self.tokens += 1
                if t in stops:
                    return "stop_token"
        if self.spec.budget_tokens is not None and self.tokens >= self.spec.budget_tokens:
            return "budget_tokens"
        if self.spec.budget_rounds is not None and self.rounds >= self.spec.budget_rounds:
            return "budget_rounds"
        return None

    def summary(self) -> dict:
        return {"rounds": self.rounds, "tokens": self.tokens, "reason": self.reason}
