"""Model handles: what ``inferlet.model()`` returns — the model's facts from ``hello``, its tokenizer, and
working sets on it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .client import Client
from .tokenizer import Tokenizer
from .working_set import WorkingSet


@dataclass
class Model:
    name: str
    client: Client
    tokenizer: Tokenizer
    vocab_size: int
    max_positions: int
    page_size: int
    drafters: list[dict]
    mtp_depth: int
    hidden_size: int = 0
    pass_cost_ms: list[float] = field(default_factory=list)  # [w-1]: engine-measured ms of a w-row pass
    mtp_step_ms: float = 0.0  # engine-measured ms of one more MTP(k) draft

    @property
    def eos_token_ids(self) -> list[int]:
        return self.tokenizer.eos_token_ids

    def working_set(self) -> WorkingSet:
        """A new, empty working set on this model (opened in the engine on first use)."""
        return WorkingSet(self)
