"""`pie model import|list|info|remove|verify|drafter`: the model store from the command line. A refusal prints one
`error: ...` line to stderr and exits 1."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from ..models.config import Lfm2Config, MambaConfig
from ..models.formats import WEIGHT_FORMATS
from ..store import DEFAULT_MODEL, PACKAGED, Manifest, ModelStore, StoreError, import_model


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="import, list, inspect and remove models in the store")
    sub = parser.add_subparsers(dest="model_command", required=True)

    p = sub.add_parser("import", help="import a .gguf file, a Hugging Face folder or a packaged model")
    p.add_argument("source", help=f"path to a .gguf file or checkpoint folder, or a packaged alias ({DEFAULT_MODEL})")
    p.add_argument("--name", help="name in the store (default: the alias, file stem or folder name)")
    p.add_argument("--force", action="store_true", help="replace a model already imported under this name")
    p.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="SPEC",
        help="attach a drafter: mtp:FILE, eagle:FILE, draft:MODEL_NAME or a shipped drafter's name (repeatable)",
    )
    p.set_defaults(func=_guarded(_import))

    p = sub.add_parser("list", help="list imported models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_guarded(_list))

    p = sub.add_parser("info", help="show one model's manifest")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_guarded(_info))

    p = sub.add_parser("remove", help="delete a model from the store")
    p.add_argument("name")
    p.set_defaults(func=_guarded(_remove))

    p = sub.add_parser("verify", help="re-hash a model's files against its manifest")
    p.add_argument("name")
    p.set_defaults(func=_guarded(_verify))

    p = sub.add_parser("drafter", help="attach or detach a model's drafters")
    dsub = p.add_subparsers(dest="drafter_command", required=True)
    d = dsub.add_parser("attach", help="attach mtp:FILE, eagle:FILE, draft:MODEL_NAME or a shipped drafter")
    d.add_argument("name", help="the target model")
    d.add_argument(
        "spec", help="mtp:FILE, eagle:FILE, draft:MODEL_NAME, or a shipped drafter's name (smollm2-135m-mtp-corpus)"
    )
    d.add_argument("--as", dest="drafter_name", default=None, help="drafter name (default: file stem or model name)")
    d.add_argument(
        "--weights",
        choices=list(WEIGHT_FORMATS),
        default=None,
        help="draft:MODEL only: serve the draft model in this weight format whatever the engine's --weights",
    )
    d.set_defaults(func=_guarded(_attach))
    d = dsub.add_parser("detach", help="detach a drafter by name")
    d.add_argument("name", help="the target model")
    d.add_argument("drafter", help="the drafter's name (see `pie model info`)")
    d.set_defaults(func=_guarded(_detach))


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except StoreError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1

    return run


def _import(args: argparse.Namespace) -> int:
    from ..drafters import attach, check_spec, parse_spec
    from ..shipped import attach_shipped, shipped_spec

    specs = [shipped_spec(spec) for spec in args.drafter]
    for spec, _ in specs:
        parse_spec(spec)  # a malformed spec is refused before anything is converted
    store = ModelStore()

    def check_drafters(target) -> None:
        for spec, _ in specs:
            check_spec(store, target, spec)

    # the drafters are checked against the new model before it enters the store, so a refusal leaves the
    # store as it was, a model --force would have replaced included
    result = import_model(args.source, name=args.name, force=args.force, store=store, check=check_drafters)
    m = result.manifest
    if not result.imported:
        check_drafters(m)  # attaching to the model already there: all or none
    for spec, shipped_name in specs:
        entry = attach(store, m.name, spec, shipped_name)
        print(f"attached {entry.kind} drafter {entry.name} to {m.name}")
    if args.source in PACKAGED:
        for entry in attach_shipped(store, m.name, args.source):
            print(f"attached the shipped {entry.kind} drafter {entry.name} to {m.name}")
    if result.imported:
        print(f"imported {m.name}: {m.family}, {m.parameters / 1e6:.1f}M parameters, from {m.source}")
    else:
        print(f"{m.name} is already imported (from {m.source}); use --force to replace it")
    return 0


def _attach(args: argparse.Namespace) -> int:
    from ..drafters import attach
    from ..shipped import shipped_spec

    spec, shipped_name = shipped_spec(args.spec)
    entry = attach(ModelStore(), args.name, spec, args.drafter_name or shipped_name, args.weights)
    served = f" (served in {entry.weights})" if entry.weights else ""
    print(f"attached {entry.kind} drafter {entry.name} to {args.name}{served}")
    return 0


def _detach(args: argparse.Namespace) -> int:
    from ..drafters import detach

    entry = detach(ModelStore(), args.name, args.drafter)
    print(f"detached {entry.kind} drafter {entry.name} from {args.name}")
    return 0


def _list(args: argparse.Namespace) -> int:
    manifests = ModelStore().list()
    if args.json:
        print(json.dumps([_summary(m) for m in manifests], indent=2))
        return 0
    if not manifests:
        print(f"no models imported; try `pie model import {DEFAULT_MODEL}`")
        return 0
    from rich import box
    from rich.console import Console
    from rich.table import Column, Table

    table = Table("family", "params", "dtype", "vocab", "context", "drafters", "imported", box=box.SIMPLE_HEAD)
    table.columns.insert(0, Column("name", no_wrap=True))
    for m in manifests:
        s = _summary(m)
        table.add_row(
            m.name,
            m.family,
            f"{m.parameters / 1e6:.1f}M",
            m.dtype,
            str(s["vocab_size"]),
            str(s["context"]),
            str(len(m.drafters)),
            m.imported_at[:10],
        )
    Console(width=max(Console().width, 100)).print(table)  # pipes get 80 columns otherwise
    return 0


def _print_kernels(m) -> None:
    """Which kernel each group of a quantized model's tensors runs on in the native step, in gguf and int4
    (q4 / q8: the 4- / 8-bit kernel on the stored blocks; wx: each part in its own stored kind)."""
    if not m.quantized or isinstance(m.config, (MambaConfig, Lfm2Config)):
        return
    from ..native_load import describe

    for fmt in ("gguf", "int4"):
        print(f"  runs in     --weights {fmt} (native step)")
        for group, how in describe(
            dict(m.quantized), m.config.num_hidden_layers, m.config.tie_word_embeddings, fmt
        ).items():
            print(f"    {group:<10}  {how}")


def _info(args: argparse.Namespace) -> int:
    store = ModelStore()
    m = store.get(args.name)
    if args.json:
        print(json.dumps(m.model_dump(mode="json") | {"path": str(store.path(m.name))}, indent=2))
        return 0
    c = m.config
    print(f"{m.name}  ({store.path(m.name)})")
    print(f"  family      {m.family}")
    print(f"  parameters  {m.parameters:,}")
    print(f"  dtype       {m.dtype}")
    print(f"  quantized   {m.quantized_summary()}  (store format {m.format_version})")
    _print_kernels(m)
    print(f"  vocab       {c.vocab_size:,}")
    print(f"  context     {c.max_position_embeddings:,}")
    if isinstance(c, MambaConfig):
        print(
            f"  shape       {c.num_hidden_layers} state-space layers, hidden {c.hidden_size}, inner "
            f"{c.intermediate_size}, state {c.state_size}, conv kernel {c.conv_kernel}"
        )
    else:
        convs = sum(t == "conv" for t in c.layer_types) if isinstance(c, Lfm2Config) else 0
        print(
            f"  shape       {c.num_hidden_layers} layers{f' ({convs} short-conv)' if convs else ''}, hidden "
            f"{c.hidden_size}, {c.num_attention_heads} heads, {c.num_key_value_heads} kv heads, head dim "
            f"{c.head_dim}, mlp {c.intermediate_size}"
        )
    print(
        f"  tokens      bos {m.tokenizer.bos_token_id}, eos {m.tokenizer.eos_token_ids}, "
        f"chat template {'yes' if m.tokenizer.chat_template else 'no'}"
    )
    print(f"  source      {m.source}")
    print(f"  imported    {m.imported_at}")
    print("  files")
    for fname, digest in m.files.items():
        print(f"    {fname}  sha256:{digest}")
    print("  drafters" + ("" if m.drafters else "    none"))
    for d in m.drafters:
        extra = "  " + ", ".join(f"{k} {v}" for k, v in d.config.items()) if d.config else ""
        extra += f"  served in {d.weights}" if d.weights else ""
        print(f"    {d.name}  {d.kind}  {d.path}{extra}")
    return 0


def _remove(args: argparse.Namespace) -> int:
    ModelStore().remove(args.name)
    print(f"removed {args.name}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    m = ModelStore().verify(args.name)
    print(f"{m.name}: {len(m.files)} files match their digests")
    return 0


def _summary(m: Manifest) -> dict:
    return {
        "name": m.name,
        "family": m.family,
        "parameters": m.parameters,
        "dtype": m.dtype,
        "vocab_size": m.config.vocab_size,
        "context": m.config.max_position_embeddings,
        "drafters": [d.name for d in m.drafters],
        "imported_at": m.imported_at,
        "source": m.source,
    }
