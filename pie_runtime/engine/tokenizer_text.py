"""The tokenizer.json text an engine keeps for its clients (the ``tokenizer`` request), read as ASCII: every
non-ASCII character written as JSON's ``\\uXXXX`` escape (a surrogate pair beyond the BMP). The document parses
to the same value, and Python keeps an ASCII str at a byte a character, where one character beyond the BMP
(Gemma 3's vocabulary has emoji) makes the whole str four bytes a character: the engine would hold its largest
tokenizers at several times their file's size for as long as it runs."""

from __future__ import annotations

import codecs
import re
from json.encoder import encode_basestring_ascii
from pathlib import Path

_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
_CHUNK = 1 << 20  # bytes decoded at a time: the file's text is never a wide str whole


def ascii_json_text(path: Path, chunk: int = _CHUNK) -> str:
    """The JSON document at ``path`` (UTF-8) as ASCII text, non-ASCII characters escaped. Non-ASCII characters
    occur only inside a JSON document's strings, where an escape stands for the character."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    out = bytearray()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            out += _escaped(decoder.decode(block))
    out += _escaped(decoder.decode(b"", final=True))
    return out.decode("ascii")


def _escaped(text: str) -> bytes:
    return _NON_ASCII.sub(lambda m: encode_basestring_ascii(m.group())[1:-1], text).encode("ascii")
