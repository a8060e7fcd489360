"""gpt-oss's harmony output format, read incrementally: the reasoning split (`HarmonySplitter`,
`--reasoning-parser openai_gptoss`) and the tool-call parser (`HarmonyToolParser`,
`--tool-call-parser openai`), both over one reader of the message grammar (`HarmonyReader`).

After the chat template's `<|start|>assistant`, a gpt-oss model writes messages

    [<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>FMT]<|message|>BODY END

with END one of `<|end|>` (another message follows), `<|return|>` (the answer is done) or `<|call|>`
(a tool call; both are stop tokens, so the text may simply end). The `analysis` channel is the
model's reasoning, `final` its answer; a `commentary` message to `functions.NAME` is a call of tool
NAME whose body is the JSON arguments (other commentary is a preamble shown to the user).

The splitter sends analysis bodies to `reasoning_content` and final (and preamble) bodies to
`content`, and leaves each tool call in the answer in one canonical spelling,
`<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>`, which the tool parser reads; the
tool parser reads raw harmony as well (no reasoning parser), dropping analysis bodies. The tags must
stay in the text: both set the detokenizer to keep special tokens (server.serving.service,
server.api.context). A whole text and the same text fed in any pieces give the same split
(tests/test_harmony.py): a possible tag start is held until it is decided.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from server.text.tool_parsers import ArgsDelta, CallStart, Content, Piece, ToolCallParser, longest_prefix_suffix

START, CHANNEL, MESSAGE, END, RETURN, CALL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                                              "<|call|>")
_OPENERS = (START, CHANNEL)
_ENDS = (END, RETURN, CALL)
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")
TOOL_PREFIX = "functions."


@dataclass(frozen=True)
class Header:
    """A message's header: its channel ("analysis", "final", "commentary"; "" if unnamed) and
    recipient ("functions.get_weather"; None for a message to the user)."""

    channel: str
    recipient: Optional[str]

    @staticmethod
    def parse(raw: str) -> "Header":
        ch, to = _CHANNEL_RE.search(raw), _RECIPIENT_RE.search(raw)
        return Header(ch.group(1) if ch else "", to.group(1) if to else None)

    @property
    def tool(self) -> Optional[str]:
        """The function a tool call names, or None."""
        if self.recipient is None or not self.recipient.startswith(TOOL_PREFIX):
            return None
        return self.recipient[len(TOOL_PREFIX):]


@dataclass
class Outside:
    """Text outside any message (between messages, or a model that does not write harmony)."""

    text: str


@dataclass
class Body:
    header: Header
    text: str


@dataclass
class Closed:
    header: Header


Event = Union[Outside, Body, Closed]
_OUTSIDE, _HEADER, _BODY = range(3)


def _first(buf: str, tags: Iterable[str]) -> tuple[int, str]:
    """(index, tag) of the earliest of `tags` in buf, or (-1, "")."""
    best, found = -1, ""
    for t in tags:
        i = buf.find(t)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, t
    return best, found


def _held(buf: str, tags: Iterable[str]) -> int:
    return max(longest_prefix_suffix(buf, t) for t in tags)


class HarmonyReader:
    """The message grammar as events: `feed(text)` per delta, then `finish()`. `in_header`: the
    text starts inside a header (the prompt ended with `<|start|>assistant`)."""

    def __init__(self, in_header: bool) -> None:
        self._state = _HEADER if in_header else _OUTSIDE
        self._buf = ""  # held text (a possible tag start) or the header so far
        self._header: Optional[Header] = None

    @property
    def current(self) -> Optional[Header]:
        """The header of the message whose body is being read, or None between messages."""
        return self._header if self._state == _BODY else None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        buf, self._buf = self._buf + text, ""
        while buf:
            if self._state == _OUTSIDE:
                i, tag = _first(buf, _OPENERS)
                if i < 0:
                    keep = _held(buf, _OPENERS)
                    out.append(Outside(buf[: len(buf) - keep]))
                    self._buf = buf[len(buf) - keep:]
                    break
                if i:
                    out.append(Outside(buf[:i]))
                self._state, buf = _HEADER, buf[i:]
            elif self._state == _HEADER:
                i = buf.find(MESSAGE)
                if i < 0:
                    self._buf = buf  # the header is read whole
                    break
                self._header = Header.parse(buf[:i])
                self._state, buf = _BODY, buf[i + len(MESSAGE):]
            else:
                assert self._header is not None
                i, tag = _first(buf, _ENDS)
                if i < 0:
                    keep = _held(buf, _ENDS)
                    out.append(Body(self._header, buf[: len(buf) - keep]))
                    self._buf = buf[len(buf) - keep:]
                    break
                out.append(Body(self._header, buf[:i]))
                out.append(Closed(self._header))
                self._state, buf = _OUTSIDE, buf[i + len(tag):]
        return [e for e in out if not isinstance(e, (Outside, Body)) or e.text]

    def finish(self) -> list[Event]:
        """The end of the text: an open body ends (its `<|return|>` / `<|call|>` was the stop
        token); a header never finished is dropped when it named a channel (cut off by
        max_tokens), else it was plain text and is released as such."""
        held, self._buf = self._buf, ""
        state, self._state = self._state, _OUTSIDE
        if state == _BODY:
            assert self._header is not None
            out: list[Event] = [Body(self._header, held)] if held else []
            return out + [Closed(self._header)]
        if state == _HEADER and CHANNEL in held:
            return []
        return [Outside(held)] if held else []


class HarmonySplitter:
    """ReasoningSplitter's interface (server.text.reasoning) for harmony: `feed(text, token_ids)`
    and `finish()` return the (reasoning, answer) text released now."""

    __slots__ = ("_reader", "_tokens", "_reasoning_tokens", "_call")

    def __init__(self) -> None:
        self._reader = HarmonyReader(in_header=True)
        self._call: Optional[Header] = None  # the tool call whose canonical opening was released
        self._tokens = 0
        self._reasoning_tokens = 0  # fixed when an analysis message closes: every token up to there

    @property
    def reasoning_tokens(self) -> int:
        """Tokens up to the end of the last analysis message (all so far while one is open)."""
        return self._tokens if self.in_reasoning else self._reasoning_tokens

    @property
    def in_reasoning(self) -> bool:
        h = self._reader.current
        return h is not None and self._thought(h)

    def feed(self, text: str, token_ids: list[int]) -> tuple[str, str]:
        events = self._reader.feed(text)
        self._tokens += len(token_ids)
        if any(isinstance(e, Closed) and self._thought(e.header) for e in events):
            self._reasoning_tokens = self._tokens
        return self._split(events)

    def finish(self) -> tuple[str, str]:
        return self._split(self._reader.finish())

    @staticmethod
    def _thought(h: Header) -> bool:
        return h.channel == "analysis" and h.recipient is None

    def _split(self, events: list[Event]) -> tuple[str, str]:
        reasoning: list[str] = []
        answer: list[str] = []
        for e in events:
            if isinstance(e, Outside):
                if e.text.strip():
                    answer.append(e.text)
            elif e.header.recipient is not None:  # a tool call, spelled canonically for the tool parser
                if self._call is not e.header:
                    answer.append(_canonical_open(e.header))
                    self._call = e.header
                if isinstance(e, Body):
                    answer.append(e.text)
                else:
                    answer.append(CALL)
                    self._call = None
            elif isinstance(e, Body):
                (reasoning if self._thought(e.header) else answer).append(e.text)
        return "".join(reasoning), "".join(answer)


def _canonical_open(h: Header) -> str:
    return f"{CHANNEL}{h.channel or 'commentary'} to={h.recipient}{MESSAGE}"


class HarmonyToolParser(ToolCallParser):
    """Tool calls in harmony (`to=functions.NAME` messages, arguments streamed as they arrive);
    final and preamble bodies and text outside messages are content, analysis bodies dropped. A
    call to a function not in the request's tools is passed on as content."""

    def __init__(self, tool_names: Iterable[str]) -> None:
        super().__init__()
        self.tool_names = frozenset(tool_names)
        self._reader = HarmonyReader(in_header=False)
        self._call: Optional[int] = None  # the call whose arguments are streaming
        self._in: Optional[Header] = None

    def feed(self, text: str) -> list[Piece]:
        return self._pieces(self._reader.feed(text))

    def finish(self) -> list[Piece]:
        out = self._pieces(self._reader.finish())
        self._end_content(out)
        return out

    def _pieces(self, events: list[Event]) -> list[Piece]:
        out: list[Piece] = []
        for e in events:
            if isinstance(e, Outside):
                self._content(e.text, out)
            elif e.header.tool is not None and e.header.tool in self.tool_names:
                if self._in is not e.header:  # the message's first event starts the call
                    self._in = e.header
                    self._call = self._start_call(e.header.tool, e.text if isinstance(e, Body) else "", out)
                elif isinstance(e, Body) and self._call is not None:
                    out.append(ArgsDelta(self._call, e.text))
                if isinstance(e, Closed):
                    self._in, self._call = None, None
            elif isinstance(e, Body) and (e.header.channel != "analysis" or e.header.recipient is not None):
                self._content(e.text, out)
        return out


__all__ = ["HarmonyReader", "HarmonySplitter", "HarmonyToolParser", "Header", "CallStart", "Content"]
