"""gpt-oss's harmony end to end: the official openai SDK (and the WebSocket) against a tiny gpt-oss
that writes harmony (tests/harmony_model.py; its two answers are transformers' greedy output).
Asked with tools it reasons on the analysis channel and calls `get_weather`; given the call's
result it reasons again and answers on the final channel. Both parsers are picked from the chat
template. Whole and streamed responses give the same reasoning_content, tool calls and content, and
a JSON schema constrains the final channel only (the reasoning before it stays free text)."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import openai
import pytest

from tests.harmony_model import (
    ANSWER,
    ARGS,
    REASON_CALL,
    REASON_FINAL,
    TOOLS,
    USER,
    make_harmony_model,
    with_tool_result,
)
from tests.server.harness import ServerProcess, WsClient, tokens_of

# Nothing required: llguidance allows only the canonical tokens of bytes a schema forces (a
# required key's `{"weather": "`), which would mask the model's one-token answer.
SCHEMA = {"type": "object", "properties": {"weather": {"type": "string"}, "sky": {"type": "string"}},
          "additionalProperties": False}


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_harmony_model(tmp_path_factory.mktemp("harmony") / "gpt-oss-harmony")


@pytest.fixture(scope="module")
def srv(harmony: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(harmony["path"], tmp_path_factory.mktemp("ledger") / "h.db", "--log-level", "info")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _stream(client: openai.OpenAI, **kw: Any) -> tuple[str, str, dict[int, dict[str, str]], str, Any]:
    """(reasoning, content, calls by index, finish_reason, usage) added up from the chunks."""
    reasoning, content, finish, usage = "", "", "", None
    calls: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(model="demo", temperature=0, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += tc.id or ""
                c["name"] += (tc.function.name or "") if tc.function else ""
                c["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    return reasoning, content, calls, finish, usage


def test_parsers_are_detected_from_the_template(srv: ServerProcess) -> None:
    log = srv.read_log()
    assert "reasoning parser: openai_gptoss (from the chat template)" in log
    assert "parser openai" in log


def test_a_tool_call_whole_and_streamed(client: openai.OpenAI, harmony: dict[str, Any]) -> None:
    r = client.chat.completions.create(model="demo", messages=USER, tools=TOOLS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == REASON_CALL
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", json.loads(ARGS))
    assert r.usage.completion_tokens == len(harmony["call_ids"])  # transformers' greedy answer, <|call|> included
    assert r.usage.completion_tokens_details.reasoning_tokens == 7  # up to the analysis message's <|end|>

    reasoning, content, calls, finish, usage = _stream(client, messages=USER, tools=TOOLS)
    assert (reasoning, content, finish) == (REASON_CALL, "", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", json.loads(ARGS))]
    assert calls[0]["id"].startswith("call_") and usage.completion_tokens == len(harmony["call_ids"])


def test_the_final_answer_after_the_tool_result(client: openai.OpenAI, harmony: dict[str, Any]) -> None:
    r = client.chat.completions.create(model="demo", messages=with_tool_result(), tools=TOOLS, temperature=0)
    choice = r.choices[0]
    assert (choice.message.content, choice.finish_reason) == (ANSWER, "stop")
    assert choice.message.model_extra["reasoning_content"] == REASON_FINAL and not choice.message.tool_calls
    assert r.usage.completion_tokens == len(harmony["final_ids"])
    reasoning, content, calls, finish, _ = _stream(client, messages=with_tool_result(), tools=TOOLS)
    assert (reasoning, content, calls, finish) == (REASON_FINAL, ANSWER, {}, "stop")


def test_a_json_schema_constrains_the_final_channel_only(client: openai.OpenAI) -> None:
    """The analysis message is written as the model wants (a JSON grammar over the whole output
    would have forbidden its `<|c` first token); the final body follows the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="demo", messages=with_tool_result(), response_format=fmt, temperature=0)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == REASON_FINAL
    assert json.loads(msg.content or "") == json.loads(ANSWER)
    reasoning, content, _, _, _ = _stream(client, messages=with_tool_result(), response_format=fmt)
    assert (reasoning, json.loads(content)) == (REASON_FINAL, json.loads(ANSWER))
    # A schema the final answer does not follow: the grammar masks it, the reasoning is untouched.
    other = {"type": "object", "properties": {"sky": {"type": "string", "enum": ["clear"]}}, "required": ["sky"],
             "additionalProperties": False}
    fmt2 = {"type": "json_schema", "json_schema": {"name": "s", "schema": other, "strict": True}}
    r2 = client.chat.completions.create(model="demo", messages=with_tool_result(), response_format=fmt2,
                                        temperature=0, max_tokens=40)
    assert r2.choices[0].message.model_extra["reasoning_content"] == REASON_FINAL
    assert json.loads(r2.choices[0].message.content or "") == {"sky": "clear"}


def test_websocket_tool_calls_and_final_answer(srv: ServerProcess, harmony: dict[str, Any]) -> None:
    async def go() -> dict[str, list[dict[str, Any]]]:
        async with WsClient(srv.ws_url) as ws:
            return await ws.run({
                "call": {"kind": "chat", "messages": USER, "tools": TOOLS, "params": {"temperature": 0}},
                "final": {"kind": "chat", "messages": with_tool_result(), "tools": TOOLS,
                          "params": {"temperature": 0}}})

    got = asyncio.run(go())
    call, final = got["call"], got["final"]
    assert tokens_of(call) == harmony["call_ids"] and tokens_of(final) == harmony["final_ids"]
    deltas = [f for f in call if f["type"] == "delta"]
    assert "".join(f.get("reasoning_content", "") for f in deltas) == REASON_CALL
    assert "".join(f["text"] for f in deltas) == ""
    pieces = [tc for f in deltas for tc in f.get("tool_calls", [])]
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert json.loads("".join(tc["function"]["arguments"] for tc in pieces)) == json.loads(ARGS)
    assert call[-1]["type"] == "done" and call[-1]["finish_reason"] == "tool_calls"
    assert call[-1]["usage"]["reasoning_tokens"] == 7
    deltas = [f for f in final if f["type"] == "delta"]
    assert "".join(f.get("reasoning_content", "") for f in deltas) == REASON_FINAL
    assert "".join(f["text"] for f in deltas) == ANSWER and not any("tool_calls" in f for f in deltas)
    assert final[-1]["finish_reason"] == "stop"


def test_websocket_refuses_tools_on_a_completion(srv: ServerProcess) -> None:
    async def go() -> dict[str, Any]:
        async with WsClient(srv.ws_url) as ws:
            await ws.send({"type": "generate", "id": "x", "prompt": "hi", "tools": TOOLS})
            return await ws.recv()

    frame = asyncio.run(go())
    assert frame["type"] == "error" and frame["param"] == "tools"
