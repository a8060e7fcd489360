"""Streaming text for one sample: incremental detokenization and stop-string matching.

Torch-free. `IncrementalDetokenizer` turns each new batch of token ids into only the new text,
never a broken UTF-8 sequence. `StopStringMatcher` finds stop strings that span token boundaries
and holds back any tail that could still become one. The engine's output processor chains the
two for each sample (`SampleText`).
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

# How many prompt tokens to re-decode with the first output tokens. Decoding a little context
# (instead of a token alone) keeps leading spaces right for SentencePiece-style tokenizers, which
# drop a word-initial space at the start of a decode. vLLM uses the same number.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """New text for each batch of new tokens, using vLLM's prefix_offset/read_offset technique.

    Invariant: the ids in `[prefix_offset, read_offset)` decode to text that has already been
    emitted (and ends on a character boundary). Each `add` decodes that window with and without
    the new tokens and emits the difference. If the longer decode ends in U+FFFD, a multi-byte
    character is still incomplete (byte-level BPE splits them across tokens), so nothing is
    emitted and the offsets stay, until a later token completes it or `flush` gives up waiting.

    A tokenizer with `decode_stream` (server.text.tokenizer.Tokenizer) gives one call per step
    instead: a byte-level tokenizer's ByteStream (server/text/byte_stream.py, a table lookup per
    token), any other's DecodeStream (the same technique inside the tokenizers library: 1.4 ->
    0.6 us a token on SmolLM2's tokenizer and English text, bench/RESULTS.md session 23). The window
    is still kept here, since `flush` needs the held-back ids, which the streams do not give out. A
    sample whose context ends inside a character starts on the two decodes and moves to a stream
    with its first text.

    Args:
        tokenizer: anything with `decode(ids, skip_special_tokens)` (server.text.tokenizer.Tokenizer).
        prompt_token_ids: the prompt; only its last few ids are kept (copied) as decode context.
        skip_special_tokens: leave special tokens (e.g. <|im_end|>) out of the text.
    """

    def __init__(
        self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Only the decode window is kept: old ids before prefix_offset are dropped as it advances,
        # so memory and decode cost stay constant however long the sample runs.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._streams = getattr(self._tok, "decode_stream", None) is not None
        self._set_stream(self._new_stream())

    def _set_stream(self, stream: Optional[Callable[[list[int]], Optional[str]]]) -> None:
        self._stream = stream
        # A ByteStream's one-id call (add_token's), when the stream has one.
        self._step: Optional[Callable[[int], Optional[str]]] = getattr(stream, "step", None)

    def _new_stream(self) -> Optional[Callable[[list[int]], Optional[str]]]:
        make = getattr(self._tok, "decode_stream", None)
        if make is None:
            return None
        # DecodeStream takes a context whose text ends in an incomplete character as not yet
        # shown, and would emit that context's text with the first new token, and a ByteStream
        # starts on a character boundary (a prompt cut inside a character; the ids `flush` gave
        # up on): such a sample keeps the two decodes.
        if self._ids and self._decode(self._ids).endswith(_REPLACEMENT_CHAR):
            return None
        return make(self._ids, skip_special_tokens=self._skip)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return only the newly completed text (possibly "")."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        if self._stream is not None:
            text = self._stream(list(new_token_ids))
            return self._advance(text) if text else ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT_CHAR):
            text = self._advance(full_text[len(prefix_text):])
            # The window now ends on a character boundary: a sample that started here (a prompt
            # cut inside a character) goes on with the one-call stream from its first text on.
            # A prompt of raw byte tokens kept every step of bench.engine_step on two decodes.
            if self._stream is None and self._streams:
                self._set_stream(self._new_stream())
            return text
        return ""

    def add_token(self, token_id: int) -> str:
        """add([token_id]): a decode step's one sampled token. On a ByteStream, its one-id step,
        without the lists `add` builds (the engine thread calls this between two steps, with the
        caches cold after the weights' stream)."""
        step = self._step
        if step is None:
            return self.add([token_id])
        ids = self._ids
        ids.append(token_id)
        text = step(token_id)
        return self._advance(text) if text else ""

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a trailing byte sequence that never completed, shown
        as U+FFFD). Call once when the sample finishes; later `add` calls continue normally."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        text = self._advance(full_text[len(prefix_text):])
        if self._streams:  # a stream still holds the ids given up on: start it again here
            self._set_stream(self._new_stream())
        return text

    def _advance(self, text: str) -> str:
        # The old read window becomes the new prefix context; drop ids before it.
        del self._ids[:self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return text


class StopStringMatcher:
    """Finds the first stop string in a stream of text chunks.

    "First" means the match that ends earliest (ties: the longest one). That rule gives the same
    answer however the text is chunked, because a match is reported in the very feed that
    completes it. Text is emitted only once no stop string can start inside it: any tail that is
    a proper prefix of some stop string is held back until it either completes a match or can
    no longer become one.

    Args:
        stops: non-empty stop strings.
        include_stop_str_in_output: emit the matched stop string itself (text after it never is).
    """

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop: stop strings must not be empty")
        self._stops = list(dict.fromkeys(stops))  # dedupe, keep order
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: Optional[str] = None

    def feed(self, text: str) -> tuple[str, bool, Optional[str]]:
        """Add text. Returns (text safe to emit now, whether a stop string matched, which one).

        After a match, further feeds return ("", True, matched).
        """
        if self.stopped:
            return "", True, self.matched
        if not self._stops:
            return text, False, None
        buf = self._held + text
        best: Optional[tuple[int, int, str]] = None  # (end, -length, stop)
        for s in self._stops:
            i = buf.find(s)
            if i >= 0:
                cand = (i + len(s), -len(s), s)
                if best is None or cand < best:
                    best = cand
        if best is not None:
            end, neg_len, stop = best
            self.stopped, self.matched, self._held = True, stop, ""
            return (buf[:end] if self._include else buf[:end + neg_len]), True, stop
        hold = self._hold_point(buf)
        self._held = buf[hold:]
        return buf[:hold], False, None

    def _hold_point(self, buf: str) -> int:
        """Smallest i such that buf[i:] is a proper prefix of some stop string (len(buf) if none).
        Only the last max_len - 1 characters can qualify."""
        for i in range(max(0, len(buf) - self._max_len + 1), len(buf)):
            tail = buf[i:]
            if any(s.startswith(tail) for s in self._stops):
                return i
        return len(buf)

    def flush(self) -> str:
        """Release the held-back tail (the sample ended for another reason: length, EOS)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


class SampleText:
    """One sample's text in the making: its detokenizer, its stop-string matcher (None without
    stop strings) and the text decoded but not yet emitted. The engine's output processor keeps
    one per sequence (`Sequence.text_state`)."""

    __slots__ = ("detok", "stops", "pending", "reported")

    def __init__(self, tokenizer: _Decoder, token_ids: Sequence[int], skip_special_tokens: bool,
                 stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, token_ids, skip_special_tokens=skip_special_tokens)
        self.stops: Optional[StopStringMatcher] = (
            StopStringMatcher(list(stop), include_stop_str_in_output) if stop else None
        )
        self.pending = ""
        self.reported = False  # the finish_reason has been sent (exactly once)
