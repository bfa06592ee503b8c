"""Which change to a stateless MTP head raises its first-position agreement with the target, at equal data
and steps: the input (the last layer's hidden state alone, or EAGLE-3's fusion of a low, a middle and the
last layer, Li et al. 2025), the loss, the width. A probe for choosing what to build, not a trainer: the
heads it trains are thrown away.

Each variant trains a fresh head (the shipped design, ``pie_runtime/models/mtp.py``: inputs → linear → SwiGLU
blocks → the target's norm and lm head, predicting token t+2 from position t and token t+1) on the same
sequences of the teacher data, with the same seed, steps and schedule, then counts on the held-out windows
how often its argmax equals the target's greedy token, where token t+1 is the target's greedy choice (as a
speculative round sees it), per corpus.

    python examples/drafters/probe_mtp_inputs.py --corpus ../shared/corpus/austen.txt \
        --corpus ../shared/corpus/kjv.txt --seqs 384 --steps 2000 \
        --variant last --variant fused --variant last:ce --variant last:blocks=4

Measured with it on 2 cores (98K tokens, austen / kjv held-out text): after 2,000 steps last .506 / .469,
fused .519 / .496, last:ce .498 / .450, last:blocks=4 .498 / .473; after 4,000 steps last .527 / .498, fused
.508 / .507 (about ±0.015 of noise: ~1,000 counted rows per corpus).

The teacher data plan defaults to the shipped head's (``pie drafter train``'s cache is reused when it
holds the same plan); the probe reads ``--seqs`` sequences spread over it and runs the target's first
layers once more over them for the low and middle residuals.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from pie_runtime import distill
from pie_runtime.drafters import target_digest
from pie_runtime.models.config import ModelConfig
from pie_runtime.models.llama import MLP, LlamaForCausalLM, RMSNorm
from pie_runtime.paths import cache_dir
from pie_runtime.store import DEFAULT_MODEL, load_model


class ProbeHead(nn.Module):
    """inputs (each RMS-normed with its own weight) → linear → ``blocks`` SwiGLU blocks → pre-norm hidden."""

    def __init__(self, n_inputs: int, hidden: int, intermediate: int, blocks: int):
        super().__init__()
        mlp = ModelConfig(
            vocab_size=1, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
            num_attention_heads=1, num_key_value_heads=1, head_dim=1, max_position_embeddings=1,
        )  # fmt: skip
        self.norms = nn.ModuleList(RMSNorm(hidden, 1e-5) for _ in range(n_inputs))
        self.proj = nn.Linear(n_inputs * hidden, hidden, bias=False)
        self.block_norms = nn.ModuleList(RMSNorm(hidden, 1e-5) for _ in range(blocks))
        self.mlps = nn.ModuleList(MLP(mlp) for _ in range(blocks))

    def forward(self, parts: list[torch.Tensor]) -> torch.Tensor:
        x = self.proj(torch.cat([n(p.float()) for n, p in zip(self.norms, parts)], dim=-1))
        for norm, mlp in zip(self.block_norms, self.mlps):
            x = x + mlp(norm(x))
        return x


@torch.inference_mode()
def residuals(target: LlamaForCausalLM, tokens: torch.Tensor, layers: tuple[int, int]) -> list[torch.Tensor]:
    """(S, T) → the residual stream after each of ``layers`` (two (S, T, H) bfloat16 tensors)."""
    low, mid = [], []
    for i in tqdm(range(0, len(tokens), 4), desc="low/mid residuals", unit="seq", unit_scale=4):
        ids = tokens[i : i + 4]
        x = target.embed(ids)
        cos, sin = target.rotary.cos_sin(torch.arange(ids.shape[1]), x.dtype)
        for n, layer in enumerate(target.model.layers[: layers[1] + 1]):
            x = distill.dense_layer(layer, x, cos, sin)  # type: ignore[arg-type]
            if n == layers[0]:
                low.append(x.to(torch.bfloat16))
        mid.append(x.to(torch.bfloat16))
    return [torch.cat(low).clone(), torch.cat(mid).clone()]


class Data:
    """Teacher data with the low/mid residuals: ``inputs`` gives a variant's inputs at (sequence, position)."""

    def __init__(self, target: LlamaForCausalLM, data: distill.TeacherData, layers: tuple[int, int]):
        self.target, self.data = target, data
        self.low, self.mid = residuals(target, data.tokens, layers)

    def inputs(self, fused: bool, si: torch.Tensor, ti: torch.Tensor) -> list[torch.Tensor]:
        e = self.target.embed(self.data.tokens[si, ti + 1]).detach()
        h = self.data.hidden[si, ti]
        return [self.low[si, ti], self.mid[si, ti], h, e] if fused else [h, e]


