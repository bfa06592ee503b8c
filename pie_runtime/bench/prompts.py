"""The prompts the benchmarks read (``pie_runtime/assets/prompts/``): ``mixed`` (prose to continue: little a
lookup drafter can copy), ``repetitive`` (a chat request to copy a passage back, where lookup drafts pay) and
``prefill512`` (a chat request of about 512 tokens, `pie bench decode`'s); and the set ``chat`` (``chat/*.txt``:
short requests in the default model's chat template, on topics and in words that `pie drafter data`'s training
prompts never use, so a drafter trained on its answers is measured on held-out chat)."""

from __future__ import annotations

from pathlib import Path

from ..launcher import LaunchError

PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "prompts"
NAMED = ("mixed", "repetitive", "prefill512")
SETS = ("chat",)  # a folder of prompts: each one a column of `pie bench speculation`
DECODE_PROMPT = "prefill512"  # `pie bench decode`'s
SPECULATION_PROMPT = "repetitive"  # `pie bench decode --speculation`'s


def prompt_text(choice: str) -> str:
    """A named prompt's text, or the text of the file ``choice``; LaunchError when there is neither."""
    path = PROMPTS / f"{choice}.txt" if choice in NAMED else Path(choice)
    if not path.is_file():
        raise LaunchError(f"no prompt file {path}; name one of {', '.join(NAMED)} or give a text file")
    return path.read_text()


def expand_prompts(choices: list[str]) -> list[tuple[str, str]]:
    """(name, text) of each choice, a set (:data:`SETS`) giving one per file: ``chat`` → chat/01, chat/02, ..."""
    out = []
    for choice in choices:
        if choice in SETS:
            out += [(f"{choice}/{f.stem}", f.read_text()) for f in sorted((PROMPTS / choice).glob("*.txt"))]
        else:
            out.append((choice, prompt_text(choice)))
    return out
