"""Tool-call parsers: turn a model's generated text into content and OpenAI tool calls,
incrementally, so one parser serves both a streamed and a whole response.

A parser is fed the text of one sample as it arrives (`feed`) and told when it ended
(`finish`); each call returns `Piece`s in order: `Content` (text for the message's `content`),
`CallStart` (a new call: its name and the first part of its arguments) and `ArgsDelta` (more
argument text for a call already started). A whole response feeds the full text once, so it is
exactly the concatenation of what the stream sent.

Formats:
  - `hermes`: Hermes/Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks inside
    ordinary text. A block is held back until it closes and is then checked: a block that is not
    a JSON object with a known `name` and object `arguments` is passed on as content, unchanged.
  - `llama3_json`: Llama 3.x's JSON style, the whole message being one or more
    `{"name": ..., "parameters": {...}}` objects separated by `;`, optionally after
    `<|python_tag|>`. A message that starts like one is held until the end and checked the same way.
  - the constrained forms, whose validity the grammar engine guarantees, stream their arguments
    as they are generated: `NamedCallParser` (the whole text is one call's arguments) and
    `JsonCallsParser` (a JSON array, or one object, of `{"name", "parameters"}` calls).

Whitespace-only content next to calls (the newlines between Qwen's blocks) is dropped; content
that holds any other text keeps its whitespace.

Torch-free and independent of HTTP: `detect_parser` picks the format from a chat template's
source text, as vLLM users otherwise pick it with `--tool-call-parser`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

PARSER_NAMES = ("hermes", "llama3_json", "openai", "none")  # openai: gpt-oss's harmony (server.text.harmony)
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    """A new tool call; `index` counts the sample's calls from 0."""

    index: int
    name: str
    arguments: str


@dataclass
class ArgsDelta:
    index: int
    text: str


Piece = Union[Content, CallStart, ArgsDelta]


def detect_parser(template: Optional[str]) -> str:
    """The tool-call format a chat template teaches its model.

    `<|channel|>` → openai (harmony); `<tool_call>` → hermes; `<|python_tag|>` or the `ipython` role →
    llama3_json. A template that
    never mentions tools gets `hermes`: such models are shown the tools and the Hermes format in a
    system message (server.serving.tool_render), so that is the format they are asked to answer in.
    A template that handles tools in some other format gets `none` (pick one with --tool-call-parser).
    """
    src = template or ""
    if "<|channel|>" in src:  # gpt-oss's harmony: to=functions.NAME messages
        return "openai"
    if HERMES_OPEN in src:
        return "hermes"
    if PYTHON_TAG in src or "ipython" in src:
        return "llama3_json"
    if "tools" not in src:
        return "hermes"
    return "none"


def longest_prefix_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text that may
    still become the tag, so a stream must hold it back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _call_fields(obj: Any, tool_names: frozenset[str]) -> Optional[tuple[str, str]]:
    """(name, arguments JSON) of one parsed call object, or None when it is not a valid call."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


class ToolCallParser:
    """Base: the content side (whitespace handling) and the call counter."""

    def __init__(self) -> None:
        self.num_calls = 0
        self._ws = ""  # whitespace-only content held until text or the end decides its fate

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError

    def _content(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        out.append(Content(self._ws + body))
        self._ws = text[len(body):]

    def _start_call(self, name: str, arguments: str, out: list[Piece]) -> int:
        self._ws = ""  # whitespace before a call separates it from the text: not content
        index = self.num_calls
        self.num_calls += 1
        out.append(CallStart(index, name, arguments))
        return index

    def _end_content(self, out: list[Piece]) -> None:
        if self._ws and self.num_calls == 0:
            out.append(Content(self._ws))
        self._ws = ""


class HermesParser(ToolCallParser):
    """`<tool_call>{json}</tool_call>` blocks inside text (Hermes, Qwen 2.5/3)."""

    def __init__(self, tool_names: Iterable[str]) -> None:
        super().__init__()
        self.tool_names = frozenset(tool_names)
        self._buf = ""
        self._in_block = False

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += text
        while True:
            if self._in_block:
                j = self._buf.find(HERMES_CLOSE)
                if j < 0:
                    break
                inner = self._buf[:j]
                self._buf = self._buf[j + len(HERMES_CLOSE):]
                self._in_block = False
                self._close(inner, HERMES_OPEN + inner + HERMES_CLOSE, out)
                continue
            i = self._buf.find(HERMES_OPEN)
            if i >= 0:
                self._content(self._buf[:i], out)
                self._buf = self._buf[i + len(HERMES_OPEN):]
                self._in_block = True
                continue
            keep = longest_prefix_suffix(self._buf, HERMES_OPEN)
            self._content(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return out

    def _close(self, inner: str, raw: str, out: list[Piece]) -> None:
        try:
            call = _call_fields(json.loads(inner), self.tool_names)
        except ValueError:
            call = None
        if call is None:
            self._content(raw, out)
        else:
            self._start_call(call[0], call[1], out)

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._in_block:
            # The model stopped (EOS) before `</tool_call>`: accept the block if its JSON is whole.
            self._close(self._buf, HERMES_OPEN + self._buf, out)
        else:
            self._content(self._buf, out)
        self._buf = ""
        self._in_block = False
        self._end_content(out)
        return out


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x JSON tool calls: the message is `[<|python_tag|>]{call}[; {call}...]`."""

    def __init__(self, tool_names: Iterable[str]) -> None:
        super().__init__()
        self.tool_names = frozenset(tool_names)
        self._buf = ""
        self._mode: Optional[str] = None  # None: undecided; "calls": held to the end; "text"

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self._mode == "text":
            self._content(text, out)
            return out
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return out  # could still become a call
            if head.startswith(PYTHON_TAG) or head.startswith("{"):
                self._mode = "calls"
            else:
                self._mode = "text"
                self._content(self._buf, out)
                self._buf = ""
        return out

    def _parse_calls(self, text: str) -> Optional[list[tuple[str, str]]]:
        s = text.strip()
        if s.startswith(PYTHON_TAG):
            s = s[len(PYTHON_TAG):]
        decoder = json.JSONDecoder()
        calls: list[tuple[str, str]] = []
        pos = 0
        while True:
            while pos < len(s) and s[pos].isspace():
                pos += 1
            if pos >= len(s):
                break
            if calls:
                if s[pos] != ";":
                    return None
                pos += 1
                while pos < len(s) and s[pos].isspace():
                    pos += 1
            try:
                obj, pos = decoder.raw_decode(s, pos)
            except ValueError:
                return None
            call = _call_fields(obj, self.tool_names)
            if call is None:
                return None
            calls.append(call)
        return calls or None

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._buf:
            calls = self._parse_calls(self._buf) if self._mode == "calls" else None
            if calls is None:
                self._content(self._buf, out)
            else:
                for name, args in calls:
                    self._start_call(name, args, out)
        self._buf = ""
        self._end_content(out)
        return out


