"""`pie serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one engine and N inferlet hosts.

    pie serve --model NAME [--http 127.0.0.1:8000] [--listen ADDR --token @FILE] [--api-key @FILE ...]
              [--workers N] [--engines N [--ray-address auto|HOST:PORT] [--engine-cpus C]]
              [--inferlets DIR ...] [--draft-lookup NGRAM:K | --draft-model NAME:K | --draft-mtp K |
                                     --draft-suffix K[:ROWS] [--suffix-index FILE]]
              [--prompt-cache-dir DIR] [--allow-upload] [--share-prefix-cache] [--open-metrics]
              [--stream-stall-timeout S] [--key-concurrent N --key-tokens-per-minute N --key-kv-pages N
                                          --key-kv-memory SIZE --key-cache-mib N]
              [--drain-timeout S] [--no-engine-restart | --engine-max-restarts N --engine-restart-window S]
              [engine options]

Tenants (docs/security.md): each API key's uploads, prompt caches, cached prefixes and runs are its own;
uploads run per key in a bubblewrap sandbox, and without one ``--allow-upload`` refuses to start. Secrets come
from ``@FILE`` or the environment (``$PIE_API_KEYS``, ``$PIE_ENGINE_TOKEN``), never argv (a literal is warned
about).

Order: the model and the speculation policy are checked from the store first, and a policy that cannot run
ends the command (exit 2, the refusal on stderr) before the HTTP listener binds; so does a file in ``--inferlets
DIR`` with a shipped inferlet's name. A custom inferlet that takes the completion arguments is served as the
model ``MODEL:NAME`` (``serve/custom_models.py``; every flag: docs/serving.md). Then the listener binds and
the engine and hosts start in the background (``/health`` is 503 until they are up; "pie serve ready on URL"
is printed when they are). SIGTERM stops accepting, lets running requests finish for ``--drain-timeout``
seconds, cancels the rest, and stops the hosts and the engine.

When the engine process dies, the runs in flight fail at once with 503 ``engine_lost`` and a new engine is
started (with a backoff; at most ``--engine-max-restarts`` within ``--engine-restart-window`` seconds), without
restarting `pie serve`; ``/health`` reports the engine's state, restarts and last exit (``serve/engine_life.py``).
Single engine only: under ``--engines N`` Ray restarts engine actors and the router fails a lost one's runs.

``--engines N`` (or ``--ray-address``) serves N engine replicas as Ray actors behind the cache-aware router
(``pie_runtime/cluster/``); Ray is imported only then.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .engine import add_engine_options

if TYPE_CHECKING:
    from ..serve.app import ServerConfig
    from ..serve.auth import Quotas
    from ..serve.backend import Backend, EngineSpec, Uploads


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", default=None, help="a model in the store (default: the default model)")
    p.add_argument("--http", default="127.0.0.1:8000", help="HOST:PORT the HTTP server binds (default loopback)")
    p.add_argument("--listen", default=None, help="also expose the engine on this address (tcp needs --token)")
    p.add_argument("--token", default=None, help="the engine's tcp token: @FILE, else $PIE_ENGINE_TOKEN")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a Bearer key (repeatable): @FILE of one key a line; also $PIE_API_KEYS. A literal is warned about",
    )
    p.add_argument("--workers", type=int, default=1, help="inferlet host processes (per engine)")
    p.add_argument(
        "--engines", type=int, default=1, help="engine replicas as Ray actors behind a cache-aware router (needs [ray])"
    )
    p.add_argument(
        "--ray-address", default=None, help="a running Ray cluster (auto or HOST:PORT); default: a local instance"
    )
    p.add_argument("--engine-cpus", type=float, default=1.0, help="CPUs Ray reserves for each engine actor")
    p.add_argument("--inferlets", type=Path, action="append", default=[], help="a folder of custom inferlets")
    policy = p.add_mutually_exclusive_group()
    policy.add_argument("--draft-lookup", metavar="NGRAM:K", default=None, help="prompt-lookup speculation")
    policy.add_argument("--draft-model", metavar="NAME:K", default=None, help="draft-model speculation")
    policy.add_argument("--draft-mtp", metavar="K", default=None, help="MTP-head speculation")
    policy.add_argument(
        "--draft-suffix",
        metavar="K[:ROWS]",
        default=None,
        help="suffix decoding: drafts from this request and a per-host store of earlier outputs (ROWS: token trees)",
    )
    p.add_argument("--suffix-index", metavar="FILE", default=None, help="a static index the suffix store starts from")
    _add_tenant_options(p)
    p.add_argument(
        "--no-engine-restart",
        action="store_true",
        help="when the engine dies, stay unhealthy (503) instead of starting a new one",
    )
    p.add_argument(
        "--engine-max-restarts", type=int, default=5, help="engine restarts allowed within --engine-restart-window"
    )
    p.add_argument("--engine-restart-window", type=float, default=300.0, help="seconds (see --engine-max-restarts)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    p.add_argument("--max-n", type=int, default=16, help="the largest n a request may ask for")
    p.add_argument("--max-tokens", type=int, default=4096, help="the most tokens a request may generate")
    p.add_argument("--max-running", type=int, default=64, help="runs in hosts at once; later ones wait")
    p.add_argument("--max-waiting", type=int, default=512, help="waiting requests past which new ones get 503")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    p.add_argument("--chat-template", type=Path, default=None, help="a Jinja chat template file (default: the model's)")
    p.add_argument(
        "--prompt-cache-dir",
        type=Path,
        default=None,
        help="a folder of saved prompt caches: requests save and start from them by name (off without it)",
    )
    p.add_argument(
        "--embedding-pooling",
        choices=["mean", "last"],
        default="mean",
        help="how /v1/embeddings pools the final hidden states (a request's `pooling` overrides it)",
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: NAME)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    add_engine_options(p)
    p.set_defaults(func=serve)


def _add_tenant_options(p) -> None:
    """Keys' quotas, uploads' sandbox limits and what keys share (serve/auth.py, serve/sandbox.py)."""
    p.add_argument("--keys", type=Path, default=None, help="JSON file of keys and their quotas (auth.py)")
    p.add_argument("--key-concurrent", type=int, default=None, help="default quota: runs in flight per key")
    p.add_argument("--key-tokens-per-minute", type=int, default=None, help="default quota: tokens a minute per key")
    p.add_argument("--key-kv-pages", type=int, default=None, help="default quota: KV pages held per key")
    p.add_argument(
        "--key-kv-memory",
        default=None,
        help="default quota: bytes of KV held per key, across page groups (64MiB, 1GiB; a bare number is MiB)",
    )
    p.add_argument("--key-cache-mib", type=int, default=None, help="default quota: MiB of saved prompt caches per key")
    p.add_argument("--allow-upload", action="store_true", help="accept inferlet source on POST /v1/inferlets")
    p.add_argument("--upload-memory", type=int, default=4096, help="MiB of address space an upload host gets")
    p.add_argument("--upload-cpu-seconds", type=int, default=600, help="CPU seconds an upload host gets")
    p.add_argument("--upload-open-files", type=int, default=256, help="open files an upload host gets")
    p.add_argument("--upload-processes", type=int, default=64, help="processes and threads a key's uploads get")
    p.add_argument("--upload-scratch", type=int, default=64, help="MiB of private /tmp an upload sandbox gets")
    p.add_argument(
        "--share-prefix-cache",
        action="store_true",
        help="share cached prompt prefixes across API keys (default: each key's own; a hit tells one key "
        "what another sent)",
    )
    p.add_argument("--open-metrics", action="store_true", help="serve /metrics without a key when keys are set")
    p.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=60.0,
        help="seconds a streaming client may not read before its run is cancelled and its slot freed",
    )


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a SIGTERM it drained for is a clean exit (status 0) rather than
        re-raised once the server has stopped."""

        def handle_exit(self, sig: int, frame) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and isinstance(captured, list) and sig in captured:
                captured.remove(sig)

    return Server


