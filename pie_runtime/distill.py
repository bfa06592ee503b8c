"""Self-distillation of drafters from a frozen target (``pie drafter train``).

Labels are the target's own predictions, never the corpus's next words: for every training position the
target's final hidden state ``h_t`` is cached once (with its top-k token ids), and the student is trained
to reproduce the target's distribution ``softmax(lm_head(h_t))``. The loss at a position is

    KL(p_target || p_student) over a candidate set C  +  alpha * |h_student - h_target|^2 / |h_target|^2

where C is the union of the batch's target top-k tokens and some random ones (the full 49K-way softmax
costs about 30x more on a CPU and adds little: the mass outside the target's top-k is small), and the
hidden-state term pulls the student's final hidden state towards the target's, which matches the whole
distribution at once since the head is shared.

Training data: windows of the corpus (teacher-forced) and, optionally, the target's own greedy
continuations of corpus prompts, which are what a drafter sees when serving.

Precision (``--precision``, default bf16 on CPUs with bf16 units): the teacher pass runs a bfloat16 copy of
the target (its top-k re-ranked with the float32 head) and training runs under bfloat16 autocast with
float32 weights and optimizer state. On the 2-core development machine that is 3-5x more data and steps per
CPU minute than float32, which is what took the drafters past their aims; about 1% of greedy labels differ
from the float32 target's.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .models.context import ForwardContext, Segment
from .models.kv_cache import KVCache
from .models.llama import DecoderLayer, LlamaForCausalLM
from .models.mtp import MTPConfig, MTPHead, MTPModule
from .models.rope import apply_rotary

TOP_K = 8  # target top-k ids cached per position (the candidate set's core)
HELDOUT_FRACTION = 0.05  # the last 5% of every corpus file is never trained on


# ---- dense forward (training and caching; the engine's paged forward is for serving) ---------------


def dense_layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list | None = None) -> torch.Tensor:
    """One decoder layer over (B, T, H) with plain causal attention; same weights as the paged path.
    ``cache``: ``[k, v]`` of the positions before (None at first), extended in place; x then holds the T
    positions after them (T = 1 when the cache is not empty: one decode step)."""
    a = layer.self_attn
    b, t, _ = x.shape
    h = layer.input_layernorm(x).reshape(b * t, -1)
    q = a.q_proj(h).view(b * t, a.heads, a.head_dim)
    k = a.k_proj(h).view(b * t, a.kv_heads, a.head_dim)
    v = a.v_proj(h).view(b, t, a.kv_heads, a.head_dim)
    if a.qk_norm:
        q, k = a.q_norm(q), a.k_norm(k)
    cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)  # (B*T, D)
    q = apply_rotary(q, cos, sin).view(b, t, a.heads, a.head_dim).transpose(1, 2)  # (B, h, T, D)
    k = apply_rotary(k, cos, sin).view(b, t, a.kv_heads, a.head_dim).transpose(1, 2)
    v = v.transpose(1, 2)
    causal = True
    if cache is not None:
        if cache[0] is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            causal = False  # one new position attends to all
        cache[0], cache[1] = k, v
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=a.scale, enable_gqa=True)
    x = x + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def dense_hidden(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """(B, T) token ids from position 0 → (B, T, H) final normed hidden states."""
    x = model.embed(ids)
    cos, sin = model.rotary.cos_sin(torch.arange(ids.shape[1]), x.dtype)
    for layer in model.model.layers:
        x = dense_layer(layer, x, cos, sin)
    return model.model.norm(x)


@torch.inference_mode()
def top_ids(model: LlamaForCausalLM, hidden: torch.Tensor, k: int = TOP_K, chunk: int = 1024,
            fast: bool = False) -> torch.Tensor:
    """(N, H) → (N, k) int32 ids of the target's k most likely tokens, best first. ``fast``: a bfloat16
    product finds 4k candidates, re-ranked with the float32 head (5x cheaper on CPUs with bf16 units;
    the same ids unless a true top-k token falls outside the bf16 top-4k)."""
    out = []
    w = model.lm_head.weight
    w16 = w.to(torch.bfloat16) if fast else None
    for i in range(0, len(hidden), chunk):
        h = hidden[i : i + chunk].float()
        if not fast:
            out.append(model.logits(h).topk(k, dim=-1).indices)
            continue
        cand = (h.to(torch.bfloat16) @ w16.T).topk(4 * k, dim=-1).indices  # (n, 4k)
        exact = torch.einsum("nh,nch->nc", h, w.float()[cand])
        out.append(cand.gather(1, exact.topk(k, dim=-1).indices))
    return torch.cat(out).to(torch.int32)


def teacher_model(model: LlamaForCausalLM, dtype: torch.dtype) -> LlamaForCausalLM:
    """The target for the teacher pass: itself, or a copy with its weights in ``dtype`` (bfloat16: about 3x
    faster on CPUs with bf16 units; 98.9% of greedy labels equal the float32 target's on held-out Austen)."""
    if dtype == next(model.parameters()).dtype:
        return model
    import copy

    return copy.deepcopy(model).to(dtype)


def bf16_is_fast() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 / AMX); else bf16 is emulated and slow."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - an older torch without the probe
        return False


