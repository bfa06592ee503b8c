"""``torch.compile`` of the decoder layers' dense work, the engine's ``--compile``.

At batch 1 a step is mostly small ops: in int4 the matmuls of all 30 layers take ~3 ms and the ~60 other
ops a layer (norms, rope, slicing, casts, residual adds, the MLP's gate) cost more than the matmuls
themselves. Inductor fuses them into a few C++ kernels per layer. Attention stays eager
(``torch.compiler.disable``): it writes the paged KV cache and loops over the batch's attention groups,
which vary every step and would make the compiler specialize endlessly; the graph breaks around it.

One compiled graph (``dynamic=True``: any row count) serves every layer, since layers share their code
and inductor takes their weights as inputs. The first passes compile it (tens of seconds on 2 cores, less
with inductor's on-disk cache warm); the engine runs them before it says ready and reports the time.

Measured on the 2-core CPU, int4, a 1-row pass: 12.5 ms compiled against 11.1 ms eager. The 30 graph breaks
a step (one around each layer's attention) cost what the fusion saves, so ``--compile`` is off by default; a
paged-attention custom op that inductor can call would remove the breaks.
"""

from __future__ import annotations

import torch

from .llama import LlamaForCausalLM


def compile_layers(model: LlamaForCausalLM) -> None:
    """Compiles each decoder layer's forward around its (eager) attention, in place."""
    for layer in model.model.layers:
        layer.self_attn.attend = torch.compiler.disable(layer.self_attn.attend)  # type: ignore[method-assign]
        layer.forward = torch.compile(layer.forward, dynamic=True)  # type: ignore[method-assign]
