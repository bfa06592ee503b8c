"""keep-prompt: an eviction policy in 30 lines (docs/kv-editing.md). The prompt, an instruction the output must
keep following, is never evicted; of the generated rows only the last ``window`` stay, so the KV memory of a long
generation stays flat. Greedy; until its first eviction its tokens are text-completion's.

    pie run examples/keep_prompt.py -- --prompt "Count: 1, 2, 3," --max-tokens 200 --window 64
"""

from __future__ import annotations

from pydantic import BaseModel

import inferlet


class Args(BaseModel):
    prompt: str
    max_tokens: int = 64
    window: int = 64  # generated rows kept beside the prompt


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    prompt = model.tokenizer.encode_prompt(args.prompt)
    ws = model.working_set()
    ids, out, evicted = prompt, [], 0
    for _ in range(args.max_tokens):
        fp = inferlet.ForwardPass(ws).embed(ids).readout([len(ids) - 1], inferlet.Argmax())
        tokens = (await fp.submit()).tokens  # the pass folds its rows: they are committed now
        assert tokens is not None
        ids = [int(tokens[0])]
        out += ids
        generated = ws.committed - len(prompt)  # the prompt's rows are never evicted, so the rest are output
        if generated >= args.window + model.page_size:  # a page's worth at once: the kept rows move by whole pages
            await ws.evict(ranges=[(len(prompt), ws.committed - args.window)])
            evicted += generated - args.window
    stats = {"evicted_rows": evicted, "kv_rows": ws.committed, "kv_pages_max": ws.pages_max}
    await ws.release()
    return {"text": model.tokenizer.decode(out), "token_ids": out, "stats": stats}
