"""Builds a served model from the store, one job a step: check the options against the model, load and prepare
its weights in the format, attach its drafter heads, build its runner (a KV pool sized by pages or bytes and, for
a model with recurrent state, its state pool; or the ranks of a tensor-parallel group), describe it to clients
(``ModelInfo``), and compile and time it before anyone is served."""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from ..drafters import check_attached, heldout_acceptance, load_eagle_head, load_mtp_head
from ..heap import release_freed
from ..models import native_lib
from ..models.config import ModelConfig
from ..models.eagle import EagleHead
from ..models.families import state_shapes
from ..models.kv_cache import KVCache
from ..models.linear import prepack
from ..models.llama import LlamaForCausalLM
from ..models.mtp import MTPHead
from ..models.native_model import NativeLlama
from ..models.native_model import unsupported as native_unsupported
from ..models.state_cache import StateCache
from ..models.weights import ACTIVATION_DTYPE, linear_bytes, load_dtype, prepare_for_serving
from ..native_load import NATIVE_FORMATS, load_native
from ..protocol.messages import ModelInfo
from ..store import LoadedModel, Manifest, ModelStore, load_model
from .kv_pages import KVPages
from .options import ServeOptions
from .page_pool import PagePool
from .pass_cost_cache import curve_key, pass_costs
from .pass_costs import measure_eagle_step_ms, measure_mtp_step_ms, warm_up
from .runner import ModelRunner
from .served import ServedModel
from .state_slots import StateSlots
from .tokenizer_text import ascii_json_text

log = logging.getLogger("pie.engine")
STATELESS_PAGES = 1 << 16  # page-table entries of a model without attention layers (no bytes behind them)


def build_served_model(
    name: str, options: ServeOptions | None = None, *, store: ModelStore | None = None
) -> ServedModel:
    """Model ``name`` of ``store`` (default: the user's) served as ``options`` say (engine/options.py)."""
    opts = options or ServeOptions()
    store = store or ModelStore()
    weights = _weights_for(name, store, opts)
    loaded, packed_bytes = _load(name, store, opts, weights)
    mtp, eagle = _heads(store, loaded, opts, weights)
    if eagle is not None and KVCache.layout_of(loaded.model.config, 1, opts.swa_full).sliding:
        raise ValueError(
            f"model {name}: an EAGLE head's draft layer reads every row of page group 0, and this model's sliding "
            "layers keep only their window's pages; serve it with --kv-swa-full"
        )
    shapes = state_shapes(loaded.model.config)
    kv_pages = _kv_pages(loaded, opts, ACTIVATION_DTYPE[weights], eagle is not None)
    runner, kv = _runner(name, loaded, opts, weights, kv_pages, eagle is not None)
    runner.mtp, runner.eagle = mtp, eagle
    info = _describe(loaded, opts, weights, mtp, eagle, packed_bytes)
    info.kv_bytes = kv.nbytes
    info.page_bytes = kv.nbytes // max(kv.num_pages, 1)
    info.page_windows = list(kv.layout.windows)
    info.layer_windows = list(kv.layout.layer_window)
    info.sliding = any(w is not None for w in kv.layout.layer_window)
    if opts.compiled and not _native(loaded):
        assert isinstance(loaded.model, LlamaForCausalLM)  # refused by _weights_for for the recurrent families
        t0 = time.perf_counter()
        from ..models.compiled import compile_decoder  # torch.compile's import alone holds ~80 MiB: only for --compile

        compile_decoder(loaded.model)
        warm_up(runner, kv_pages)
        info.compile_s = round(time.perf_counter() - t0, 1)
    costs_from = _time_passes(runner, info, loaded, opts, weights, kv_pages)
    release_freed()  # the load's and the timed passes' transients
    rows = opts.kept_row_states
    return ServedModel(
        name=loaded.manifest.name,
        info=info,
        runner=runner,
        pages=KVPages(PagePool(kv_pages), opts.page_size, runner.copy_pages, runner.copy_slots, kv.layout.windows),
        tokenizer_json=ascii_json_text(loaded.tokenizer_path),
        states=StateSlots(opts.state_slots, runner, rows) if shapes else None,
        pass_costs_from=costs_from,
    )


