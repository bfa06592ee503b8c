"""Runs one inferlet file in this process: connect to the engine, learn its models, parse the arguments,
await ``main(args)``, and write the result as JSON where the launcher asked."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from pie_runtime.protocol.messages import PROTOCOL_VERSION, ModelInfo

from .args import parse_args
from .client import Client
from .model import Model
from .tokenizer import Tokenizer

_entry = None  # the function marked with @inferlet.main
_session: Session | None = None


def main(fn):
    """Marks ``async def main(args)`` as the inferlet's entry point."""
    global _entry
    _entry = fn
    return fn


class Session:
    def __init__(self, client: Client, models: dict[str, Model], default: str):
        self.client = client
        self.models = models
        self.default = default
        self.inferlet = ""  # the running inferlet's name (its file's stem), for the engine's stats


async def connect(address: str, token: str | None = None) -> Session:
    """Says hello and fetches each model's tokenizer; sets the session ``inferlet.model()`` uses."""
    global _session
    client = Client(address)
    hello = await client.request("hello", version=PROTOCOL_VERSION, client="inferlet", token=token)
    models = {}
    for fields in hello["models"]:
        info = ModelInfo.model_validate(fields)
        tok_json = (await client.request("tokenizer", model=info.name))["tokenizer_json"]
        tok = Tokenizer(tok_json, info.eos_token_ids, info.bos_token_id, info.chat_template)
        models[info.name] = Model(info, client, tok)
    _session = Session(client, models, hello["default_model"])
    return _session


def inferlet_name() -> str:
    """The running inferlet's name ("" outside ``pie run``)."""
    return _session.inferlet if _session is not None else ""


def model(name: str | None = None) -> Model:
    if _session is None:
        raise RuntimeError("not connected to an engine (run this file with `pie run`)")
    key = name or _session.default
    if key not in _session.models:
        raise KeyError(f"the engine serves no model {key!r} (it serves {', '.join(_session.models)})")
    return _session.models[key]


def emit(text: str) -> None:
    """Streams text to the user as it is generated."""
    sys.stdout.write(text)
    sys.stdout.flush()


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def load_entry(path: Path):
    spec = importlib.util.spec_from_file_location(f"inferlet_{path.stem.replace('-', '_')}", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if _entry is None:
        raise RuntimeError(f"{path} has no function marked with @inferlet.main")
    return _entry


async def _run(path: Path, engine: str, words: list[str], token: str | None) -> Any:
    fn = load_entry(path)
    args = parse_args(words, fn)
    session = await connect(engine, token)
    session.inferlet = path.stem
    try:
        return await fn(args)
    finally:
        session.client.close()


def run_file(path: str, engine: str, words: list[str], result_path: str | None, token: str | None = None) -> int:
    try:
        result = asyncio.run(_run(Path(path), engine, words, token))
        payload = {"ok": True, "result": _jsonable(result)}
        code = 0
    except BaseException as e:  # any failure of user code is reported, not raised
        if isinstance(e, KeyboardInterrupt):
            raise
        traceback.print_exc()
        payload = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        code = 1
    if result_path:
        Path(result_path).write_text(json.dumps(payload))
    else:
        print(json.dumps(payload))
    return code