@torch.inference_mode()
def greedy_generate(model: LlamaForCausalLM, prompts: list[list[int]], n_new: int):
    """Batched greedy continuation with a dense KV cache (the prompts share one length, so no paging: on
    a CPU this is many times faster than the paged serving path at batch 32). Returns (tokens (B, P+n_new)
    int64, hidden (B, P+n_new, H)): the hidden state of every token, the last generated one included."""
    ids = torch.tensor(prompts, dtype=torch.int64)
    p = ids.shape[1]
    x = model.embed(ids)
    cos, sin = model.rotary.cos_sin(torch.arange(p + n_new), x.dtype)
    caches = [[None, None] for _ in model.model.layers]

    def run(x, lo, hi):
        for layer, cache in zip(model.model.layers, caches):
            x = dense_layer(layer, x, cos[lo:hi], sin[lo:hi], cache)
        return model.model.norm(x)

    hid = [run(x, 0, p)]
    toks = [ids]
    for step in range(n_new):
        nxt = model.logits(hid[-1][:, -1]).argmax(dim=-1)  # (B,)
        toks.append(nxt.unsqueeze(1))
        hid.append(run(model.embed(nxt).unsqueeze(1), p + step, p + step + 1))
    return torch.cat(toks, dim=1), torch.cat(hid, dim=1)


@torch.inference_mode()
def paged_greedy_generate(model: LlamaForCausalLM, prompts: list[list[int]], n_new: int, page_size: int = 16):
    """Batched greedy continuation through the paged cache (the serving path). Returns (tokens (B, P+n_new) int64, hidden
    (B, P+n_new, H)): the hidden state of every token, the last generated one included. Prompts share
    one length P."""
    cfg = model.config
    b, p = len(prompts), len(prompts[0])
    per = math.ceil((p + n_new) / page_size)
    kv = KVCache(cfg, b * per, page_size, next(model.parameters()).dtype)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
    ids = torch.tensor(prompts, dtype=torch.int64)
    ctx = ForwardContext.build([Segment(tables[i], 0, p) for i in range(b)], page_size)
    hid = [model(model.embed(ids.reshape(-1)), ctx, kv).view(b, p, -1)]
    toks = [ids]
    for step in range(n_new):
        nxt = model.logits(hid[-1][:, -1]).argmax(dim=-1)  # (B,)
        toks.append(nxt.unsqueeze(1))
        ctx = ForwardContext.build([Segment(tables[i], p + step, 1) for i in range(b)], page_size)
        hid.append(model(model.embed(nxt), ctx, kv).view(b, 1, -1))
    return torch.cat(toks, dim=1), torch.cat(hid, dim=1)


# ---- the teacher cache ----------------------------------------------------------------------------


@dataclass
class TeacherData:
    """Sequences with the target's view of them: every position's final hidden state and top-k ids."""

    tokens: torch.Tensor  # (S, T) int64
    hidden: torch.Tensor  # (S, T, H) bfloat16, final normed hidden
    top: torch.Tensor  # (S, T, TOP_K) int32; top[..., 0] is the target's greedy next token

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def cat(self, other: "TeacherData") -> "TeacherData":
        return TeacherData(*(torch.cat([a, b]) for a, b in
                             zip((self.tokens, self.hidden, self.top), (other.tokens, other.hidden, other.top))))