def _weights_for(name: str, store: ModelStore, opts: ServeOptions) -> str:
    """The checks that need the model's config; the format it is served in (``opts.weights``, but fp32 for a
    family with recurrent state asked for an int format)."""
    cfg = store.get(name).config
    if opts.sharded and cfg.recurrent:
        raise ValueError(
            f"--tensor-parallel supports the Llama family only: {name} carries recurrent state ({cfg.family})"
        )
    if state_shapes(cfg) and opts.compiled:
        raise ValueError(f"--compile is not supported for {cfg.family} (a model with recurrent state)")
    if opts.weights in ("int8", "int4", "gguf") and cfg.recurrent:
        # no int layers for these families yet: the engine's default format must still serve them, exactly
        log.warning("%s carries recurrent state: served in fp32 (the int formats cover the Llama family)", name)
        return "fp32"
    return opts.weights


def _load(name: str, store: ModelStore, opts: ServeOptions, weights: str) -> tuple[LoadedModel, int]:
    """The model's weights on the device, prepared for serving in ``weights`` (on the native step where it runs
    them: :func:`torch_kernels_reason`), and the bytes of the lm head's prepacked copy (0: none)."""
    why = torch_kernels_reason(store.get(name).config, weights, opts.device, opts.tensor_parallel)
    if why is None:
        if opts.compiled:
            log.info("%s: the native step is one call a pass; --compile has nothing left to compile", name)
        return load_native(name, weights, store), 0
    log.info("%s: %s on torch's kernels (%s)", name, weights, why)
    quantized = weights in ("int8", "int4", "gguf")  # only these formats build layers from the stored blocks
    loaded = load_model(name, dtype=load_dtype(weights), device=opts.device, store=store, keep_quantized=quantized)
    prepare_for_serving(loaded.model, weights, loaded.quantized)
    # The lm head is where the prepacked copy pays (several rows; at one the plain path stays faster); the layers'
    # matmuls gained too little in a whole pass to be worth their memory (docs/performance.md).
    packed_bytes = prepack(loaded.model.lm_head) if opts.prepack_lm_head and not opts.sharded else 0
    return loaded, packed_bytes


def _heads(
    store: ModelStore, loaded: LoadedModel, opts: ServeOptions, weights: str
) -> tuple[MTPHead | None, EagleHead | None]:
    """The model's MTP and EAGLE heads, once every attached drafter is one the target can use (else the engine
    stops here). Heads are not sharded: a tensor-parallel engine serves the target without them."""
    check_attached(store, loaded.manifest)
    if opts.sharded:
        return None, None
    # the heads of a model on the native step take its float32 hidden states
    dtype, device = torch.float32 if _native(loaded) else ACTIVATION_DTYPE[weights], opts.device
    mtp = load_mtp_head(store, loaded.manifest, loaded.model, dtype, device, weights)
    eagle = load_eagle_head(store, loaded.manifest, loaded.model, dtype, device, weights)
    return mtp, eagle


