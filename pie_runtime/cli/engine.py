"""`pie engine`: run an engine process that serves models from the store on one ZeroMQ address."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from ..engine.options import (
    DEFAULT_MAX_PROGRAMS,
    DEFAULT_PER_ROW_STATES,
    DEFAULT_STATE_SLOTS,
    PASS_COST_CACHE_MODES,
    RECURRENT_FOLDS,
    ServeOptions,
)
from ..models.formats import DEFAULT_WEIGHTS, WEIGHT_FORMATS
from ..protocol.programs import PROGRAM_MEMORY

if TYPE_CHECKING:
    from ..engine.served import ServedModel
    from ..engine.server import EngineServer

DEFAULT_COMPILE = False
LEGACY_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


THREAD_WAITS = ("spin", "short", "passive")
# --thread-wait short: spins before a waiting thread sleeps; enough to cover the waits at a step's barriers (the
# partner arrives within microseconds), not the gap between steps, where the cores go to the inferlet host and
# the server (docs/measurements-http.md)
SHORT_SPINS = 30000


def apply_thread_wait(wait: str) -> None:
    """``passive``: the OpenMP runtime (torch's libgomp, which the native kernels share) puts a thread that waits
    for work, at a barrier or between steps, to sleep at once instead of spinning; ``short``: it spins
    ``SHORT_SPINS`` times first. libgomp reads its policy once, when it loads with torch, so this sets it for this
    process (and the ranks it starts) before torch is imported. ``spin`` leaves the runtime's default (or the
    user's ``$OMP_WAIT_POLICY`` / ``$GOMP_SPINCOUNT``) alone."""
    if wait == "spin":
        return
    if "torch" in sys.modules:  # an engine run in a process that already loaded torch: too late to apply
        logging.getLogger("pie.engine").warning(f"--thread-wait {wait}: torch is already loaded; ignored")
        return
    if wait == "passive":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.environ.pop("GOMP_SPINCOUNT", None)
    else:
        os.environ.pop("OMP_WAIT_POLICY", None)
        os.environ["GOMP_SPINCOUNT"] = str(SHORT_SPINS)


def weights_value(value: str) -> str:
    """One --weights word: FORMAT (every model's default) or MODEL=FORMAT (that model's)."""
    model, sep, fmt = value.rpartition("=")
    if fmt not in WEIGHT_FORMATS or (sep and not model):
        raise argparse.ArgumentTypeError(
            f"--weights takes FORMAT or MODEL=FORMAT with FORMAT one of {', '.join(WEIGHT_FORMATS)}, not {value!r}"
        )
    return value


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"a positive count, not {value}")
    return n


def named_format(args) -> str | None:
    """The format the command line names for every model (the last plain --weights, or the older --dtype's), or
    None: then each model runs in its own default (formats.default_format)."""
    if getattr(args, "dtype", None):
        return LEGACY_DTYPES[args.dtype]
    plain = [w for w in args.weights or [] if "=" not in w]
    return plain[-1] if plain else None


def model_weights(args) -> dict[str, str]:
    """The formats --weights MODEL=FORMAT names per model (the last one wins)."""
    return dict(w.rpartition("=")[::2] for w in args.weights or [] if "=" in w)


