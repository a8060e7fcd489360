"""Streaming text: incremental decode equals full decode, never broken UTF-8, exact stop strings."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers

from server.models.default_model import find_default_model, missing_default_model_message
from server.models.demo_model import build_tokenizer
from server.text.byte_stream import BytePieces, ByteStream
from server.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.text.loader import load_tokenizer
from server.text.tokenizer import Tokenizer

MULTIBYTE_TEXT = "naïve café 東京の空 🎉🚀 👨‍👩‍👧 𝕳𝖊𝖑𝖑𝖔 Ω≈ç√ and plain words"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return Tokenizer.from_dir(d)


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feed ids in random chunks of 1-3; return every chunk's text, then the flush."""
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 3)
        out.append(detok.add(ids[i:i + k]))
        i += k
    out.append(detok.flush())
    return out


def random_ids(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    # Byte tokens (ids 4..259 in the demo vocab) are drawn often, so many streams contain
    # broken and completed multi-byte sequences.
    return [rng.randrange(4, 260) if rng.random() < 0.5 else rng.randrange(tok.vocab_size) for _ in range(n)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_equals_full_decode_on_random_streams(tok: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(1)
    for _ in range(300):
        ids = random_ids(tok, rng, rng.randint(1, 30))
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens)
        assert "".join(stream(detok, ids, rng)) == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_prompt_is_context_not_output(tok: Tokenizer) -> None:
    rng = random.Random(2)
    for _ in range(100):
        prompt = tok.encode(rng.choice(["Hello there.", "東京 🎉", "x", ""]) + " " + str(rng.random()))
        out = random_ids(tok, rng, rng.randint(1, 20))
        detok = IncrementalDetokenizer(tok, prompt)
        want = tok.decode(prompt + out)[len(tok.decode(prompt)):]
        assert "".join(stream(detok, out, rng)) == want


def test_no_replacement_char_when_full_text_has_none(tok: Tokenizer) -> None:
    rng = random.Random(3)
    ids = tok.encode(MULTIBYTE_TEXT * 3, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE_TEXT)  # the small vocabulary splits these characters into bytes
    for _ in range(50):
        chunks = stream(IncrementalDetokenizer(tok, []), ids, rng)
        assert all("\ufffd" not in c for c in chunks)
        assert "".join(chunks) == MULTIBYTE_TEXT * 3


def test_multibyte_character_is_held_until_complete(tok: Tokenizer) -> None:
    prompt = tok.encode("Party:", add_special_tokens=False)
    emoji = tok.encode("🎉", add_special_tokens=False)
    assert len(emoji) >= 3  # four UTF-8 bytes, split across tokens by the small vocabulary
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add([t]) for t in emoji]
    assert pieces == [""] * (len(emoji) - 1) + ["🎉"]
    assert detok.flush() == ""


def test_flush_releases_a_sequence_that_never_completes(tok: Tokenizer) -> None:
    first_byte = tok.encode("東", add_special_tokens=False)[0]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(tok.encode("ok", add_special_tokens=False)) == "ok"
    assert detok.add([first_byte]) == ""
    assert detok.flush() == "\ufffd"


def test_prompt_list_is_copied(tok: Tokenizer) -> None:
    prompt = tok.encode("Hello")
    detok = IncrementalDetokenizer(tok, prompt)
    prompt.extend(tok.encode(" garbage", add_special_tokens=False))  # the engine appends to its list
    assert detok.add(tok.encode(" world", add_special_tokens=False)) == " world"


def test_leading_space_survives_with_sentencepiece_style_decoder(tmp_path: Path) -> None:
    # Metaspace decoders drop the space of a word-initial '▁' at the start of a decode; decoding a
    # window of context keeps it.
    words = ["<unk>", "▁Hello", "▁world", "!", "▁again"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>"}))
    sp = Tokenizer.from_dir(tmp_path)
    assert sp.decode([2]) == "world"
    detok = IncrementalDetokenizer(sp, [1])
    assert [detok.add([t]) for t in (2, 3, 4)] == [" world", "!", " again"]
    fresh = IncrementalDetokenizer(sp, [])
    assert [fresh.add([t]) for t in (1, 2)] == ["Hello", " world"]


# -- stop strings ----------------------------------------------------------------------------------
def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, Optional[str]]:
    """The first match is the one ending earliest; ties go to the longest."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < (best[0] + len(best[1]), -len(best[1]))):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s)] if include else text[:i], s


def run_matcher(chunks: list[str], stops: list[str], include: bool) -> tuple[str, Optional[str]]:
    m = StopStringMatcher(stops, include)
    out = []
    for c in chunks:
        emit, stopped, matched = m.feed(c)
        out.append(emit)
        if stopped:
            return "".join(out), matched
    out.append(m.flush())
    return "".join(out), None


def test_stop_string_spanning_chunks() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello S") == ("hello ", False, None)
    assert m.feed("T") == ("", False, None)
    assert m.feed("OP and more") == ("", True, "STOP")
    assert m.feed("anything") == ("", True, "STOP")


def test_held_tail_is_released_when_it_cannot_match() -> None:
    m = StopStringMatcher(["abc"])
    assert m.feed("xab") == ("x", False, None)
    assert m.feed("d") == ("abd", False, None)
    assert m.feed("ab") == ("", False, None)
    assert m.flush() == "ab"


def test_stop_at_the_very_first_chunk() -> None:
    assert StopStringMatcher(["Hi"]).feed("Hi there") == ("", True, "Hi")
    assert StopStringMatcher(["Hi"], include_stop_str_in_output=True).feed("Hi there") == ("Hi", True, "Hi")


def test_overlapping_candidates_pick_the_earliest_ending_match() -> None:
    # "bc" completes before "abcd" could; same-end ties go to the longer stop.
    assert run_matcher(["a", "b", "c", "d"], ["abcd", "bc"], False) == ("a", "bc")
    assert run_matcher(["abcd"], ["abcd", "bc"], False) == ("a", "bc")
    assert run_matcher(["xabc"], ["bc", "abc"], False) == ("x", "abc")
    assert run_matcher(["xabc"], ["bc", "abc"], True) == ("xabc", "abc")
    # A partial candidate that fails must not hide a later full match inside it.
    assert run_matcher(["aba", "bac"], ["abac"], False) == ("ab", "abac")
    assert run_matcher(["ab", "ab", "x"], ["abac"], False) == ("ababx", None)


def test_include_stop_str_never_emits_text_after_the_stop() -> None:
    assert run_matcher(["say ST", "OP now"], ["STOP"], True) == ("say STOP", "STOP")


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
def test_any_chunking_gives_the_reference_result(text: str, stops: list[str], cuts: list[int], include: bool) -> None:
    points = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(points, points[1:])]
    assert run_matcher(chunks, stops, include) == reference_stop(text, stops, include)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(["ok", ""])


class _DecodeOnly:
    """The tokenizer with only `decode`: IncrementalDetokenizer's two-decode path (no DecodeStream)."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class _DecodeStreamOnly(_DecodeOnly):
    """The tokenizer with tokenizers' DecodeStream as its stream, as a tokenizer whose decoder is
    not plain ByteLevel gets (Tokenizer.decode_stream gives byte-level ones a ByteStream)."""

    def decode_stream(self, context: Sequence[int],
                      skip_special_tokens: bool = True) -> Optional[Callable[[list[int]], Optional[str]]]:
        from tokenizers.decoders import DecodeStream

        s = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        backend = self._tok._tok
        return lambda ids: s.step(backend, ids)


def _chunks_of_each_path(tok: Tokenizer, prompt: list[int], ids: list[int], skip_special_tokens: bool,
                         cuts: list[int]) -> list[list[str]]:
    """Every chunk (and the flushes after each cut) of a sample streamed through the ByteStream,
    DecodeStream and two-decode paths, each with the same random chunking."""
    outs = []
    for t in (tok, _DecodeStreamOnly(tok), _DecodeOnly(tok)):
        detok = IncrementalDetokenizer(t, prompt, skip_special_tokens)
        if isinstance(t, _DecodeStreamOnly):
            assert detok._stream is None or not isinstance(detok._stream, ByteStream)
        elif isinstance(t, _DecodeOnly):
            assert detok._stream is None
        r = random.Random(len(ids))
        chunks: list[str] = []
        for a, b in zip([0] + cuts, cuts + [len(ids)]):
            chunks += stream(detok, ids[a:b], r)
        outs.append(chunks)
    return outs


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_stream_paths_give_the_two_decode_paths_chunks(tok: Tokenizer, skip_special_tokens: bool) -> None:
    # Chunk for chunk, with prompts as context (some cut inside a character) and flushes
    # mid-stream (later adds go on from the flushed text).
    assert isinstance(tok.decode_stream([], skip_special_tokens), ByteStream)  # a byte-level vocabulary
    rng = random.Random(7)
    for _ in range(300):
        prompt = random_ids(tok, rng, rng.randint(0, 8))
        ids = random_ids(tok, rng, rng.randint(1, 40))
        cuts = sorted(rng.sample(range(len(ids) + 1), k=min(2, len(ids) + 1)))
        byte_stream, decode_stream, two_decodes = _chunks_of_each_path(tok, prompt, ids, skip_special_tokens, cuts)
        assert byte_stream == two_decodes
        assert decode_stream == two_decodes


def _token_by_token(t: Any, prompt: list[int], ids: list[int], skip_special_tokens: bool, cuts: list[int],
                    one: bool) -> list[str]:
    """Every token's text (add_token when `one`, else add([id])) and the flushes after each cut."""
    detok = IncrementalDetokenizer(t, prompt, skip_special_tokens)
    out: list[str] = []
    for k, i in enumerate(ids):
        out.append(detok.add_token(i) if one else detok.add([i]))
        if k + 1 in cuts:
            out.append(detok.flush())
    out.append(detok.flush())
    return out


def _check_add_token(t: Tokenizer, samples: list[tuple[list[int], list[int]]], skip_special_tokens: bool) -> None:
    rng = random.Random(5)
    fast = 0
    for prompt, ids in samples:
        cuts = sorted(rng.sample(range(1, len(ids) + 1), k=min(2, len(ids))))
        want = _token_by_token(_DecodeOnly(t), prompt, ids, skip_special_tokens, cuts, one=False)
        assert _token_by_token(t, prompt, ids, skip_special_tokens, cuts, one=True) == want
        assert _token_by_token(_DecodeStreamOnly(t), prompt, ids, skip_special_tokens, cuts, one=True) == want
        fast += sum(1 for i in ids if (BytePieces(t._tok, skip_special_tokens).piece(i)).isascii())
    assert fast > len(samples)  # ASCII ids (ByteStream.step's shortcut) were among them, and others


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_add_token_gives_the_two_decode_paths_text_token_by_token(tok: Tokenizer, skip_special_tokens: bool) -> None:
    # ByteStream.step's ASCII shortcut on a clean stream, its full path after held bytes or text,
    # and DecodeStream's, each token's text against two decodes, flushes mid-stream included.
    rng = random.Random(9)
    samples = [(random_ids(tok, rng, rng.randint(0, 8)), random_ids(tok, rng, rng.randint(1, 40))) for _ in range(300)]
    plain = tok.encode(" naïve café 東京 and more, in plain ASCII too", add_special_tokens=False)
    samples += [([], plain), (plain[:3], plain[3:])]
    _check_add_token(tok, samples, skip_special_tokens)


def test_a_decoder_that_is_not_plain_byte_level_keeps_decode_stream(tmp_path: Path) -> None:
    # ByteLevel inside a Sequence, and Metaspace: text that is not the tokens' bytes end to end.
    for decoder in (decoders.Sequence([decoders.ByteLevel()]), decoders.Metaspace()):
        raw = RawTokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
        raw.decoder = decoder
        raw.save(str(tmp_path / "tokenizer.json"))
        made = Tokenizer.from_dir(tmp_path).decode_stream([1])
        assert made is not None and not isinstance(made, ByteStream)


def test_ids_past_the_vocabulary_give_no_text_as_decode(tok: Tokenizer) -> None:
    # A model's vocabulary can be padded past its tokenizer's (Qwen's 151,936 rows for 151,665 ids).
    ids = tok.encode("ok", add_special_tokens=False) + [tok.vocab_size, tok.vocab_size + 7]
    ids += tok.encode(" go", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    assert isinstance(detok._stream, ByteStream)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == tok.decode(ids) == "ok go"


# -- the real default model's tokenizer (SmolLM2's, from its GGUF) ------------------------------
@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    found = find_default_model()
    if found is None:
        pytest.fail(missing_default_model_message())
    return load_tokenizer(found.path)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_every_id_of_a_real_vocabulary_has_the_bytes_decode_gives(smol: Tokenizer, skip_special_tokens: bool) -> None:
    pieces = BytePieces(smol._tok, skip_special_tokens)
    for i in range(smol.vocab_size):
        assert pieces.piece(i).decode("utf-8", "replace") == smol.decode([i], skip_special_tokens), i
    assert smol.vocab_size == 49152 and None not in pieces.table


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_real_vocabulary_streams_the_two_decode_paths_chunks(smol: Tokenizer, skip_special_tokens: bool) -> None:
    # SmolLM2's byte tokens (its single-character ids whose character spells a byte >= 0x80), its
    # added tokens, and text with multi-byte characters, mixed in random samples.
    byte_ids = [i for i in range(smol.vocab_size) if len(smol.id_to_token(i) or "") == 1
                and BytePieces(smol._tok, False).piece(i)[0] >= 0x80]
    assert len(byte_ids) >= 64
    added = sorted(smol._tok.get_added_tokens_decoder())
    text = smol.encode(MULTIBYTE_TEXT + " The end.", add_special_tokens=False)
    rng = random.Random(11)
    for _ in range(200):
        n = rng.randint(1, 40)
        ids = [rng.choice(byte_ids) if r < 0.4 else rng.choice(added) if r < 0.5 else
               rng.choice(text) if r < 0.8 else rng.randrange(smol.vocab_size)
               for r in (rng.random() for _ in range(n))]
        prompt = [rng.choice(byte_ids + text) for _ in range(rng.randint(0, 6))]
        cuts = sorted(rng.sample(range(len(ids) + 1), k=min(2, len(ids) + 1)))
        byte_stream, decode_stream, two_decodes = _chunks_of_each_path(smol, prompt, ids, skip_special_tokens, cuts)
        assert byte_stream == two_decodes
        assert decode_stream == two_decodes
    streamed = IncrementalDetokenizer(smol, [])
    assert "".join(streamed.add([i]) for i in text) + streamed.flush() == MULTIBYTE_TEXT + " The end."
    streamed = IncrementalDetokenizer(smol, [])
    assert "".join(streamed.add_token(i) for i in text) + streamed.flush() == MULTIBYTE_TEXT + " The end."
    samples = []
    for _ in range(100):
        ids = [rng.choice(byte_ids) if r < 0.3 else rng.choice(added) if r < 0.4 else rng.choice(text)
               for r in (rng.random() for _ in range(rng.randint(1, 40)))]
        samples.append(([rng.choice(text) for _ in range(rng.randint(0, 6))], ids))
    _check_add_token(smol, samples, skip_special_tokens)


def test_a_prompt_cut_inside_a_character_moves_to_the_stream_with_its_first_text(tok: Tokenizer) -> None:
    # The prompt ends on the first byte of "é" (byte tokens: the demo vocab's ids 4..259), so the
    # sample starts on the two decodes. From its first text on it runs DecodeStream, and every
    # chunk is still the two-decode path's.
    broken = [i for i in range(4, 260) if tok.decode([i]) == "\ufffd"]
    lead, tail = next((a, b) for a in broken for b in broken if tok.decode([a, b]) == "é")
    prompt = tok.encode("Hello ", add_special_tokens=False) + [lead]
    out = [tail] + tok.encode(" naïve café 東京 and more", add_special_tokens=False)
    detok, plain = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(_DecodeOnly(tok), prompt)
    assert detok._stream is None
    texts = [detok.add([i]) for i in out]
    assert texts == [plain.add([i]) for i in out]
    assert detok._stream is not None
    first = next(k for k, t in enumerate(texts) if t)
    assert first < len(out) - 1 and "".join(texts[first:]).endswith("東京 and more")
