"""Tool-call parsers (server.text.tool_parsers): Hermes and Llama 3 JSON formats, the constrained
forms, streaming in any split giving the same result as the whole text, and malformed output
staying content."""
from __future__ import annotations

import json
import random

import pytest

from server.text.tool_parsers import (
    ArgsDelta,
    CallStart,
    Content,
    HermesParser,
    JsonCallsParser,
    Llama3JsonParser,
    NamedCallParser,
    Piece,
    ToolCallParser,
    detect_parser,
    fold,
    longest_prefix_suffix,
)

NAMES = ["get_weather", "search"]


def whole(parser: ToolCallParser, text: str) -> tuple[str, list[tuple[str, str]]]:
    return fold(parser.feed(text) + parser.finish())


def streamed(parser: ToolCallParser, text: str, seed: int) -> tuple[list[Piece], tuple[str, list[tuple[str, str]]]]:
    """Feed `text` in random-sized fragments (1-7 characters)."""
    rng = random.Random(seed)
    pieces: list[Piece] = []
    i = 0
    while i < len(text):
        k = rng.randint(1, 7)
        pieces += parser.feed(text[i:i + k])
        i += k
    pieces += parser.finish()
    return pieces, fold(pieces)


HERMES_TWO = (
    "Let me look that up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
    "\"days\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"a<b\"}}\n</tool_call>"
)


def test_hermes_two_calls_and_leading_content() -> None:
    content, calls = whole(HermesParser(NAMES), HERMES_TWO)
    assert content == "Let me look that up."
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("search", {"q": "a<b"})]


@pytest.mark.parametrize("seed", range(8))
def test_hermes_streamed_in_any_split_equals_whole(seed: int) -> None:
    pieces, result = streamed(HermesParser(NAMES), HERMES_TWO, seed)
    assert result == whole(HermesParser(NAMES), HERMES_TWO)
    # The tag is never leaked as content, even when split across fragments.
    assert all("<tool" not in p.text for p in pieces if isinstance(p, Content))
    starts = [p for p in pieces if isinstance(p, CallStart)]
    assert [p.index for p in starts] == [0, 1]


def test_hermes_plain_text_passes_through_with_whitespace() -> None:
    text = "  Hello <b>world</b>\n\n"
    assert whole(HermesParser(NAMES), text) == (text, [])
    _, result = streamed(HermesParser(NAMES), text, 3)
    assert result == (text, [])


def test_hermes_holds_back_a_possible_tag_then_releases_it() -> None:
    p = HermesParser(NAMES)
    assert fold(p.feed("a <tool_")) == ("a", [])  # "<tool_" may start a call; " " held as whitespace
    assert fold(p.feed("x> b")) == (" <tool_x> b", [])


@pytest.mark.parametrize("bad", [
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",  # invalid JSON
    "<tool_call>\n{\"name\": \"delete_all\", \"arguments\": {}}\n</tool_call>",  # not one of the tools
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",  # no name
    "<tool_call>\n[1, 2]\n</tool_call>",  # not an object
    "<tool_call>\n{\"name\": \"search\", \"arguments\": [1]}\n</tool_call>",  # arguments not an object
    "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"cut off",  # unterminated, incomplete JSON
])
def test_hermes_malformed_block_stays_content(bad: str) -> None:
    text = "Before " + bad
    assert whole(HermesParser(NAMES), text) == (text, [])
    _, result = streamed(HermesParser(NAMES), text, 1)
    assert result == (text, [])


def test_hermes_unterminated_block_with_whole_json_is_a_call() -> None:
    text = "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}\n"
    assert whole(HermesParser(NAMES), text) == ("", [("search", '{"q": "x"}')])


def test_hermes_arguments_as_json_string_are_accepted() -> None:
    text = "<tool_call>{\"name\": \"search\", \"arguments\": \"{\\\"q\\\": 1}\"}</tool_call>"
    assert whole(HermesParser(NAMES), text) == ("", [("search", '{"q": 1}')])


