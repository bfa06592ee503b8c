"""transformers' side of `pie bench decode`, in its own process (so its peak RSS is its own):

    python -m pie_runtime.bench.hf_worker '<HfJob JSON>'

Loads ``LlamaForCausalLM`` over the store's weights (``pie_runtime.reference``), casts it to the job's dtype,
runs one short warm-up ``generate`` and then one greedy ``generate`` of the job's prompt ids, and prints a
``Measured`` JSON line. Timing comes from a streamer: ``generate`` hands it each new token as it is picked, so
prefill = start → first new token (the prompt's forward and the first pick), decode rate = (n - 1) kept tokens
over first → last new token (an EOS's step counts in the time, not the tokens). EOS stops it, as it stops the
others; the ids are cut before it.
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from .report import Measured
from .rss import peak_rss_mib


class HfJob(BaseModel):
    model: str
    dtype: Literal["fp32", "bf16"]
    threads: int
    prompt_ids: list[int]
    tokens: int


class _Clock:
    """A transformers streamer that only notes when each new token arrived."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate first puts the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def measure(job: HfJob) -> Measured:
    import torch

    from ..reference import transformers_llama
    from ..store import ModelStore

    warnings.filterwarnings("ignore")
    torch.set_num_threads(job.threads)
    store = ModelStore()
    manifest = store.get(job.model)
    with tempfile.TemporaryDirectory() as tmp:
        # Any: transformers' stubs do not let pyright bind generate() on LlamaForCausalLM
        model: Any = transformers_llama(store.path(job.model), manifest.config, Path(tmp))
        if job.dtype == "bf16":
            model = model.to(torch.bfloat16)
    eos = list(manifest.config.eos_token_ids)
    x = torch.tensor([job.prompt_ids])
    kw = dict(do_sample=False, eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
    with torch.inference_mode():
        model.generate(x, max_new_tokens=2, **kw)  # warm-up
        clock = _Clock()
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=job.tokens, streamer=clock, **kw)
    ids = out[0, len(job.prompt_ids) :].tolist()
    ids = ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))]
    times = clock.times
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    return Measured(
        decode_tokens_per_s=(len(ids) - 1) / decode_s if decode_s > 0 and ids else 0.0,
        prefill_tokens_per_s=len(job.prompt_ids) / (times[0] - t0) if times else None,
        prompt_tokens=len(job.prompt_ids),
        token_ids=ids,
        peak_rss_mib=peak_rss_mib(),
    )


def main(argv: list[str]) -> int:
    job = HfJob.model_validate_json(argv[0])
    print(measure(job).model_dump_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
