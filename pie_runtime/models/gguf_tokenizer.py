"""A tokenizer.json, built with the ``tokenizers`` library, from the vocabulary a llama.cpp GGUF carries
(``tokenizer.ggml.*``), splitting text into the same ids as llama.cpp's own tokenizer (src/llama-vocab.cpp).

Two tokenizer models:

- ``gpt2``: byte-level BPE over the GGUF's ``merges``. Text is first cut by the pre-tokenizer's split rules
  (``tokenizer.ggml.pre``), each regex applied in turn to every piece the previous one left, matches and the
  text between them both kept (llama.cpp's ``unicode_regex_split``; ``Split(..., "isolated")`` here).
- ``llama`` (SentencePiece): llama.cpp merges the adjacent pair whose joined text is the vocabulary piece of
  highest score, leftmost first, until none is left, then spells a character outside the vocabulary as its
  ``<0xXX>`` byte pieces. That is BPE whose merge list is every (left, right) pair of pieces whose join is a
  piece, ranked by the joined piece's score (how transformers' SentencePiece converters build it), with byte
  fallback. Spaces become "▁"; ``add_space_prefix`` puts one before every stretch of text that starts the
  input or follows a special token.

Special tokens (llama.cpp's ``tokenizer_st_partition``): control and unknown pieces are split out of the text
when special tokens are parsed (always, in the SDK), user-defined pieces always; both as added tokens matched
on the raw text.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from .checkpoint import TokenizerInfo
from .config import UnsupportedModelError

# llama.cpp's split rules (src/llama-vocab.cpp, llm_tokenizer_bpe), verbatim
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_RULES: dict[str, tuple[str, ...]] = {
    "llama-bpe": (_LLAMA3,),  # Llama 3.x
    "qwen2": (_QWEN2,),  # Qwen2, Qwen2.5, Qwen3
    "smollm": (r"\p{N}", _GPT2),  # SmolLM, SmolLM2: digits one by one, then GPT-2's rule
    "gpt-2": (_GPT2,),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
}
# other names llama.cpp gives the same rule; "gpt2" was accepted here before (llama.cpp itself refuses it)
PRE_ALIASES = {"llama3": "llama-bpe", "llama-v3": "llama-bpe", "deepseek-r1-qwen": "qwen2", "gpt2": "gpt-2"}
IGNORE_MERGES = {"llama-bpe"}  # a split piece that is a whole vocabulary token is taken as is
TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
# turn ends llama.cpp also stops at (its end-of-generation list), beside the eos/eot/eom ids
TURN_END_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>")


class TokenType(IntEnum):
    """llama.cpp's ``llama_token_type`` (``tokenizer.ggml.token_type``)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


def supported() -> str:
    """The supported tokenizers, in words, for refusals and docs."""
    models = ", ".join(f"{k} ({v})" for k, v in TOKENIZER_MODELS.items())
    return f"tokenizer models {models}; gpt2 pre-tokenizers {', '.join(SPLIT_RULES)}"


def pre_tokenizer_name(meta: dict[str, Any]) -> str:
    """The split rule's name (``SPLIT_RULES`` key) of a ``gpt2`` GGUF; llama.cpp reads a missing one as default."""
    pre = meta.get("tokenizer.ggml.pre") or "default"
    return PRE_ALIASES.get(pre, pre)


