"""The target answers chat prompts on a running engine, many at once: the data of `pie drafter data`.

    jobs = [(prompt, temperature) not yet in the folder]      held-out prompts first (greedy), then training
    N workers, each:  ws = fresh working set
                      fire(chat(prompt), Hidden on every row, Sample|Argmax on the last)
                      loop: fire([last token], Hidden + Sample|Argmax) until EOS or max_new
    every `flush` answers: append a shard (answer_shards), stop at the token or time budget

The workers' fires are separate working sets' one-row fires, so the engine's scheduler runs them in one step
(continuous batching): N rows a step cost little more than one. Every row also reads out the final hidden state,
so the data holds the served engine's view of every position (what an MTP head drafts from), not a float32
copy's. An answer the time budget cuts is kept as far as it got (its prompt counts as answered).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .answer_shards import Answer
from .chat_prompts import ChatPrompt

TEMPERATURES = (0.0, 0.7, 1.0)  # greedy and the sampling temperatures people use


@dataclass(frozen=True)
class Job:
    prompt: ChatPrompt
    temperature: float
    seed: int

    @property
    def key(self) -> tuple[str, float]:
        return self.prompt.id, round(self.temperature, 3)


def plan_jobs(train: list[ChatPrompt], heldout: list[ChatPrompt], seed: int, done: set[tuple[str, float]]) -> list[Job]:
    """The jobs not ``done`` yet: every held-out prompt greedy (agreement is measured on the target's greedy
    path), then the training prompts, each at one of :data:`TEMPERATURES` in turn."""
    jobs = [Job(p, 0.0, seed) for p in heldout]
    jobs += [Job(p, TEMPERATURES[i % len(TEMPERATURES)], seed + i) for i, p in enumerate(train)]
    return [j for j in jobs if j.key not in done]


@dataclass
class Budget:
    """When to stop starting answers: ``tokens`` answer tokens in all (the folder's included), or at
    ``deadline`` (time.monotonic()); ``tokens_done`` counts as answers finish."""

    tokens: int
    deadline: float | None
    tokens_done: int = 0
    fires: int = 0  # one-row fires sent (the throughput's denominator with the engine's steps)

    def spent(self) -> bool:
        return self.tokens_done >= self.tokens or (self.deadline is not None and time.monotonic() >= self.deadline)


@dataclass
class Generator:
    """What every worker shares: the model, the job queue, the budget, the answers not yet in a shard, and
    ``on_answer`` (called with each finished answer: the progress bar, the shard writer)."""

    model: object  # inferlet.Model
    jobs: list[Job]
    budget: Budget
    max_new: int
    on_answer: Callable[[Answer], None]
    results: list[Answer] = field(default_factory=list)

    async def worker(self) -> None:
        while self.jobs and not self.budget.spent():
            job = self.jobs.pop(0)
            answer = await self.answer(job)
            self.budget.tokens_done += len(answer.tokens) - answer.prompt_len
            self.on_answer(answer)

    async def answer(self, job: Job) -> Answer:
        """One prompt answered on a fresh working set (cut short when the deadline comes)."""
        from inferlet import Argmax, ForwardPass, Hidden, Sample

        model = self.model
        tok = model.tokenizer  # type: ignore[attr-defined]
        prompt = tok.encode(tok.chat([{"role": "user", "content": job.prompt.text}]))
        limit = min(self.max_new, model.max_positions - len(prompt) - 1)  # type: ignore[attr-defined]
        ws = model.working_set()  # type: ignore[attr-defined]
        tokens, hidden = list(prompt), []
        try:
            window = prompt
            for step in range(limit):
                pick = Argmax() if job.temperature == 0 else Sample(job.temperature, seed=job.seed * 100_003 + step)
                fp = ForwardPass(ws).embed(window).readout(list(range(len(window))), Hidden())
                res = await fp.readout([len(window) - 1], pick).submit()
                self.budget.fires += 1
                rows, picked = res.readouts[0].hidden, res.readouts[1].tokens
                assert rows is not None and picked is not None  # a Hidden readout, then an Argmax or Sample
                hidden.append(rows.astype(np.float16))
                token = int(picked[0])
                tokens.append(token)
                if token in tok.eos_token_ids:
                    break
                if self.budget.deadline is not None and time.monotonic() >= self.budget.deadline:
                    break
                window = [token]
        finally:
            await ws.release()
        return Answer(job.prompt.id, round(job.temperature, 3), len(prompt), tokens, np.concatenate(hidden))


async def generate(address: str, gen_args: dict, concurrency: int) -> Generator:
    """Connects to the engine at ``address`` and runs ``concurrency`` workers over ``gen_args``'s jobs
    (the fields of :class:`Generator` but ``model``) until the jobs or the budget run out."""
    import inferlet

    session = await inferlet.connect(address)
    try:
        gen = Generator(model=session.model(), **gen_args)
        await asyncio.gather(*(gen.worker() for _ in range(concurrency)))
    finally:
        session.close()
    return gen
