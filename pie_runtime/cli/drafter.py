"""`pie drafter train`: distil an MTP head, an EAGLE head or a draft model from a stored target on its own
predictions.

    pie drafter train --model smollm2-135m --kind mtp --corpus austen.txt --depth 3 --out head.safetensors
    pie drafter train --model smollm2-135m --kind eagle --corpus austen.txt --depth 3 --out eagle.safetensors
    pie drafter train --model smollm2-135m --kind draft --corpus austen.txt --out smollm2-draft

``mtp`` and ``eagle`` write ``FILE`` (safetensors) and ``FILE`` with a ``.json`` suffix (its config, naming the
target by the sha256 of its weights file); attach it with ``pie model drafter attach MODEL mtp:FILE`` (or
``eagle:FILE``). ``draft``
imports a small model with the target's tokenizer into the store under ``--out``; attach it with
``pie model drafter attach MODEL draft:NAME``. ``--attach`` does either right after training.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..models.formats import WEIGHT_FORMATS

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..distill import TeacherData, TrainSettings
    from ..models.llama import LlamaForCausalLM
    from ..store import ImportResult, LoadedModel, ModelStore

Head = TypeVar("Head")  # an MTPModule or an EagleModule
# per kind: the default --epochs, --batch (rows for mtp, sequences for eagle and draft) and --lr
TRAIN_DEFAULTS: dict[str, tuple[float, int, float]] = {
    "mtp": (40, 256, 1e-3),
    "eagle": (4, 4, 1e-3),
    "draft": (4, 4, 3e-4),
}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("drafter", help="train drafters by self-distillation")
    dsub = parser.add_subparsers(dest="drafter_command", required=True)
    p = dsub.add_parser(
        "train", help="train an MTP head, an EAGLE head or a draft model on the target's own predictions"
    )
    _add_target_and_data_options(p)
    _add_training_options(p)
    _add_output_options(p)
    p.set_defaults(func=run_train)
    from . import drafter_data

    drafter_data.register(dsub)


def _add_target_and_data_options(p: argparse.ArgumentParser) -> None:
    """The target, and the teacher data: its corpora, rounds, and the teacher pass's threads and precision."""
    p.add_argument("--model", default=None, help="the target model in the store (default: the default model)")
    p.add_argument("--kind", required=True, choices=["mtp", "eagle", "draft"])
    p.add_argument("--corpus", action="append", required=True, help="a UTF-8 text file (repeatable)")
    p.add_argument("--tokens", type=int, default=49152, help="corpus tokens to train on, split across corpora")
    p.add_argument(
        "--gen-tokens",
        type=int,
        default=0,
        help="also train on this many tokens of the target's own greedy continuations",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="teacher data in this many rounds of --tokens and --gen-tokens each, every round on text the rounds "
        "before did not cover and cached on its own: raising --rounds runs the teacher over the new rounds only",
    )
    p.add_argument(
        "--gen-rounds",
        type=int,
        default=0,
        help="then this many rounds of the target's own continuations only (--gen-round-tokens each, no corpus "
        "windows, prompts from the corpora), each cached on its own: data on the drafts' serving path, unlimited "
        "where the corpora run out",
    )
    p.add_argument(
        "--chat-rounds",
        type=int,
        default=0,
        help="then this many rounds of the target's replies in its chat template to requests about corpus "
        "passages (summarize, continue, explain, ...; --gen-round-tokens each): what a drafter sees serving a chat",
    )
    p.add_argument(
        "--open-rounds",
        type=int,
        default=0,
        help='then this many rounds of its replies to open requests, no passage ("Explain {topic} to a '
        'ten-year-old.", 24 templates x 153 topics; --gen-round-tokens each): what a drafter sees serving most chats',
    )
    p.add_argument(
        "--gen-round-tokens",
        type=int,
        default=None,
        help="tokens of one --gen-rounds, --chat-rounds or --open-rounds round (default 262144)",
    )
    p.add_argument(
        "--data",
        action="append",
        default=None,
        help="mtp: also train on a `pie drafter data` folder (the target's chat answers with the engine's hidden "
        "states; repeatable); its held-out answers become the held-out set early stopping and the figures use",
    )
    p.add_argument("--window", type=int, default=64, help="with --data: positions per training window")
    p.add_argument(
        "--data-positions",
        choices=["answers", "all"],
        default="answers",
        help="with --data: train on the answers' positions only (a head drafts only while the target answers; "
        "the prompt is prefilled) or on the prompts' too",
    )
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--heldout-tokens", type=int, default=2048, help="held-out tokens per corpus for the progress bar")
    p.add_argument("--cache-dir", default=None, help="teacher cache (default $PIE_HOME/cache/distill; 'none' disables)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads for the target's forward")
    p.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="teacher pass and training forward: bf16 (float32 weights kept for training; the "
        "teacher's top-k re-ranked in float32) or fp32; auto: bf16 where the CPU has bf16 units",
    )


