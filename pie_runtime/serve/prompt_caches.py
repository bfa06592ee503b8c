"""Saved prompt caches of `pie serve --prompt-cache-dir DIR`: a prompt's KV, prefilled once and saved under a
name by the prompt-cache inferlet (inferlets/prompt-cache.py; inferlet/kv_file.py is the file), that a request
starts from instead of computing that prefix again (llama-server's ``--slot-save-path`` and
``/slots/{id}?action=save|restore``, by name).

Requests name a cache, never a path: a name is ``[A-Za-z0-9][A-Za-z0-9_-]{0,63}`` (no dot, no slash, so no
traversal) and lives at ``DIR/NAME.safetensors``. Before a run starts the file's header is checked against the
served model (weights digest, weight format, KV dtype): a cache of another model or format is a 400 with code
``kv_mismatch``, an unknown name a 404 ``prompt_cache_not_found``, a bad name a 400 ``invalid_prompt_cache_name``,
and any of it without ``--prompt-cache-dir`` a 403 ``prompt_cache_disabled``. A save is written to a hidden
temporary file and renamed into place when the run succeeds, so a request never loads half a file.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

from inferlet.kv_file import SavedKVMismatch, check_meta, read_meta
from pie_runtime.protocol.messages import ModelInfo

from .errors import APIError, invalid_request, not_found
from .generation import Job
from .openai_api import ChatRequest, CompletionRequest, PromptCacheCard

PROMPT_CACHE = "prompt-cache"  # the inferlet that saves and loads them
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
SUFFIX = ".safetensors"


def disabled() -> APIError:
    return APIError(
        403, "prompt caches are off (start with --prompt-cache-dir DIR)", "permission_error", "prompt_cache_disabled"
    )


def mismatch(e: SavedKVMismatch, param: str) -> APIError:
    return invalid_request(e.message, param=param, code="kv_mismatch")


class PromptCaches:
    """The server's folder of saved prompt caches."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, name: str, param: str) -> Path:
        """Where the cache ``name`` lives; a 400 for a name that is no plain cache name."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise invalid_request(
                f"{name!r} is no prompt cache name ([A-Za-z0-9][A-Za-z0-9_-]{{0,63}}: a name, never a path)",
                param=param,
                code="invalid_prompt_cache_name",
            )
        return self.folder / f"{name}{SUFFIX}"

    def existing(self, name: str, param: str) -> Path:
        """The path of the cache ``name``; a 404 when there is none."""
        path = self.path(name, param)
        if not path.is_file():
            raise not_found(f"no prompt cache {name!r}", "prompt_cache_not_found", param)
        return path

    def checked(self, name: str, info: ModelInfo, param: str) -> Path:
        """The path of an existing cache this model can load: 404 when absent, 400 ``kv_mismatch`` when it was
        saved by another model, weight format or KV dtype (or is no saved working set at all)."""
        path = self.existing(name, param)
        try:
            check_meta(read_meta(path), info)
        except SavedKVMismatch as e:
            raise mismatch(e, param) from None
        return path

    def card(self, name: str) -> PromptCacheCard:
        path = self.path(name, "name")
        try:
            meta = read_meta(path)
        except SavedKVMismatch:
            meta = {}
        st = path.stat()
        return PromptCacheCard(
            id=name,
            created=int(st.st_mtime),
            bytes=st.st_size,
            rows=int(meta.get("committed", 0)),
            model=meta.get("model"),
            weights=meta.get("weights"),
            kv_dtype=meta.get("kv_dtype"),
        )

    def bytes_used(self) -> int:
        """Bytes of the caches saved here (a key's folder: its share of the disk)."""
        return sum(p.stat().st_size for p in self.folder.glob(f"*{SUFFIX}") if p.is_file())

    def names(self) -> list[str]:
        return sorted(p.name.removesuffix(SUFFIX) for p in self.folder.glob(f"*{SUFFIX}") if NAME.fullmatch(p.stem))

    def scratch(self) -> Path:
        """A hidden file name in the folder for a save in progress (no cache name starts with a dot)."""
        return self.folder / f".saving-{uuid.uuid4().hex}{SUFFIX}"

    def commit(self, scratch: Path, name: str) -> None:
        os.replace(scratch, self.path(name, "name"))  # atomic: a load never sees half a file


def start_from(job: Job, req: CompletionRequest | ChatRequest, path: Path) -> Job:
    """``job`` run by the prompt-cache inferlet from the saved cache at ``path``: the request's prompt continues
    from the longest prefix it shares with the cache. A 400 for what that inferlet cannot do."""
    for param, asked in (
        ("speculation", req.speculation not in (None, False)),
        ("response_format", req.response_format is not None and req.response_format.type != "text"),
        ("n", req.n > 1),
    ):
        if asked:
            raise invalid_request(f"{param} cannot be combined with prompt_cache", param=param)
    args: dict[str, Any] = {k: v for k, v in job.args.items() if k not in ("draft_length", "max_ngram", "draft")}
    args["load"] = str(path)
    return Job(PROMPT_CACHE, args, job.prompt_tokens, job.max_tokens, job.n, job.echo)