def _kv_pages(loaded: LoadedModel, opts: ServeOptions, dtype: torch.dtype, eagle: bool) -> int:
    """The KV pool's pages: as asked, or as many as ``opts.kv_bytes`` hold (an EAGLE head's draft layer keeps its
    K/V in the same pages)."""
    if opts.kv_pages is not None:
        return opts.kv_pages
    cfg, extra = loaded.model.config, 1 if eagle else 0
    layout = KVCache.layout_of(cfg, extra, opts.swa_full)
    per_page = KVCache.bytes_per_page(cfg, opts.page_size, dtype, extra, layout)
    # pages of a model without attention hold no bytes: the table only bounds a working set's rows
    return max(1, opts.kv_bytes // per_page) if per_page else STATELESS_PAGES


def _runner(
    name: str, loaded: LoadedModel, opts: ServeOptions, weights: str, kv_pages: int, eagle: bool
) -> tuple[ModelRunner, KVCache]:
    """The runner over its KV pool (and state pool, for a model with recurrent state), or a tensor-parallel
    group's rank 0."""
    cfg, device = loaded.model.config, opts.device
    if opts.sharded:
        from .tp_worker import start_tensor_parallel

        assert isinstance(loaded.model, LlamaForCausalLM)  # refused by _weights_for for the recurrent families
        return start_tensor_parallel(
            name,
            loaded.model,
            opts.tensor_parallel,
            kv_pages,
            opts.page_size,
            device,
            torch.get_num_threads(),
            opts.swa_full,
        )
    dtype = ACTIVATION_DTYPE[weights]
    extra = 1 if eagle else 0
    layout = KVCache.layout_of(cfg, extra, opts.swa_full)
    kv = KVCache(cfg, kv_pages, opts.page_size, dtype, device, extra_layers=extra, layout=layout)
    shapes = state_shapes(cfg)
    states = StateCache(shapes, opts.state_slots, torch.float32, device, opts.kept_row_states) if shapes else None
    return ModelRunner(loaded.model, kv, torch.device(device), states), kv


def _describe(
    loaded: LoadedModel,
    opts: ServeOptions,
    weights: str,
    mtp: MTPHead | None,
    eagle: EagleHead | None,
    packed_bytes: int,
) -> ModelInfo:
    """What clients learn of the served model in ``hello``."""
    manifest, cfg = loaded.manifest, loaded.model.config
    shapes = state_shapes(cfg)
    rows = opts.kept_row_states
    return ModelInfo(
        name=manifest.name,
        vocab_size=cfg.vocab_size,
        max_positions=cfg.max_position_embeddings,
        page_size=opts.page_size,
        bos_token_id=manifest.tokenizer.bos_token_id,
        eos_token_ids=list(manifest.tokenizer.eos_token_ids),
        chat_template=manifest.tokenizer.chat_template,
        add_bos_token=manifest.tokenizer.add_bos_token,
        add_eos_token=manifest.tokenizer.add_eos_token,
        drafters=[d.model_dump() for d in manifest.drafters],
        mtp_depth=mtp.depth if mtp is not None else 0,
        mtp_acceptance=heldout_acceptance(mtp.module.config.training) if mtp is not None else [],
        eagle_depth=eagle.depth if eagle is not None else 0,
        eagle_acceptance=heldout_acceptance(eagle.module.config.training) if eagle is not None else [],
        prepacked_bytes=packed_bytes,
        weights=weights,
        weights_digest=manifest_digest(manifest),
        kv_dtype=str(ACTIVATION_DTYPE[weights]).removeprefix("torch.") if cfg.kv_layers else "",
        weight_bytes=loaded.model.weight_bytes if isinstance(loaded.model, NativeLlama) else linear_bytes(loaded.model),
        kernels=_kernels(loaded, weights, opts),
        family=cfg.family,
        recurrent=cfg.recurrent,
        state_slots=opts.state_slots if shapes else 0,
        state_bytes=StateCache.bytes_per_slot(shapes) if shapes else 0,
        recurrent_fold=(opts.recurrent_fold if rows else "replay") if shapes else "",
        per_row_states=rows if shapes else 0,
        state_granule=cfg.state_granule,
    )


def manifest_digest(manifest: Manifest) -> str:
    """The model's identity across engines and stores: sha256 over its manifest's file digests (weights and
    tokenizer), whatever name it was imported under."""
    h = hashlib.sha256(b"pie-model-files\n")
    for name, digest in sorted(manifest.files.items()):
        h.update(f"{name}\t{digest}\n".encode())
    return h.hexdigest()


def _time_passes(
    runner: ModelRunner, info: ModelInfo, loaded: LoadedModel, opts: ServeOptions, weights: str, kv_pages: int
) -> str:
    """With ``opts.pass_cost_rows``: the pass-cost curve and the heads' step costs into ``info``; returns where
    the curve came from ("" when none was wanted)."""
    if not opts.pass_cost_rows:
        return ""
    device = torch.device(opts.device)
    fmt = f"{weights} ({info.kernels})" if _native(loaded) else weights  # a curve per kernel set
    key = curve_key(
        loaded.manifest, fmt, device, opts.pass_cost_rows, opts.page_size, opts.compiled, opts.tensor_parallel
    )
    info.pass_cost_ms, costs_from = pass_costs(runner, kv_pages, key, opts.pass_cost_cache)
    info.mtp_step_ms = measure_mtp_step_ms(runner)
    info.eagle_step_ms = measure_eagle_step_ms(runner, kv_pages)
    return costs_from


def torch_kernels_reason(cfg, weights: str, device: str, tensor_parallel: int) -> str | None:
    """Why a model of ``cfg`` in ``weights`` runs on torch's kernels rather than the native step (None: native)."""
    if weights not in NATIVE_FORMATS:
        return f"--weights {weights}: the native step runs {' and '.join(NATIVE_FORMATS)}"
    if torch.device(device).type != "cpu":
        return f"the native step runs on CPUs, not {device}"
    if tensor_parallel > 1:
        return "--tensor-parallel shards torch's layers"
    if not isinstance(cfg, ModelConfig):
        return f"the native step runs the Llama family, not {cfg.family}"
    return native_unsupported(cfg) or native_lib.unavailable_reason()


def _kernels(loaded: LoadedModel, weights: str, opts: ServeOptions) -> str:
    if _native(loaded):
        return f"native {native_lib.variant()}"
    return f"torch ({torch_kernels_reason(loaded.model.config, weights, opts.device, opts.tensor_parallel)})"


def _native(loaded: LoadedModel) -> bool:
    return isinstance(loaded.model, NativeLlama)
