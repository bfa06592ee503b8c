"""Model handles: what ``inferlet.model()`` returns — the model's facts from ``hello`` (the protocol's
``ModelInfo``, as the engine sent it), its tokenizer, and working sets on it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pie_runtime.protocol.messages import ModelInfo

from .client import Client
from .errors import UsageError
from .kv_file import SavedKV, read_saved
from .shared import shared
from .tokenizer import Tokenizer
from .working_set import WorkingSet

T = TypeVar("T")


@dataclass
class Model:
    """A model the engine serves, as ``inferlet.model()`` (or ``inferlet.model(name)``) returns it: its facts
    (``name``, ``vocab_size``, ``max_positions``, ``page_size``, the drafters attached), its ``tokenizer``, and
    ``working_set()`` to open a KV cache on it."""

    info: ModelInfo
    client: Client
    tokenizer: Tokenizer

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def max_positions(self) -> int:
        return self.info.max_positions

    @property
    def page_size(self) -> int:
        return self.info.page_size

    @property
    def drafters(self) -> list[dict]:
        return self.info.drafters

    @property
    def mtp_depth(self) -> int:
        """> 0 when the model serves MTP(k) readouts, up to this k."""
        return self.info.mtp_depth

    def require_mtp(self, depth: int) -> None:
        """Raises :class:`UsageError` when this model serves no MTP head ``depth`` drafts deep, naming the
        commands that attach or train one."""
        if self.mtp_depth == 0:
            raise UsageError(
                f"model {self.name} has no MTP head: attach one with `pie model drafter attach {self.name} mtp:FILE` "
                f"(train it with `pie drafter train --model {self.name} --kind mtp --corpus TEXT --out FILE`), "
                "then restart the engine"
            )
        if depth > self.mtp_depth:
            raise UsageError(
                f"--draft-length {depth} is past the MTP depth of {self.name}'s head ({self.mtp_depth}): "
                f"use --draft-length {self.mtp_depth} or less, or train a deeper head with "
                f"`pie drafter train --model {self.name} --kind mtp --depth {depth} ...`"
            )

    @property
    def eagle_depth(self) -> int:
        """> 0 when the model serves Eagle(k) readouts, up to this k."""
        return self.info.eagle_depth

    @property
    def eagle_step_ms(self) -> float:
        """Engine-measured ms of one more Eagle(k) draft."""
        return self.info.eagle_step_ms

    @property
    def recurrent(self) -> bool:
        """Whether a working set carries recurrent state (Mamba, LFM2): a fold of fewer rows than a fire ran
        costs the engine a replay of the folded rows, unless a per-row state serves it (``per_row_states``)."""
        return self.info.recurrent

    @property
    def per_row_states(self) -> int:
        """With recurrent state: folds of up to this many rows fewer than ran copy a state the engine kept per
        row, with no replay (0: every such fold replays; engine ``--recurrent-fold``)."""
        return self.info.per_row_states

    @property
    def state_granule(self) -> int:
        """Rows the model's state advances by; above 1 a fire folds all its rows, so no round can speculate."""
        return self.info.state_granule

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    @property
    def pass_cost_ms(self) -> list[float]:
        """[w-1]: engine-measured ms of a w-row pass."""
        return self.info.pass_cost_ms

    @property
    def mtp_step_ms(self) -> float:
        """Engine-measured ms of one more MTP(k) draft."""
        return self.info.mtp_step_ms

    @property
    def mtp_acceptance(self) -> list[float]:
        """[i]: the MTP head's held-out acceptance of draft i+1 given drafts 1..i kept, from its training record
        (empty: not recorded)."""
        return self.info.mtp_acceptance

    @property
    def eagle_acceptance(self) -> list[float]:
        """The EAGLE head's, as :attr:`mtp_acceptance`."""
        return self.info.eagle_acceptance

    @property
    def eos_token_ids(self) -> list[int]:
        return self.tokenizer.eos_token_ids

    def shared(self, key: str, make: Callable[[], T]) -> T:
        """An object the runs of this process share for this model, made by ``make()`` on first use
        (inferlet.shared): a cross-request index, a table read once. Not shared with other processes."""
        return shared(self.name, key, make)

    def working_set(self) -> WorkingSet:
        """A new, empty working set on this model (opened in the engine on first use)."""
        return WorkingSet(self)

    async def load_working_set(self, path: str | Path) -> tuple[WorkingSet, SavedKV]:
        """A new working set holding the rows a :meth:`WorkingSet.save` wrote to ``path`` (in this engine or
        another one), at the positions they were written at, and what the file says of them (``tokens``,
        ``pending``, ...). Refused :class:`inferlet.SavedKVMismatch` (code ``kv_mismatch``) unless this is the
        same model (weights digest) in the same weight format and KV dtype; nothing is left in the engine when a
        load fails (``out_of_pages`` included).

            ws, saved = await model.load_working_set("prompt.kv")
            fp = inferlet.ForwardPass(ws).embed(saved.pending)
            res = await fp.readout([len(saved.pending) - 1], inferlet.Argmax()).submit()
        """
        saved = read_saved(path)
        saved.check_fits(self.info)
        ws = self.working_set()
        try:
            await ws.append_saved(saved)
        except BaseException:
            await ws.release()
            raise
        return ws, saved
