"""The prompts the benchmarks read (``pie_runtime/assets/prompts/``): ``mixed`` (prose to continue: little a
lookup drafter can copy), ``repetitive`` (a chat request to copy a passage back, where lookup drafts pay) and
``prefill512`` (a chat request of about 512 tokens, `pie bench decode`'s); and the set ``chat`` (``chat/*.txt``:
short requests in the default model's chat template, on topics and in words that `pie drafter data`'s training
prompts never use, so a drafter trained on its answers is measured on held-out chat); and a prompt of exactly N
token ids cut from a corpus text (`pie bench decode --depth N`: decode after a long context)."""

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


def depth_prompt_ids(tokenizer_file: Path, corpus: Path, n: int, bos: int | None) -> list[int]:
    """Exactly ``n`` token ids: ``bos`` (when the model adds one) and then the first ids of ``corpus``'s text, as
    the model's tokenizer reads it; LaunchError when the text is shorter. Cut by ids, not by text, so every runner
    gets the same ids and the same count."""
    from tokenizers import Tokenizer

    head = [bos] if bos is not None else []
    want = n - len(head)
    tok = Tokenizer.from_file(str(tokenizer_file))
    text = corpus.read_text(errors="replace")
    chars = 8 * want + 64  # more than enough characters for ``want`` ids (English runs ~4 characters an id)
    ids = tok.encode(text[:chars], add_special_tokens=False).ids
    if len(ids) < want:
        raise LaunchError(f"{corpus} holds {len(ids)} tokens, fewer than the {want} asked for")
    return head + ids[:want]


def depth_corpus(given: Path | None) -> Path:
    """The text a ``--depth`` prompt is cut from: ``given``, else the corpus's austen.txt (``$PIE_CORPUS_DIR`` or
    ``shared/corpus/`` beside the repository); LaunchError naming where it looked when there is none."""
    from ..distill.data import corpus_folders, find_corpus

    if given is not None:
        if not given.is_file():
            raise LaunchError(f"no corpus file {given}")
        return given
    found = find_corpus("austen.txt")
    if found is None:
        where = ", ".join(str(f) for f in corpus_folders())
        raise LaunchError(f"no corpus text for --depth in {where}: name a UTF-8 text file with --depth-corpus FILE")
    return found


def expand_prompts(choices: list[str]) -> list[tuple[str, str]]:
    """(name, text) of each choice, a set (:data:`SETS`) giving one per file: ``chat`` → chat/01, chat/02, ..."""
    out = []
    for choice in choices:
        if choice in SETS:
            out += [(f"{choice}/{f.stem}", f.read_text()) for f in sorted((PROMPTS / choice).glob("*.txt"))]
        else:
            out.append((choice, prompt_text(choice)))
    return out