def weights_words(args) -> list[str]:
    """--weights as a child engine's command line takes it."""
    named = named_format(args)
    out = ["--weights", named] if named else []
    for model, fmt in model_weights(args).items():
        out += ["--weights", f"{model}={fmt}"]
    return out


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The flags of `pie engine` that `pie run`, `pie serve` and `pie bench` pass on to the engine they start."""
    _add_weight_options(p)
    _add_memory_options(p)
    _add_compute_options(p)


def _add_weight_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--weights",
        action="append",
        type=weights_value,
        default=None,
        metavar="[MODEL=]FORMAT",
        help=f"weight format, one of {', '.join(WEIGHT_FORMATS)} (default {DEFAULT_WEIGHTS}, or gguf for a model "
        "whose GGUF holds kinds int4 would requantize, such as Q4_K_M); the default model's "
        "projections and lm head take fp32 513 MiB, bf16 256, int8 ~130, int4 90 (a GGUF's Q4/Q8 blocks run as "
        "they are, the lm head stays 8-bit); activations are bf16 outside fp32. MODEL=FORMAT (repeatable) serves "
        "one model in its own format; a draft model attached with a format of its own (pie model drafter attach "
        "--weights) is served in that one unless named here",
    )
    p.add_argument("--dtype", choices=list(LEGACY_DTYPES), help=argparse.SUPPRESS)  # the older name of --weights
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_COMPILE,
        help="torch.compile the decoder at start (fewer, fused ops a step; costs start-up time, printed)",
    )
    p.add_argument(
        "--no-prepack",
        dest="prepack",
        action="store_false",
        help="no oneDNN-prepacked lm head copy (saves vocab x hidden x 4 bytes; slower verify windows)",
    )


def _add_memory_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-pages", type=int, default=None, help="KV pool size in pages")
    kv.add_argument("--kv-memory", type=int, default=1024, help="KV pool size in MiB (default 1024)")
    p.add_argument(
        "--no-prefix-cache", dest="prefix_cache", action="store_false", help="no reuse of cached KV prefix pages"
    )
    p.add_argument(
        "--kv-swa-full",
        dest="swa_full",
        action="store_true",
        help="sliding-window layers keep every row (one page group) instead of only their window's pages",
    )
    p.add_argument(
        "--state-slots",
        type=int,
        default=DEFAULT_STATE_SLOTS,
        help="models with recurrent state (mamba, lfm2): working sets held at once, each a state and its "
        f"snapshot (default {DEFAULT_STATE_SLOTS}; printed at start)",
    )
    p.add_argument(
        "--recurrent-fold",
        choices=list(RECURRENT_FOLDS),
        default="per-row",
        help="models with recurrent state: how a fold of fewer rows than a fire ran restores the state. per-row "
        "(default) keeps the state after each of a speculative fire's rows and copies one; replay restores the "
        "state from before the fire and runs the kept rows again (one more forward, less memory)",
    )
    p.add_argument(
        "--per-row-states",
        type=int,
        default=DEFAULT_PER_ROW_STATES,
        help="with --recurrent-fold per-row: states a working set keeps per fire (folds of more rows replay; "
        f"default {DEFAULT_PER_ROW_STATES}; the memory is printed at start)",
    )
    p.add_argument(
        "--program-memory",
        type=int,
        default=PROGRAM_MEMORY >> 20,
        help=f"MiB a program's values may peak at; a program over it is refused (default {PROGRAM_MEMORY >> 20})",
    )
    p.add_argument(
        "--max-programs",
        type=_positive,
        default=DEFAULT_MAX_PROGRAMS,
        help="epilogue programs one client identity holds at once; registering one more evicts its least recently used "
        "program that no queued fire uses (the SDK registers an evicted one again by itself; "
        f"default {DEFAULT_MAX_PROGRAMS})",
    )


def _add_compute_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch-tokens", type=int, default=256, help="rows per step (prefill is chunked to fit)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (of each rank under --tensor-parallel)")
    p.add_argument(
        "--thread-wait",
        choices=THREAD_WAITS,
        default="spin",
        help="how the compute threads wait for work: spin (the OpenMP runtime's default, or $OMP_WAIT_POLICY: "
        "a waiting thread keeps its core a while, the fastest step where the engine has its cores to itself), "
        "short (it spins 30,000 times, then sleeps: a step's barriers still spin, the gaps between steps leave "
        "the cores to the inferlet host and the server; the fastest HTTP stream on an otherwise idle machine) or "
        "passive (it sleeps at once: slower steps on idle cores, but an engine that shares its cores with other "
        "busy processes no longer burns them spinning; docs/measurements-http.md)",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="T",
        help="shard the model over T ranks (torch.distributed: gloo on CPU, NCCL on CUDA); fp32 weights only",
    )
    p.add_argument(
        "--pass-cost-rows",
        type=int,
        default=32,
        help="at start, time passes of 1..N rows for inferlets that size their drafts (0: skip)",
    )
    p.add_argument(
        "--pass-cost-cache",
        choices=PASS_COST_CACHE_MODES,
        default="reuse",
        help="reuse: a curve stored under $PIE_HOME/cache/pass_costs for this machine, model, format and threads,"
        " once its 1-row and widest passes still cost what it says (else measure and store); refresh: measure and"
        " store; off: measure, store nothing (default reuse)",
    )
    # scale-out measurements on few cores: every step also sleeps MS, as if on a device of its own (server.py)
    p.add_argument("--simulate-step-ms", type=float, default=0.0, help=argparse.SUPPRESS)


def register(sub) -> None:
    p = sub.add_parser("engine", help="run an engine process")
    p.add_argument("--model", action="append", default=None, help="a model in the store (repeatable)")
    p.add_argument("--listen", required=True, help="ipc:///path or tcp://host:port (tcp needs --token)")
    p.add_argument(
        "--token", default=None, help="auth token clients must present in hello: @FILE, else $PIE_ENGINE_TOKEN"
    )
    p.add_argument(
        "--also-listen", action="append", default=[], help="another address to bind (repeatable; same --token)"
    )
    p.add_argument(
        "--tenant-listen",
        action="append",
        default=[],
        help="an ipc:// address to bind whose connections are one client identity: they share one set of the "
        "per-client limits (repeatable; pie serve binds one per API key for its upload sandboxes)",
    )
    add_engine_options(p)
    p.set_defaults(func=run_engine)


def run_engine(args) -> int:
    apply_thread_wait(args.thread_wait)
    import torch

    from ..engine.core import EngineCore
    from ..engine.server import EngineServer
    from ..store import StoreError
    from .secrets import secret

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        token = secret(args.token, "--token", "PIE_ENGINE_TOKEN")
        served = _build_models(args)
        core = EngineCore(
            served,
            args.max_batch_tokens,
            args.program_memory << 20,
            prefix_cache=args.prefix_cache,
            max_programs=args.max_programs,
        )
        server = EngineServer(
            core,
            args.listen,
            token,
            simulate_step_s=args.simulate_step_ms / 1000,
            also=args.also_listen,
            tenants=args.tenant_listen,
        )
        broken = _stop_when_a_group_breaks(served, server) if args.tensor_parallel > 1 else []
    except (StoreError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for s in served:
        _print_model(s)
    print(_memory_line(served, args.program_memory), file=sys.stderr, flush=True)
    pools = ", ".join(f"{s.name}: {s.pages.total} pages x {s.info.page_size}" for s in served)
    print(f"pie engine ready on {args.listen} ({pools})", flush=True)
    server.serve_forever()
    if broken:
        print(f"error: the engine stopped: tensor parallelism {broken[0]}", file=sys.stderr)
        return 1
    return 0


def serve_options(args, weights: str) -> ServeOptions:
    """The engine's flags as the options of one served model in format ``weights``."""
    return ServeOptions(
        device=args.device,
        weights=weights,
        compiled=args.compile,
        page_size=args.page_size,
        kv_pages=args.kv_pages,
        kv_bytes=args.kv_memory << 20,
        swa_full=getattr(args, "swa_full", False),
        prepack_lm_head=args.prepack,
        pass_cost_rows=args.pass_cost_rows,
        pass_cost_cache=args.pass_cost_cache,
        state_slots=args.state_slots,
        recurrent_fold=args.recurrent_fold,
        per_row_states=args.per_row_states,
        tensor_parallel=args.tensor_parallel,
    )