def corpus_tokens(tokenizer_file: Path, corpus: Path) -> tuple[list[int], list[int]]:
    """(train ids, held-out ids) of one corpus file: the held-out part is its last 5% of characters."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    text = Path(corpus).read_text(encoding="utf-8", errors="replace")
    cut = int(len(text) * (1 - HELDOUT_FRACTION))
    cut = text.rfind("\n", 0, cut) + 1 or cut
    return tok.encode(text[:cut]).ids, tok.encode(text[cut:]).ids


def spaced_windows(ids: list[int], n: int, length: int) -> list[list[int]]:
    """``n`` windows of ``length`` tokens spread evenly over ``ids`` (whole corpus, not its first pages)."""
    room = len(ids) - length
    if n <= 0 or room < 0:
        return []
    starts = [round(i * room / max(1, n - 1)) for i in range(n)] if n > 1 else [0]
    return [ids[s : s + length] for s in starts]


def teacher_windows(model: LlamaForCausalLM, windows: list[list[int]], batch: int = 4, bar=None,
                    head: LlamaForCausalLM | None = None) -> TeacherData:
    """``model`` runs the layers (maybe a bf16 copy); ``head`` (default ``model``) ranks the top-k."""
    toks, hid, top = [], [], []
    head = head or model
    fast = head is not model
    with torch.inference_mode():
        for i in range(0, len(windows), batch):
            ids = torch.tensor(windows[i : i + batch], dtype=torch.int64)
            h = dense_hidden(model, ids)
            toks.append(ids)
            hid.append(h.to(torch.bfloat16))
            top.append(top_ids(head, h.reshape(-1, h.shape[-1]), fast=fast).view(*ids.shape, -1))
            if bar is not None:
                bar.update(ids.numel())
    return TeacherData(torch.cat(toks), torch.cat(hid).clone(), torch.cat(top).clone())  # clone: no inference tensors


def teacher_generations(model, prompts: list[list[int]], n_new: int, batch: int = 32, bar=None,
                        head: LlamaForCausalLM | None = None) -> TeacherData:
    """Greedy continuations, ``batch`` prompts in one forward a step (decode reads the weights once per
    step whatever the batch: 32 rows cost little more than one)."""
    toks, hid, top = [], [], []
    head = head or model
    for i in range(0, len(prompts), batch):
        t, h = greedy_generate(model, prompts[i : i + batch], n_new)
        toks.append(t)
        hid.append(h.to(torch.bfloat16))
        top.append(top_ids(head, h.reshape(-1, h.shape[-1]), fast=head is not model).view(*t.shape, -1))
        if bar is not None:
            bar.update(t.numel())
    return TeacherData(torch.cat(toks).clone(), torch.cat(hid).clone(), torch.cat(top).clone())


@dataclass
class DataPlan:
    corpora: list[Path]
    tokens: int  # corpus tokens to train on (split evenly across corpora)
    gen_tokens: int  # tokens of the target's own greedy continuations (prompts included)
    seq_len: int = 256
    heldout_tokens: int = 2048  # per corpus, teacher-forced, for the progress bar
    prompt_len: int = 32
    teacher_dtype: str = "float32"  # the teacher pass's weights: float32 (exact) or bfloat16 (fast)

    def key(self, target_digest: str) -> str:
        files = [(str(Path(c).resolve()), Path(c).stat().st_size) for c in self.corpora]
        blob = json.dumps([target_digest, files, self.tokens, self.gen_tokens, self.seq_len, self.heldout_tokens,
                           self.prompt_len, TOP_K, HELDOUT_FRACTION, 1]
                          + ([self.teacher_dtype] if self.teacher_dtype != "float32" else []))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_teacher_data(model, tokenizer_file: Path, plan: DataPlan, cache_dir: Path | None, target_digest: str,
                       progress: bool = True) -> tuple[TeacherData, TeacherData]:
    """(train, held-out) teacher data, from ``cache_dir`` when an identical plan was cached before."""
    from tqdm import tqdm

    path = cache_dir / f"teacher-{plan.key(target_digest)}.pt" if cache_dir else None
    if path is not None and path.is_file():
        d = torch.load(path)
        return TeacherData(**d["train"]), TeacherData(**d["heldout"])
    splits = [corpus_tokens(tokenizer_file, c) for c in plan.corpora]
    per = plan.tokens // plan.seq_len // len(splits)
    n_held = max(1, plan.heldout_tokens // plan.seq_len)
    gen_new = plan.seq_len - plan.prompt_len
    n_gen = plan.gen_tokens // plan.seq_len // len(splits)
    windows, held, prompts = [], [], []
    for train_ids, held_ids in splits:
        # corpus windows and generation prompts come from disjoint halves of each window slot
        windows += spaced_windows(train_ids, per, plan.seq_len)
        held += spaced_windows(held_ids, n_held, plan.seq_len)
        prompts += [w[-plan.prompt_len :] for w in spaced_windows(train_ids, n_gen, plan.seq_len + 97)]
    total = len(windows) * plan.seq_len + len(held) * plan.seq_len + len(prompts) * plan.seq_len
    teacher = teacher_model(model, getattr(torch, plan.teacher_dtype))
    with tqdm(total=total, desc="target", unit="tok", disable=not progress, smoothing=0.1) as bar:
        heldout = teacher_windows(teacher, held, bar=bar, head=model)
        train = teacher_windows(teacher, windows, bar=bar, head=model)
        if prompts:
            train = train.cat(teacher_generations(teacher, prompts, gen_new, bar=bar, head=model))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"train": vars(train), "heldout": vars(heldout)}, path)
    return train, heldout


# ---- losses -----------------------------------------------------------------------------------------


def candidates(top: torch.Tensor, vocab: int, n_random: int, gen: torch.Generator) -> torch.Tensor:
    """Union of the rows' target top-k ids and ``n_random`` random ids: the vocabulary the loss sees."""
    rand = torch.randint(0, vocab, (n_random,), generator=gen)
    return torch.unique(torch.cat([top.reshape(-1).long(), rand]))