class NamedCallParser(ToolCallParser):
    """tool_choice naming one function: the whole (grammar-constrained) text is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._started = False

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if not self._started:
            text = text.lstrip()
            if not text:
                return out
            self._started = True
            self._start_call(self.name, text, out)
        elif text:
            out.append(ArgsDelta(0, text))
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if not self._started:
            self._started = True
            self._start_call(self.name, "", out)
        return out


class JsonCallsParser(ToolCallParser):
    """tool_choice "required": a JSON array of `{"name": ..., "parameters": {...}}` objects (or one
    such object when parallel calls are off), as the grammar forces. Scans the JSON as it arrives
    and streams each call's `parameters` text once its name is known.

    The scanner tracks only what it needs: string/escape state, nesting depth, the current key
    of a call object, and where its parameters value starts and ends.
    """

    def __init__(self, array: bool) -> None:
        super().__init__()
        self._call_depth = 2 if array else 1
        self._text = ""
        self._pos = 0
        self._depth = 0
        self._in_str = False
        self._escape = False
        self._str_start = 0
        self._expect_key = False
        self._key: Optional[str] = None
        self._name: Optional[str] = None
        self._args_start: Optional[int] = None
        self._args_end: Optional[int] = None
        self._call: Optional[int] = None  # index of the call whose arguments are being streamed
        self._sent = 0  # how much of the current arguments text has been sent

    def _reset_object(self) -> None:
        self._expect_key = True
        self._key = self._name = None
        self._args_start = self._args_end = None
        self._call = None
        self._sent = 0

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._text += text
        t, base = self._text, self._call_depth
        for i in range(self._pos, len(t)):
            c = t[i]
            if self._in_str:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_str = False
                    self._string_done(t[self._str_start: i + 1])
                continue
            if c == '"':
                self._in_str = True
                self._str_start = i
            elif c in "{[":
                self._depth += 1
                if self._depth == base and c == "{":
                    self._reset_object()
                elif self._depth == base + 1 and self._key in ("parameters", "arguments") and c == "{":
                    self._args_start = i
            elif c in "}]":
                if self._depth == base + 1 and self._args_start is not None and self._args_end is None:
                    self._args_end = i + 1
                    self._stream_args(out)
                if self._depth == base and c == "}":
                    self._object_done(out)
                self._depth -= 1
            elif c == ":" and self._depth == base:
                self._expect_key = False
            elif c == "," and self._depth == base:
                self._expect_key = True
                self._key = None
        self._pos = len(t)
        self._stream_args(out)
        return out

    def _string_done(self, literal: str) -> None:
        if self._depth != self._call_depth:
            return
        try:
            value = json.loads(literal)
        except ValueError:
            return
        if self._expect_key:
            self._key = value
        elif self._key == "name" and isinstance(value, str):
            self._name = value

    def _stream_args(self, out: list[Piece]) -> None:
        """Send the arguments text generated so far, starting the call once its name is known."""
        if self._args_start is None or self._name is None:
            return
        end = self._args_end if self._args_end is not None else len(self._text)
        if self._call is None:
            self._call = self._start_call(self._name, self._text[self._args_start:end], out)
        elif end > self._args_start + self._sent:
            out.append(ArgsDelta(self._call, self._text[self._args_start + self._sent: end]))
        self._sent = end - self._args_start

    def _object_done(self, out: list[Piece]) -> None:
        if self._call is None and self._name is not None:
            # No parameters key (or it came before the name): send the call now.
            args = "{}" if self._args_start is None else self._text[self._args_start: self._args_end]
            self._start_call(self._name, args, out)
        self._name = None
        self._args_start = None
        self._call = None

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.num_calls == 0 and self._text.strip():
            # Nothing recognisable (e.g. cut off by max_tokens before a name): keep it as content.
            out.append(Content(self._text))
        return out


def fold(pieces: Iterable[Piece]) -> tuple[str, list[tuple[str, str]]]:
    """The content and the (name, arguments) calls that a sequence of pieces adds up to."""
    content: list[str] = []
    calls: list[list[str]] = []
    for p in pieces:
        if isinstance(p, Content):
            content.append(p.text)
        elif isinstance(p, CallStart):
            calls.append([p.name, p.arguments])
        else:
            calls[p.index][1] += p.text
    return "".join(content), [(n, a) for n, a in calls]
