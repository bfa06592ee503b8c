"""What ships with the project for its packaged default model: bringing that model into the store on first use
(:func:`ensure_default_model`), and the drafters that ship beside it, so that speculation with a trained drafter
works on the first run: their files (``pie_runtime/assets/drafters/``), the sha256 each must have, and attaching
them when the packaged model is imported (``pie model import smollm2-135m``, or the first use of the default
model). A file whose digest differs from the recorded one is refused, never attached.

A shipped drafter may also be one a user attaches by name only (``on_import`` False: an earlier default kept for
comparison, ``pie model drafter attach smollm2-135m smollm2-135m-mtp-corpus``). A model serves its first attached
MTP head. A user who detaches a shipped drafter keeps it detached: only an import attaches it again. One still attached
from an older release (its file's digest is not this release's) is replaced by this release's the next time the
default model is used (:func:`refresh_shipped`, from :func:`ensure_default_model`).

This module sits above the store and the drafters (it uses both); the store knows nothing of it.
"""

from __future__ import annotations

import fcntl
from dataclasses import dataclass
from pathlib import Path

from .drafters import attach, detach
from .paths import sha256_file
from .store import DEFAULT_MODEL, FORMAT_VERSION, DrafterEntry, Manifest, ModelStore, StoreError, import_model

ASSETS = Path(__file__).parent / "assets" / "drafters"


@dataclass(frozen=True)
class ShippedDrafter:
    name: str  # the drafter's name once attached
    kind: str  # "mtp"
    file: str  # under ASSETS; an MTP head's JSON config lies beside it
    sha256: str  # of ``file``, checked before attaching
    on_import: bool = True  # attached when the packaged model is imported; False: attached by name only

    @property
    def path(self) -> Path:
        return ASSETS / self.file


SHIPPED: dict[str, tuple[ShippedDrafter, ...]] = {
    "smollm2-135m": (
        # trained on the model's own chat answers (`pie drafter data`) from the corpus head below
        ShippedDrafter(
            name="smollm2-135m-mtp",
            kind="mtp",
            file="smollm2-135m-mtp.safetensors",
            sha256="0a94f889a7f67af6d8129ff2893442ba1f7131a574f724d7b7fc67da96aa938f",
        ),
        # the default until 2026-12-07, trained on corpus text and generated continuations
        ShippedDrafter(
            name="smollm2-135m-mtp-corpus",
            kind="mtp",
            file="smollm2-135m-mtp-corpus.safetensors",
            sha256="d2409333253b416531de59bc782aeb2f06bf11e5ebcdce7c45a6486502b5ab2d",
            on_import=False,
        ),
    ),
}


class ShippedDrafterCorrupt(StoreError):
    """A shipped drafter's file is missing or does not have its recorded digest."""


def check_shipped(drafter: ShippedDrafter) -> Path:
    """The drafter's file, once its digest is the recorded one."""
    path = drafter.path
    if not path.is_file():
        raise ShippedDrafterCorrupt(f"the shipped drafter {drafter.name} is missing ({path}): reinstall pie_runtime")
    digest = sha256_file(path)
    if digest != drafter.sha256:
        raise ShippedDrafterCorrupt(
            f"the shipped drafter {path} has sha256 {digest[:12]}..., not the recorded {drafter.sha256[:12]}...: "
            "reinstall pie_runtime"
        )
    return path


def attach_spec(drafter: ShippedDrafter) -> str:
    """``KIND:FILE``, the spec that attaches the drafter's file, once its digest is checked."""
    return f"{drafter.kind}:{check_shipped(drafter)}"


def shipped_spec(spec: str) -> tuple[str, str | None]:
    """A drafter spec as `pie model import --drafter` and `pie model drafter attach` take it: a shipped drafter's
    name (``smollm2-135m-mtp-corpus``) becomes ``KIND:FILE`` (its digest checked) and the name it attaches under;
    any other spec comes back as it is, with no name."""
    for drafters in SHIPPED.values():
        for drafter in drafters:
            if drafter.name == spec:
                return attach_spec(drafter), drafter.name
    return spec, None


def stale_shipped(manifest: Manifest) -> list[ShippedDrafter]:
    """The shipped drafters attached to ``manifest``'s model (by name and kind) from another release's file."""
    attached = {(d.name, d.kind): d.path for d in manifest.drafters}
    return [
        drafter
        for drafter in SHIPPED.get(manifest.name, ())
        if (drafter.name, drafter.kind) in attached
        and manifest.files.get(attached[(drafter.name, drafter.kind)]) != drafter.sha256
    ]


def refresh_shipped(store: ModelStore, model: str) -> list[DrafterEntry]:
    """Replaces each shipped drafter attached to ``model`` from another release's file with this release's (the
    user's own drafters, and shipped ones they detached, are left alone); returns what was attached."""
    out = []
    for drafter in stale_shipped(store.get(model)):
        spec = attach_spec(drafter)  # before detaching: a corrupt install keeps the old head
        detach(store, model, drafter.name)
        out.append(attach(store, model, spec, drafter.name))
    return out


def attach_shipped(store: ModelStore, model: str, packaged: str | None = None) -> list[DrafterEntry]:
    """Attaches to stored model ``model``, imported from packaged model ``packaged`` (default: the same name),
    the shipped drafters it has no drafter of that name for; returns what was attached."""
    have = {d.name for d in store.get(model).drafters}
    out = []
    for drafter in SHIPPED.get(packaged or model, ()):
        if drafter.on_import and drafter.name not in have:
            out.append(attach(store, model, attach_spec(drafter), drafter.name))
    return out


def ensure_default_model(store: ModelStore | None = None) -> Manifest:
    """The default model's manifest, importing it from its packaged GGUF on first use, and again (drafters
    kept) when the stored copy was written by an older store format; a shipped drafter still attached from an
    older release is replaced by this release's. Concurrent callers take turns."""
    store = store or ModelStore()
    if store.exists(DEFAULT_MODEL):
        manifest = store.get(DEFAULT_MODEL)
        if _current(manifest) and not stale_shipped(manifest):
            return manifest
    store.root.mkdir(parents=True, exist_ok=True)
    with open(store.root / f".import-{DEFAULT_MODEL}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if store.exists(DEFAULT_MODEL):
            manifest = store.get(DEFAULT_MODEL)
            if _current(manifest):  # another process may have imported it while this one waited
                refresh_shipped(store, DEFAULT_MODEL)
                return store.get(DEFAULT_MODEL)
            import_model(DEFAULT_MODEL, store=store, progress=False, force=True, keep_drafters=True)
        else:
            import_model(DEFAULT_MODEL, store=store, progress=False)
        attach_shipped(store, DEFAULT_MODEL)
        refresh_shipped(store, DEFAULT_MODEL)  # a kept drafter may be an older release's
        return store.get(DEFAULT_MODEL)


def _current(manifest: Manifest) -> bool:
    return manifest.format_version >= FORMAT_VERSION