def _add_training_options(p: argparse.ArgumentParser) -> None:
    """The drafter's shape and its training run."""
    p.add_argument("--depth", type=int, default=3, help="mtp, eagle: draft steps (one module reused K times)")
    p.add_argument(
        "--epochs", type=float, default=None, help="passes over the data (default: 40 mtp, 4 eagle and draft)"
    )
    p.add_argument("--minutes", type=float, default=None, help="stop training after this many minutes")
    p.add_argument("--layers", default="0,1,2,-1", help="draft: target layers the draft starts from")
    p.add_argument("--blocks", type=int, default=2, help="mtp: residual MLP blocks")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="mtp, eagle: draft from the N tokens the target predicts most often in the training data (EAGLE-3's "
        "reduced vocabulary: each draft step reads N rows of the lm head, not all); 0: the whole vocabulary; "
        "default: the whole vocabulary up to 65,536 tokens, a 32,768-token slice above (Gemma 3's 262,144)",
    )
    p.add_argument("--init", default=None, help="mtp, eagle: continue training this head (FILE.safetensors)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--batch", type=int, default=None, help="rows (mtp) or sequences (eagle, draft) per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--patience",
        type=int,
        default=0,
        help="early stopping: stop after this many held-out checks (4 an epoch) without a better first-draft "
        "agreement and keep the best weights; 0: off",
    )
    p.add_argument(
        "--train-threads",
        type=int,
        default=1,
        help="torch CPU threads while training (small ops: one thread is fastest on a busy machine)",
    )


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """Where the drafter goes: a file or a store model, attached to the target or not."""
    p.add_argument(
        "--out", default=None, help="mtp, eagle: output file (default MODEL-KIND.safetensors); draft: store name"
    )
    p.add_argument("--attach", action="store_true", help="attach the result to the target when done")
    p.add_argument(
        "--attach-weights",
        choices=list(WEIGHT_FORMATS),
        default="int8",
        help="draft, with --attach: the weight format the engine serves the draft model in, whatever its --weights "
        "(default int8: the 4-layer default draft decodes garbage with 4-bit weights; README, Drafters)",
    )
    p.add_argument("--force", action="store_true", help="draft: replace a store model of the same name")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run_train(args: argparse.Namespace) -> int:
    import torch

    from ..drafters import attach
    from ..store import DEFAULT_MODEL, StoreError, check_model_name

    if args.rounds < 1 or min(args.gen_rounds, args.chat_rounds, args.open_rounds) < 0:
        print(
            "error: --rounds is at least 1, --gen-rounds, --chat-rounds and --open-rounds at least 0", file=sys.stderr
        )
        return 2
    torch.set_num_threads(args.threads)
    name = args.model or DEFAULT_MODEL
    try:
        if args.kind == "draft" and args.out is not None:  # checked before the teacher's pass and the training
            try:
                check_model_name(args.out)
            except StoreError as e:
                raise StoreError(f"--kind draft writes a model into the store, so --out names it: {e}") from None
        store, loaded, corpora = _load_target(args, name)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    run = _teacher_pass(args, name, store, loaded, corpora)
    torch.set_num_threads(args.train_threads)
    spec = {"mtp": _train_mtp, "eagle": _train_eagle, "draft": _train_draft}[args.kind](run)
    if args.attach:
        try:
            entry = attach(store, name, spec, weights=args.attach_weights if args.kind == "draft" else None)
        except StoreError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"attached {entry.kind} drafter {entry.name} to {name}")
    return 0


def portable_path(path: str | Path) -> str:
    """A path as a training record keeps it, so that a shipped drafter's record names no machine's folders:
    relative to the repository when the file lies in it or beside it (the corpus is ../shared/corpus/),
    else its file name."""
    import os

    from ..launcher import REPO_ROOT

    p = Path(path).expanduser().resolve()
    return os.path.relpath(p, REPO_ROOT) if p.is_relative_to(REPO_ROOT.parent) else p.name


def _portable_words(words: list[str]) -> list[str]:
    return [portable_path(w) if w.startswith(("/", "~")) else w for w in words]