def distill_loss(student_h: torch.Tensor, teacher_h: torch.Tensor, head_w: torch.Tensor, cand: torch.Tensor,
                 alpha: float) -> torch.Tensor:
    """student_h, teacher_h: (N, H) final normed hidden; head_w: (V, H) the shared lm head."""
    w = head_w[cand]  # (C, H)
    s = student_h.float() @ w.T
    with torch.no_grad():
        p = torch.softmax(teacher_h.float() @ w.T, dim=-1)
    kl = (p * (torch.log(p.clamp_min(1e-12)) - torch.log_softmax(s, dim=-1))).sum(-1).mean()
    th = teacher_h.float()
    mse = ((student_h.float() - th) ** 2).sum(-1).mean() / (th**2).sum(-1).mean()
    return kl + alpha * mse


def _schedule(opt, lr: float, step: int, total: int, warmup: int = 50, elapsed: float = 0.0,
              max_seconds: float | None = None) -> None:
    """Linear warm-up, then cosine decay to 5% over the run. The run's progress is the larger of its step
    share and, under a time limit, its time share: a run cut by ``--minutes`` still ends at a low rate
    (before, a time-capped run stopped at its peak rate and kept the noisy weights of that moment)."""
    progress = step / max(1, total)
    if max_seconds:
        progress = max(progress, elapsed / max_seconds)
    scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    for g in opt.param_groups:
        g["lr"] = lr * max(scale, 0.05)


# ---- MTP ------------------------------------------------------------------------------------------------


@torch.no_grad()
def follows_greedy(data: TeacherData) -> torch.Tensor:
    """(S, T-1) bool: token t+1 of the data is the target's greedy choice after position t (always true
    on the target's own greedy continuations; on corpus text only where the text agrees with it)."""
    return data.tokens[:, 1:] == data.top[:, :-1, 0].long()


@torch.no_grad()
def mtp_agreement(head: MTPHead, data: TeacherData, depth: int, conditional: bool = False,
                  start: int = 0) -> list[float]:
    """Per draft position j = 1..depth, how often the chained MTP draft equals the target's greedy token.

    At position t the chain starts from h_t and token t+1 (the readout's column 0 when the data follows
    the target's greedy choice) and feeds each draft to the next step, as served. Draft j is compared with
    the target's greedy choice after position t+j, counted only where tokens t+1..t+j are the target's
    greedy path (so the comparison is what a speculative round would see). ``conditional``: only count
    rows whose drafts 1..j-1 agreed too (the acceptance rate at position j). Positions before ``start``
    are context only."""
    if start:
        data = TeacherData(data.tokens[:, start:], data.hidden[:, start:], data.top[:, start:])
    s, t = data.tokens.shape
    n = t - depth - 1
    if n <= 0:
        return [0.0] * depth
    h = data.hidden[:, :n].reshape(-1, data.hidden.shape[-1]).float()
    first = data.tokens[:, 1 : n + 1].reshape(-1)
    chunks = [head.draft(h[i : i + 2048], first[i : i + 2048], depth)[0] for i in range(0, len(h), 2048)]
    drafts = torch.cat(chunks)  # (S*n, depth)
    follows = follows_greedy(data)
    valid = torch.ones_like(first, dtype=torch.bool)
    out = []
    for j in range(1, depth + 1):
        valid &= follows[:, j - 1 : j - 1 + n].reshape(-1)
        ok = drafts[:, j - 1] == data.top[:, j : j + n, 0].reshape(-1).long()
        out.append(float(ok[valid].float().mean()) if valid.any() else 0.0)
        if conditional:
            valid &= ok
    return out


