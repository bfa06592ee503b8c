"""`pie run NAME_OR_FILE [--model NAME] [--engine ADDR [--token @FILE]] [--json] -- ARGS`: run one inferlet.

Without --engine an engine is started on the model (the default one, imported on first use) and stopped
afterwards: the embedded default. An engine on ``tcp://`` (``pie engine --listen tcp://... --token``, or
``pie serve --listen``) needs its token: ``--token @FILE`` (the file's text), else ``$PIE_TOKEN``; a literal
``--token VALUE`` works, warned about (every local user can read a process's argv). The inferlet process gets
it in ``$PIE_TOKEN``, never on its command line.

What it prints, for people: the inferlet's text on stdout as it streams (or at the end, when it streamed none),
then one line of stats on stderr (tokens, tok/s, prefill, and for a speculative run its rounds and acceptance).
``--json`` prints the whole result as one JSON object on stdout's last line instead, for programs. An error is
one line on stderr, starting ``error:``, that says what to do about it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .engine import add_engine_options, weights_words

# result fields the stats line and the text stand for; any other field of a dict result is printed as is
SHOWN = ("text", "token_ids", "finish_reason", "stop_reason", "stats", "speculation", "choices")


def register(sub) -> None:
    p = sub.add_parser("run", help="run a shipped inferlet by name, or a .py file")
    p.add_argument("inferlet", help="a shipped inferlet's name or a path to a .py file")
    p.add_argument("--model", action="append", default=None, help="model(s) for the embedded engine")
    p.add_argument("--engine", default=None, help="address of a running engine")
    p.add_argument("--token", default=None, help="the engine's token (tcp://): @FILE, else $PIE_TOKEN")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    add_engine_options(p)
    p.set_defaults(func=run)


def engine_args(args) -> list[str]:
    out = [
        "--device",
        args.device,
        *weights_words(args),
        "--page-size",
        str(args.page_size),
        "--max-batch-tokens",
        str(args.max_batch_tokens),
    ]
    out += ["--kv-pages", str(args.kv_pages)] if args.kv_pages else ["--kv-memory", str(args.kv_memory)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    out += ["--thread-wait", getattr(args, "thread_wait", "spin")]
    out += ["--compile" if args.compile else "--no-compile"]
    out += [] if args.prefix_cache else ["--no-prefix-cache"]
    out += ["--kv-swa-full"] if getattr(args, "swa_full", False) else []
    out += ["--state-slots", str(args.state_slots)]
    out += ["--recurrent-fold", getattr(args, "recurrent_fold", "per-row")]
    out += ["--per-row-states", str(getattr(args, "per_row_states", 8))]
    if getattr(args, "tensor_parallel", 1) > 1:
        out += ["--tensor-parallel", str(args.tensor_parallel)]
    out += ["--pass-cost-rows", str(args.pass_cost_rows), "--pass-cost-cache", args.pass_cost_cache]
    out += ["--program-memory", str(args.program_memory), "--max-programs", str(args.max_programs)]
    out += [] if args.prepack else ["--no-prepack"]
    return out


def run(args) -> int:
    from ..launcher import EmbeddedEngine, LaunchError, resolve_inferlet

    streamed = _Echo()
    try:
        path = resolve_inferlet(args.inferlet)
        token = _token(args)
        if args.engine:
            _check_address(args.engine, token)
            outcome = _run(path, args.engine, args.inferlet_args, streamed, token)
        else:
            with EmbeddedEngine(args.model, engine_args(args), die_with_parent=True) as engine:
                outcome = _run(path, engine.address, args.inferlet_args, streamed)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not outcome["ok"]:
        if streamed.any:
            sys.stdout.write("\n")
        print(f"error: {outcome['error']}", file=sys.stderr)
        return 1
    result = outcome["result"]
    if args.json:
        if streamed.any:
            sys.stdout.write("\n")
        print(json.dumps(result))
        return 0
    print_result(result, streamed.any)
    return 0


class _Echo:
    """The inferlet's stdout passed through to ours as it comes; ``any``: whether it wrote anything."""

    def __init__(self) -> None:
        self.any = False

    def __call__(self, chunk: bytes) -> None:
        self.any = self.any or bool(chunk.strip())
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()


def _run(path: Path, address: str, words: list[str], echo: _Echo, token: str | None = None) -> dict:
    from ..launcher import run_inferlet

    return run_inferlet(path, address, words, on_output=echo, token=token)


def _token(args) -> str | None:
    """The engine's token: ``--token @FILE`` or a literal (warned about), else ``$PIE_TOKEN``; a LaunchError
    for a token with no --engine (the embedded engine takes none) or an unreadable file."""
    from ..launcher import LaunchError
    from .secrets import secret

    if args.token is not None and not args.engine:
        raise LaunchError("--token is for --engine tcp://...; the engine pie run starts itself needs none")
    try:
        return secret(args.token, "--token", "PIE_TOKEN") if args.engine else None
    except ValueError as e:
        raise LaunchError(str(e)) from None


def _check_address(address: str, token: str | None = None) -> None:
    """A LaunchError saying what to do when ``address`` is an ipc:// socket no engine listens on (a client would
    otherwise wait for it forever), or a tcp:// address given no token (the engine refuses every client then)."""
    from ..launcher import LaunchError

    if address.startswith("tcp://") and not token:
        raise LaunchError(
            f"{address} is a tcp:// engine: give its token with --token @FILE or $PIE_TOKEN "
            "(the one it was started with: pie engine --token, pie serve --token)"
        )
    if address.startswith("ipc://") and not Path(address.removeprefix("ipc://")).exists():
        raise LaunchError(
            f"no engine listens on {address} (no such socket file): start one with `pie engine --listen {address}`,"
            " or leave out --engine and pie run starts one for this run"
        )


def print_result(result, streamed: bool) -> None:
    """The result for a person: the text when the run streamed none, the other choices' texts, any field the
    inferlet added, and one line of stats on stderr."""
    if not isinstance(result, dict):
        if result is not None:
            print(json.dumps(result))
        return
    text = result.get("text")
    if isinstance(text, str) and not streamed:
        sys.stdout.write(text)
    sys.stdout.write("\n")
    for i, choice in enumerate((result.get("choices") or [])[1:], start=1):  # choice 0 is the text above
        if isinstance(choice, dict):
            print(f"--- choice {i}\n{choice.get('text', '')}")
    sys.stdout.flush()
    for key, value in result.items():
        if key not in SHOWN:
            print(f"{key}: {json.dumps(value)}", file=sys.stderr)
    line = stats_line(result)
    if line:
        print(line, file=sys.stderr)


def stats_line(result: dict) -> str | None:
    """One readable line of a completion-style result's stats, e.g. ``12 tokens, 9.4 tok/s, 3 rounds,
    acceptance 0.57 (4 of 7 drafts); prompt 5 tokens, prefill 142 ms; stopped at the token limit``; None when
    the result carries no stats."""
    stats = result.get("stats")
    if not isinstance(stats, dict):
        return None
    parts = []
    if "generated_tokens" in stats:
        parts.append(f"{stats['generated_tokens']} tokens")
    if stats.get("decode_tokens_per_s"):
        parts.append(f"{stats['decode_tokens_per_s']:.1f} tok/s")
    speculation = result.get("speculation")
    spec: dict = speculation if isinstance(speculation, dict) else stats
    if "rounds" in spec:
        parts.append(f"{spec['rounds']} rounds")
    if spec.get("proposed"):
        parts.append(
            f"acceptance {spec.get('acceptance', 0.0):.2f} ({spec.get('accepted', 0)} of {spec['proposed']} drafts)"
        )
    line = ", ".join(parts)
    prompt = []
    if "prompt_tokens" in stats:
        cached = stats.get("cached_tokens") or 0
        prompt.append(f"prompt {stats['prompt_tokens']} tokens" + (f" ({cached} cached)" if cached else ""))
    if stats.get("prefill_ms"):
        prompt.append(f"prefill {stats['prefill_ms']:.0f} ms")
    if prompt:
        line += "; " + ", ".join(prompt)
    finish = _finish(result.get("finish_reason"), result.get("stop_reason"))
    if finish:
        line += f"; {finish}"
    if stats.get("device"):
        line += f"; {stats['device']}"
    return line or None


def _finish(reason, stop) -> str:
    """Why the text ended, in words (finish_reason and stop_reason as the OpenAI API and vLLM name them)."""
    if reason == "length":
        return "stopped at the token limit"
    if reason == "stop":
        return f"stopped at {stop!r}" if stop is not None else "stopped at end of sequence"
    return f"finished: {reason}" if reason else ""
