"""prompt-cache: a prompt's KV saved to a file by one engine and loaded by another, which goes on decoding as
if it had run the prefill itself. The idea is llama-server's slot save/restore (``POST /slots/{id}?action=save``
and ``restore``) and vLLM's LMCache (KV offloaded out of the engine and brought back); here it is a user program
over two primitives, ``ws.save(path, ...)`` and ``model.load_working_set(path)`` (inferlet/kv_file.py).

    pie run prompt-cache -- --prompt P --save FILE     prefill P but its last token, save those rows (their K/V,
                                                      tokens and positions, the model's digest, weight format
                                                      and KV dtype) and the held-back token; exit
    pie run prompt-cache -- --load FILE [--max-tokens N ...]
                                                      load the rows into a new working set (refused, code
                                                      kv_mismatch, unless this is the same model in the same
                                                      format), embed the held-back token, read its row for the
                                                      first token, then decode as text-completion does
    pie run prompt-cache -- --load FILE --prompt P    continue P instead: keep the loaded rows P starts with (the
                                                      longest common prefix of the file's tokens and P's, as
                                                      llama-server's restore with cache_prompt), drop the rest,
                                                      prefill the rest of P; ``cached_tokens`` says how many rows
                                                      came from the file

The rule: rows keep the positions they were written at and the next row goes at the saved logical length, so a
greedy continuation after a load is text-completion's on the same prompt, token for token. The last prompt token
is held back (``pending`` in the file) because a prefill's last row is what picks the first new token: its
readout must run in the loading engine, with the run's own sampling arguments.

A file of an edited working set (rows evicted before the save) keeps no prefix of its tokens' sequence: with
``--prompt`` it is continued only when P starts with all of its tokens.

Stats: ``kv_pages`` (pages held at the end) and ``kv_pages_max`` (the most held at once), ``loaded_rows``
and ``cached_tokens`` (or ``saved_rows``), ``load_ms`` (or ``prefill_ms`` and ``save_ms``).
"""

from __future__ import annotations

import time

from pydantic import model_validator

import inferlet
from inferlet.text import CompletionArgs, Output, StepSampler


class Args(CompletionArgs):
    prompt: str = ""
    save: str | None = None  # prefill --prompt and save it here, then exit
    load: str | None = None  # continue from a file --save wrote

    @model_validator(mode="after")
    def _one_mode(self) -> Args:
        if (self.save is None) == (self.load is None):
            raise ValueError("give exactly one of --save FILE (with --prompt) and --load FILE")
        if self.save is not None and not self.prompt:
            raise ValueError("--save needs the --prompt to prefill")
        if self.n != 1:
            raise ValueError("prompt-cache decodes one choice (n = 1)")
        return self


async def save(model: inferlet.Model, args: Args, path: str) -> dict:
    """Prefills the prompt but its last token and saves those rows, the last token pending."""
    prompt = args.prompt_ids(model.tokenizer)
    ws = model.working_set()
    try:
        t0 = time.perf_counter()
        if len(prompt) > 1:
            await inferlet.ForwardPass(ws).embed(prompt[:-1]).submit()
        t1 = time.perf_counter()
        saved = await ws.save(path, tokens=prompt[:-1], pending=prompt[-1:])
        t2 = time.perf_counter()
    finally:
        await ws.release()
    return {
        "saved": path,
        "model": saved.meta["model"],
        "weights": saved.meta["weights"],
        "kv_dtype": saved.kv_dtype,
        "stats": {
            "prompt_tokens": len(prompt),
            "saved_rows": saved.rows,
            "pending_tokens": len(saved.pending),
            "prefill_ms": round((t1 - t0) * 1e3, 2),
            "save_ms": round((t2 - t1) * 1e3, 2),
            "kv_pages": ws.pages,
            "kv_pages_max": ws.pages_max,
            "kv_bytes": ws.kv_bytes,
            "kv_bytes_max": ws.kv_bytes_max,
        },
    }


def common_prefix(saved: inferlet.SavedKV, prompt: list[int]) -> int:
    """How many loaded rows ``prompt`` keeps: the longest common prefix of the file's tokens and the prompt's,
    leaving at least the prompt's last token to fire (its row picks the first new token)."""
    n, most = 0, min(len(saved.tokens), len(prompt) - 1)
    while n < most and saved.tokens[n] == prompt[n]:
        n += 1
    if saved.dropped and n < len(saved.tokens):
        raise inferlet.UsageError(
            f"the saved working set had {saved.dropped} rows evicted, so it is no prefix of a longer prompt; the "
            f"prompt must start with all of its {len(saved.tokens)} tokens (it shares {n})"
        )
    return n


async def resume(model: inferlet.Model, args: Args, path: str) -> dict:
    """Loads the saved rows, embeds the pending tokens (or the rest of ``--prompt``) and decodes as
    text-completion does."""
    t0 = time.perf_counter()
    ws, saved = await model.load_working_set(path)
    load_ms = (time.perf_counter() - t0) * 1e3
    try:
        if args.prompt or args.prompt_token_ids:
            prompt = args.prompt_ids(model.tokenizer)
            keep = common_prefix(saved, prompt)
        else:
            prompt = saved.tokens + saved.pending
            keep = len(saved.tokens) - (not saved.pending)  # nothing pending: read the last row again
        window = prompt[keep:]
        if keep < ws.committed:
            await ws.truncate(keep)
    except BaseException:
        await ws.release()
        raise
    out = Output(model.tokenizer, args, ws.position + len(window), model.max_positions)
    sampler = StepSampler(args, prompt)
    try:
        await sampler.step(ws, window, out)
        t_decode = time.perf_counter()
        while not out.done:
            await sampler.step(ws, out.ids[-1:], out)
        decode_s = time.perf_counter() - t_decode
    finally:
        await ws.release()
    return sampler.result(
        out, ws, len(prompt), decode_s, loaded_rows=saved.rows, cached_tokens=keep, load_ms=round(load_ms, 2)
    )


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    if args.save is not None:
        return await save(model, args, args.save)
    assert args.load is not None
    return await resume(model, args, args.load)