def test_llama3_json_with_python_tag_and_two_calls() -> None:
    text = "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}; " \
           "{\"name\": \"search\", \"parameters\": {}}"
    expected = ("", [("get_weather", '{"city": "Oslo"}'), ("search", "{}")])
    assert whole(Llama3JsonParser(NAMES), text) == expected
    for seed in range(4):
        pieces, result = streamed(Llama3JsonParser(NAMES), text, seed)
        assert result == expected
        assert not any(isinstance(p, Content) for p in pieces)


def test_llama3_json_bare_object() -> None:
    text = " {\"name\": \"search\", \"parameters\": {\"q\": \"x\"}}"
    assert whole(Llama3JsonParser(NAMES), text) == ("", [("search", '{"q": "x"}')])


@pytest.mark.parametrize("text", [
    "The answer is {42}.",  # text: streams straight through
    "{\"name\": \"search\", \"parameters\": {\"q\": \"x\"}} and more",  # trailing text: not a call message
    "{\"name\": \"nope\", \"parameters\": {}}",  # unknown tool
    "{\"name\": \"search\", \"parameters\": {\"q\": ",  # cut off
])
def test_llama3_json_non_calls_stay_content(text: str) -> None:
    assert whole(Llama3JsonParser(NAMES), text) == (text, [])
    _, result = streamed(Llama3JsonParser(NAMES), text, 2)
    assert result == (text, [])


def test_llama3_plain_text_is_not_held_back() -> None:
    p = Llama3JsonParser(NAMES)
    assert fold(p.feed("Hi")) == ("Hi", [])
    p = Llama3JsonParser(NAMES)
    assert p.feed("<|pyth") == []  # may become the python tag


def test_named_parser_streams_arguments() -> None:
    p = NamedCallParser("search")
    assert p.feed("") == []
    assert p.feed(" {\"q\"") == [CallStart(0, "search", "{\"q\"")]
    assert p.feed(": 1}") == [ArgsDelta(0, ": 1}")]
    assert p.finish() == []
    assert p.num_calls == 1


REQUIRED_ARRAY = ('[{"name": "get_weather", "parameters": {"city": "P\\"a}r[is", "n": [1, {"a": {}}]}}, '
                  '{"name": "search", "parameters": {}}]')


def test_json_calls_array_streams_arguments_by_index() -> None:
    expected = ("", [("get_weather", '{"city": "P\\"a}r[is", "n": [1, {"a": {}}]}'), ("search", "{}")])
    assert whole(JsonCallsParser(array=True), REQUIRED_ARRAY) == expected
    for seed in range(6):
        pieces, result = streamed(JsonCallsParser(array=True), REQUIRED_ARRAY, seed)
        assert result == expected
        # Arguments arrive in several fragments: the call starts before its arguments are complete.
        assert sum(isinstance(p, ArgsDelta) for p in pieces) > 1


def test_json_calls_single_object_and_name_after_parameters() -> None:
    assert whole(JsonCallsParser(array=False), '{"name": "search", "parameters": {"q": "z"}}') == (
        "", [("search", '{"q": "z"}')])
    # Key order is the grammar's; a call whose name comes last is sent once the name is known.
    text = '[{"parameters": {"q": 1}, "name": "search"}]'
    _, result = streamed(JsonCallsParser(array=True), text, 0)
    assert result == ("", [("search", '{"q": 1}')])


def test_json_calls_cut_off_before_a_name_is_content() -> None:
    assert whole(JsonCallsParser(array=True), '[{"na') == ('[{"na', [])


def test_detect_parser_from_template_text() -> None:
    assert detect_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_parser("{{ '<|python_tag|>' }}{% if tools %}{% endif %}") == "llama3_json"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"  # tool-unaware
    assert detect_parser("{% if tools %}[AVAILABLE_TOOLS]{% endif %}") == "none"


def test_longest_prefix_suffix() -> None:
    assert longest_prefix_suffix("abc<tool", "<tool_call>") == 5
    assert longest_prefix_suffix("abc", "<tool_call>") == 0
    assert longest_prefix_suffix("x<tool_call>", "<tool_call>") == 0  # the whole tag is not a proper prefix
