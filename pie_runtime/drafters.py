"""Drafters attached to a stored model: the checks that decide whether a target can use one, attach and
detach, and loading an attached MTP or EAGLE head for serving.

A drafter spec is ``mtp:FILE`` (an MTP head file written by ``pie drafter train --kind mtp``, with its
JSON config beside it), ``eagle:FILE`` (an EAGLE head, ``--kind eagle``, likewise) or ``draft:MODEL``
(another model in the store, used as draft model). Every check runs before anything is written, and again
when the engine loads the target with its drafters.

An attached head is copied to ``<model>/drafters/<name>/`` (``mtp.safetensors`` and ``mtp.json``, or
``eagle.safetensors`` and ``eagle.json``); both files join the manifest's digest list, so ``pie model
verify`` and every load check them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from .models import eagle as eagle_file
from .models.config import ModelConfig
from .models.eagle import EagleConfig, EagleHead, load_eagle
from .models.head_files import config_path
from .models.mtp import MTPConfig, MTPHead, load_mtp, read_config
from .models.weights import serve_drafter
from .paths import sha256_file
from .store import (
    MANIFEST_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    DrafterEntry,
    Manifest,
    ModelStore,
    StoreError,
)

# config keys or families that mark a model keeping recurrent state (Mamba, RWKV, hybrids ...): such a
# draft model cannot roll back a rejected draft by simply not folding its rows
RECURRENT_KEYS = ("recurrent", "state", "state_size", "ssm_state_size", "recurrent_state", "has_recurrent_state")
RECURRENT_FAMILIES = ("mamba", "mamba2", "lfm2", "rwkv", "jamba", "recurrent_gemma", "griffin", "xlstm")
MTP_WEIGHTS = "mtp.safetensors"
MTP_CONFIG = "mtp.json"
HEAD_KINDS = ("mtp", "eagle")  # drafters that are a file bound to the target (not a store model)
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")


class DrafterRefused(StoreError):
    """The drafter cannot serve this target (other vocab, ids, capacity, target, or recurrent state)."""


def parse_spec(spec: str) -> tuple[str, str]:
    kind, sep, value = spec.partition(":")
    if not sep or kind not in (*HEAD_KINDS, "draft") or not value:
        raise DrafterRefused(f"drafter spec {spec!r} must be mtp:FILE, eagle:FILE or draft:MODEL_NAME")
    return kind, value


def target_digest(manifest: Manifest) -> str:
    """What an MTP head names its target by: the sha256 of the target's weights file, from its manifest."""
    return manifest.files[WEIGHTS_FILE]


# ---- checks ---------------------------------------------------------------------------------------------


def check_mtp(target: Manifest, weights: Path) -> MTPConfig:
    """An MTP head trained for exactly this target, whose tensors fit its config."""
    weights = Path(weights)
    if not weights.is_file() or not config_path(weights).is_file():
        raise DrafterRefused(f"MTP head {weights} needs its weights file and {config_path(weights).name} beside it")
    try:
        marker = recurrent_marker(json.loads(config_path(weights).read_text()))
    except (OSError, ValueError):
        marker = None  # read_config below says what is wrong with it
    if marker:  # our MTP module is stateless; one that carried state could not fork and rewind per draft
        raise DrafterRefused(f"MTP head {weights.name} carries recurrent state ({marker}); only stateless heads")
    try:
        cfg = read_config(weights)
    except (OSError, ValueError) as e:
        raise DrafterRefused(f"MTP config {config_path(weights)} is unreadable: {str(e).splitlines()[0]}") from e
    tc = target.config
    if cfg.hidden_size != tc.hidden_size:
        raise DrafterRefused(
            f"MTP head {weights.name} has hidden size {cfg.hidden_size}, model {target.name!r} has {tc.hidden_size}"
        )
    if cfg.target_digest != target_digest(target):
        raise DrafterRefused(
            f"MTP head {weights.name} was trained for another target (weights sha256 {cfg.target_digest[:12]}..., "
            f"model {target.name!r} has {target_digest(target)[:12]}...)"
        )
    if cfg.vocab_size != tc.vocab_size:
        raise DrafterRefused(
            f"MTP head {weights.name} has vocab {cfg.vocab_size}, model {target.name!r} {tc.vocab_size}"
        )
    try:
        load_mtp(weights)  # tensors fit the config
    except (OSError, ValueError) as e:
        raise DrafterRefused(f"MTP head {weights.name} is unreadable: {e}") from e
    return cfg


