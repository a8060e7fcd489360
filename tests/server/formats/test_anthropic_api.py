"""Anthropic's Messages API with the official `anthropic` SDK against a live server.

The references are ones nobody here wrote: the SDK parses every response and accumulates every
stream (`messages.stream(...).get_final_message()`), jsonschema validates tool inputs and
constrained answers, and the OpenAI edge (same spec, same engine) must give the same text and
prompt tokens for the same conversation. Sampling fields the installed SDK no longer types
(`temperature`, and pagewire's `seed`) go through `extra_body`, as a client of an older SDK
sends them.
"""
from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server.formats.conftest import FormatServer
from tests.server.test_tools_api import SEARCH_PARAMS, WEATHER_PARAMS

TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER_PARAMS},
    {"name": "search", "input_schema": SEARCH_PARAMS},
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                  **({"description": t["description"]} if "description" in t else {})}}
                for t in TOOLS]
USER = [{"role": "user", "content": "What is the weather in Paris this week?"}]
GREEDY = {"temperature": 0}
# A conversation the random demo model answers greedily to max_tokens without an end of turn
# (deterministic: greedy decoding), so a disconnect always finds it still running.
LONG = [{"role": "user", "content": "Tell me a very long story"}]


@pytest.fixture(scope="module")
def client(fmt_server: FormatServer) -> anthropic.Anthropic:
    """The SDK sending the key as `x-api-key` (how Anthropic's own API takes it)."""
    return anthropic.Anthropic(base_url=fmt_server.base, api_key=None, default_headers={"x-api-key": fmt_server.key},
                               max_retries=0, timeout=300)


def _events(fmt_server: FormatServer, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A raw stream's (event name, data) pairs."""
    out: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream("POST", fmt_server.base + "/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": fmt_server.key, "anthropic-version": "2023-06-01"}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                assert name is not None
                out.append((name, json.loads(line[6:])))
                name = None
    return out


def test_whole_stream_and_openai_agree(client: anthropic.Anthropic, fmt_server: FormatServer) -> None:
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in English."}]
    kw: dict[str, Any] = dict(model="demo", max_tokens=12, system=system, messages=USER, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "demo"
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text  # type: ignore[union-attr]
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    text = whole.content[0].text  # type: ignore[union-attr]

    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.content[0].text == text and final.stop_reason == whole.stop_reason  # type: ignore[union-attr]
    total = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == total
    assert final.usage.output_tokens == whole.usage.output_tokens

    # The same conversation through the OpenAI edge: the same spec, so the same prompt and text.
    oa = openai.OpenAI(base_url=fmt_server.base + "/v1", api_key=fmt_server.key, max_retries=0)
    chat = oa.chat.completions.create(model="demo", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "You are terse.\nAnswer in English."}, *USER])  # type: ignore[list-item]
    assert chat.choices[0].message.content == text
    assert chat.usage is not None and chat.usage.prompt_tokens == total
    assert chat.usage.completion_tokens == whole.usage.output_tokens

    # The ledger recorded it as this API's request, with its usage.
    row = fmt_server.row("req-" + final.id.removeprefix("msg_"))
    assert row["api"] == "anthropic" and row["state"] == "finished"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (total, final.usage.output_tokens)


def test_stream_is_anthropics_exact_event_sequence(fmt_server: FormatServer) -> None:
    events = _events(fmt_server, {"model": "demo", "max_tokens": 6, "messages": USER, **GREEDY})
    names = [n for n, _ in events]
    deltas = len(names) - 6
    assert deltas >= 1
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    assert all(d["type"] == n for n, d in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for n, d in events if n == "content_block_delta")
    end = events[-2][1]
    assert end["delta"]["stop_reason"] == "max_tokens" and end["usage"]["output_tokens"] == 6


