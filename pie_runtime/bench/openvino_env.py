"""OpenVINO GenAI for `pie bench decode --peers openvino` and examples/bench_streams_openvino.py, installed on
demand into a venv in a cache outside the repository (``$PIE_OPENVINO_DIR``, default ``~/.cache/pie/openvino``),
and each model's int4 export, cached there per model.

The venv sees the project's own site-packages through a ``.pth`` file, so torch is reused, never downloaded again:
pip is held to the installed torch by a constraint, the venv's own old setuptools is removed (pip would otherwise
try to replace the project's newer one, which it cannot), and torchvision, which optimum-intel pulls in and whose
build does not match this torch, is removed after the install. Packages the exporter needs at other versions
(transformers, tokenizers) land in the venv and shadow the project's there only.

The model is exported by ``optimum-cli export openvino --task text-generation-with-past --weight-format int4
--group-size 32 --ratio 1.0`` from a Hugging Face folder of the store's dequantized float32 weights (the folder
transformers runs in `pie bench decode`, ``pie_runtime.reference``): Llama-family models only. Every failure is an
``OpenVinoUnavailable`` whose message says why, for the bench's "openvino skipped: ..." line.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

from ..store import ModelStore, StoreError
from .logged_step import run_step

PACKAGES = ("openvino-genai", "optimum-intel[openvino]", "nncf")
IMPORTS = "import openvino_genai, optimum.intel"
EXPORT_ARGS = ("--task", "text-generation-with-past", "--weight-format", "int4", "--group-size", "32", "--ratio", "1.0")
INSTALL_TIMEOUT_S = 3600
EXPORT_TIMEOUT_S = 3600
WORKER = Path(__file__).with_name("openvino_worker.py")
VARIANT = "int4 g32"  # the export's weights, as the bench's rows name them


class OpenVinoUnavailable(RuntimeError):
    """OpenVINO GenAI cannot run here; the message is the reason, one line."""


def cache_dir() -> Path:
    return Path(os.environ.get("PIE_OPENVINO_DIR") or Path.home() / ".cache" / "pie" / "openvino")


def venv_python(root: Path | None = None) -> Path:
    return (root or cache_dir()) / "venv" / "bin" / "python"


def _importable(python: Path) -> bool:
    if not python.is_file():
        return False
    probe = subprocess.run([str(python), "-c", IMPORTS], capture_output=True, timeout=300)
    return probe.returncode == 0


def _run(cmd: list[str], log: Path, what: str, timeout: float = INSTALL_TIMEOUT_S) -> None:
    """Runs ``cmd`` with its output appended to ``log``; OpenVinoUnavailable naming ``what`` when it fails."""
    run_step(cmd, log, what, OpenVinoUnavailable, timeout)


def _make_venv(root: Path, log: Path) -> Path:
    """A venv whose Python also sees this interpreter's site-packages (after its own)."""
    python = venv_python(root)
    _run([sys.executable, "-m", "venv", str(root / "venv")], log, "making the venv")
    site = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True
    ).stdout.strip()
    (Path(site) / "pie_project_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python), "-m", "pip", "uninstall", "-y", "-q", "setuptools"], log, "removing the venv's setuptools")
    return python


def ensure_openvino(progress: Callable[[str], None] = print) -> Path:
    """The Python of a venv where OpenVINO GenAI and optimum-intel import, installing them first when needed."""
    root = cache_dir()
    python = venv_python(root)
    if _importable(python):
        return python
    try:
        import torch
    except ImportError:
        raise OpenVinoUnavailable("torch is not installed in this environment (the venv reuses it)") from None
    root.mkdir(parents=True, exist_ok=True)
    log = root / "install.log"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another bench may be installing it now: wait for that one
        if _importable(python):
            return python
        progress(f"installing {', '.join(PACKAGES)} into {root} (a few minutes; log {log})")
        log.write_text("")
        if not python.is_file():
            python = _make_venv(root, log)
        constraints = root / "constraints.txt"
        constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")  # this torch, not a new download
        _run([str(python), "-m", "pip", "install", "-c", str(constraints), *PACKAGES], log, "the install")
        _run([str(python), "-m", "pip", "uninstall", "-y", "torchvision"], log, "removing torchvision")
        if not _importable(python):
            raise OpenVinoUnavailable(f"openvino_genai does not import after the install (log {log})")
    return python


def hf_folder(model: str, folder: Path) -> Path:
    """``folder`` holding a Hugging Face checkpoint of the store's ``model`` (config, float32 weights, tokenizer),
    what optimum-cli exports; OpenVinoUnavailable for a model the writer cannot express."""
    from ..models.config import ModelConfig
    from ..reference import write_llama_folder

    store = ModelStore()
    try:
        manifest = store.get(model)
    except StoreError as e:
        raise OpenVinoUnavailable(str(e)) from e
    if not isinstance(manifest.config, ModelConfig):
        raise OpenVinoUnavailable(f"{model} is a {manifest.config.family} model: the export writes Llama-family ones")
    try:
        write_llama_folder(store.path(model), manifest.config, folder, copy=True)
    except ImportError:
        raise OpenVinoUnavailable("transformers is not installed (it writes the folder optimum-cli exports)") from None
    shutil.copy(store.path(model) / "tokenizer.json", folder / "tokenizer.json")
    t = manifest.tokenizer
    special = {"bos_token_id": t.bos_token_id, "eos_token_id": (t.eos_token_ids or [None])[0]}
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": t.add_bos_token, **special}
    if t.chat_template:
        tok_config["chat_template"] = t.chat_template
    import json

    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder


def exported_model(model: str, python: Path, progress: Callable[[str], None] = print) -> Path:
    """The folder of ``model``'s OpenVINO int4 export (group 32), exporting it first when it is not cached."""
    root = cache_dir() / "models"
    out = root / f"{model}-int4-g32"
    if (out / "openvino_model.xml").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    log = root / f"{model}-export.log"
    with open(root / f".{model}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "openvino_model.xml").is_file():
            return out
        scratch, tmp = root / f".{model}-hf", root / f".{model}-export"
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        hf_folder(model, scratch)
        progress(f"exporting {model} to OpenVINO int4 g32 into {out} (log {log})")
        log.write_text("")
        cli = [str(python), "-m", "optimum.commands.optimum_cli", "export", "openvino"]
        _run([*cli, "--model", str(scratch), *EXPORT_ARGS, str(tmp)], log, "the export", EXPORT_TIMEOUT_S)
        if not (tmp / "openvino_model.xml").is_file():
            raise OpenVinoUnavailable(f"the export wrote no openvino_model.xml (log {log})")
        tmp.rename(out)
        shutil.rmtree(scratch, ignore_errors=True)
    return out