def check_eagle(target: Manifest, weights: Path) -> EagleConfig:
    """An EAGLE head trained for exactly this target (digest, vocab, width, attention geometry, the KV pool
    layer it writes), whose tensors fit its config."""
    tc = target.config
    # its draft layer keeps K/V per position beside the target's; a recurrent state cannot rewind per draft
    if not isinstance(tc, ModelConfig):
        raise DrafterRefused(
            f"model {target.name!r} carries recurrent state (family {tc.family!r}): an EAGLE head needs a target "
            "with attention only"
        )
    weights = Path(weights)
    cfg_file = config_path(weights)
    if not weights.is_file() or not cfg_file.is_file():
        raise DrafterRefused(f"EAGLE head {weights} needs its weights file and {cfg_file.name} beside it")
    try:
        cfg = eagle_file.read_config(weights)
    except (OSError, ValueError) as e:
        raise DrafterRefused(f"EAGLE config {cfg_file} is unreadable: {str(e).splitlines()[0]}") from e
    if cfg.target_digest != target_digest(target):
        raise DrafterRefused(
            f"EAGLE head {weights.name} was trained for another target (weights sha256 {cfg.target_digest[:12]}..., "
            f"model {target.name!r} has {target_digest(target)[:12]}...)"
        )
    mine = (cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    theirs = (tc.vocab_size, tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim)
    if mine != theirs or cfg.kv_layer != tc.num_hidden_layers:
        raise DrafterRefused(
            f"EAGLE head {weights.name} (vocab, hidden, heads, kv heads, head dim {mine}; KV layer {cfg.kv_layer}) "
            f"does not fit model {target.name!r} ({theirs}; {tc.num_hidden_layers} layers)"
        )
    try:
        load_eagle(weights)  # tensors fit the config
    except (OSError, ValueError) as e:
        raise DrafterRefused(f"EAGLE head {weights.name} is unreadable: {e}") from e
    return cfg


def _raw_manifest(store: ModelStore, name: str) -> dict:
    path = store.path(name) / MANIFEST_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def recurrent_marker(raw: dict) -> str | None:
    """The first sign that a manifest describes a model with recurrent state, or None."""
    for where in (raw, raw.get("config") or {}):
        for key in RECURRENT_KEYS:
            if where.get(key):
                return f"{key}={where[key]!r}"
        fam = str(where.get("family", "")).lower()
        if fam in RECURRENT_FAMILIES:
            return f"family {fam!r}"
    return None


def _vocab_ids(tokenizer_json: Path) -> dict[str, int]:
    data = json.loads(tokenizer_json.read_text())
    vocab = dict((data.get("model") or {}).get("vocab") or {})
    if isinstance(vocab, list):  # unigram models list [piece, score]
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    for tok in data.get("added_tokens") or []:
        vocab[tok["content"]] = tok["id"]
    return vocab


def check_draft(store: ModelStore, target: Manifest, draft_name: str) -> Manifest:
    """A store model the target can use as draft model: no recurrent state, a vocab no larger than the
    target's, every token at the target's id, and at least the target's positions."""
    if draft_name == target.name:
        raise DrafterRefused(f"model {target.name!r} cannot be its own draft model")
    marker = recurrent_marker(_raw_manifest(store, draft_name))  # before parsing: our schema has no such field
    if marker:
        raise DrafterRefused(
            f"draft model {draft_name!r} keeps recurrent state ({marker}); only stateless drafts are supported"
        )
    draft = store.get(draft_name)
    dc, tc = draft.config, target.config
    if dc.vocab_size > tc.vocab_size:
        raise DrafterRefused(
            f"draft model {draft_name!r} has vocab {dc.vocab_size}, larger than {target.name!r}'s {tc.vocab_size}"
        )
    if dc.max_position_embeddings < tc.max_position_embeddings:
        raise DrafterRefused(
            f"draft model {draft_name!r} holds {dc.max_position_embeddings} positions, fewer than "
            f"{target.name!r}'s {tc.max_position_embeddings}"
        )
    mine_file, theirs_file = store.path(target.name) / TOKENIZER_FILE, store.path(draft_name) / TOKENIZER_FILE
    if sha256_file(mine_file) != sha256_file(theirs_file):  # the files, not manifests: cheap and exact
        mine, theirs = _vocab_ids(mine_file), _vocab_ids(theirs_file)
        for piece, i in theirs.items():
            if mine.get(piece) != i:
                raise DrafterRefused(
                    f"draft model {draft_name!r} gives token {piece!r} id {i}, {target.name!r} gives {mine.get(piece)}"
                )
    return draft


def check_attached(store: ModelStore, target: Manifest) -> None:
    """Re-runs every attached drafter's checks (the engine does this before serving a model)."""
    folder = store.path(target.name)
    for d in target.drafters:
        if d.kind == "mtp":
            check_mtp(target, folder / d.path)
        elif d.kind == "eagle":
            check_eagle(target, folder / d.path)
        else:
            check_draft(store, target, d.path)


def check_spec(store: ModelStore, target: Manifest, spec: str) -> None:
    kind, value = parse_spec(spec)
    if kind == "mtp":
        check_mtp(target, Path(value).expanduser())
    elif kind == "eagle":
        check_eagle(target, Path(value).expanduser())
    else:
        check_draft(store, target, value)


# ---- attach / detach --------------------------------------------------------------------------------------


def attach(
    store: ModelStore, model: str, spec: str, name: str | None = None, weights: str | None = None
) -> DrafterEntry:
    """Checks, then attaches: an MTP or EAGLE head is copied under the model's ``drafters/<name>/``.
    ``weights``: a draft model's own weight format (the engine serves it so unless --weights names it)."""
    kind, value = parse_spec(spec)
    if weights is not None and kind != "draft":
        raise DrafterRefused(f"a weight format of its own is for a draft model: an {kind} head runs in the target's")
    target = store.get(model)
    src = Path(value).expanduser()
    config: dict = {}
    if kind == "mtp":
        cfg = check_mtp(target, src)
        config = {"depth": cfg.depth, "num_blocks": cfg.num_blocks, "intermediate_size": cfg.intermediate_size}
        name = name or _drafter_name(src.stem)
    elif kind == "eagle":
        if any(d.kind == "eagle" for d in target.drafters):
            raise DrafterRefused(f"model {model!r} already has an EAGLE head (its KV pool holds one draft layer)")
        ecfg = check_eagle(target, src)
        config = {"depth": ecfg.depth, "intermediate_size": ecfg.intermediate_size}
        name = name or _drafter_name(src.stem)
    else:
        check_draft(store, target, value)
        name = name or value
    if not _NAME.fullmatch(name):
        raise DrafterRefused(f"invalid drafter name {name!r}: use lowercase letters, digits, '.', '_' and '-'")
    if any(d.name == name for d in target.drafters):
        raise DrafterRefused(f"model {model!r} already has a drafter named {name!r}; detach it first")
    files = dict(target.files)
    if kind in HEAD_KINDS:
        rel = f"drafters/{name}"
        dst = store.path(model) / rel
        if dst.exists():
            shutil.rmtree(dst)  # a leftover of an interrupted attach: not in the manifest
        dst.mkdir(parents=True)
        weights, cfg_name = f"{kind}.safetensors", f"{kind}.json"
        try:
            shutil.copyfile(src, dst / weights)
            shutil.copyfile(src.with_suffix(".json"), dst / cfg_name)
            files[f"{rel}/{weights}"] = sha256_file(dst / weights)
            files[f"{rel}/{cfg_name}"] = sha256_file(dst / cfg_name)
        except BaseException:
            shutil.rmtree(dst, ignore_errors=True)
            raise
        entry = DrafterEntry(kind=kind, name=name, path=f"{rel}/{weights}", config=config)
    else:
        entry = DrafterEntry.model_validate({"kind": "draft", "name": name, "path": value, "weights": weights})
    store.write_manifest(target.model_copy(update={"files": files, "drafters": [*target.drafters, entry]}))
    return entry


def detach(store: ModelStore, model: str, drafter: str) -> DrafterEntry:
    target = store.get(model)
    entry = next((d for d in target.drafters if d.name == drafter), None)
    if entry is None:
        names = ", ".join(d.name for d in target.drafters) or "none"
        raise DrafterRefused(f"model {model!r} has no drafter {drafter!r} (drafters: {names})")
    files = dict(target.files)
    if entry.kind in HEAD_KINDS:
        rel = f"drafters/{entry.name}/"
        files = {f: d for f, d in files.items() if not f.startswith(rel)}
    store.write_manifest(
        target.model_copy(update={"files": files, "drafters": [d for d in target.drafters if d.name != drafter]})
    )
    if entry.kind in HEAD_KINDS:
        shutil.rmtree(store.path(model) / "drafters" / entry.name, ignore_errors=True)
    return entry


def _drafter_name(stem: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-._") or "mtp"


# ---- serving ----------------------------------------------------------------------------------------------


def load_mtp_head(
    store: ModelStore, target: Manifest, model, dtype: torch.dtype, device, weights: str = "fp32"
) -> MTPHead | None:
    """The target's MTP head (the first attached), checked, in the target's weight format ``weights`` and bound
    to the loaded target, or None."""
    entry = next((d for d in target.drafters if d.kind == "mtp"), None)
    if entry is None:
        return None
    path = store.path(target.name) / entry.path
    check_mtp(target, path)
    return MTPHead(serve_drafter(load_mtp(path, dtype, device), weights, native=_native(model)), model)


def _native(model) -> bool:
    """Whether ``model`` runs on the native step (its heads then take float32 hidden states)."""
    return bool(getattr(model, "attends_natively", False))


def heldout_acceptance(training: dict) -> list[float]:
    """[i]: a head's acceptance of draft i+1 given drafts 1..i kept, on the held-out text of its training
    (``pie drafter train`` records it); empty when its record holds none that reads as probabilities."""
    got = training.get("heldout_acceptance")
    if not isinstance(got, list) or not all(isinstance(a, int | float) and 0 <= a <= 1 for a in got):
        return []
    return [float(a) for a in got]


def load_eagle_head(
    store: ModelStore, target: Manifest, model, dtype: torch.dtype, device, weights: str = "fp32"
) -> EagleHead | None:
    """The target's EAGLE head (at most one is attached), checked, in the target's weight format ``weights``
    and bound to the loaded target, or None."""
    entry = next((d for d in target.drafters if d.kind == "eagle"), None)
    if entry is None:
        return None
    path = store.path(target.name) / entry.path
    check_eagle(target, path)
    return EagleHead(serve_drafter(load_eagle(path, dtype, device), weights, native=_native(model)), model)


def served_formats(store: ModelStore, names: list[str], default: str | None, chosen: dict[str, str]) -> dict[str, str]:
    """Every model an engine serves, in order, with its weight format: the named models, then their draft
    models. A model's format is the one ``chosen`` for it (--weights MODEL=FORMAT), else the format its draft
    model attachment records (the first target's), else ``default``, else (no plain --weights) the model's own
    default (formats.default_format of the kinds it stores)."""
    from .models.formats import default_format

    attached: dict[str, str | None] = {}
    for name in names:
        for d in store.get(name).drafters:
            if d.kind == "draft":
                attached.setdefault(d.path, d.weights)

    def own_default(name: str) -> str:
        try:
            return default_format(store.get(name).quantized.values())
        except StoreError:  # the engine's checks of that model say what is wrong with it, after this
            return default_format([])

    formats = {n: chosen.get(n) or attached.get(n) or default or own_default(n) for n in [*names, *attached]}
    unknown = sorted(set(chosen) - set(formats))
    if unknown:
        raise ValueError(
            f"--weights {unknown[0]}={chosen[unknown[0]]}: this engine does not serve {unknown[0]!r} "
            f"(it serves {', '.join(formats)})"
        )
    return formats
