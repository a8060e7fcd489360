"""OpenAI's Responses API through the official openai SDK (client.responses.create / .stream /
.retrieve / .delete) against a live server: the answer equals the chat completion of the same
conversation (greedy), streaming adds up to it with the typed events in order, a conversation
continues by previous_response_id (and hits the prefix cache), function tools and their
function_call / function_call_output items, text.format json_schema, store, bad input as a 4xx
naming the field, and cancel on disconnect."""
from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.server.harness import ServerProcess, ledger_rows

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> Any:
    return client.chat.completions.create(model="demo", messages=messages, max_tokens=max_tokens, temperature=0)


def test_create_equals_the_chat_completion_of_the_same_conversation(client: openai.OpenAI,
                                                                    server: ServerProcess) -> None:
    r = client.responses.create(model="demo", input="Say something", instructions="Be brief.",
                                max_output_tokens=12, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}], 12)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 12
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    # One ledger row, like any request; the response is stored (store defaults to true).
    rid = "req-" + r.id.removeprefix("resp_")
    assert ledger_rows(server.db)[rid]["state"] == "finished"
    got = client.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.id == r.id


def test_input_items_and_stream_events(client: openai.OpenAI) -> None:
    items: Any = [{"role": "developer", "content": "Be brief."},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}]
    whole = client.responses.create(model="demo", input=items, max_output_tokens=10, temperature=0)
    kinds: list[str] = []
    seqs: list[int] = []
    final: Any = None
    # Cut by max_output_tokens, the stream ends with `response.incomplete` (as OpenAI's does), which
    # carries the final response; the SDK's get_final_response() wants `response.completed` only.
    with client.responses.stream(model="demo", input=items, max_output_tokens=10, temperature=0) as stream:
        for ev in stream:
            kinds.append(ev.type)
            seqs.append(ev.sequence_number)
            if ev.type == "response.incomplete":
                final = ev.response
    assert final.output_text == whole.output_text and final.status == "incomplete"
    assert seqs == list(range(len(seqs)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds.count("response.output_text.delta") >= 1
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]


def test_previous_response_id_continues_and_hits_the_prefix_cache(client: openai.OpenAI) -> None:
    first = client.responses.create(model="demo", input="Tell me a story about a cat", max_output_tokens=40,
                                    temperature=0)
    second = client.responses.create(model="demo", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    history = [{"role": "user", "content": "Tell me a story about a cat"},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}]
    chat = _chat(client, history, 8)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    # The first turn's prompt (and its answer) is the start of the second's: KV blocks reused.
    assert second.usage.input_tokens_details.cached_tokens >= 16


def test_store_false_and_delete(client: openai.OpenAI) -> None:
    r = client.responses.create(model="demo", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="demo", input="more", previous_response_id=r.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    kept = client.responses.create(model="demo", input="hi", max_output_tokens=2)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_function_calls_and_their_outputs(client: openai.OpenAI) -> None:
    r = client.responses.create(model="demo", input="Weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and r.status == "completed"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    with client.responses.stream(model="demo", input="Weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                 temperature=0) as stream:
        streamed = stream.get_final_response()
    s_calls = [o for o in streamed.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in s_calls] == [(c.name, c.arguments) for c in calls]
    # The result goes back as a function_call_output item, continuing the stored conversation.
    follow = client.responses.create(
        model="demo", previous_response_id=r.id, max_output_tokens=6, temperature=0, tools=[WEATHER],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp_c": 21}'}])
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > r.usage.input_tokens
    # Or given in full without storage: the call item, then its output.
    again = client.responses.create(
        model="demo", store=False, max_output_tokens=4, tools=[WEATHER],  # type: ignore[list-item]
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"}])
    assert again.usage.output_tokens >= 1


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
              "required": ["answer"], "additionalProperties": False}
    r = client.responses.create(model="demo", input="Answer in JSON", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert r.status == "completed"
    assert set(json.loads(r.output_text)) == {"answer"}


@pytest.mark.parametrize("body, field", [
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "background": True}, "background"),
    ({"input": 5}, "input"),
    ({}, "input"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
])
def test_bad_input_is_a_400_naming_the_field(server: ServerProcess, body: dict[str, Any], field: str) -> None:
    r = httpx.post(server.base + "/v1/responses", json={"model": "demo", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field or (err["param"] or "").startswith(field), err


def test_too_long_names_input_and_max_output_tokens(server: ServerProcess) -> None:
    r = httpx.post(server.base + "/v1/responses", json={"input": "word " * 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(server.base + "/v1/responses", json={"input": "hi", "max_output_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_unknown_previous_response_is_404(server: ServerProcess) -> None:
    r = httpx.post(server.base + "/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_disconnect_mid_stream_cancels(server: ServerProcess) -> None:
    body = {"model": "demo", "input": "Tell me a very long story", "max_output_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.base + "/v1/responses", json=body, timeout=60) as r:
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("event: response.output_text.delta"):
                break
    deadline = time.monotonic() + 60
    while ledger_rows(server.db)[rid]["state"] != "cancelled" and time.monotonic() < deadline:
        time.sleep(0.05)
    row = ledger_rows(server.db)[rid]
    assert row["state"] == "cancelled" and row["completion_tokens"] < 400


def test_disconnect_while_waiting_for_the_whole_response_cancels(server: ServerProcess) -> None:
    from tests.server.harness import hang_up_while_generating

    body = {"model": "demo", "input": "Tell me a very long story", "max_output_tokens": 1500, "temperature": 0}
    rid = hang_up_while_generating(server.base, "/v1/responses", body, {}, server.db, "resp-gone")
    deadline = time.monotonic() + 300
    while ledger_rows(server.db)[rid]["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    row = ledger_rows(server.db)[rid]
    assert row["state"] == "cancelled" and row["completion_tokens"] < 1500


def test_idempotency_key_returns_the_same_response(client: openai.OpenAI) -> None:
    kw: Any = dict(model="demo", input="Count to three", max_output_tokens=6, temperature=0,
                   extra_headers={"Idempotency-Key": "resp-idem-1"})
    a = client.responses.create(**kw)
    b = client.responses.create(**kw)
    assert (b.id, b.output_text, b.created_at) == (a.id, a.output_text, a.created_at)
    with pytest.raises(openai.ConflictError):  # the same key with another body
        client.responses.create(**{**kw, "input": "Count to four"})
