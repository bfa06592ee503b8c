"""The file format of every drafter head (MTP, EAGLE): ``<stem>.safetensors`` holds the module's tensors and
``<stem>.json`` beside it its config, a pydantic model that names the target by the sha256 of the target's
weights file. One save and one load for every kind; a kind's module names its config and its module class."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from pydantic import BaseModel
from torch import nn

Config = TypeVar("Config", bound=BaseModel)
Module = TypeVar("Module", bound=nn.Module)


def config_path(weights: Path) -> Path:
    """The JSON config beside a head's weights file: ``head.safetensors`` → ``head.json``."""
    return Path(weights).with_suffix(".json")


def read_head_config(config_type: type[Config], weights: Path) -> Config:
    return config_type.model_validate_json(config_path(weights).read_text())


def cast_floats(state: dict[str, torch.Tensor], dtype: torch.dtype, device=None) -> dict[str, torch.Tensor]:
    """A state dict with its floating tensors in ``dtype`` (ids and other integer buffers kept as they are)."""
    return {
        k: v.detach().to(device=device, dtype=dtype if v.is_floating_point() else v.dtype).contiguous()
        for k, v in state.items()
    }


def save_head(module: nn.Module, config: BaseModel, weights: Path, dtype: torch.dtype, kind: str) -> None:
    """Writes the module's tensors in ``dtype`` (the engine casts them to its own) and ``config`` beside them;
    ``kind`` ("mtp", "eagle") goes into the file's metadata."""
    from safetensors.torch import save_file

    weights = Path(weights)
    weights.parent.mkdir(parents=True, exist_ok=True)
    save_file(cast_floats(module.state_dict(), dtype), str(weights), metadata={"format": "pt", "pie": kind})
    config_path(weights).write_text(config.model_dump_json(indent=2))


def load_head(
    build: Callable[[Config], Module], config: Config, weights: Path, what: str, dtype: torch.dtype, device
) -> Module:
    """``build(config)``'s module holding the file's tensors in ``dtype`` on ``device``, in eval mode without
    gradients; a missing, unexpected or misshapen tensor raises ValueError (``what`` names the kind)."""
    from safetensors.torch import load_file

    with torch.device("meta"):
        module = build(config)
    state = load_file(str(weights), device="cpu")
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if want != got:
        diff = sorted(set(want) ^ set(got)) or sorted(k for k in want if want[k] != got[k])
        raise ValueError(f"{what} tensors do not fit its config (first difference: {diff[0]})")
    module.load_state_dict(cast_floats(state, dtype, device), assign=True)
    module.requires_grad_(False)
    return module.eval()