def check_tokenizer(meta: dict[str, Any]) -> None:
    """Refuse a tokenizer this module cannot rebuild exactly, naming the supported ones (cheap: metadata only)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise UnsupportedModelError(f"unsupported GGUF tokenizer model {kind!r}; supported: {supported()}")
    if kind == "gpt2" and pre_tokenizer_name(meta) not in SPLIT_RULES:
        pre = meta.get("tokenizer.ggml.pre")
        raise UnsupportedModelError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {supported()}")
    if "tokenizer.ggml.tokens" not in meta:
        raise UnsupportedModelError("the GGUF carries no vocabulary (tokenizer.ggml.tokens)")


def build_tokenizer(meta: dict[str, Any]) -> tuple[str, TokenizerInfo]:
    """tokenizer.json text and tokenizer facts from the GGUF's ``tokenizer.ggml.*`` fields."""
    from tokenizers import AddedToken

    check_tokenizer(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)]
    spm = meta["tokenizer.ggml.model"] == "llama"
    tok = _spm_tokenizer(meta, tokens, types) if spm else _bpe_tokenizer(meta, tokens)
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == TokenType.USER_DEFINED]
    )
    special = [t for t, ty in zip(tokens, types) if ty in (TokenType.CONTROL, TokenType.UNKNOWN)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    info = _info(meta, tokens, types, spm, special)
    _post_processor(tok, tokens, info)
    return tok.to_str(), info


def _info(meta: dict[str, Any], tokens: list[str], types: list[int], spm: bool, special: list[str]) -> TokenizerInfo:
    """BOS/EOS ids and rules, with llama.cpp's defaults for what the GGUF leaves out: SentencePiece BOS 1, EOS 2,
    add BOS; byte-level BPE adds BOS only under the Llama 3 rule (its default ids, 11, are GPT-NeoX's: no id
    here instead)."""

    def token_id(key: str, default: int | None) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        value = default if value is None else int(value)
        return value if value is not None and 0 <= value < len(tokens) else None

    bos = token_id("bos_token_id", 1 if spm else None)
    eos = token_id("eos_token_id", 2 if spm else None)
    eos_ids = [eos] if eos is not None else []
    ends = [token_id(key, None) for key in ("eot_token_id", "eom_token_id")]
    ends += [i for i, (t, ty) in enumerate(zip(tokens, types)) if t in TURN_END_TOKENS and ty == TokenType.CONTROL]
    eos_ids += sorted({i for i in ends if i is not None} - set(eos_ids))
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = spm or pre_tokenizer_name(meta) == "llama-bpe"
    return TokenizerInfo(
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens=special,
        add_bos_token=bool(add_bos) and bos is not None,
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token")) and eos is not None,
    )


def _post_processor(tok, tokens: list[str], info: TokenizerInfo) -> None:
    """BOS/EOS as the model adds them, for tools that encode with ``add_special_tokens=True`` (the SDK adds them
    itself, once: ``inferlet.Tokenizer.encode_prompt``)."""
    from tokenizers import processors

    if not (info.add_bos_token or info.add_eos_token):
        return
    pairs: list[tuple[str, int]] = []
    if info.add_bos_token and info.bos_token_id is not None:
        pairs.append((tokens[info.bos_token_id], info.bos_token_id))
    a = [*(p[0] for p in pairs), "$A"]
    if info.add_eos_token and info.eos_token_ids:
        pairs.append((tokens[info.eos_token_ids[0]], info.eos_token_ids[0]))
        a.append(tokens[info.eos_token_ids[0]])
    b = [x if x != "$A" else "$B" for x in a]
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(a), pair=" ".join([*a, *b]), special_tokens=pairs
    )


def _bpe_tokenizer(meta: dict[str, Any], tokens: list[str]):
    """Byte-level BPE with the pre-tokenizer's split rules."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = pre_tokenizer_name(meta)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in IGNORE_MERGES
    )
    tok = Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(rule), behavior="isolated") for rule in SPLIT_RULES[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) pair of pieces whose join is a piece, the join of higher score first, pairs of one
    join by the left piece's and then the right piece's id. Joins of equal score go by id, where llama.cpp
    takes the leftmost pair: SentencePiece gives its normal pieces distinct scores, so only pieces split out
    before merging (control, user-defined) or never joined share one."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = sorted(ids.items(), key=lambda kv: (-scores[kv[1]], kv[1]))
    merges: list[tuple[str, str]] = []
    for piece, _ in ranked:
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        merges.extend(sorted(pairs, key=lambda p: (ids[p[0]], ids[p[1]])))
    return merges


def _spm_tokenizer(meta: dict[str, Any], tokens: list[str], types: list[int]):
    """SentencePiece as llama.cpp runs it: BPE by score with <0xXX> byte fallback, spaces as "▁"."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
    vocab = {t: i for i, t in enumerate(tokens)}  # llama.cpp refuses a vocabulary with a piece twice
    unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
    unk_token = tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None
    model = models.BPE(
        vocab=vocab, merges=spm_merges(tokens, scores), unk_token=unk_token, fuse_unk=True, byte_fallback=True
    )
    tok = Tokenizer(model)
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix")
    add_prefix = True if add_prefix is None else bool(add_prefix)  # llama.cpp's default for SentencePiece
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if add_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok
