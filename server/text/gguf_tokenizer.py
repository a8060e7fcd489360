"""tokenizer_from_gguf: build a Tokenizer from a GGUF file's `tokenizer.*` metadata with `tokenizers`.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token types, special ids
and the chat template as metadata. This module owns rebuilding the equivalent `tokenizers` pipeline:

- `gpt2` (byte-level BPE): the pre-tokenizer is chosen by `tokenizer.ggml.pre`, which names the
  split regex the vocabulary was trained with (gpt-2, smollm, llama-bpe, qwen2);
- `llama` (SentencePiece-style BPE with byte fallback): "▁" for spaces, a prefix space on the first
  word when `tokenizer.ggml.add_space_prefix` says so, merges from the file or, when the file has
  none, derived from the token scores (a higher score merges earlier, as SentencePiece ranks pieces).

Control tokens become special added tokens and user-defined ones plain added tokens, so both are
matched whole in text. No transformers at run time.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _BackendTokenizer

from server.models.config import ModelLoadError
from server.models.gguf_file import GGUFFile
from server.text.tokenizer import Tokenizer, TokenizerError

# llama.cpp's token types (llama_token_type in gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes the vocabularies were trained with (llama.cpp's per-`pre` patterns).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: letters run on through combining marks (\p{M}), which Qwen2's regex splits off.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> Any:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.pre -> (pre-tokenizer factory, normalizer factory or None, ignore_merges).
# Llama 3 looks whole words up before merging (ignore_merges), as its tokenizer.json and llama.cpp
# do; Qwen2 NFC-normalises first, as its tokenizer.json does.
_PRE_TOKENIZERS: dict[str, tuple[Callable[[], Any], Optional[Callable[[], Any]], bool]] = {
    "gpt-2": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None, False),
    "smollm": (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]), None, False),
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), None, True),
    "llama3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), None, True),
    "llama-v3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), None, True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), lambda: normalizers.NFC(), False),
    "deepseek-r1-qwen": (lambda: _split_then_bytes(_QWEN2_SPLIT), lambda: normalizers.NFC(), False),
    "qwen35": (lambda: _split_then_bytes(_QWEN35_SPLIT), lambda: normalizers.NFC(), False),
}
SUPPORTED_PRE_TOKENIZERS = tuple(_PRE_TOKENIZERS)
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes map to themselves, the
    other 68 bytes to code points 256 upwards, in byte order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """The Tokenizer a GGUF file describes. Raises TokenizerError naming the file and the key."""
    try:
        f = GGUFFile.open(path)
        return _build(f)
    except ModelLoadError as e:
        raise TokenizerError(str(e)) from None


def _build(f: GGUFFile) -> Tokenizer:
    kind = f.get_str("tokenizer.ggml.model")
    tokens: list[str] = f.get_list("tokenizer.ggml.tokens", str)
    if not tokens:
        raise TokenizerError(f"{f.path}: metadata key 'tokenizer.ggml.tokens' is empty")
    types: list[int] = f.get_list("tokenizer.ggml.token_type", int, [])
    if types and len(types) != len(tokens):
        raise TokenizerError(
            f"{f.path}: metadata key 'tokenizer.ggml.token_type' has {len(types)} entries for {len(tokens)} tokens"
        )
    n = len(tokens)
    ids = {name: f.token_id(f"tokenizer.ggml.{key}", n) for name, key in (
        ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"), ("eot", "eot_token_id"), ("eom", "eom_token_id"))}

    if kind == "gpt2":
        backend, spelled = _byte_level_bpe(f, tokens)
        add_bos_default = False
    elif kind == "llama":
        backend = _sentencepiece_bpe(f, tokens, ids["unk"])
        spelled = tokens
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say
    else:
        raise TokenizerError(
            f"{f.path}: metadata key 'tokenizer.ggml.model' is {kind!r}; supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}"
        )
    _add_special_tokens(backend, spelled, tokens, types, byte_level=kind == "gpt2")

    def content(i: Optional[int]) -> Optional[str]:
        return spelled[i] if i is not None else None

    return Tokenizer(
        backend,
        bos_token=content(ids["bos"]),
        eos_token=content(ids["eos"]),
        pad_token=content(ids["pad"]),
        unk_token=content(ids["unk"]),
        add_bos_token=f.get_bool("tokenizer.ggml.add_bos_token", add_bos_default),
        chat_template=_chat_templates(f),
        model_max_length=_context_length(f),
        extra_eos_token_ids=[i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None],
        name=str(f.path),
    )


def _merges(f: GGUFFile) -> Optional[list[tuple[str, str]]]:
    raw = f.get_list("tokenizer.ggml.merges", str, None)
    if raw is None:
        return None
    out = []
    for i, m in enumerate(raw):
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise TokenizerError(f"{f.path}: metadata key 'tokenizer.ggml.merges'[{i}] is not 'left right': {m!r}")
        out.append((left, right))
    return out


def _byte_level_bpe(f: GGUFFile, tokens: list[str]) -> tuple[_BackendTokenizer, list[str]]:
    pre = f.get_str("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise TokenizerError(
            f"{f.path}: metadata key 'tokenizer.ggml.pre' is {pre!r}, which pagewire does not know; "
            f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
        )
    merges = _merges(f)
    if merges is None:
        raise TokenizerError(f"{f.path}: missing metadata key 'tokenizer.ggml.merges' (needed by a gpt2 tokenizer)")
    # Byte-level vocabularies spell every token in GPT-2's byte alphabet; a token written in plain
    # text (some converters do this for added tokens) is re-spelled so the BPE model can reach it.
    alphabet = _byte_alphabet()
    chars = set(alphabet.values())
    spelled = [t if set(t) <= chars else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    make_pre, make_norm, ignore_merges = _PRE_TOKENIZERS[pre]
    backend = _BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = make_pre()
    if make_norm is not None:
        backend.normalizer = make_norm()
    backend.decoder = decoders.ByteLevel()
    return backend, spelled


def _sentencepiece_bpe(f: GGUFFile, tokens: list[str], unk: Optional[int]) -> _BackendTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(f)
    if merges is None:
        scores: list[float] = f.get_list("tokenizer.ggml.scores", float, None) or []
        if len(scores) != len(tokens):
            raise TokenizerError(
                f"{f.path}: a llama tokenizer needs 'tokenizer.ggml.merges' or one 'tokenizer.ggml.scores' entry per token"
            )
        merges = _merges_from_scores(tokens, scores, vocab)
    add_prefix = f.get_bool("tokenizer.ggml.add_space_prefix", True)
    backend = _BackendTokenizer(models.BPE(
        vocab=vocab, merges=merges, unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True, byte_fallback=True,
    ))
    # SentencePiece marks spaces with "▁" and, with add_space_prefix, puts one before the first word
    # of the text only ("first"), not after every special token.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a token into two known
    pieces is a merge ranked by the token's score (higher first); ties go to the longer left piece,
    then the longer right piece, then vocabulary order."""
    ranked: list[tuple[float, int, int, int, int, str, str]] = []
    for tok, score in zip(tokens, scores):
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, -len(left), -len(right), vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(r[5], r[6]) for r in ranked]


