"""Builds a served model from the store: weights on the device, a KV pool sized by pages or bytes, and for a
model with recurrent state its state pool of ``state_slots`` slots."""

from __future__ import annotations

import logging
import time

import torch

from ..drafters import check_attached, heldout_acceptance, load_eagle_head, load_mtp_head
from ..models.compiled import compile_decoder
from ..models.families import state_shapes
from ..models.kv_cache import KVCache
from ..models.linear import prepack
from ..models.llama import LlamaForCausalLM
from ..models.state_cache import StateCache
from ..models.weights import ACTIVATION_DTYPE, linear_bytes, load_dtype, prepare_for_serving
from ..protocol.messages import ModelInfo
from ..store import ModelStore, load_model
from .kv_pages import KVPages
from .page_pool import PagePool
from .pass_cost_cache import curve_key, pass_costs
from .pass_costs import measure_eagle_step_ms, measure_mtp_step_ms, warm_up
from .runner import ModelRunner
from .served import ServedModel
from .state_slots import StateSlots

log = logging.getLogger("pie.engine")
DEFAULT_STATE_SLOTS = 64  # working sets of a model with recurrent state at once (--state-slots)
RECURRENT_FOLDS = ("per-row", "replay")  # how a fold of fewer rows than ran brings the state back (engine/fold.py)
DEFAULT_PER_ROW_STATES = 8  # per-row states a working set keeps under --recurrent-fold per-row (--per-row-states)
STATELESS_PAGES = 1 << 16  # page-table entries of a model without attention layers (no bytes behind them)