def test_count_tokens_matches_the_prompt_of_a_message(client: anthropic.Anthropic, fmt_server: FormatServer) -> None:
    system = "Be brief."
    counted = client.messages.count_tokens(model="demo", system=system, messages=USER, tools=TOOLS)  # type: ignore[arg-type]
    sent = client.messages.create(model="demo", max_tokens=2, system=system, messages=USER, tools=TOOLS,  # type: ignore[arg-type]
                                  tool_choice={"type": "none"}, extra_body=GREEDY)
    assert counted.input_tokens == sent.usage.input_tokens + (sent.usage.cache_read_input_tokens or 0)
    tok = httpx.post(fmt_server.base + "/tokenize", headers=fmt_server.bearer(), json={
        "messages": [{"role": "system", "content": system}, *USER], "tools": OPENAI_TOOLS}).json()
    assert tok["count"] == counted.input_tokens


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = dict(model="demo", max_tokens=24, messages=USER, extra_body=GREEDY)
    text = client.messages.create(**kw).content[0].text  # type: ignore[union-attr]
    words = [w for w in text.split() if len(w) >= 3 and w.isalpha()]
    stop = next(w for w in words if text.find(w) >= 4)
    cut = client.messages.create(stop_sequences=[stop, "never-there"], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]  # type: ignore[union-attr]
    with client.messages.stream(stop_sequences=[stop], **kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == text[: text.find(stop)]  # type: ignore[union-attr]


def _calls(message: Any, allowed: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """Every tool_use block names an allowed tool and has input valid for its schema; ids distinct."""
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses, message
    assert len({b.id for b in uses}) == len(uses) and all(b.id.startswith("toolu_") for b in uses)
    for b in uses:
        assert b.name in allowed
        jsonschema.validate(b.input, SCHEMAS[b.name])
    return [(b.name, b.input) for b in uses]


@pytest.mark.parametrize("seed", [1, 2])
def test_tool_choice_any_whole_and_streamed(client: anthropic.Anthropic, seed: int) -> None:
    kw: dict[str, Any] = dict(model="demo", max_tokens=300, messages=USER, tools=TOOLS, tool_choice={"type": "any"},
                              extra_body={"temperature": 1.0, "seed": seed})
    whole = client.messages.create(**kw)
    assert whole.stop_reason == "tool_use"
    calls = _calls(whole, {"get_weather", "search"})
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert _calls(final, {"get_weather", "search"}) == calls  # same seed: the stream adds up to the whole


def test_named_tool_and_no_parallel_calls(client: anthropic.Anthropic) -> None:
    named = client.messages.create(model="demo", max_tokens=200, messages=USER, tools=TOOLS,  # type: ignore[arg-type]
                                   tool_choice={"type": "tool", "name": "search"}, extra_body={"temperature": 1.0})
    assert named.stop_reason == "tool_use" and len(_calls(named, {"search"})) == 1
    one = client.messages.create(model="demo", max_tokens=300, messages=USER, tools=TOOLS,  # type: ignore[arg-type]
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 extra_body={"temperature": 1.0})
    assert one.stop_reason == "tool_use" and len(_calls(one, {"get_weather", "search"})) == 1


def test_auto_reads_the_models_own_call(client: anthropic.Anthropic) -> None:
    # The server parses auto-mode calls as llama3_json ({"name", "parameters"}); a schema makes the
    # random model write exactly such a call, which auto mode must then read back as a tool_use.
    call_schema = {"type": "object", "properties": {"name": {"type": "string", "enum": ["search"]},
                                                    "parameters": SEARCH_PARAMS},
                   "required": ["name", "parameters"], "additionalProperties": False}
    kw: dict[str, Any] = dict(model="demo", max_tokens=200, messages=USER, tools=TOOLS,
                              output_config={"format": {"type": "json_schema", "schema": call_schema}},
                              extra_body={"temperature": 1.0, "seed": 5})
    whole = client.messages.create(**kw)
    assert whole.stop_reason == "tool_use" and len(_calls(whole, {"search"})) == 1
    with client.messages.stream(**kw) as s:
        assert _calls(s.get_final_message(), {"search"}) == _calls(whole, {"search"})


def test_tool_result_turn(client: anthropic.Anthropic, fmt_server: FormatServer) -> None:
    first = client.messages.create(model="demo", max_tokens=200, messages=USER, tools=TOOLS,  # type: ignore[arg-type]
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 1.0})
    use = next(b for b in first.content if b.type == "tool_use")
    result = json.dumps({"forecast": "sunny", "high": 21})
    convo: list[Any] = [*USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,  # type: ignore[union-attr]
                                                      "content": [{"type": "text", "text": result}]},
                                                     {"type": "text", "text": "And tomorrow?"}]}]
    second = client.messages.create(model="demo", max_tokens=8, messages=convo, tools=TOOLS,  # type: ignore[arg-type]
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in second.content] == ["text"] and second.stop_reason in ("end_turn", "max_tokens")
    # The prompt is the conversation in OpenAI's shape through the same template: the call, its
    # result (before the user's text, as Anthropic orders them) and the tools.
    oa_convo = [*USER,
                {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function", "function": {  # type: ignore[union-attr]
                    "name": use.name, "arguments": json.dumps(use.input)}}]},  # type: ignore[union-attr]
                {"role": "tool", "tool_call_id": use.id, "content": result},  # type: ignore[union-attr]
                {"role": "user", "content": "And tomorrow?"}]
    tok = httpx.post(fmt_server.base + "/tokenize", headers=fmt_server.bearer(),
                     json={"messages": oa_convo, "tools": OPENAI_TOOLS}).json()
    assert second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0) == tok["count"]


