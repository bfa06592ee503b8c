"""Convert a Hugging Face checkpoint folder (config.json, one or sharded safetensors, tokenizer.json) of a
Llama-family model (llama, mistral, qwen2, qwen3, gemma3_text, the text part of a gemma3), a Mamba or an LFM2
into the store's layout: float32 tensors under their own names (a gemma3's text model under
Gemma3ForCausalLM's), checked name by name and shape by shape against the config before any weight is read."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from .checkpoint import CheckpointError, Converted, TokenizerInfo, check_shapes, drop_ignored
from .config import config_from_hf

INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"missing file {path}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it (a single file, or the shards of an index)."""
    index = folder / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = _read_json(index).get("weight_map", {})
        return {name: folder / shard for name, shard in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"missing file {single} (or {INDEX_FILE})")
    try:
        with safe_open(single, "pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (the handle has keys() but no __iter__)
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise CheckpointError(f"cannot read {single}: {e}") from e


# Gemma3ForConditionalGeneration's text model: "language_model.model.*" (checkpoints saved by transformers 4)
# or "model.language_model.*" (5); the vision tower and projector are dropped
_TEXT_PART = (
    (re.compile(r"^language_model\.model\.(.*)$"), r"model.\1"),
    (re.compile(r"^model\.language_model\.(.*)$"), r"model.\1"),
    (re.compile(r"^language_model\.(lm_head\..*)$"), r"\1"),
    (re.compile(r"^(lm_head\..*)$"), r"\1"),
)


def text_part(files: dict[str, Path]) -> tuple[dict[str, Path], dict[str, str]]:
    """The text model's tensors of a multimodal Gemma 3 checkpoint under Gemma3ForCausalLM's names: (name →
    file, name → its name in the file)."""
    out: dict[str, Path] = {}
    source: dict[str, str] = {}
    for name, path in files.items():
        for pattern, repl in _TEXT_PART:
            if pattern.match(name):
                new = pattern.sub(repl, name)
                out[new], source[new] = path, name
                break
    return out, source


def _shapes(files: dict[str, Path], source: dict[str, str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(path, "pt") as f:
                for name in names:
                    shapes[name] = tuple(f.get_slice(source.get(name, name)).get_shape())
        except FileNotFoundError:
            raise CheckpointError(f"missing file {path}") from None
        except Exception as e:
            raise CheckpointError(f"cannot read {path}: {e}") from e
    return shapes


def tokenizer_info(folder: Path, hf_config: dict[str, Any], tokenizer_json: str) -> TokenizerInfo:
    """bos/eos ids, chat template and special tokens from the folder's tokenizer and generation files."""
    tok_cfg_path = folder / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.exists() else {}
    template = tok_cfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: keep the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)

    eos: list[int] = []
    sources = [hf_config]
    if (folder / "generation_config.json").exists():
        sources.append(_read_json(folder / "generation_config.json"))
    for src in sources:
        value = src.get("eos_token_id")
        for i in value if isinstance(value, list) else ([] if value is None else [value]):
            if int(i) not in eos:
                eos.append(int(i))
    added = json.loads(tokenizer_json).get("added_tokens", [])
    bos = hf_config.get("bos_token_id")
    add_bos, add_eos = adds_bos_eos(tokenizer_json, bos, eos[0] if eos else None)
    return TokenizerInfo(
        bos_token_id=bos,
        eos_token_ids=eos,
        chat_template=template,
        special_tokens=[t["content"] for t in added if t.get("special")],
        add_bos_token=bool(tok_cfg.get("add_bos_token", add_bos)) and bos is not None,
        add_eos_token=bool(tok_cfg.get("add_eos_token", add_eos)) and bool(eos),
    )


def adds_bos_eos(tokenizer_json: str, bos: int | None, eos: int | None) -> tuple[bool, bool]:
    """Whether the tokenizer.json's post-processor puts BOS before / EOS after a text (Llama 3's and Gemma's do);
    tokenizer_config.json's ``add_bos_token`` / ``add_eos_token``, where present, say it instead."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    plain, framed = tok.encode("a", add_special_tokens=False).ids, tok.encode("a", add_special_tokens=True).ids
    added_bos = bos is not None and framed[:1] == [bos] and plain[:1] != [bos]
    added_eos = eos is not None and framed[-1:] == [eos] and plain[-1:] != [eos]
    return added_bos, added_eos


def convert_hf(folder: Path, *, progress: bool = True) -> Converted:
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a checkpoint folder")
    hf_config = _read_json(folder / "config.json")
    cfg = config_from_hf(hf_config)  # refuses an unknown model_type
    tok_path = folder / "tokenizer.json"
    try:
        tokenizer_json = tok_path.read_text()
        json.loads(tokenizer_json)
    except FileNotFoundError:
        raise CheckpointError(f"missing file {tok_path}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {tok_path}: {e}") from e
    info = tokenizer_info(folder, hf_config, tokenizer_json)
    if not cfg.eos_token_ids and info.eos_token_ids:
        cfg = cfg.model_copy(update={"eos_token_ids": tuple(info.eos_token_ids)})

    files = weight_files(folder)
    source: dict[str, str] = {}  # a tensor's name in its file, where it is not the store's
    if hf_config.get("model_type") == "gemma3":  # the text part of a multimodal checkpoint
        files, source = text_part(files)
    keep = drop_ignored(list(files), cfg)
    shapes = _shapes({n: files[n] for n in keep}, source)
    check_shapes(cfg, shapes)

    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in keep:
        by_file.setdefault(files[name], []).append(name)
    with tqdm(total=len(keep), desc="tensors", unit="t", disable=not progress, leave=False) as bar:
        for path, names in by_file.items():
            with safe_open(path, "pt") as f:
                for name in names:
                    tensors[name] = f.get_tensor(source.get(name, name)).to(torch.float32).contiguous()
                    bar.update()
    return Converted(
        family=cfg.family,
        config=cfg,
        tensors=tensors,
        tokenizer_json=tokenizer_json,
        tokenizer=info,
        source=str(folder.resolve()),
    )