def _add_special_tokens(
    backend: _BackendTokenizer, spelled: list[str], raw: list[str], types: list[int], byte_level: bool
) -> None:
    """Control tokens (e.g. <|im_start|>) become special added tokens and user-defined ones plain
    added tokens, so text containing them maps to their ids instead of being cut into pieces."""
    special, plain = [], []
    for s, r, t in zip(spelled, raw, types):
        if t == _CONTROL and (not byte_level or s == r):
            # A control token that had to be re-spelled is not written in text as such; adding its
            # plain form would invent a new id past the model's vocabulary.
            special.append(AddedToken(s, special=True, normalized=False))
        elif t == _USER_DEFINED:
            plain.append(AddedToken(s, special=False, normalized=False))
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def _chat_templates(f: GGUFFile) -> dict[str, str] | str | None:
    """`tokenizer.chat_template`, plus named ones listed in `tokenizer.chat_templates` and stored
    under `tokenizer.chat_template.<name>`."""
    default = f.get_str("tokenizer.chat_template", None)
    names: list[str] = f.get_list("tokenizer.chat_templates", str, [])
    named = {n: f.get_str(f"tokenizer.chat_template.{n}") for n in names}
    if named:
        if default is not None:
            named.setdefault("default", default)
        return named
    return default


def _context_length(f: GGUFFile) -> Optional[int]:
    arch = f.get_str("general.architecture", None)
    return f.get_int(f"{arch}.context_length", None) if arch else None