def build_served_model(
    name: str,
    *,
    device: str = "cpu",
    weights: str = "fp32",
    page_size: int = 16,
    kv_pages: int | None = None,
    kv_bytes: int = 1 << 30,
    store: ModelStore | None = None,
    prepack_lm_head: bool = True,
    pass_cost_rows: int = 0,
    pass_cost_cache: str = "reuse",
    compiled: bool = False,
    state_slots: int = DEFAULT_STATE_SLOTS,
    recurrent_fold: str = "per-row",
    per_row_states: int = DEFAULT_PER_ROW_STATES,
    tensor_parallel: int = 1,
) -> ServedModel:
    """``weights``: the weight format (models/weights.py); ``prepack_lm_head``: a oneDNN-prepacked copy of the
    lm head for multi-row readouts (CPU fp32 only; see models/linear.py); ``pass_cost_rows``: measure pass
    costs up to this many rows (0: don't), reusing a stored curve that still holds (``pass_cost_cache``: reuse,
    refresh or off; engine/pass_cost_cache.py); ``compiled``: torch.compile the decoder as one graph
    (models/compiled.py), and compile it here, before anyone is served; ``state_slots``: working sets a model
    with recurrent state holds at once (each a slot of its state and a snapshot; models without recurrent state
    ignore it);
    ``recurrent_fold``: ``per-row`` keeps the state after each of a speculative fire's first ``per_row_states``
    rows, so a fold of that many rows or fewer is a copy, or ``replay`` restores the snapshot and runs the kept
    rows again (engine/fold.py says why per-row is the default);
    ``tensor_parallel``: shard it over that many ranks (``tp_worker.py``; float32 and the Llama family only,
    served without its MTP or EAGLE head, no prepacked or compiled copies)."""
    if recurrent_fold not in RECURRENT_FOLDS:
        raise ValueError(f"--recurrent-fold is one of {', '.join(RECURRENT_FOLDS)}, not {recurrent_fold!r}")
    if per_row_states < 0:
        raise ValueError(f"--per-row-states must be 0 or more, not {per_row_states}")
    rows = per_row_states if recurrent_fold == "per-row" else 0
    if tensor_parallel > 1 and weights != "fp32":
        raise ValueError(f"--tensor-parallel supports --weights fp32 only, not {weights}")
    if tensor_parallel > 1 and compiled:
        raise ValueError("--tensor-parallel does not combine with --compile")
    store = store or ModelStore()
    recurrent = store.get(name).config.recurrent
    if tensor_parallel > 1 and recurrent:
        raise ValueError(
            f"--tensor-parallel supports the Llama family only: {name} carries recurrent state "
            f"({store.get(name).config.family})"
        )
    if weights in ("int8", "int4") and recurrent:
        # no int layers for these families yet: the engine's default format must still serve them, exactly
        log.warning("%s carries recurrent state: served in fp32 (the int formats cover the Llama family)", name)
        weights = "fp32"
    torch_dtype = ACTIVATION_DTYPE[weights]
    quantized = weights in ("int8", "int4")  # only these formats build layers from the stored blocks
    loaded = load_model(name, dtype=load_dtype(weights), device=device, store=store, keep_quantized=quantized)
    prepare_for_serving(loaded.model, weights, loaded.quantized)
    # The lm head is where the prepacked copy pays: 3.7 ms vs 2.7 ms at 1 row but 5.4 vs 13.2 at 9 rows
    # (SmolLM2, 2 cores); the layers' matmuls gained too little in a whole pass to be worth their memory.
    packed_bytes = prepack(loaded.model.lm_head) if prepack_lm_head and tensor_parallel == 1 else 0
    cfg = loaded.model.config
    shapes = state_shapes(cfg)
    if shapes and compiled:
        raise ValueError(f"--compile is not supported for {cfg.family} (a model with recurrent state)")
    manifest = loaded.manifest
    check_attached(store, manifest)  # a drafter the target cannot use stops the engine here
    # heads are not sharded: a tensor-parallel engine serves the target without them (mtp_depth 0)
    sharded = tensor_parallel > 1
    mtp = None if sharded else load_mtp_head(store, manifest, loaded.model, torch_dtype, device, weights)
    eagle = None if sharded else load_eagle_head(store, manifest, loaded.model, torch_dtype, device, weights)
    extra = 1 if eagle is not None else 0  # the EAGLE draft layer's K/V live in the same pages
    if kv_pages is None:
        per_page = KVCache.bytes_per_page(cfg, page_size, torch_dtype, extra)
        # pages of a model without attention hold no bytes: the table only bounds a working set's rows
        kv_pages = max(1, kv_bytes // per_page) if per_page else STATELESS_PAGES
    if sharded:
        from .tp_worker import start_tensor_parallel

        assert isinstance(loaded.model, LlamaForCausalLM)  # refused above for the families with recurrent state
        runner, kv = start_tensor_parallel(
            name, loaded.model, tensor_parallel, kv_pages, page_size, device, torch.get_num_threads()
        )
    else:
        kv = KVCache(cfg, kv_pages, page_size, torch_dtype, device, extra_layers=extra)
        states = StateCache(shapes, state_slots, torch.float32, device, rows) if shapes else None
        runner = ModelRunner(loaded.model, kv, torch.device(device), states)
    info = ModelInfo(
        name=manifest.name,
        vocab_size=cfg.vocab_size,
        max_positions=cfg.max_position_embeddings,
        page_size=page_size,
        bos_token_id=manifest.tokenizer.bos_token_id,
        eos_token_ids=list(manifest.tokenizer.eos_token_ids),
        chat_template=manifest.tokenizer.chat_template,
        drafters=[d.model_dump() for d in manifest.drafters],
        mtp_depth=mtp.depth if mtp is not None else 0,
        mtp_acceptance=heldout_acceptance(mtp.module.config.training) if mtp is not None else [],
        eagle_depth=eagle.depth if eagle is not None else 0,
        eagle_acceptance=heldout_acceptance(eagle.module.config.training) if eagle is not None else [],
        prepacked_bytes=packed_bytes,
        weights=weights,
        weight_bytes=linear_bytes(loaded.model),
        family=cfg.family,
        recurrent=cfg.recurrent,
        state_slots=state_slots if shapes else 0,
        state_bytes=StateCache.bytes_per_slot(shapes) if shapes else 0,
        recurrent_fold=(recurrent_fold if rows else "replay") if shapes else "",
        per_row_states=rows if shapes else 0,
        state_granule=cfg.state_granule,
    )
    runner.mtp = mtp
    runner.eagle = eagle
    if compiled:
        assert isinstance(loaded.model, LlamaForCausalLM)  # refused above for the families with recurrent state
        t0 = time.perf_counter()
        compile_decoder(loaded.model)
        warm_up(runner, kv_pages)
        info.compile_s = round(time.perf_counter() - t0, 1)
    costs_from = ""
    if pass_cost_rows:
        key = curve_key(manifest, weights, torch.device(device), pass_cost_rows, page_size, compiled, tensor_parallel)
        info.pass_cost_ms, costs_from = pass_costs(runner, kv_pages, key, pass_cost_cache)
        info.mtp_step_ms = measure_mtp_step_ms(runner)
        info.eagle_step_ms = measure_eagle_step_ms(runner, kv_pages)
    return ServedModel(
        name=manifest.name,
        info=info,
        runner=runner,
        pages=KVPages(PagePool(kv_pages), page_size, runner.copy_pages, runner.copy_slots),
        tokenizer_json=loaded.tokenizer_path.read_text(),
        states=StateSlots(state_slots, runner, rows) if shapes else None,
        pass_costs_from=costs_from,
    )
