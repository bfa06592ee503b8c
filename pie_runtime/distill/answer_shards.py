"""Where `pie drafter data` keeps the target's answers: a folder of append-only shards and a manifest.

    DIR/manifest.json        the run's settings, the shards in order, their answers and tokens
    DIR/shard-00000.npz      answers: token ids (prompt + answer), lengths, prompt lengths, prompt ids,
                             temperatures, and the engine's final hidden state of every position but the last

A shard is written whole (to a temporary name, then renamed) before the manifest names it, so a run killed at any
moment leaves a readable folder; a resumed run skips the (prompt, temperature) pairs the manifest's shards hold
and appends new shards. The hidden states are the served engine's (its weight format's), float16: what an MTP
head reads when it drafts on that engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel

MANIFEST = "manifest.json"


class DataError(ValueError):
    """A data folder that cannot be used as asked (another model or prompt set, a damaged manifest)."""


class ShardInfo(BaseModel):
    file: str
    answers: int
    tokens: int  # answer tokens (the prompts' not counted)


class Manifest(BaseModel):
    """The folder's record: what made it (``settings``, checked on resume) and its shards."""

    version: int = 1
    settings: dict
    shards: list[ShardInfo] = []

    @property
    def answer_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def answers(self) -> int:
        return sum(s.answers for s in self.shards)


@dataclass
class Answer:
    """One answered prompt: ``tokens`` = prompt + answer; ``hidden[t]`` (float16) is the target's final hidden
    state after tokens[: t + 1], for t < len(tokens) - 1."""

    prompt_id: str
    temperature: float
    prompt_len: int
    tokens: list[int]
    hidden: np.ndarray  # (len(tokens) - 1, H) float16

    @property
    def key(self) -> tuple[str, float]:
        return self.prompt_id, self.temperature


def open_folder(folder: Path, settings: dict) -> Manifest:
    """The folder's manifest, a new one when it has none; DataError when it was made with other ``settings``."""
    path = folder / MANIFEST
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        manifest = Manifest(settings=settings)
        write_manifest(folder, manifest)
        return manifest
    try:
        manifest = Manifest.model_validate_json(path.read_text())
    except ValueError as e:
        raise DataError(f"{path} is not a data manifest: {e}") from None
    if manifest.settings != settings:
        diff = {k: (manifest.settings.get(k), v) for k, v in settings.items() if manifest.settings.get(k) != v}
        raise DataError(f"{folder} holds data made with other settings (was, now): {diff}; use another folder")
    return manifest


def write_manifest(folder: Path, manifest: Manifest) -> None:
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(manifest.model_dump_json(indent=1))
    os.replace(tmp, folder / MANIFEST)


def append_shard(folder: Path, manifest: Manifest, answers: list[Answer]) -> None:
    """Writes ``answers`` as the next shard, then names it in the manifest."""
    if not answers:
        return
    name = f"shard-{len(manifest.shards):05d}.npz"
    tmp = folder / f".{name}.tmp.npz"
    np.savez(
        tmp,
        tokens=np.concatenate([np.asarray(a.tokens, dtype=np.int32) for a in answers]),
        lengths=np.asarray([len(a.tokens) for a in answers], dtype=np.int32),
        prompt_lens=np.asarray([a.prompt_len for a in answers], dtype=np.int32),
        prompt_ids=np.asarray([a.prompt_id for a in answers]),
        temperatures=np.asarray([a.temperature for a in answers], dtype=np.float32),
        hidden=np.concatenate([a.hidden for a in answers]).astype(np.float16),
    )
    os.replace(tmp, folder / name)
    tokens = sum(len(a.tokens) - a.prompt_len for a in answers)
    manifest.shards.append(ShardInfo(file=name, answers=len(answers), tokens=tokens))
    write_manifest(folder, manifest)


def read_answers(folder: Path) -> list[Answer]:
    """Every answer the manifest's shards hold, in order."""
    manifest = Manifest.model_validate_json((folder / MANIFEST).read_text())
    out = []
    for shard in manifest.shards:
        with np.load(folder / shard.file) as z:
            lengths, tokens, hidden = z["lengths"], z["tokens"], z["hidden"]
            t0 = h0 = 0
            for i, n in enumerate(lengths.tolist()):
                out.append(
                    Answer(
                        str(z["prompt_ids"][i]),
                        round(float(z["temperatures"][i]), 3),  # stored float32: 0.7 reads 0.69999
                        int(z["prompt_lens"][i]),
                        tokens[t0 : t0 + n].tolist(),
                        hidden[h0 : h0 + n - 1],
                    )
                )
                t0, h0 = t0 + n, h0 + n - 1
    return out


def done_keys(folder: Path) -> set[tuple[str, float]]:
    """The (prompt id, temperature) pairs the folder's shards hold."""
    manifest = Manifest.model_validate_json((folder / MANIFEST).read_text())
    keys = set()
    for shard in manifest.shards:
        with np.load(folder / shard.file) as z:
            keys |= {(str(p), round(float(t), 3)) for p, t in zip(z["prompt_ids"], z["temperatures"])}
    return keys