def train_mtp(target: LlamaForCausalLM, train: TeacherData, heldout: TeacherData, *, depth: int, epochs: float,
              target_name: str, target_digest: str, intermediate: int | None = None, blocks: int = 2,
              batch: int = 256, lr: float = 1e-3, alpha: float = 1.0, n_random: int = 1024, seed: int = 0,
              progress: bool = True, max_seconds: float | None = None, bf16: bool = False,
              init: MTPModule | None = None) -> MTPModule:
    """Trains one MTP module reused ``depth`` times (step j: the previous step's output hidden and the
    data's token, teacher-forced; each step's loss against the target at that position). ``bf16``: the
    forward under bfloat16 autocast (float32 weights and optimizer; about 3x the steps a CPU minute).
    ``init``: continue training this module (its blocks, width and depth win over the arguments)."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    cfg = target.config
    module = init if init is not None else MTPModule(MTPConfig(
        hidden_size=cfg.hidden_size, intermediate_size=intermediate or cfg.intermediate_size, num_blocks=blocks,
        depth=depth, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps, target=target_name,
        target_digest=target_digest,
    ))  # fmt: skip
    if init is not None:
        module = module.float().requires_grad_(True)
        depth = module.config.depth
    head = MTPHead(module, target)
    s, t = train.tokens.shape
    n = t - depth  # start positions with targets up to t+depth
    rows = torch.arange(s).repeat_interleave(n), torch.arange(n).repeat(s)
    steps_per_epoch = max(1, len(rows[0]) // batch)
    total = max(1, int(epochs * steps_per_epoch))
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(seed)
    head_w = target.lm_head.weight.detach()
    norm, embed = target.model.norm, target.model.embed_tokens
    weights = [0.5**j for j in range(depth)]  # later steps matter less (acceptance is a prefix)
    t0 = time.monotonic()
    bar = tqdm(total=total, desc="mtp", unit="step", disable=not progress)
    probe = TeacherData(heldout.tokens[::4], heldout.hidden[::4], heldout.top[::4])  # progress bar only
    agree = mtp_agreement(head, probe, 1)[0]
    step = 0
    while step < total:
        perm = torch.randperm(len(rows[0]), generator=gen)
        for i in range(0, len(perm) - batch + 1, batch):
            if step >= total or (max_seconds and time.monotonic() - t0 > max_seconds):
                step = total
                break
            si, ti = rows[0][perm[i : i + batch]], rows[1][perm[i : i + batch]]
            module.train()
            h = train.hidden[si, ti].float()
            loss = 0.0
            top = torch.stack([train.top[si, ti + j] for j in range(1, depth + 1)])
            cand = candidates(top, cfg.vocab_size, n_random, gen)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                for j in range(1, depth + 1):
                    e = embed(train.tokens[si, ti + j]).detach()
                    h = norm(module(h, e))
                    loss = loss + weights[j - 1] * distill_loss(h, train.hidden[si, ti + j], head_w, cand, alpha)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            _schedule(opt, lr, step, total, elapsed=time.monotonic() - t0, max_seconds=max_seconds)
            opt.step()
            step += 1
            if step % max(1, steps_per_epoch // 4) == 0 or step == total:
                module.eval()
                agree = mtp_agreement(head, probe, 1)[0]
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", heldout_agree=f"{agree:.3f}")
            bar.update(1)
    bar.close()
    module.eval()
    module.requires_grad_(False)
    return module


# ---- draft model ----------------------------------------------------------------------------------------


def draft_from_target(target: LlamaForCausalLM, layers: list[int]) -> LlamaForCausalLM:
    """A small model with the target's config but only ``layers`` (copied, renumbered), its embedding, head
    and final norm: the starting point of a distilled draft model."""
    from .store import build_model

    n = len(target.model.layers)
    layers = [i % n for i in layers]
    cfg = target.config.model_copy(update={"num_hidden_layers": len(layers)})
    src = target.state_dict()
    state = {k: v for k, v in src.items() if not k.startswith("model.layers.")}
    for new, old in enumerate(layers):
        prefix = f"model.layers.{old}."
        state |= {f"model.layers.{new}.{k[len(prefix):]}": v for k, v in src.items() if k.startswith(prefix)}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return build_model(cfg, {k: v.clone().float() for k, v in state.items()}, torch.float32, "cpu")


@torch.no_grad()
def draft_agreement(draft: LlamaForCausalLM, data: TeacherData, depth: int = 1, batch: int = 4,
                    start: int = 0) -> list[float]:
    """Per draft position j = 1..depth, the acceptance rate of the draft model's greedy drafts: draft j
    agrees with the target's greedy token given that drafts 1..j-1 did. With 1..j-1 accepted the draft
    model has read exactly the target's greedy tokens, so draft j is its teacher-forced argmax at t+j-1,
    compared with the target's greedy token there; rows count only where the data's tokens t+1..t+j-1
    are that greedy path (all rows on the target's own greedy continuations)."""
    oks = []
    for i in range(0, len(data.tokens), batch):
        ids = data.tokens[i : i + batch]
        h = dense_hidden(draft, ids)
        pred = draft.logits(h.reshape(-1, h.shape[-1])).argmax(-1).view(ids.shape)
        oks.append(pred == data.top[i : i + batch, :, 0].long())
    ok = torch.cat(oks)[:, start:]  # (S, T): draft's argmax at t equals the target's
    follows = follows_greedy(data)[:, start:]
    s, t = ok.shape
    n = t - depth
    out = []
    valid = torch.ones(s, n, dtype=torch.bool)
    for j in range(depth):
        if j:
            valid &= follows[:, j - 1 : j - 1 + n]
        hit = ok[:, j : j + n]
        out.append(float(hit[valid].float().mean()) if valid.any() else 0.0)
        valid &= hit
    return out


def train_draft(target: LlamaForCausalLM, train: TeacherData, heldout: TeacherData, *, layers: list[int],
                epochs: float, batch: int = 4, lr: float = 3e-4, alpha: float = 1.0, n_random: int = 1024,
                seed: int = 0, progress: bool = True, max_seconds: float | None = None,
                bf16: bool = False) -> LlamaForCausalLM:
    """Distills a few-layer copy of the target (shared embedding and head stay frozen). ``bf16``: the
    forward under bfloat16 autocast (float32 weights and optimizer)."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    draft = draft_from_target(target, layers)
    trainable = [p for n, p in draft.named_parameters() if n.startswith(("model.layers.", "model.norm."))]
    for p in trainable:
        p.requires_grad_(True)
    s, t = train.tokens.shape
    steps_per_epoch = max(1, s // batch)
    total = max(1, int(epochs * steps_per_epoch))
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(seed)
    head_w = draft.lm_head.weight.detach()
    t0 = time.monotonic()
    bar = tqdm(total=total, desc="draft", unit="step", disable=not progress)
    probe = TeacherData(heldout.tokens[::4], heldout.hidden[::4], heldout.top[::4])  # progress bar only
    agree = draft_agreement(draft, probe)[0]
    step = 0
    while step < total:
        perm = torch.randperm(s, generator=gen)
        for i in range(0, s - batch + 1, batch):
            if step >= total or (max_seconds and time.monotonic() - t0 > max_seconds):
                step = total
                break
            idx = perm[i : i + batch]
            draft.train()
            cand = candidates(train.top[idx], draft.config.vocab_size, n_random, gen)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                h = dense_hidden(draft, train.tokens[idx]).reshape(-1, head_w.shape[1])
                loss = distill_loss(h, train.hidden[idx].reshape(-1, head_w.shape[1]), head_w, cand, alpha)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            _schedule(opt, lr, step, total, warmup=20, elapsed=time.monotonic() - t0, max_seconds=max_seconds)
            opt.step()
            step += 1
            if step % max(1, steps_per_epoch // 2) == 0 or step == total:
                draft.eval()
                agree = draft_agreement(draft, probe)[0]
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", heldout_agree=f"{agree:.3f}")
            bar.update(1)
    bar.close()
    draft.requires_grad_(False)
    return draft.eval()