@dataclass
class TrainingRun:
    """One training run after the teacher pass: its arguments, its target and data, and its record (``info``,
    saved with the drafter). ``started``: wall and CPU clocks when training began."""

    args: argparse.Namespace
    name: str  # the target's store name
    store: ModelStore
    loaded: LoadedModel
    digest: str  # the target's, as an MTP head names it
    train: TeacherData
    heldout: TeacherData
    info: dict
    bf16: bool
    reports: dict[str, TeacherData] = field(default_factory=dict)  # held-out sets figured after every epoch
    started: tuple[float, float] = field(default_factory=lambda: (time.monotonic(), time.process_time()))

    def settings(self, kind: str) -> TrainSettings:
        """The training settings from the command line, each unset one at ``kind``'s default."""
        from ..distill import TrainSettings

        epochs, batch, lr = TRAIN_DEFAULTS[kind]
        a = self.args
        return TrainSettings(
            epochs=a.epochs or epochs,
            batch=a.batch or batch,
            lr=a.lr or lr,
            seed=a.seed,
            bf16=self.bf16,
            progress=not a.quiet,
            max_seconds=a.minutes * 60 if a.minutes else None,
            patience=a.patience,
        )

    def initial_head(self, load: Callable[[Path], Head], read_config: Callable[[Path], Any]) -> Head | None:
        """With ``--init FILE``: the head to continue training (read with ``load``), its record kept in this
        run's; else None."""
        if not self.args.init:
            return None
        path = Path(self.args.init)
        head = load(path)
        self.continued_from(self.args.init, read_config(path).training)
        return head

    def continued_from(self, init: str, training: dict) -> None:
        """Records the head this run continued training (``--init``) and that head's own record."""
        self.info["init"] = {"file": portable_path(init), "training": training}

    def write_head(
        self,
        module: Any,  # an MTPModule or EagleModule: each has its own config type
        kind: str,
        agree: list[float],
        save: Callable[..., None],
    ) -> str:
        """Records the run in the head's config, writes it with ``save`` and returns its drafter spec."""
        from ..models.head_files import config_path

        self.trained(agree)
        module.config = module.config.model_copy(update={"training": self.info})
        out = Path(self.args.out or f"{self.name}-{kind}.safetensors")
        save(module, out)
        print(
            f"wrote {out} and {config_path(out)}  (held-out acceptance by draft position: "
            f"{', '.join(f'{a:.3f}' for a in agree)}; train {self.info['train_s']:.0f} s)"
        )
        return f"{kind}:{out}"

    def slice_vocab(self, module: Any) -> None:
        """With ``--draft-vocab N``: gives the head the N tokens the target chose most often in the training data
        (with its end-of-sequence tokens) and records how much of the target's greedy choices they cover."""
        from ..distill import follows_greedy
        from ..models.draft_vocab import coverage, default_size, frequent_ids, set_draft_vocab

        cfg, eos = self.loaded.config, self.loaded.manifest.tokenizer.eos_token_ids
        size = default_size(cfg.vocab_size, self.args.draft_vocab)
        if not size:
            return
        ids = frequent_ids(self.train.top[..., 0], cfg.vocab_size, size, always=list(eos))
        set_draft_vocab(module, ids)
        held = self.heldout.top[:, :-1, 0][follows_greedy(self.heldout)]  # on the greedy path, as drafts are
        self.info["draft_vocab"] = {
            "size": int(ids.numel()),
            "coverage_train": round(coverage(ids, self.train.top[..., 0]), 4),
            "coverage_heldout": round(coverage(ids, held), 4),
        }
        print(
            f"draft vocabulary: {ids.numel()} tokens, covering {self.info['draft_vocab']['coverage_heldout']:.1%} "
            "of the target's held-out greedy choices"
        )

    def trained(self, agree: list[float]) -> None:
        """Records the training time and the held-out acceptance by draft position."""
        self.info |= {
            "train_s": round(time.monotonic() - self.started[0], 1),
            "train_cpu_s": round(time.process_time() - self.started[1], 1),
            "heldout_acceptance": [round(a, 4) for a in agree],
        }


