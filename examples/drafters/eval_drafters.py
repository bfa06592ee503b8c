"""Measures drafters against their target on held-out text (the last 5% of each corpus file, which
`pie drafter train` never trains on): per draft position j = 1..K, how often draft j equals the target's
greedy choice, given that drafts 1..j-1 did (the acceptance rate of a speculative round), and for MTP also
unconditionally.

Two kinds of held-out rows per corpus:
- text: the corpus's own held-out tokens, teacher-forced (the target's greedy token after each position);
- greedy: the target's own greedy continuations of held-out prompts, i.e. exactly what a speculative
  decoder drafts against;
- chat (a model with a chat template): its greedy replies to chat requests about held-out passages
  (``distill.CHAT_REQUESTS``, as `pie drafter train --chat-rounds` builds them from training passages).

and, for a model with a chat template, once: open, its greedy replies to open requests about held-out topics
(``distill.open_requests``, as `pie drafter train --open-rounds` builds them from the other topics), the
kind of request most chats make and the one a head trained on passages drafts worst.

    python examples/drafters/eval_drafters.py --mtp pie_runtime/assets/drafters/smollm2-135m-mtp.safetensors \
        --eagle smollm2-135m-eagle.safetensors --draft smollm2-draft --corpus austen.txt --corpus kjv.txt

A head with a reduced draft vocabulary (``--draft-vocab``) is measured through its slice, as it is served.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pie_runtime import distill
from pie_runtime.distill.eagle import eagle_agreement
from pie_runtime.models.eagle import load_eagle
from pie_runtime.models.mtp import MTPHead, load_mtp
from pie_runtime.store import DEFAULT_MODEL, load_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--mtp", default=None)
    p.add_argument("--eagle", default=None, help="an EAGLE head (FILE.safetensors)")
    p.add_argument("--draft", default=None, help="a draft model in the store")
    p.add_argument("--corpus", action="append", required=True)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--text-tokens", type=int, default=2048, help="held-out text tokens per corpus")
    p.add_argument("--prompts", type=int, default=16, help="greedy continuations per corpus")
    p.add_argument("--new", type=int, default=48, help="tokens per greedy continuation")
    p.add_argument("--open-prompts", type=int, default=32, help="replies to open requests (held-out topics)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the table here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(args.model)
    head = MTPHead(load_mtp(Path(args.mtp)), target.llama) if args.mtp else None
    eagle = load_eagle(Path(args.eagle)) if args.eagle else None
    draft = load_model(args.draft).llama if args.draft else None
    k = args.depth
    table = {}
    chat = target.manifest.tokenizer.chat_template
    frame = distill.model_chat_frame(target.tokenizer_path, target.manifest.tokenizer) if chat else None

    def measure(name: str, data: distill.TeacherData, start: int) -> None:
        """Agreement per draft position of every drafter over ``data``'s rows from ``start`` on."""
        row: dict[str, int | list[float]] = {"rows": int(data.tokens[:, start:].numel())}
        if head is not None:
            d = min(k, head.depth)
            row["mtp"] = distill.mtp_agreement(head, data, d, conditional=True, start=start)
            row["mtp_unconditional"] = distill.mtp_agreement(head, data, d, start=start)
        if eagle is not None:
            d = min(k, eagle.config.depth)
            row["eagle"] = eagle_agreement(eagle, target.llama, data, d, conditional=True, start=start)
        if draft is not None:
            row["draft"] = distill.draft_agreement(draft, data, k, start=start)
        table[name] = row
        shown = {n: [round(x, 3) for x in v] if isinstance(v, list) else v for n, v in row.items()}
        print(name, json.dumps(shown), flush=True)

    for corpus in args.corpus:
        _, held = distill.corpus_tokens(target.tokenizer_path, Path(corpus))
        text = distill.teacher_windows(target.llama, distill.spaced_windows(held, args.text_tokens // 256, 256))
        prompts = [w[:32] for w in distill.spaced_windows(held, args.prompts, 64)]
        measure(f"{Path(corpus).stem}/text", text, 0)
        measure(f"{Path(corpus).stem}/greedy", distill.teacher_generations(target.llama, prompts, args.new), 31)
        if frame is not None:  # greedy and chat: from the last prompt token
            n = distill.CHAT_PROMPT_LEN
            requests = distill.chat_requests(
                target.tokenizer_path, frame, distill.spaced_windows(held, args.prompts, n), n
            )
            measure(f"{Path(corpus).stem}/chat", distill.teacher_generations(target.llama, requests, args.new), n - 1)
    if frame is not None and args.open_prompts:
        requests = distill.chat_prompts(
            target.tokenizer_path, frame, distill.open_requests(args.open_prompts, heldout=True)
        )
        longest = max(map(len, requests))  # every reply is measured from here: the shorter prompts' first tokens wait
        measure("open", distill.teacher_replies(target.llama, requests, longest + args.new), longest - 1)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
