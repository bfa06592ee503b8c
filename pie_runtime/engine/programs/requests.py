"""The requests of epilogue programs and device channels: ``program_register/unregister``,
``channel_open/put/set/take/read/close``, and the checks a fire with a program, a channel-fed window or a
run-ahead passes before it is queued. Channels and programs belong to the client that made them; a client
identity's (identities.py) channels are bounded in number and bytes, its programs a bounded cache
(registry.py)."""

from __future__ import annotations

import torch

from ...protocol import ErrorCode, PieError
from ...protocol import messages as m
from ...protocol.dtypes import CHANNEL_DTYPES
from ...protocol.programs import PROGRAM_MEMORY, ModelDims
from ..channels import Channel, ChannelTable
from ..identities import Identities
from ..jobs import Handler, Reply
from ..served import ServedModels
from ..working_set import WorkingSet
from .fire import RunState
from .registry import MAX_PROGRAMS, ProgramTable
from .validate import Program, validate

MAX_CHANNELS = 256  # per identity


class ProgramRequests:
    def __init__(
        self,
        models: ServedModels,
        channels: ChannelTable,
        outbox: list[Reply],
        program_memory: int = PROGRAM_MEMORY,
        max_programs: int = MAX_PROGRAMS,
        identities: Identities | None = None,
    ):
        self.models = models
        self.identities = identities or channels.identities
        self.program_memory = program_memory  # bytes: a program whose values peak above it is refused
        self.channels = channels
        self.outbox = outbox  # replies owed to waiting takes that a host put or close answers
        self.programs = ProgramTable(max_programs, self.identities)

    def ops(self) -> dict[str, Handler]:
        return {
            "program_register": self.register,
            "program_unregister": self.unregister,
            "channel_open": self.open,
            "channel_put": self.put,
            "channel_set": self.set,
            "channel_take": self.take,
            "channel_read": self.read,
            "channel_close": self.close,
        }

    def count(self) -> int:
        return self.programs.count()

    def drop_client(self, client: bytes) -> None:
        self.channels.drop_client(client)
        self.programs.drop_client(client)

    # ---- a fire's program, bindings and input channel ---------------------------------------------

    def source(self, client: bytes, req: m.Fire, ws: WorkingSet) -> Channel | None:
        """The channel a fire takes its window from, if it names one."""
        if req.tokens_from is None:
            return None
        ch = self.channels.get(client, req.tokens_from)
        if len(ch.shape) != 1 or CHANNEL_DTYPES[ch.dtype] != "int" or ch.model != ws.model:
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"tokens come from a 1-d int channel on {ws.model}")
        if req.positions is not None:
            raise PieError(ErrorCode.INVALID_ARGUMENT, "a channel-fed fire takes the default positions")
        ch.check_live()
        if not ch.cells and not self.models.writes(ch):
            raise PieError(ErrorCode.CHANNEL_EMPTY, f"channel {ch.id} is empty and no fire in flight writes it")
        return ch

    def bind(self, client: bytes, req: m.Fire, ws: WorkingSet, w: int) -> tuple[Program | None, list[Channel]]:
        """The fire's program and the channels bound to its slots, checked against its window."""
        bindings = [self.channels.get(client, h) for h in req.bindings]
        if req.program is None:
            if bindings:
                raise PieError(ErrorCode.INVALID_ARGUMENT, "channel bindings need a program")
            return None, []
        program = self.programs.get(client, req.program)
        if program is None:
            raise PieError(ErrorCode.UNKNOWN_PROGRAM, f"no program {req.program} (register it first)")
        if program.model != ws.model or any(ch.model != ws.model for ch in bindings):
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"program and channels must be on the fire's model {ws.model}")
        program.check_fire(w, bindings)
        return program, bindings

    def check_run_ahead(
        self, client: bytes, req: m.Fire, program: Program | None, bindings: list[Channel], source: Channel | None
    ) -> RunState | None:
        ra = req.run_ahead
        if ra is None:
            return None
        if source is None or program is None or not program.folds:
            raise PieError(ErrorCode.INVALID_ARGUMENT, "run-ahead needs tokens_from and a program that folds")
        written = {bindings[s].id for s in program.writes}
        if source.id not in written or ra.output not in written:
            raise PieError(ErrorCode.INVALID_ARGUMENT, "a run-ahead's program writes its input and output channels")
        if ra.stop_channel is not None:
            self.channels.get(client, ra.stop_channel)
        if req.readouts:
            raise PieError(ErrorCode.INVALID_ARGUMENT, "a run-ahead reads out through its program's channels")
        return RunState(ra)

    # ---- requests -------------------------------------------------------------------------------

    def register(self, client: bytes, req: m.ProgramRegister) -> dict:
        served = self.models.get(req.model)
        dims = ModelDims(served.info.vocab_size, served.info.hidden_size, served.info.mtp_depth)
        program = validate(served.name, [n.model_dump() for n in req.nodes], dims, self.program_memory)
        program = self.programs.add(client, program, lambda: self._in_use(client))
        return {"program": program.hash, "slots": len(program.slots)}

    def unregister(self, client: bytes, req: m.ProgramUnregister) -> dict:
        return {"removed": self.programs.remove(client, req.program)}

    def _in_use(self, client: bytes) -> set[tuple[bytes, str]]:
        """The (client, hash) of the programs that the queued fires of ``client``'s identity use."""
        identity = self.identities.of(client)
        return {
            (job.client, job.program.hash)
            for job in self.models.jobs()
            if job.program is not None and self.identities.of(job.client) == identity
        }

    def open(self, client: bytes, req: m.ChannelOpen) -> dict:
        served = self.models.get(req.model)
        if len(self.channels.held_by(client)) >= MAX_CHANNELS:
            raise PieError(
                ErrorCode.LIMIT_EXCEEDED,
                f"MAX_CHANNELS: a client's identity (all its connections) holds at most {MAX_CHANNELS} channels",
            )
        ch = self.channels.open(client, served.name, req.shape, req.dtype, req.capacity, served.runner.device)
        return {"channel": ch.id}

    def put(self, client: bytes, req: m.ChannelPut) -> dict:
        ch = self.channels.get(client, req.channel)
        value = req.value.to_numpy()
        ch.check_host_value(value)
        ch.put(torch.from_numpy(value.copy()))
        self.outbox.extend(self.channels.serve(self.models.writes))
        return {"size": len(ch.cells)}

    def set(self, client: bytes, req: m.ChannelSet) -> dict:
        ch = self.channels.get(client, req.channel)
        value = req.value.to_numpy()
        ch.check_host_value(value)
        ch.set(torch.from_numpy(value.copy()))
        self.outbox.extend(self.channels.serve(self.models.writes))
        return {"size": len(ch.cells)}

    def take(self, client: bytes, req: m.ChannelTake) -> dict | None:
        ch = self.channels.get(client, req.channel)
        if min(req.min, req.max) > ch.capacity:  # it would wait for more cells than the channel can hold
            raise PieError(
                ErrorCode.INVALID_ARGUMENT,
                f"a take waits for at most channel {ch.id}'s capacity of {ch.capacity} cells, got min={req.min}",
            )
        return self.channels.take(client, req.id, ch, req.max, True, self.models.writes, req.min)

    def read(self, client: bytes, req: m.ChannelRead) -> dict | None:
        ch = self.channels.get(client, req.channel)
        return self.channels.take(client, req.id, ch, 1, False, self.models.writes)

    def close(self, client: bytes, req: m.ChannelClose) -> dict:
        ch = self.channels.get(client, req.channel)
        if self.models.uses(ch):
            raise PieError(ErrorCode.BUSY, f"channel {ch.id} is bound to fires in flight")
        self.channels.close(ch)
        self.outbox.extend(self.channels.serve(self.models.writes))
        return {}
