"""Tokenizers built from tiny GGUF files' metadata match transformers' GGUF tokenizer, for the
SentencePiece-style `llama` model (byte fallback, prefix space, merges derived from scores) and the
byte-level `gpt2` model with the llama-bpe and qwen2 pre-tokenizers.

The real model's gpt2/smollm tokenizer is checked on 1,000 strings in test_gguf_smollm2.py.
"""
from __future__ import annotations

import random
import unicodedata
from pathlib import Path
from typing import Any, Optional

import pytest

from server.text.loader import load_tokenizer
from tests.gguf_files import CHATML, train_byte_level_vocab, train_sentencepiece_vocab


def write_tokenizer_gguf(path: Path, model: str, tokens: list[str], types: list[int], *,
                         merges: Optional[list[str]] = None, scores: Optional[list[float]] = None,
                         pre: Optional[str] = None, extra: Optional[dict[str, Any]] = None) -> Path:
    """A GGUF with only tokenizer metadata (architecture llama), enough for both tokenizers."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", model)
    if pre is not None:
        w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    if merges is not None:
        w.add_array("tokenizer.ggml.merges", merges)
    if scores is not None:
        w.add_array("tokenizer.ggml.scores", scores)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_string("tokenizer.chat_template", CHATML)
    for k, v in (extra or {}).items():
        w.add_bool(k, v) if isinstance(v, bool) else w.add_string(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _strings(n: int, seed: int) -> list[str]:
    """Mixed text: corpus words, digits, whitespace runs, punctuation/code, accents, CJK, emoji."""
    from server.models.demo_model import _corpus_paragraphs

    rng = random.Random(seed)
    words = " ".join(_corpus_paragraphs()).split()
    extras = ["12345", "3.14159", "  ", "\n\n", "\t", "def f(x):\n    return x**2", "café", "naïve",
              "日本語", "中文字符", "😀", "👍🏽", "—", "ü", "x=1;y=2", "<b>", "{'a': [1, 2]}", "   spaced"]
    out = []
    for _ in range(n):
        parts = [rng.choice(words) if rng.random() < 0.7 else rng.choice(extras) for _ in range(rng.randint(1, 8))]
        sep = rng.choice([" ", "", "  ", "\n"])
        out.append(sep.join(parts))
    return out


def _reference(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokens, scores, types = train_sentencepiece_vocab(200)
    return write_tokenizer_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", "llama", tokens, types, scores=scores)


def test_sentencepiece_llama_tokenizer_matches_transformers(spm_file: Path) -> None:
    ours, ref = load_tokenizer(spm_file), _reference(spm_file)
    assert ours.add_bos_token and ours.bos_token == "<s>" and ours.eos_token == "</s>"
    strings = _strings(300, seed=1)
    byte_fallbacks = 0
    for s in strings:
        ids = ours.encode(s)
        assert ids == ref.encode(s), s
        assert ids[0] == 1  # add_bos defaults to true for a SentencePiece vocabulary
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), s
        # SentencePiece drops the one prefix space it added; text that starts with spaces is the
        # known lossy case (the same in both), everything else round-trips.
        assert ours.decode(ids) == s or s[:1].isspace(), s
        byte_fallbacks += any(3 <= i < 259 for i in ids)
    assert byte_fallbacks > 20  # CJK and emoji are not in the vocabulary: they went through <0xXX> bytes


def test_sentencepiece_without_prefix_space(tmp_path: Path) -> None:
    tokens, scores, types = train_sentencepiece_vocab(200)
    path = write_tokenizer_gguf(tmp_path / "np.gguf", "llama", tokens, types, scores=scores,
                                extra={"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False})
    tok = load_tokenizer(path)
    ids = tok.encode("the cat")
    assert tok.id_to_token(ids[0])[0] != "▁" and tok.decode(ids) == "the cat" and 1 not in ids


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_byte_level_pre_tokenizers_match_transformers(pre: str, tmp_path: Path) -> None:
    tokens, merges, types = train_byte_level_vocab(600)
    path = write_tokenizer_gguf(tmp_path / "bl.gguf", "gpt2", tokens, types, merges=merges, pre=pre)
    ours, ref = load_tokenizer(path), _reference(path)
    assert not ours.add_bos_token
    for s in _strings(300, seed=2) + ["<|im_start|>user\nhi 12345<|im_end|>"]:
        s = unicodedata.normalize("NFC", s)  # Qwen2 NFC-normalises; transformers' GGUF path does not
        ids = ours.encode(s)
        assert ids == ref.encode(s), s
        assert ours.decode(ids, skip_special_tokens=False) == s
    # Control tokens stay whole; the regex splits digits in threes (llama-bpe) or ones (qwen2).
    assert ours.encode("<|im_start|>")[0] == 1
    pieces = [p for p, _ in ours._tok.pre_tokenizer.pre_tokenize_str("12345 abc")]
    assert pieces == (["123", "45", "Ġabc"] if pre == "llama-bpe" else ["1", "2", "3", "4", "5", "Ġabc"])
    if pre == "qwen2":
        assert ours.encode("cafe\u0301") == ours.encode("café")


def test_chat_template_and_special_ids_come_from_metadata(spm_file: Path) -> None:
    tok = load_tokenizer(spm_file)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_ids == frozenset({2}) and tok.bos_token_id == 1


def test_qwen35_pre_tokenizer_matches_transformers_qwen3_5_tokenizer(tmp_path: Path) -> None:
    """`qwen35` (Qwen3.5's GGUF files): NFC, then Qwen2's split with combining marks kept in their
    word, then bytes -- as transformers' Qwen3_5Tokenizer over the same vocabulary and merges."""
    from transformers import Qwen3_5Tokenizer

    tokens, merges, types = train_byte_level_vocab(600)
    path = write_tokenizer_gguf(tmp_path / "q35.gguf", "gpt2", tokens, types, merges=merges, pre="qwen35")
    ours = load_tokenizer(path)
    ref = Qwen3_5Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    marks = ["हिन्दी भाषा", "naïve cafe\u0301", "e\u0308\u0301x", "ไทย ภาษา", "a\u20dd b"]
    for s in _strings(200, seed=5) + marks:
        assert ours.encode(s) == ref.encode(s, add_special_tokens=False), s
    # Marks stay in their word here, where Qwen2's regex splits them off.
    words = [p for p, _ in ours._tok.pre_tokenizer.pre_tokenize_str("हिन्दी")]
    assert len(words) == 1