def _build_models(args) -> list[ServedModel]:
    """Every model the engine serves (the named ones, then their draft models), each in its format."""
    from ..drafters import served_formats
    from ..engine.build import build_served_model
    from ..shipped import ensure_default_model
    from ..store import DEFAULT_MODEL, ModelStore

    names = args.model or [DEFAULT_MODEL]
    if DEFAULT_MODEL in names:
        ensure_default_model()
    formats = served_formats(ModelStore(), names, named_format(args), model_weights(args))
    if args.tensor_parallel > 1 and len(formats) > 1:
        raise ValueError("--tensor-parallel serves one model (no draft models)")
    return [build_served_model(n, serve_options(args, fmt)) for n, fmt in formats.items()]


def _stop_when_a_group_breaks(served: list[ServedModel], server: EngineServer) -> list[str]:
    """Stops ``server`` when a tensor-parallel group breaks (it cannot run again: the engine is to be started
    anew); the list it returns gets why."""
    from ..engine.tp_worker import TPRunner

    broken: list[str] = []

    def on_broken(why: str) -> None:
        broken.append(why)
        server.stop()

    for s in served:
        if isinstance(s.runner, TPRunner):
            s.runner.group.on_broken = on_broken
    return broken


def _print_model(s: ServedModel) -> None:
    """A served model's start-up lines on stderr: pass costs, weights, recurrent state, prepacked head."""

    def say(line: str) -> None:
        print(f"{s.name}: {line}", file=sys.stderr, flush=True)

    info = s.info
    if info.pass_cost_ms:
        costs = info.pass_cost_ms
        say(
            "pass cost by rows (ms) "
            + " ".join(f"{w}:{costs[w - 1]:.1f}" for w in (1, 2, 4, 8, 16, 32) if w <= len(costs))
        )
        say(f"pass costs {s.pass_costs_from}")
    compiled = f", decoder compiled in {info.compile_s:.1f} s" if info.compile_s else ""
    say(f"weights {info.weights} ({info.weight_bytes >> 20} MiB of projections and lm head){compiled}")
    say(f"kernels {info.kernels}")
    if info.state_slots:
        per_row = info.per_row_states
        fold = f"fold per-row (up to {per_row} rows, then replay)" if per_row else "fold by replay"
        kept = f" and {per_row} per-row states" if per_row else ""
        say(
            f"recurrent state ({info.family}), {info.state_slots} slots x "
            f"{(2 + per_row) * info.state_bytes / 2**20:.2f} MiB (state, snapshot{kept}); {fold}; prefix cache off"
        )
    if info.prepacked_bytes:
        say(f"lm head prepacked for multi-row readouts (+{info.prepacked_bytes >> 20} MiB)")


def _memory_line(served: list[ServedModel], program_mib: int) -> str:
    """The engine's memory at start by part: the weights as served, the KV pools as allocated (their pages
    become resident as they fill), the epilogue programs' limit, and the process's resident set."""
    from ..bench.rss import rss_mib

    weights = sum(s.info.weight_bytes for s in served) / 2**20
    kv = sum(s.info.kv_bytes for s in served) / 2**20
    rss = rss_mib()
    rest = f", process RSS {rss:.0f} MiB (weights, touched KV pages, torch, Python)" if rss is not None else ""
    return f"memory: weights {weights:.0f} MiB, KV pool {kv:.0f} MiB allocated, programs up to {program_mib} MiB{rest}"
