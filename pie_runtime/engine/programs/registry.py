"""Every client's registered epilogue programs: at most ``max_programs`` a client identity (all its
connections', identities.py), least recently used evicted.

A program is named by the hash of its content, so the table is a cache rather than a namespace: registering
a program again costs one validation, and the SDK registers again by itself when a fire is refused
``unknown_program``. So a client whose identity is at its cap and that registers one more has its identity's
least recently used program (registered or fired last, by any of its clients) evicted, as vLLM's LoRA cache
(``--max-cpu-loras``) and the prefix caches of vLLM and SGLang evict their least recently used entry instead
of refusing work: a long-lived inferlet host that never unregisters stays bounded and keeps serving, and a
tenant that opens more connections gets no more programs. A program that a queued fire of the identity uses
(a run-ahead included) is never evicted; only when every held program is in use is a registration refused
``limit_exceeded``. A queued fire holds its own reference to its program, so neither an eviction nor
``program_unregister`` can take a program from under a fire; they only stop later fires from naming it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ...protocol import ErrorCode, PieError
from ..identities import Identities, Identity
from ..options import DEFAULT_MAX_PROGRAMS as MAX_PROGRAMS
from .validate import Program


class ProgramTable:
    def __init__(self, max_programs: int = MAX_PROGRAMS, identities: Identities | None = None):
        if max_programs < 1:
            raise ValueError(f"a client must be able to hold a program (max_programs={max_programs})")
        self.max_programs = max_programs
        self.identities = identities or Identities()
        self._by_client: dict[bytes, OrderedDict[str, Program]] = {}  # client → hash → program, oldest use first
        # identity → its clients' (client, hash), least recently used first
        self._lru: dict[Identity, OrderedDict[tuple[bytes, str], None]] = {}
        self.evictions = 0

    def _use(self, client: bytes, program_hash: str) -> None:
        lru = self._lru.setdefault(self.identities.of(client), OrderedDict())
        lru[(client, program_hash)] = None
        lru.move_to_end((client, program_hash))

    def _forget(self, client: bytes, program_hash: str) -> None:
        identity = self.identities.of(client)
        lru = self._lru.get(identity)
        if lru is not None:
            lru.pop((client, program_hash), None)
            if not lru:
                del self._lru[identity]

    def count(self) -> int:
        return sum(len(held) for held in self._by_client.values())

    def held(self, client: bytes) -> list[str]:
        """The client's program hashes, least recently used first."""
        return list(self._by_client.get(client, ()))

    def get(self, client: bytes, program_hash: str) -> Program | None:
        """The client's program of that hash, now its most recently used; None if it holds none."""
        held = self._by_client.get(client)
        if held is None or program_hash not in held:
            return None
        held.move_to_end(program_hash)
        self._use(client, program_hash)
        return held[program_hash]

    def add(self, client: bytes, program: Program, in_use: Callable[[], set[tuple[bytes, str]]]) -> Program:
        """Holds ``program`` for the client (the one it already holds under that hash, if any) as its most
        recently used, evicting the identity's least recently used (client, hash) that ``in_use()`` does not
        name when the identity is at the cap."""
        held = self._by_client.setdefault(client, OrderedDict())
        if program.hash in held:
            held.move_to_end(program.hash)
            self._use(client, program.hash)
            return held[program.hash]
        lru = self._lru.get(self.identities.of(client), OrderedDict())
        if len(lru) >= self.max_programs:
            busy = in_use()
            victim = next((entry for entry in lru if entry not in busy), None)
            if victim is None:
                if not held:
                    del self._by_client[client]
                raise PieError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"a client's identity (all its connections) holds at most {self.max_programs} programs "
                    "(--max-programs) and queued fires use every one: unregister one, or wait for those fires",
                )
            self.remove(*victim)
            self.evictions += 1
        held[program.hash] = program
        self._use(client, program.hash)
        return program

    def remove(self, client: bytes, program_hash: str) -> bool:
        """Forgets the client's program of that hash; whether it held one."""
        held = self._by_client.get(client)
        if held is None or held.pop(program_hash, None) is None:
            return False
        if not held:
            del self._by_client[client]
        self._forget(client, program_hash)
        return True

    def drop_client(self, client: bytes) -> None:
        for program_hash in list(self._by_client.get(client, ())):
            self.remove(client, program_hash)
