"""Reasoning output: a model's `<think>…</think>` block split from its answer, whole or incrementally.

Parsers (`--reasoning-parser`, vLLM's names):
  qwen3        Qwen3 and QwQ: the output may open with `<think>`; a prompt whose chat template
               already opened the block (ends inside `<think>`) starts the output in it, and one
               that closed it (`enable_thinking: false` renders `<think>\n\n</think>`) does not;
  deepseek_r1  DeepSeek-R1 and its distills: the template opens the block, so the output is
               thinking until `</think>` (a leading `<think>` the model repeats is dropped);
  openai_gptoss  gpt-oss's harmony messages: the `analysis` channel is the reasoning, `final` the
               answer (server.text.harmony; `new_splitter` picks its splitter).
`detect_reasoning_parser` picks one from the chat template where that is unambiguous.

The split, for a sample's whole text (`split_whole`), and the same split fed in arbitrary pieces
(`ReasoningSplitter`: the answer held back only while it could still be the start of a marker)
give the same two strings at every split of the text (tests/test_reasoning.py):
  * leading whitespace then `<think>`: the block opens there (the tag is not output);
  * otherwise the output starts in the block only when the prompt left one open;
  * inside, everything up to `</think>` is reasoning; newlines right after `</think>` are dropped,
    the rest is the answer; no `</think>` (cut by max_tokens): it is all reasoning.

Reasoning tokens (`completion_tokens_details.reasoning_tokens`) are the sample's tokens up to and
including the `</think>` token (all of them while the block is open), counted on token ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from server.text.harmony import CHANNEL, END, MESSAGE, HarmonySplitter

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")
HARMONY = "openai_gptoss"
ANSWER_CHANNEL = "final"  # harmony's answer channel: structured outputs apply to its body


def detect_reasoning_parser(template: Optional[str]) -> Optional[str]:
    """The parser a chat template implies, or None when it does not teach a `<think>` block.

    Both tags in the template is a thinking model; `enable_thinking` (Qwen3's switch) or no
    generation prompt that opens the block means qwen3; a generation prompt that writes
    `<think>` itself (DeepSeek-R1's) means deepseek_r1."""
    src = template or ""
    if CHANNEL in src and "analysis" in src:  # gpt-oss's harmony template
        return HARMONY
    if THINK_START not in src or THINK_END not in src:
        return None
    if "enable_thinking" in src:
        return "qwen3"
    # DeepSeek-R1's templates end the generation prompt with `<｜Assistant｜><think>\n`.
    tail = src[src.rfind("add_generation_prompt"):] if "add_generation_prompt" in src else ""
    if THINK_START in tail and THINK_END not in tail:
        return "deepseek_r1"
    return "qwen3"


@dataclass(frozen=True)
class ReasoningFormat:
    """A served model's reasoning markers: the parser, and the token ids of the two tags (for
    openai_gptoss `<|channel|>` and `<|end|>`, which the detokenizer must keep in the text).
    openai_gptoss also has the ids structured outputs wait for (the engine's harmony
    ReasoningGate): `<|message|>`, and the answer channel's name ("final") as the tokenizer
    writes it after `<|channel|>`; without them a constraint applies to the whole output."""

    parser: str
    start_token_id: int
    end_token_id: int
    message_token_id: Optional[int] = None
    answer_channel: tuple[int, ...] = ()

    def starts_open(self, prompt_token_ids: list[int]) -> bool:
        """Whether the output starts inside the block: deepseek_r1 always; qwen3 when the prompt's
        last `<think>` is not followed by a `</think>` (the template opened the block); never for
        harmony, whose output opens its own messages."""
        if self.parser == HARMONY:
            return False
        if self.parser == "deepseek_r1":
            return True
        for t in reversed(prompt_token_ids):
            if t == self.end_token_id:
                return False
            if t == self.start_token_id:
                return True
        return False


def split_whole(text: str, starts_open: bool) -> tuple[str, str]:
    """(reasoning, answer) of a sample's whole text (the module docstring's rules)."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        rest = stripped[len(THINK_START):]
    elif starts_open:
        rest = text
    else:
        return "", text
    i = rest.find(THINK_END)
    if i < 0:
        return rest, ""
    return rest[:i], rest[i + len(THINK_END):].lstrip("\n")


def _marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


_START, _INSIDE, _AFTER_END, _ANSWER = range(4)


class ReasoningSplitter:
    """The incremental split of one sample: `feed(text, token_ids)` per delta, then `finish()`.
    Each call returns the (reasoning, answer) text it can release now."""

    __slots__ = ("fmt", "starts_open", "_state", "_held", "_tokens", "_reasoning_tokens", "_ended", "_entered")

    def __init__(self, fmt: ReasoningFormat, starts_open: bool) -> None:
        self.fmt = fmt
        self.starts_open = starts_open
        self._state = _START
        self._held = ""  # text not yet released (a possible marker start, or undecided leading text)
        self._tokens = 0
        self._reasoning_tokens = 0
        self._ended = False  # `</think>` was seen (token count fixed)
        self._entered = False  # the block opened at some point

    @property
    def reasoning_tokens(self) -> int:
        """Tokens of the block so far: fixed at the `</think>` token, else all tokens inside it."""
        if self._ended:
            return self._reasoning_tokens
        return self._tokens if self._state == _INSIDE else 0

    @property
    def in_reasoning(self) -> bool:
        return self._state == _INSIDE

    def feed(self, text: str, token_ids: list[int]) -> tuple[str, str]:
        before = self._tokens
        self._tokens += len(token_ids)
        reasoning, answer = self._text(text)
        if self._entered and self._state in (_AFTER_END, _ANSWER) and not self._ended:
            # The block closed in this delta: count up to the `</think>` token when it is there.
            self._ended = True
            try:
                self._reasoning_tokens = before + token_ids.index(self.fmt.end_token_id) + 1
            except ValueError:  # the tag came as several tokens: count the whole delta
                self._reasoning_tokens = self._tokens
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """Release what is held at the end of the sample."""
        held, self._held = self._held, ""
        if self._state == _START:  # undecided to the end: whitespace or a partial `<think>`
            if self.starts_open:
                self._state = _INSIDE
                return held, ""
            self._state = _ANSWER
            return "", held
        if self._state == _INSIDE:
            return held, ""
        return "", ""

    def _text(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        answer: list[str] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self._state == _START:
                lead = buf.lstrip()
                if not lead or (THINK_START.startswith(lead) and len(lead) < len(THINK_START)):
                    self._held = buf  # undecided: whitespace, or a partial `<think>`
                    return "".join(reasoning), "".join(answer)
                if lead.startswith(THINK_START):
                    self._state, self._entered = _INSIDE, True
                    buf = lead[len(THINK_START):]
                elif self.starts_open:
                    self._state, self._entered = _INSIDE, True
                else:
                    self._state = _ANSWER
            elif self._state == _INSIDE:
                i = buf.find(THINK_END)
                if i >= 0:
                    reasoning.append(buf[:i])
                    buf = buf[i + len(THINK_END):]
                    self._state = _AFTER_END
                    continue
                keep = _marker_prefix_len(buf, THINK_END)
                reasoning.append(buf[:len(buf) - keep])
                self._held = buf[len(buf) - keep:]
                buf = ""
            elif self._state == _AFTER_END:
                rest = buf.lstrip("\n")
                if rest:
                    self._state = _ANSWER
                buf = rest
            else:
                answer.append(buf)
                buf = ""
        return "".join(reasoning), "".join(answer)


def new_splitter(fmt: ReasoningFormat, starts_open: bool) -> Union[ReasoningSplitter, HarmonySplitter]:
    """A fresh splitter for one sample of a chat served with `fmt`."""
    return HarmonySplitter() if fmt.parser == HARMONY else ReasoningSplitter(fmt, starts_open)


def reasoning_format(parser: str, token_to_id: Callable[[str], Optional[int]],
                     encode: Optional[Callable[[str], list[int]]] = None) -> ReasoningFormat:
    """The format for `parser` with the tokenizer's ids of `<think>` / `</think>`. Raises
    ValueError naming what is missing (the tags must be single tokens: the engine gates
    structured outputs on the `</think>` token). For openai_gptoss, `encode` (text -> ids, no
    special tokens added) gives the answer channel's ids, with which structured outputs wait for
    the `final` message."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"expected one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
    tags = (CHANNEL, END) if parser == HARMONY else (THINK_START, THINK_END)
    start, end = token_to_id(tags[0]), token_to_id(tags[1])
    missing = [tag for tag, tid in ((tags[0], start), (tags[1], end)) if tid is None]
    if missing or start is None or end is None:
        raise ValueError(f"reasoning parser {parser!r} needs {' and '.join(missing)} as a single token in the "
                         "tokenizer's vocabulary, and this tokenizer has none")
    if parser != HARMONY:
        return ReasoningFormat(parser, int(start), int(end))
    message = token_to_id(MESSAGE)
    channel = tuple(encode(ANSWER_CHANNEL)) if encode is not None and message is not None else ()
    return ReasoningFormat(parser, int(start), int(end), None if not channel else message, channel)
