"""Tool calling with the official openai SDK against a live server.

The model is the random-weight demo model with a Hermes-style chat template that supports tools
(tests.tiny_models.HERMES_TOOL_TEMPLATE). Its weights know nothing of tools or JSON, so when a
`required` or named tool_choice yields calls whose arguments parse and validate against the
tools' schemas at temperature 1.0, only the grammar constraint can have made them so.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server.harness import ServerProcess, ledger_rows
from tests.tiny_models import HERMES_TOOL_TEMPLATE, with_chat_template

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"type": "string", "enum": ["metric", "imperial"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
SEARCH_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 8}, "exact": {"type": "boolean"}},
    "required": ["query", "exact"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH_PARAMS}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def tool_server(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("tools")
    model = with_chat_template(demo_model, tmp / "model", HERMES_TOOL_TEMPLATE)
    proc = ServerProcess(model, tmp / "ledger.db")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(tool_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(calls: Any, allowed: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """Every call is OpenAI-shaped, names an allowed tool and has arguments valid for its schema."""
    out = []
    assert calls, "expected tool calls"
    ids = set()
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        ids.add(c.id)
        assert c.function.name in allowed
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    assert len(ids) == len(calls)  # ids are distinct
    return out


def stream_final(client: openai.OpenAI, min_chunks: int = 3, **kw: Any) -> Any:
    """Stream a chat completion and accumulate it with the SDK's own stream state."""
    state = ChatCompletionStreamState()
    chunks = 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        chunks += 1
    assert chunks >= min_chunks
    return state.get_final_completion()


def call_tuples(calls: Any) -> list[tuple[str, str, str]]:
    return [(c.id, c.function.name, c.function.arguments) for c in calls]


@pytest.mark.parametrize("seed", [1, 2])
def test_required_tool_choice_whole_and_streamed(client: openai.OpenAI, seed: int) -> None:
    kw: dict[str, Any] = dict(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                              temperature=1.0, seed=seed, max_tokens=400)
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = check_calls(choice.message.tool_calls, {"get_weather", "search"})

    final = stream_final(client, **kw)
    s = final.choices[0]
    assert s.finish_reason == "tool_calls"
    # Same seed, same output: the stream adds up to exactly the whole response.
    assert check_calls(s.message.tool_calls, {"get_weather", "search"}) == calls
    assert [c.id for c in s.message.tool_calls] != [c.id for c in choice.message.tool_calls]  # other request
    assert not s.message.content


def test_required_without_parallel_calls_makes_exactly_one(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                              parallel_tool_calls=False, temperature=1.0, max_tokens=400)
    for n in (1, 3):
        resp = client.chat.completions.create(n=n, **kw)
        assert len(resp.choices) == n
        for c in resp.choices:
            assert c.finish_reason == "tool_calls"
            assert len(check_calls(c.message.tool_calls, {"get_weather", "search"})) == 1


@pytest.mark.parametrize("name", ["get_weather", "search"])
def test_named_tool_choice_whole_and_streamed(client: openai.OpenAI, name: str) -> None:
    kw: dict[str, Any] = dict(model="demo", messages=MESSAGES, tools=TOOLS, temperature=1.0, max_tokens=200,
                              tool_choice={"type": "function", "function": {"name": name}})
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert len(check_calls(whole.choices[0].message.tool_calls, {name})) == 1

    final = stream_final(client, n=2, **kw)
    assert len(final.choices) == 2
    for c in final.choices:
        assert c.finish_reason == "tool_calls"
        assert len(check_calls(c.message.tool_calls, {name})) == 1