def parse_variant(text: str) -> dict:
    """``last`` or ``fused``, then ``:``-separated options: ``ce`` (+ cross-entropy on the greedy token),
    ``mse=0`` (no hidden-state term), ``blocks=N``."""
    name, *opts = text.split(":")
    if name not in ("last", "fused"):
        raise SystemExit(f"variant {text!r}: the input is 'last' or 'fused'")
    v = {"name": text, "fused": name == "fused", "ce": False, "mse": 1.0, "blocks": 2}
    for o in opts:
        key, _, val = o.partition("=")
        if key == "ce":
            v["ce"] = True
        elif key in ("mse", "blocks") and val:
            v[key] = float(val) if key == "mse" else int(val)
        else:
            raise SystemExit(f"variant {text!r}: unknown option {o!r}")
    return v


def train(v: dict, target: LlamaForCausalLM, data: Data, steps: int, lr: float, seed: int) -> ProbeHead:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    h = target.config.hidden_size
    head = ProbeHead(4 if v["fused"] else 2, h, target.config.intermediate_size, v["blocks"])
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    s, t = data.data.tokens.shape
    rows = torch.arange(s).repeat_interleave(t - 2), torch.arange(t - 2).repeat(s)
    head_w = target.lm_head.weight.detach()
    for step in tqdm(range(steps), desc=v["name"], unit="step"):
        scale = min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * max(scale, 0.05)
        b = torch.randint(0, len(rows[0]), (256,), generator=gen)
        si, ti = rows[0][b], rows[1][b]
        cand = distill.candidates(data.data.top[si, ti + 1], target.config.vocab_size, 1024, gen)
        pred = target.model.norm(head(data.inputs(v["fused"], si, ti)))
        loss = distill.distill_loss(pred, data.data.hidden[si, ti + 1], head_w, cand, v["mse"])
        if v["ce"]:
            greedy = torch.searchsorted(cand, data.data.top[si, ti + 1, 0].long())  # cand is sorted
            loss = loss + F.cross_entropy(pred.float() @ head_w[cand].T, greedy)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
    return head.eval().requires_grad_(False)


@torch.no_grad()
def agreement(head: ProbeHead, fused: bool, target: LlamaForCausalLM, data: Data, groups: int) -> list[float]:
    """First-position agreement on each of ``groups`` equal runs of sequences (one per corpus, in order)."""
    tokens, top = data.data.tokens, data.data.top
    s, t = tokens.shape
    si, ti = torch.arange(s).repeat_interleave(t - 2), torch.arange(t - 2).repeat(s)
    hit = torch.cat(
        [
            target.logits(target.model.norm(head(data.inputs(fused, si[i : i + 4096], ti[i : i + 4096])))).argmax(-1)
            == top[si[i : i + 4096], ti[i : i + 4096] + 1, 0].long()
            for i in range(0, len(si), 4096)
        ]
    )
    counted = distill.follows_greedy(data.data)[:, : t - 2].reshape(-1)  # token t+1 is the greedy choice
    per = s // groups
    return [float(hit[counted & (si // per == g)].float().mean()) for g in range(groups)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--corpus", action="append", required=True)
    p.add_argument("--tokens", type=int, default=393216, help="the teacher data plan's corpus tokens")
    p.add_argument("--gen-tokens", type=int, default=65536, help="... and the target's own continuations")
    p.add_argument("--heldout-tokens", type=int, default=2048, help="held-out tokens per corpus")
    p.add_argument("--seqs", type=int, default=384, help="training sequences read, spread over the plan's")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--layers", default="2,14", help="the low and middle layers (0-based) of the fused input")
    p.add_argument("--variant", action="append", help="last | fused, with :ce :mse=0 :blocks=N (repeatable)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    variants = [parse_variant(v) for v in args.variant or ["last", "fused"]]
    low, mid = (int(x) for x in args.layers.split(","))

    loaded = load_model(args.model)
    target = loaded.llama.requires_grad_(False)
    plan = distill.DataPlan(
        corpora=[Path(c) for c in args.corpus],
        tokens=args.tokens,
        gen_tokens=args.gen_tokens,
        heldout_tokens=args.heldout_tokens,
        teacher_dtype="bfloat16" if distill.bf16_is_fast() else "float32",
    )
    train_all, held = distill.build_teacher_data(
        target, loaded.tokenizer_path, plan, cache_dir("distill"), target_digest(loaded.manifest)
    )
    pick = torch.linspace(0, len(train_all.tokens) - 1, min(args.seqs, len(train_all.tokens))).round().long()
    sub = distill.TeacherData(train_all.tokens[pick], train_all.hidden[pick], train_all.top[pick])
    train_data, held_data = Data(target, sub, (low, mid)), Data(target, held, (low, mid))

    names = [Path(c).stem for c in args.corpus]
    print(f"{sub.num_tokens} training tokens, {args.steps} steps of 256; first-position agreement on held-out text")
    print(f"{'variant':<24}" + "".join(f"{n:>10}" for n in names) + f"{'minutes':>10}")
    for v in variants:
        t0 = time.monotonic()
        head = train(v, target, train_data, args.steps, args.lr, args.seed)
        agree = agreement(head, v["fused"], target, held_data, len(names))
        minutes = (time.monotonic() - t0) / 60
        print(f"{v['name']:<24}" + "".join(f"{a:>10.3f}" for a in agree) + f"{minutes:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