def _load_target(args: argparse.Namespace, name: str) -> tuple[ModelStore, LoadedModel, list[Path]]:
    """The store, the target and the corpus files; StoreError when one is missing or the draft's name is taken."""
    from ..shipped import ensure_default_model
    from ..store import DEFAULT_MODEL, ModelStore, StoreError, load_model

    if name == DEFAULT_MODEL:
        ensure_default_model()
    store = ModelStore()
    cfg = store.get(name).config
    if cfg.recurrent and args.kind != "mtp":
        # an MTP head is stateless and its teacher pass runs the model's own forward (distill/stateful.py); a
        # draft model or an EAGLE head of such a target is not served (drafters.py)
        raise StoreError(
            f"model {name!r} carries recurrent state ({cfg.family}): only --kind mtp trains a drafter for it"
        )
    loaded = load_model(name, store=store)
    if (args.chat_rounds or args.open_rounds) and not loaded.manifest.tokenizer.chat_template:
        raise StoreError(f"model {name!r} has no chat template: --chat-rounds and --open-rounds need one")
    if args.kind == "draft":
        out = args.out or f"{name}-draft"
        if store.exists(out) and not args.force:
            raise StoreError(f"model {out!r} is already in the store; use --force or another --out")
    corpora = [Path(c).expanduser() for c in args.corpus]
    for c in corpora:
        if not c.is_file():
            raise StoreError(f"no such corpus file: {c}")
    return store, loaded, corpora


def _teacher_pass(
    args: argparse.Namespace, name: str, store: ModelStore, loaded: LoadedModel, corpora: list[Path]
) -> TrainingRun:
    """The target's predictions over the corpora (from the teacher cache when the same plan ran before)."""
    from .. import distill
    from ..drafters import target_digest
    from ..paths import cache_dir

    digest = target_digest(loaded.manifest)
    cache = None if args.cache_dir == "none" else Path(args.cache_dir or cache_dir("distill"))
    bf16 = args.precision == "bf16" or (args.precision == "auto" and distill.bf16_is_fast())
    plan = distill.DataPlan(
        corpora=corpora,
        tokens=args.tokens,
        gen_tokens=args.gen_tokens,
        seq_len=args.seq_len,
        heldout_tokens=args.heldout_tokens,
        teacher_dtype="bfloat16" if bf16 else "float32",
    )
    t0 = time.monotonic()
    train, heldout = distill.build_teacher_data(
        loaded.model,
        loaded.tokenizer_path,
        plan,
        cache,
        digest,
        progress=not args.quiet,
        rounds=args.rounds,
        gen_rounds=args.gen_rounds,
        gen_round_tokens=args.gen_round_tokens or distill.GEN_ROUND_TOKENS,
        chat_rounds=args.chat_rounds,
        open_rounds=args.open_rounds,
        chat=distill.model_chat_frame(loaded.tokenizer_path, loaded.manifest.tokenizer)
        if args.chat_rounds or args.open_rounds
        else None,
    )
    command = "pie " + shlex.join(_portable_words(sys.argv[1:])) if sys.argv and sys.argv[0].endswith("pie") else None
    info = {
        "command": command,
        "corpus": [portable_path(c) for c in corpora],
        "tokens": train.num_tokens,
        "teacher_s": round(time.monotonic() - t0, 1),
        "precision": "bf16" if bf16 else "fp32",
    }
    run = TrainingRun(args, name, store, loaded, digest, train, heldout, info, bf16)
    if args.data:
        _add_answer_data(run)
    return run


