"""Training an EAGLE head (:mod:`pie_runtime.models.eagle`) with EAGLE-3's training-time test (Li et al.
2025): the draft layer is run ``depth`` times over each training sequence, pass j standing for the j-th
chained step from every position at once, on the features pass j-1 predicted.

Pass j at row p is step j of the chain that starts at row n = p - j. As served, its input is
(û_{p-1} of pass j-1, t_p) (pass 1: the target's own u_{p-1}), and it attends the draft layer's K/V of pass 1
at rows 0..n+1 (what the KV pool holds, plus the chain's first step) and of passes 2..j at rows n+2..p (the
chain's later steps), which is one boolean mask over the passes' keys side by side (:func:`ttt_mask`). Its
loss is against the target at row p: the distillation loss of :mod:`.losses` on the normed output, and a
smooth-L1 regression of the feature (EAGLE's), weighted 0.5^(j-1) as later drafts matter less.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.draft_vocab import draft_logits
from ..models.eagle import EagleConfig, EagleModule, unit_rms
from ..models.llama import LlamaForCausalLM
from ..models.rope import apply_rotary
from .agreement import follows_greedy
from .data import TeacherData
from .loop import Student, TrainSettings, train_student
from .losses import candidates, distill_loss


def ttt_mask(t: int, j: int) -> torch.Tensor:
    """(T, j*T) bool: which keys of passes 1..j (side by side) pass j's query at row p attends."""
    p = torch.arange(t).unsqueeze(1)
    q = torch.arange(t).unsqueeze(0)
    blocks = [q <= p - j + 1] + [q == p - j + i for i in range(2, j + 1)]
    mask = torch.cat(blocks, dim=1)
    mask[:, (j - 1) * t :] |= torch.eye(t, dtype=torch.bool)  # every query sees itself (softmax stays finite)
    return mask


def eagle_passes(
    module: EagleModule, target: LlamaForCausalLM, tokens: torch.Tensor, features: torch.Tensor, depth: int
) -> list[torch.Tensor]:
    """(B, T) tokens and (B, T, H) target features u → ``depth`` (B, T, H) pre-norm outputs, one per pass."""
    layer = module.layer
    a = layer.self_attn
    b, t = tokens.shape
    emb = target.embed(tokens).detach()
    cos, sin = target.rotary.cos_sin(torch.arange(t), emb.dtype)
    cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)
    zero = features.new_zeros(b, 1, features.shape[-1])
    prev = torch.cat([zero, features[:, :-1]], dim=1)
    keys: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    for j in range(1, depth + 1):
        x = module.inputs(prev, emb)
        h = layer.input_layernorm(x).reshape(b * t, -1)
        q = apply_rotary(a.q_proj(h).view(b * t, a.heads, a.head_dim), cos, sin)
        k = apply_rotary(a.k_proj(h).view(b * t, a.kv_heads, a.head_dim), cos, sin)
        v = a.v_proj(h).view(b * t, a.kv_heads, a.head_dim)
        keys.append(k.view(b, t, a.kv_heads, a.head_dim).transpose(1, 2))
        vals.append(v.view(b, t, a.kv_heads, a.head_dim).transpose(1, 2))
        q = q.view(b, t, a.heads, a.head_dim).transpose(1, 2)
        mask = ttt_mask(t, j).to(q.device)
        o = F.scaled_dot_product_attention(
            q, torch.cat(keys, dim=2), torch.cat(vals, dim=2), attn_mask=mask, scale=a.scale, enable_gqa=True
        )
        x = x + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        outs.append(x)
        prev = torch.cat([zero.to(x.dtype), unit_rms(x)[:, :-1]], dim=1)
    return outs


