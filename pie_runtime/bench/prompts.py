"""The prompts the benchmarks read (``pie_runtime/assets/prompts/``): ``mixed`` (prose to continue: little a
lookup drafter can copy), ``repetitive`` (a chat request to copy a passage back, where lookup drafts pay) and
``prefill512`` (a chat request of about 512 tokens, `pie bench decode`'s)."""

from __future__ import annotations

from pathlib import Path

from ..launcher import LaunchError

PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "prompts"
NAMED = ("mixed", "repetitive", "prefill512")
DECODE_PROMPT = "prefill512"  # `pie bench decode`'s
SPECULATION_PROMPT = "repetitive"  # `pie bench decode --speculation`'s


def prompt_text(choice: str) -> str:
    """A named prompt's text, or the text of the file ``choice``; LaunchError when there is neither."""
    path = PROMPTS / f"{choice}.txt" if choice in NAMED else Path(choice)
    if not path.is_file():
        raise LaunchError(f"no prompt file {path}; name one of {', '.join(NAMED)} or give a text file")
    return path.read_text()