def _add_answer_data(run: TrainingRun) -> None:
    """With ``--data``: the folders' training answers join the training data (every window cut to ``--window``
    positions), their held-out answers become the held-out set, and both held-out sets are figured every epoch."""
    from .. import distill
    from ..distill.answer_data import answers_to_teacher, split_answers
    from ..distill.answer_shards import Manifest, read_answers

    args, t0 = run.args, time.monotonic()
    if args.kind != "mtp":
        raise SystemExit("error: --data trains an MTP head only (--kind mtp)")
    answers = [a for d in args.data for a in read_answers(Path(d))]
    train, held = split_answers(answers)
    head, fast, w = run.loaded.model, run.bf16, args.window
    answer_only = args.data_positions == "answers"
    chat_train = answers_to_teacher(train, head, w, args.depth, answer_only=answer_only, fast=fast, progress=True)
    chat_held = answers_to_teacher(held, head, w // 2, args.depth, answer_only=True, fast=fast)
    if chat_train is None or chat_held is None:
        raise SystemExit(f"error: {', '.join(args.data)} holds too few answers (train and held-out) for --window {w}")
    run.reports = {"chat": chat_held, "corpus": run.heldout}
    run.train = distill.TeacherData.concat([rewindow(run.train, w), chat_train])
    run.heldout = chat_held
    manifests = [Manifest.model_validate_json((Path(d) / "manifest.json").read_text()) for d in args.data]
    run.info["data"] = [
        {"folder": portable_path(d), "settings": m.settings, "answers": m.answers, "answer_tokens": m.answer_tokens}
        for d, m in zip(args.data, manifests)
    ]
    run.info["tokens"] = run.train.num_tokens
    print(
        f"chat answers: {len(train)} training ({chat_train.num_tokens} positions), {len(held)} held-out "
        f"({chat_held.num_tokens} positions), read in {time.monotonic() - t0:.0f} s"
    )


def rewindow(data: TeacherData, length: int) -> TeacherData:
    """``data``'s sequences cut into windows of ``length`` positions (its length a multiple of it)."""
    from .. import distill

    s, t = data.tokens.shape
    if t % length:
        raise SystemExit(f"error: --seq-len {t} is not a multiple of --window {length}")
    k = t // length
    return distill.TeacherData(
        data.tokens.reshape(s * k, length),
        data.hidden.reshape(s * k, length, -1),
        data.top.reshape(s * k, length, -1),
    )


def _train_mtp(run: TrainingRun) -> str:
    """Trains and writes an MTP head; returns its drafter spec (``mtp:FILE``)."""
    from .. import distill
    from ..models.mtp import MTPHead, load_mtp, read_config, save_mtp

    module = distill.train_mtp(
        run.loaded.model,
        run.train,
        run.heldout,
        run.settings("mtp"),
        depth=run.args.depth,
        target_name=run.name,
        target_digest=run.digest,
        blocks=run.args.blocks,
        init=run.initial_head(load_mtp, read_config),
        reports=run.reports,
    )
    run.slice_vocab(module)
    head = MTPHead(module, run.loaded.model)
    agree = distill.mtp_agreement(head, run.heldout, module.config.depth, conditional=True)
    for name, data in run.reports.items():
        figures = distill.mtp_agreement(head, data, module.config.depth, conditional=True)
        run.info[f"heldout_acceptance_{name}"] = [round(a, 4) for a in figures]
        print(f"held-out {name} acceptance by position (draft vocabulary): {', '.join(f'{a:.3f}' for a in figures)}")
    return run.write_head(module, "mtp", agree, save_mtp)


def _train_eagle(run: TrainingRun) -> str:
    """Trains and writes an EAGLE head; returns its drafter spec (``eagle:FILE``)."""
    from ..distill.eagle import eagle_agreement, train_eagle
    from ..models.eagle import load_eagle, read_config, save_eagle

    target = run.loaded.llama
    module = train_eagle(
        target,
        run.train,
        run.heldout,
        run.settings("eagle"),
        depth=run.args.depth,
        target_name=run.name,
        target_digest=run.digest,
        init=run.initial_head(load_eagle, read_config),
    )
    run.slice_vocab(module)
    agree = eagle_agreement(module, target, run.heldout, module.config.depth, conditional=True)
    return run.write_head(module, "eagle", agree, save_eagle)


def _train_draft(run: TrainingRun) -> str:
    """Trains a draft model and imports it into the store; returns its drafter spec (``draft:NAME``)."""
    from .. import distill

    args = run.args
    out = args.out or f"{run.name}-draft"
    layers = [int(x) for x in args.layers.split(",")]
    draft = distill.train_draft(run.loaded.llama, run.train, run.heldout, run.settings("draft"), layers=layers)
    agree = distill.draft_agreement(draft, run.heldout, 3)
    run.trained(agree)
    result = save_draft(run.store, draft, run.loaded, out, run.info, force=args.force)
    print(
        f"imported draft model {out} ({result.manifest.parameters / 1e6:.1f}M parameters; held-out "
        f"acceptance by draft position: {', '.join(f'{a:.3f}' for a in agree)}; "
        f"train {run.info['train_s']:.0f} s)"
    )
    return f"draft:{out}"


def save_draft(
    store: ModelStore, draft: LlamaForCausalLM, loaded: LoadedModel, name: str, info: dict, force: bool = False
) -> ImportResult:
    """Imports a trained draft model into the store under ``name`` with the target's tokenizer."""
    from ..models.checkpoint import Converted

    state = {k: v.detach().float().contiguous() for k, v in draft.state_dict().items()}
    if draft.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    converted = Converted(
        family=loaded.manifest.family,
        config=draft.config,
        tensors=state,
        tokenizer_json=loaded.tokenizer_path.read_text(),
        tokenizer=loaded.manifest.tokenizer,
        source=f"pie drafter train --kind draft from {loaded.manifest.name} "
        f"(sha256 {loaded.manifest.files['model.safetensors'][:12]}...); {info}",
    )
    return store.add(converted, name, force=force)
