"""Structured outputs over the wire, against a live server running the random-weight demo model:
OpenAI's `response_format` (through the openai SDK, including `chat.completions.parse` with a
Pydantic model), vLLM's `structured_outputs` and `guided_*` fields, WebSocket `generate` frames,
and 400s / error frames naming the field for constraints that do not compile."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from server.engine.structured import DEAD_END
from server.serving.lifecycle import FinishReason
from tests.server.harness import ServerProcess, WsClient, text_of

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "population": {"type": "integer", "minimum": 1000, "maximum": 99999},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,5}$"},
                 "minItems": 1, "maxItems": 3},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Give me a city as JSON."}]


class City(BaseModel):
    name: Literal["Paris", "Oslo", "Lima"]
    rank: Annotated[int, Field(ge=1, le=50)]
    code: Annotated[str, Field(pattern=r"^[A-Z]{3}$")]


def _client(server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_sdk_response_format_json_schema(server: ServerProcess) -> None:
    client = _client(server)
    resp = client.chat.completions.create(
        model="demo", messages=MESSAGES, temperature=1.0, max_tokens=300, seed=5, n=2,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
    )
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_openai_sdk_parse_with_a_pydantic_model(server: ServerProcess) -> None:
    client = _client(server)
    resp = client.chat.completions.parse(model="demo", messages=MESSAGES, temperature=1.0,
                                         max_tokens=200, seed=9, response_format=City)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, City)
    assert City.model_validate_json(msg.content or "") == msg.parsed


def test_openai_sdk_streamed_json_object(server: ServerProcess) -> None:
    client = _client(server)
    stream = client.chat.completions.create(
        model="demo", messages=MESSAGES, temperature=1.0, max_tokens=300, seed=11, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    )
    text, reason = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("body, check", [
    ({"structured_outputs": {"regex": "[a-f]{3}-[0-9]{2}"}}, lambda t: re.fullmatch(r"[a-f]{3}-[0-9]{2}", t)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"guided_choice": ["up", "down"], "guided_decoding_backend": "xgrammar"}, lambda t: t in ("up", "down")),
    ({"guided_regex": "(ab|cd){2}"}, lambda t: re.fullmatch("(ab|cd){2}", t)),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch("x[0-9]{2}", t)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_completions_constraints(server: ServerProcess, body: dict[str, Any], check: Any) -> None:
    r = httpx.post(server.base + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": "Answer:", "temperature": 1.0, "max_tokens": 300, "seed": 3, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert check(choice["text"]), choice["text"]


def test_chat_json_object(server: ServerProcess) -> None:
    r = httpx.post(server.base + "/v1/chat/completions", timeout=120, json={
        "model": "demo", "messages": MESSAGES, "temperature": 1.0, "max_tokens": 40, "seed": 1,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_dead_end_is_reported_as_a_finish_reason(server: ServerProcess) -> None:
    assert FinishReason.GRAMMAR_DEAD_END == DEAD_END
    r = httpx.post(server.base + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": "x", "temperature": 1.0, "max_tokens": 20, "min_tokens": 10,
        "structured_outputs": {"grammar": 'start: "ok" <|end_of_text|>'}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("ok", DEAD_END)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}},
     "structured_outputs.json"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"yaml": "a: 1"}}, "structured_outputs.yaml"),
    ("/v1/completions", {"guided_regex": "b", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
])
def test_bad_constraints_are_400_naming_the_field(server: ServerProcess, path: str, body: dict[str, Any],
                                                  field: str) -> None:
    payload: dict[str, Any] = {"model": "demo", "max_tokens": 5, **body}
    if path.endswith("chat/completions"):
        payload["messages"] = MESSAGES
    else:
        payload["prompt"] = "x"
    r = httpx.post(server.base + path, json=payload, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    assert err["message"].startswith(field + ": "), err


def test_websocket_generate_frames(server: ServerProcess) -> None:
    async def go() -> dict[str, list[dict[str, Any]]]:
        async with WsClient(server.ws_url) as ws:
            return await ws.run({
                "choice": {"prompt": "Pick:", "params": {"temperature": 1.0, "max_tokens": 20,
                                                         "structured_outputs": {"choice": ["red", "blue"]}}},
                "schema": {"kind": "chat", "messages": MESSAGES,
                           "params": {"temperature": 1.0, "max_tokens": 300, "seed": 2, "response_format": {
                               "type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}}},
                "guided": {"prompt": "n:", "params": {"max_tokens": 20, "guided_regex": "[0-9]{4}"}},
                "bad": {"prompt": "x", "params": {"structured_outputs": {"json": {"type": "strin"}}}},
                "bad_rf": {"prompt": "x", "params": {"response_format": {"type": "json_schema", "json_schema": {
                    "name": "c", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}},
            })

    frames = asyncio.run(go())
    assert text_of(frames["choice"]) in ("red", "blue")
    jsonschema.validate(json.loads(text_of(frames["schema"])), SCHEMA)
    assert re.fullmatch("[0-9]{4}", text_of(frames["guided"]))
    for cid in ("choice", "schema", "guided"):
        assert frames[cid][-1]["type"] == "done"
        assert frames[cid][-1]["finish_reason"] == "stop"
    bad = frames["bad"][-1]
    assert bad["type"] == "error" and bad["code"] == "invalid_request"
    assert bad["param"] == "params.structured_outputs.json" and "strin" in bad["message"]
    bad_rf = frames["bad_rf"][-1]
    assert bad_rf["type"] == "error" and bad_rf["param"] == "params.response_format.json_schema.schema"