def test_two_turn_tool_conversation(client: openai.OpenAI, tool_server: ServerProcess) -> None:
    first = client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=TOOLS, temperature=1.0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages: list[Any] = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),  # the assistant turn, content null
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", "high": 21})},
    ]
    assert messages[1].get("content") is None and messages[1]["tool_calls"][0]["id"] == call.id
    second = client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=12, temperature=0)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)
    assert answer.finish_reason in ("stop", "length")
    # The prompt is the conversation through the template, the tool call and its result included:
    # /tokenize renders the same messages and tools the same way.
    tok = httpx.post(tool_server.base + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert second.usage is not None and second.usage.prompt_tokens == tok["count"]
    assert first.usage is not None and tok["count"] > first.usage.prompt_tokens

    # The ledger recorded both as finished requests with their usage; tool_calls is an edge
    # rendering of a normal stop.
    rows = ledger_rows(tool_server.db)
    row = rows[first.id.removeprefix("chatcmpl-")]
    assert row["state"] == "finished" and row["finish_reason"] == "stop"
    assert first.usage is not None and row["completion_tokens"] == first.usage.completion_tokens
    assert row["prompt_tokens"] == first.usage.prompt_tokens


def test_auto_on_a_model_that_writes_no_calls_is_plain_content(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=16,
                                          temperature=0)
    c = resp.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
    plain = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=16, temperature=0)
    assert plain.choices[0].message.content == c.message.content


def test_bad_tool_requests_are_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "tool_choice.function.name" in str(e.value)
    bad_tools = [TOOLS[0], {"type": "function", "function": {"name": "bad name!"}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=MESSAGES, tools=bad_tools)  # type: ignore[arg-type]
    assert "tools[1].function.name" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=[*MESSAGES, {"role": "tool", "content": "x"}])  # type: ignore[list-item]
    assert "messages[1].tool_call_id" in str(e.value)


# A Hermes block the random model is made to write by a regex constraint (vLLM's
# `structured_outputs` extra), so `auto` has a real model-written call to parse.
AUTO_CALL_REGEX = (r'Checking\.\n<tool_call>\n\{"name": "search", "arguments": \{"query": "[a-z]{1,6}", '
                   r'"exact": (true|false)\}\}\n</tool_call>')


def test_auto_parses_the_models_hermes_call_whole_and_streamed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="demo", messages=MESSAGES, tools=TOOLS, temperature=1.0, max_tokens=100,
                              seed=7, extra_body={"structured_outputs": {"regex": AUTO_CALL_REGEX}})
    whole = client.chat.completions.create(**kw)
    c = whole.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "Checking."
    calls = check_calls(c.message.tool_calls, {"search"})
    assert len(calls) == 1

    final = stream_final(client, **kw)
    s = final.choices[0]
    assert s.finish_reason == "tool_calls" and s.message.content == "Checking."
    assert check_calls(s.message.tool_calls, {"search"}) == calls


def test_auto_leaves_a_call_to_an_unknown_tool_as_content(client: openai.OpenAI) -> None:
    text = '<tool_call>\n{"name": "format_disk", "arguments": {}}\n</tool_call>'
    kw: dict[str, Any] = dict(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=100,
                              extra_body={"structured_outputs": {"choice": [text]}})
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].message.content == text and whole.choices[0].message.tool_calls is None
    assert whole.choices[0].finish_reason == "stop"
    final = stream_final(client, **kw)
    assert final.choices[0].message.content == text and not final.choices[0].message.tool_calls


def test_a_tool_schema_that_does_not_compile_is_400_naming_the_tool(tool_server: ServerProcess) -> None:
    bad = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}
    base = {"model": "demo", "messages": MESSAGES, "tools": [TOOLS[0], bad], "max_tokens": 5}
    for choice, field in (({"type": "function", "function": {"name": "broken"}}, "tools[1].function.parameters"),
                          ("required", "tools")):
        r = httpx.post(tool_server.base + "/v1/chat/completions", json={**base, "tool_choice": choice}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and err["message"].startswith(field + ": "), err
    # auto constrains nothing, so the same tools are accepted.
    r = httpx.post(tool_server.base + "/v1/chat/completions", json=base, timeout=60)
    assert r.status_code == 200, r.text


def test_idempotent_retry_returns_the_same_calls_and_ids(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                              temperature=1.0, max_tokens=400, extra_headers={"Idempotency-Key": "tools-retry-1"})
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert again.id == first.id
    calls = call_tuples(first.choices[0].message.tool_calls)
    assert calls and call_tuples(again.choices[0].message.tool_calls) == calls
    # The same request replayed as a stream (from the stored output: one coalesced chunk).
    streamed = stream_final(client, min_chunks=1, **kw)
    assert call_tuples(streamed.choices[0].message.tool_calls) == calls
    assert streamed.choices[0].finish_reason == "tool_calls"