def engine_words(args: argparse.Namespace) -> list[str]:
    """The engine's command-line flags from ours (`pie run`'s, plus the scale-out measurements' one)."""
    from .run import engine_args

    words = engine_args(args)
    if getattr(args, "simulate_step_ms", 0.0):
        words += ["--simulate-step-ms", str(args.simulate_step_ms)]
    return words


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--http expects HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def serve(args: argparse.Namespace) -> int:
    from ..serve.app import create_app
    from ..serve.backend import EngineSpec
    from ..serve.policies import PolicyRefused
    from ..store import DEFAULT_MODEL, StoreError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    model = args.model or DEFAULT_MODEL
    try:
        _resolve_secrets(args)
        host, port = _host_port(args.http)
        config, quotas, template = _checked(args, model)
    except PolicyRefused as e:
        print(f"error: speculation policy refused: {e}", file=sys.stderr)
        return 2
    except (StoreError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    models = [model] + ([config.caps.draft_model] if config.caps.draft_model else [])
    try:
        upload_dir, uploads = _uploads(args, list(quotas.keys) or [""])
    except ValueError as e:
        print(f"error: --allow-upload: {e}", file=sys.stderr)
        return 2
    spec = EngineSpec(models, engine_words(args), listen=args.listen, token=args.token)
    try:
        backend = _backend(args, spec, template, uploads)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(backend, config, quotas)
    uv = _uvicorn(app, host, port, args)
    app.router.lifespan_context = _lifespan(backend, uv, f"http://{host}:{port}", model, args.drain_timeout)
    try:
        uv.run()
    finally:
        if upload_dir is not None:
            upload_dir.cleanup()
        if uploads is not None:
            uploads.sandbox.close()
    return 0 if backend.state != "failed" else 1


def _resolve_secrets(args: argparse.Namespace) -> None:
    """API keys and the engine token from @FILE or the environment (secrets.py); literals are warned about."""
    from .secrets import secret, secret_list

    args.api_key = secret_list(args.api_key, "--api-key", "PIE_API_KEYS")
    args.token = secret(args.token, "--token", "PIE_ENGINE_TOKEN")


def _checked(args: argparse.Namespace, model: str) -> tuple[ServerConfig, Quotas, str | None]:
    """The model, the speculation policy and the limits, checked against the store before anything binds: the
    server's config, its keys' quotas and the chat template (None: the model's). Raises what ``serve`` reports."""
    from ..serve.app import ServerConfig
    from ..serve.auth import KeyQuota, Quotas, load_keys, parse_bytes
    from ..serve.custom_models import check_folders
    from ..serve.policies import check_policy, parse_policy
    from ..shipped import ensure_default_model
    from ..store import DEFAULT_MODEL, ModelStore

    if args.listen and args.listen.startswith("tcp://") and not args.token:
        raise ValueError("--listen tcp://... needs --token")
    store = ModelStore()
    if model == DEFAULT_MODEL:
        ensure_default_model(store)
    store.get(model)
    for folder in args.inferlets:
        if not folder.is_dir():
            raise ValueError(f"--inferlets {folder}: no such folder")
    check_folders(args.inferlets)  # a custom file may not take (and so silently replace) a shipped name
    if args.workers < 1:
        raise ValueError("--workers must be at least 1")
    template = args.chat_template.read_text() if args.chat_template else None
    policy = parse_policy(args.draft_lookup, args.draft_model, args.draft_mtp, args.draft_suffix, args.suffix_index)
    caps = check_policy(store, model, policy)
    default = KeyQuota(
        concurrent=args.key_concurrent,
        tokens_per_minute=args.key_tokens_per_minute,
        kv_pages=args.key_kv_pages,
        kv_bytes=None if args.key_kv_memory is None else parse_bytes(args.key_kv_memory),
        cache_bytes=None if args.key_cache_mib is None else args.key_cache_mib << 20,
    )
    keys = dict.fromkeys(args.api_key, default)  # an --api-key key has the default quotas (--key-*)
    if args.keys:
        keys.update(load_keys(args.keys))
    config = ServerConfig(
        policy=policy,
        caps=caps,
        max_n=args.max_n,
        max_tokens=args.max_tokens,
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        served_name=args.served_model_name,
        prompt_cache_dir=_prompt_cache_dir(args.prompt_cache_dir),
        share_prefix_cache=args.share_prefix_cache,
        open_metrics=args.open_metrics,
        stream_stall_timeout=args.stream_stall_timeout,
        embedding_pooling=args.embedding_pooling,
    )
    return config, Quotas(keys, default), template


def _prompt_cache_dir(folder: Path | None) -> Path | None:
    """``--prompt-cache-dir``, made if missing and resolved (the hosts get absolute paths)."""
    if folder is None:
        return None
    folder = folder.expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _uploads(args: argparse.Namespace, keys: list[str]) -> tuple[tempfile.TemporaryDirectory | None, Uploads | None]:
    """With --allow-upload: the folder uploaded inferlets go to (removed when the server stops), the limits
    of the hosts that run them and their sandbox, checked to start here, for ``keys`` (the API keys, or the
    anonymous ``""``); else (None, None). ValueError saying why uploads cannot be served safely."""
    from ..serve.backend import Uploads
    from ..serve.limits import HostLimits
    from ..serve.sandbox import Sandbox, SandboxUnavailable

    if not args.allow_upload:
        return None, None
    if args.token:
        raise ValueError("the engine's token would be within reach of uploaded code; uploads need no --token")
    if args.engines > 1 or args.ray_address:
        raise ValueError("uploaded inferlets are sandboxed on one engine only, not under --engines")
    sandbox = Sandbox(scratch_bytes=args.upload_scratch << 20)
    try:
        sandbox.probe()
    except SandboxUnavailable as e:
        sandbox.close()
        raise ValueError(f"no sandbox for uploaded code: {e}") from None
    folder = tempfile.TemporaryDirectory(prefix="pie-uploads-")
    limits = HostLimits(
        address_space_bytes=args.upload_memory << 20,
        cpu_seconds=args.upload_cpu_seconds,
        open_files=args.upload_open_files,
        processes=args.upload_processes,
        clean_env=True,
    )
    return folder, Uploads(Path(folder.name), limits, sandbox, keys)


def _backend(args: argparse.Namespace, spec: EngineSpec, template: str | None, uploads: Uploads | None) -> Backend:
    """One engine and its hosts, or with --engines N (or --ray-address) N engines as Ray actors behind the
    cache-aware router; ValueError when Ray is missing or --listen asks for what replicas cannot do."""
    from ..serve.backend import Backend
    from ..serve.engine_life import RestartPolicy

    common = dict(workers=args.workers, inferlet_dirs=list(args.inferlets), chat_template=template, uploads=uploads)
    if not (args.engines > 1 or args.ray_address):
        restart = RestartPolicy(
            enabled=not args.no_engine_restart,
            max_restarts=args.engine_max_restarts,
            window_s=args.engine_restart_window,
        )
        return Backend(spec, **common, restart=restart)
    try:
        from ..cluster.backend import ClusterBackend, init_ray  # imports Ray: only here
    except ImportError as e:
        raise ValueError(f"--engines needs Ray: pip install 'pie-runtime[ray]' ({e})") from None
    if args.listen:
        raise ValueError("--listen is for one engine; --engines' engines listen where Ray puts them")
    # here, in the main thread and before uvicorn installs its signal handlers: Ray's own would otherwise turn
    # SIGTERM into a crash instead of a drain
    init_ray(args.ray_address, max(int(args.engines * args.engine_cpus + 0.999), os.cpu_count() or 1))
    return ClusterBackend(spec, args.engines, ray_address=args.ray_address, engine_cpus=args.engine_cpus, **common)


def _uvicorn(app, host: str, port: int, args: argparse.Namespace):
    """The uvicorn server of ``app``: graceful shutdown waits --drain-timeout seconds."""
    import uvicorn

    from ..serve.streams import Droppable

    config = uvicorn.Config(
        Droppable(app),  # a stalled stream's connection can be dropped (serve/streams.py)
        host=host,
        port=port,
        log_level=args.log_level,
        timeout_graceful_shutdown=max(int(args.drain_timeout), 1),
        lifespan="on",
    )
    return _uvicorn_server_class()(config)


def _lifespan(backend: Backend, uv, url: str, model: str, drain_timeout: float):
    """The app's lifespan: the backend starts in the background once the listener is up (it prints "pie serve
    ready on URL", or stops the server when it cannot start), and closes, draining runs, when it stops."""

    @asynccontextmanager
    async def lifespan(_app):
        async def start() -> None:
            await backend.start()
            if backend.state == "ready":
                print(f"pie serve ready on {url} (model {model})", flush=True)
            else:
                print(f"error: the server could not start: {backend.error}", file=sys.stderr, flush=True)
                uv.should_exit = True

        task = asyncio.create_task(start())
        try:
            yield
        finally:
            await asyncio.wait([task])  # a start under way finishes first, so close() sees what it started
            await backend.close(drain_timeout)

    return lifespan