def test_schema_constrained_answer(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    kw: dict[str, Any] = dict(model="demo", max_tokens=80, messages=USER,
                              output_config={"format": {"type": "json_schema", "schema": schema}},
                              extra_body={"temperature": 1.0, "seed": 11})
    whole = client.messages.create(**kw)
    text = whole.content[0].text  # type: ignore[union-attr]
    jsonschema.validate(json.loads(text), schema)
    assert whole.stop_reason == "end_turn"
    with client.messages.stream(**kw) as s:
        assert s.get_final_message().content[0].text == text  # type: ignore[union-attr]


def test_disconnect_cancels_the_request(fmt_server: FormatServer) -> None:
    body = {"model": "demo", "max_tokens": 1500, "messages": LONG, "stream": True, **GREEDY}
    with httpx.stream("POST", fmt_server.base + "/v1/messages", json=body,
                      headers={"x-api-key": fmt_server.key}, timeout=300) as r:
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()
        while not next(lines).startswith("event: content_block_delta"):
            pass
    # Closed mid-stream: the engine drops the request at its next step.
    assert fmt_server.wait_state(rid) == "cancelled"
    assert fmt_server.wait_idle() == 0

    # A whole (non-streamed) request whose client gives up is cancelled too.
    from tests.server.harness import hang_up_while_generating

    rid = hang_up_while_generating(fmt_server.base, "/v1/messages", {**body, "stream": False},
                                   {"x-api-key": fmt_server.key}, fmt_server.db, "anthropic-gone")
    assert fmt_server.wait_state(rid) == "cancelled"


def test_quota_429_in_anthropics_shape(fmt_server: FormatServer) -> None:
    tight = anthropic.Anthropic(base_url=fmt_server.base, api_key=fmt_server.tight, max_retries=0)  # Bearer
    for stream in (False, True):
        with pytest.raises(anthropic.RateLimitError) as e:
            tight.messages.create(model="demo", max_tokens=200, messages=USER, stream=stream)  # type: ignore[call-overload]
        assert e.value.status_code == 429
        body = e.value.body
        assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        assert "daily" in body["error"]["message"] and int(e.value.response.headers["retry-after"]) > 0


def test_auth_in_anthropics_shape(fmt_server: FormatServer) -> None:
    body = {"model": "demo", "max_tokens": 2, "messages": USER}
    for headers in ({}, {"x-api-key": "pw-nope.wrong"}, {"Authorization": "Bearer nope"}):
        r = httpx.post(fmt_server.base + "/v1/messages", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=fmt_server.base, api_key="wrong", max_retries=0).messages.create(
            model="demo", max_tokens=2, messages=USER)  # type: ignore[arg-type]
    ok = anthropic.Anthropic(base_url=fmt_server.base, api_key=fmt_server.key, max_retries=0).messages.create(
        model="demo", max_tokens=2, messages=USER)  # type: ignore[arg-type]
    assert ok.usage.output_tokens >= 1  # Authorization: Bearer works as well
    r = httpx.get(fmt_server.base + "/v1/messages", headers={"x-api-key": fmt_server.key})
    assert r.status_code == 405 and r.json()["type"] == "error"


BAD: list[tuple[dict[str, Any], str]] = [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens"),
    ({"max_tokens": 4}, "messages"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 4, "messages": USER, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"max_tokens": 4, "messages": [*USER, {"role": "assistant", "content": "The answer is "}]}, "messages[1].content"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"max_tokens": 4, "messages": USER, "system": [{"type": "image"}]}, "system[0].type"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"name": "x"}]}, "tools[0].input_schema"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].name"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type"),
    ({"max_tokens": 4, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name"),
    ({"max_tokens": 4, "messages": USER, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": USER, "output_config": {"format": {"type": "json"}}}, "output_config.format.type"),
    ({"max_tokens": 4, "messages": USER, "output_config": {"format": {"type": "json_schema",
                                                                       "schema": {"type": "wrong"}}}},
     "output_config.format.schema"),
    ({"max_tokens": 4000, "messages": USER}, "max_tokens"),
    ({"max_tokens": 4, "messages": USER, "stop_sequences": [""]}, "stop_sequences"),
]


@pytest.mark.parametrize("body,field", BAD, ids=[f for _, f in BAD])
def test_bad_input_is_400_naming_the_field(fmt_server: FormatServer, body: dict[str, Any], field: str) -> None:
    r = httpx.post(fmt_server.base + "/v1/messages", json={"model": "demo", **body},
                   headers={"x-api-key": fmt_server.key}, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(field + ":"), err


def test_other_refusals_in_anthropics_shape(fmt_server: FormatServer) -> None:
    h = {"x-api-key": fmt_server.key}
    r = httpx.post(fmt_server.base + "/v1/messages", json={"model": "claude-x", "max_tokens": 2, "messages": USER},
                   headers=h)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and "model" in r.text
    r = httpx.post(fmt_server.base + "/v1/messages", content=b"{" + b" " * 70000 + b"}", headers=h)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(fmt_server.base + "/v1/messages", content=b"{not json", headers=h)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(fmt_server.base + "/v1/messages/count_tokens", json={"model": "demo", "messages": [{"role": "x"}]},
                   headers=h)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[0].")


def test_idempotency_key(fmt_server: FormatServer) -> None:
    body = {"model": "demo", "max_tokens": 6, "messages": USER, "temperature": 1.0}
    h = {"x-api-key": fmt_server.key, "Idempotency-Key": "anthropic-once"}
    a = httpx.post(fmt_server.base + "/v1/messages", json=body, headers=h, timeout=120).json()
    b = httpx.post(fmt_server.base + "/v1/messages", json=body, headers=h, timeout=120).json()
    assert a["id"] == b["id"] and a["content"] == b["content"]
    r = httpx.post(fmt_server.base + "/v1/messages", json={**body, "max_tokens": 7}, headers=h, timeout=120)
    assert r.status_code == 409 and r.json()["type"] == "error"
    assert r.json()["error"]["message"].startswith("Idempotency-Key:")


PREFILL = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]


def _continuation_reference(fmt_server: FormatServer, n: int) -> tuple[str, int]:
    """The greedy continuation of transformers' own `continue_final_message` rendering of PREFILL
    (the template's turn end cut after the final message), asked as a plain completion by token ids."""
    import transformers

    from tests.tiny_models import HERMES_TOOL_TEMPLATE

    tok = transformers.AutoTokenizer.from_pretrained(str(fmt_server.proc.model_dir))
    text = tok.apply_chat_template(PREFILL, chat_template=HERMES_TOOL_TEMPLATE, tokenize=False,
                                   add_generation_prompt=False, continue_final_message=True)
    assert isinstance(text, str) and text.endswith("The colour is")
    ids = tok.encode(text, add_special_tokens=False)
    r = httpx.post(fmt_server.base + "/v1/completions", headers=fmt_server.bearer(), timeout=300,
                   json={"model": "demo", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], len(ids)


def test_prefill_continues_the_final_assistant_message(fmt_server: FormatServer, client: anthropic.Anthropic) -> None:
    want, n_prompt = _continuation_reference(fmt_server, 12)
    msg = client.messages.create(model="demo", max_tokens=12, messages=PREFILL,  # type: ignore[arg-type]
                                 extra_body={**GREEDY, "ignore_eos": True})
    assert msg.content[0].text == want  # type: ignore[union-attr]  # only the continuation
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == n_prompt
    # OpenAI's edge, with vLLM's field, continues the same way.
    oa = openai.OpenAI(base_url=fmt_server.base + "/v1", api_key=fmt_server.key, max_retries=0)
    chat = oa.chat.completions.create(model="demo", messages=PREFILL, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                      extra_body={"add_generation_prompt": False, "continue_final_message": True,
                                                  "ignore_eos": True})
    assert chat.choices[0].message.content == want and chat.usage is not None
    assert chat.usage.prompt_tokens == n_prompt


def test_prefill_refusals_name_the_field(fmt_server: FormatServer, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="demo", max_tokens=4,
                               messages=[PREFILL[0], {"role": "assistant", "content": "The colour is "}])
    assert "messages[1].content" in e.value.message and "trailing whitespace" in e.value.message
    oa = openai.OpenAI(base_url=fmt_server.base + "/v1", api_key=fmt_server.key, max_retries=0)
    for extra, field in (({"continue_final_message": True}, "continue_final_message"),
                         ({"continue_final_message": True, "add_generation_prompt": False}, "messages[0].role")):
        with pytest.raises(openai.BadRequestError) as oe:
            oa.chat.completions.create(model="demo", messages=PREFILL if field == "continue_final_message" else USER,  # type: ignore[arg-type]
                                       max_tokens=4, extra_body=extra)
        assert oe.value.body["param"] == field, oe.value.body  # type: ignore[index]