def teacher_features(target: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """The features u = h / w of the teacher's normed hidden states (models/eagle.py)."""
    return hidden.float() / target.model.norm.weight.detach().float()


@torch.no_grad()
def eagle_agreement(
    module: EagleModule,
    target: LlamaForCausalLM,
    data: TeacherData,
    depth: int,
    conditional: bool = False,
    batch: int = 2,
    start: int = 0,
) -> list[float]:
    """Per draft position j = 1..depth, how often the chain's draft j equals the target's greedy token, as
    :func:`~.agreement.mtp_agreement` counts it: a chain from row n counts at position j only where tokens
    n+1..n+j are the target's greedy path (then the teacher-forced passes are the served chain); with
    ``conditional``, only where drafts 1..j-1 agreed too (the acceptance rate at position j). Chains from rows
    before ``start`` are not counted (those rows are context only)."""
    oks = []
    logits = draft_logits(module, target)  # the served head: the draft vocabulary's slice when it has one
    for i in range(0, len(data.tokens), batch):
        ids = data.tokens[i : i + batch]
        outs = eagle_passes(module, target, ids, teacher_features(target, data.hidden[i : i + batch]), depth)
        top = data.top[i : i + batch, :, 0].long()
        oks.append(
            torch.stack([logits(target.model.norm(x.float())).argmax(-1) == top for x in outs], dim=0)  # (depth, b, T)
        )
    ok = torch.cat(oks, dim=1)  # (depth, S, T): pass j's draft at row p is right
    follows = follows_greedy(data)  # (S, T-1): token p+1 is the greedy choice after p
    s, t = data.tokens.shape
    n = t - depth  # chain starts 0..n-1
    valid = torch.ones(s, n, dtype=torch.bool)
    valid[:, :start] = False
    out = []
    for j in range(1, depth + 1):
        valid &= follows[:, j - 1 : j - 1 + n]
        hit = ok[j - 1, :, j : j + n]
        out.append(float(hit[valid].float().mean()) if valid.any() else 0.0)
        if conditional:
            valid &= hit
    return out


class EagleStudent(Student):
    """An example is a whole training sequence; the module's every parameter is trained. ``reg`` weighs the
    feature regression against the distillation loss."""

    name, weight_decay, warmup, evals_per_epoch = "eagle", 0.01, 30, 1

    def __init__(
        self,
        module: EagleModule,
        target: LlamaForCausalLM,
        train: TeacherData,
        heldout: TeacherData,
        settings: TrainSettings,
        reg: float,
    ):
        super().__init__(module, list(module.parameters()), train.tokens.shape[0], train, heldout, settings)
        self.eagle, self.target, self.depth, self.reg = module, target, module.config.depth, reg
        self.features = teacher_features(target, train.hidden).to(torch.bfloat16)

    def loss(self, batch: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        target, data, settings = self.target, self.train, self.settings
        head_w = target.lm_head.weight.detach()
        cand = candidates(data.top[batch], target.config.vocab_size, settings.n_random, gen)
        ids, u = data.tokens[batch], self.features[batch].float()
        h = data.hidden[batch]
        loss = torch.zeros(())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            outs = eagle_passes(self.eagle, target, ids, u, self.depth)
            for j, x in enumerate(outs, start=1):
                xs = x[:, j:].reshape(-1, x.shape[-1])  # rows whose chain starts at n >= 0
                pred = target.model.norm(xs)
                kl = distill_loss(pred, h[:, j:].reshape(-1, h.shape[-1]), head_w, cand, settings.alpha)
                reg = F.smooth_l1_loss(unit_rms(xs).float(), u[:, j:].reshape(-1, u.shape[-1]))
                loss = loss + 0.5 ** (j - 1) * (kl + self.reg * reg)
        return loss

    def agreement(self) -> float:
        return eagle_agreement(self.eagle, self.target, self.probe, 1)[0]


def train_eagle(
    target: LlamaForCausalLM,
    train: TeacherData,
    heldout: TeacherData,
    settings: TrainSettings,
    *,
    depth: int,
    target_name: str,
    target_digest: str,
    reg: float = 1.0,
    init: EagleModule | None = None,
) -> EagleModule:
    """Trains an EAGLE module with ``depth`` chained passes (module docstring). The draft layer starts from
    a copy of the target's last layer (its attention and MLP already read features of this kind).
    ``init``: continue training this module (its depth wins over the argument)."""

    def make() -> EagleStudent:
        if init is not None:
            module = init.float().requires_grad_(True)
        else:
            module = EagleModule(EagleConfig.for_target(target.config, depth, target_name, target_digest))
            last = target.model.layers[-1].state_dict()
            module.layer.load_state_dict({k: v.detach().float().clone() for k, v in last.items()})
            module.float()
        return EagleStudent(module, target, train, heldout, settings, reg)

    return train_student(make, settings).eagle
