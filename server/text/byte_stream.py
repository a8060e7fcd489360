"""Streaming decode for byte-level tokenizers: each token id's bytes, and a stream built on them.

Torch-free. A tokenizer whose decoder is tokenizers' `ByteLevel` (GPT-2's scheme: SmolLM2, Llama 3,
Qwen, gpt-oss, and the GGUF files of type "gpt2") spells every byte as one character. Its text for
a list of ids is the UTF-8 decoding, with U+FFFD for what is broken, of the ids' bytes laid end to
end. So a stream needs, per new token, one table lookup and an incremental UTF-8 decoder, where
tokenizers' DecodeStream decodes its window again in Rust on every call.

Why it matters: the engine thread detokenises each sampled token between two decode steps, after
the weights' stream has flushed the caches. There a DecodeStream step took 33 us a token on
SmolLM2's tokenizer, against 4 us hot; this stream's step took 8.5 us (bench/RESULTS.md, session
34), on a step of 3-4 ms.

What each id's bytes are, as tokenizers' decode makes them:
  * a vocabulary token: each character mapped back to its byte; a token with a character outside
    the byte alphabet keeps its own UTF-8 bytes whole (the ByteLevel decoder's rule);
  * an added token: its text as `decode([id])` gives it (verbatim in tokenizers 0.23; nothing for
    a special one when special tokens are skipped). Its bytes are valid UTF-8, so laid between other
    tokens' bytes they end any broken sequence as tokenizers' per-segment decoding does;
  * an id outside the vocabulary: nothing (decode skips it).
"""
from __future__ import annotations

import codecs
from typing import Any, Optional

_REPLACEMENT = "\ufffd"


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte -> character table, inverted: the character each byte is spelled with."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in spelled.items()}


_CHAR_BYTES = _byte_alphabet()


def is_byte_level(backend: Any) -> bool:
    """Whether a tokenizers.Tokenizer decodes with ByteLevel alone (not inside a Sequence with
    other steps, whose effect on the text this module does not model)."""
    try:
        from tokenizers import decoders
    except ImportError:  # pragma: no cover - tokenizers is a dependency
        return False
    return isinstance(backend.decoder, decoders.ByteLevel)


class BytePieces:
    """Each id's bytes for one skip_special_tokens choice, computed on first use: a vocabulary of
    150k ids would take a second at load, and a stream meets a few thousand of them.

    `table[i]` is None until id i's bytes are known; `piece(i)` fills it. Shared by every stream
    of a tokenizer (the engine thread's; a list item's store is atomic under the GIL anyway)."""

    def __init__(self, backend: Any, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._added = frozenset(backend.get_added_tokens_decoder())
        self.table: list[Optional[bytes]] = [None] * backend.get_vocab_size(with_added_tokens=True)

    def piece(self, token_id: int) -> bytes:
        """Token `token_id`'s bytes (see the module docstring)."""
        table = self.table
        if token_id < len(table):
            known = table[token_id]
            if known is not None:
                return known
        text = self._backend.id_to_token(token_id)
        if text is None:
            data = b""
        elif token_id in self._added:
            data = self._backend.decode([token_id], skip_special_tokens=self._skip).encode("utf-8")
        else:
            try:
                data = bytes([_CHAR_BYTES[c] for c in text])
            except KeyError:
                data = text.encode("utf-8")
        if token_id < len(table):
            table[token_id] = data
        return data


class ByteStream:
    """A stream with DecodeStream's contract (server.text.tokenizer.Tokenizer.decode_stream): each
    call with new ids returns the text they complete, or None while there is none or the text so
    far ends in U+FFFD or inside a character. DecodeStream waits there, for an incomplete
    character and for one that a later byte breaks alike, and so does this (the held text goes
    out with the next call's), so the chunks are the two-decode path's (tests/test_detokenizer.py).

    The context it starts after must end on a character boundary, as IncrementalDetokenizer
    ensures (it starts streams only where the context's text does not end in U+FFFD); UTF-8 then
    decodes on from there without it."""

    __slots__ = ("_pieces", "_table", "_decode", "_state", "_held", "_clean")

    def __init__(self, pieces: BytePieces) -> None:
        self._pieces = pieces
        self._table = pieces.table
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._decode = utf8.decode
        self._state = utf8.getstate  # (the bytes of an incomplete character it holds, flag)
        self._held = ""
        # Nothing held: no text, and no bytes of an incomplete character in the UTF-8 decoder.
        self._clean = True

    def step(self, token_id: int) -> Optional[str]:
        """The call for one id (a decode step's token): a list index, and with nothing held and
        ASCII bytes (most tokens of most text) their str at once. The incremental decoder's
        Python-level decode and getstate took 20 us a token right after a step (cold caches);
        for ASCII bytes on a clean stream they give the same text and keep the stream clean."""
        table = self._table
        data = table[token_id] if token_id < len(table) else None
        if data is None:
            data = self._pieces.piece(token_id)
        if self._clean and data.isascii():
            return data.decode("ascii") if data else None
        return self._feed(data)

    def __call__(self, ids: list[int]) -> Optional[str]:
        if len(ids) == 1:
            return self.step(ids[0])
        return self._feed(b"".join([self._pieces.piece(i) for i in ids]))

    def _feed(self, data: bytes) -> Optional[str]:
        text = self._held + self._decode(data)
        # Held too while the decoder holds an incomplete character's bytes: the text so far would
        # end in U+FFFD for DecodeStream, and IncrementalDetokenizer takes text as the end of its
        # window's (flush decodes the window again, held bytes and all).
        if not text or text[-1] == _REPLACEMENT or self._state()[0]:
            self._held = text
            self._clean = not text and not self._state()[0]
            return None
        self._held = ""
        self._clean = True
        return text
