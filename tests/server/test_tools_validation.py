"""Tool request validation (server.api.tools): every bad `tools`, `tool_choice` or tool message is
an InvalidRequest (400) naming the field; good ones become the right ToolPlan and constraint.
Also the whole/streamed rendering of tool calls (server.api.tool_output) accumulated by the openai
SDK's own delta accumulator."""
from __future__ import annotations

import json
from typing import Any, Optional

import jsonschema
import pytest

from server.api.decode import decode
from server.api.openai_format import chat_spec
from server.api.protocol import ChatCompletionRequest
from server.api.tool_output import ChatToolStream, whole_message
from server.api.tools import call_id, plan_request
from server.serving.errors import InvalidRequest
from server.serving.jobs import GenerationSpec

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def tool(name: str, params: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params or PARAMS}}


def spec_of(body: dict[str, Any], parser: str = "hermes") -> GenerationSpec:
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    req = decode(json.dumps(body), ChatCompletionRequest)
    plan = plan_request(req.tools, req.tool_choice, req.parallel_tool_calls, parser)
    return chat_spec(req, "http", "peer", "m", None, plan)


@pytest.mark.parametrize("body, field", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [tool("a"), "x"]}, "tools[1]"),
    ({"tools": [tool("a"), tool("b"), {"type": "code", "function": {"name": "c"}}]}, "tools[2].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [tool("a"), tool("b"), tool("has space")]}, "tools[2].function.name"),
    ({"tools": [tool("x" * 65)]}, "tools[0].function.name"),
    ({"tools": [tool("a"), tool("a")]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"tools": [tool("a", {"type": "array"})]}, "tools[0].function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"name": "a", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": [tool("a")], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [tool("a")], "tool_choice": {"type": "function", "function": {"name": "b"}}}, "tool_choice.function.name"),
    ({"tools": [tool("a")], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ({"tools": [tool("a")], "tool_choice": {"type": "x", "function": {"name": "a"}}}, "tool_choice.type"),
    ({"tools": [tool("a")], "tool_choice": 3}, "tool_choice"),
    ({"tools": [tool("a")], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_fields_are_400_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        spec_of(body)
    assert e.value.status == 400
    assert e.value.param == field
    assert str(e.value).startswith(field + ":")


CALL = {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": "{\"city\": \"x\"}"}}


@pytest.mark.parametrize("messages, field", [
    ([{"role": "user", "content": "q", "tool_calls": [CALL]}], "messages[0].tool_calls"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{**CALL, "id": None}]}],
     "messages[1].tool_calls[0].id"),
    ([{"role": "assistant", "tool_calls": [CALL, {**CALL, "type": "code"}]}], "messages[0].tool_calls[1].type"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "assistant", "tool_calls": [{"id": "c"}]}], "messages[0].tool_calls[0].function"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "a", "arguments": "{bad"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "a", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}], "messages[1].tool_call_id"),
    ([{"role": "tool", "tool_call_id": "c"}], "messages[0].content"),
    ([{"role": "user", "content": "q", "tool_call_id": "c"}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "tool_calls": ["x"]}], "messages[0].tool_calls[0]"),
])
def test_bad_tool_messages_are_400_naming_the_field(messages: list[dict[str, Any]], field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        spec_of({"messages": messages})
    assert e.value.param == field, str(e.value)


def test_plans_and_constraints() -> None:
    tools = [tool("a"), tool("b", {"type": "object", "properties": {"n": {"type": "integer"}}})]
    auto = spec_of({"tools": tools})
    assert auto.tools == tools and auto.tool_format == "hermes"
    assert "structured_outputs" not in auto.sampling
    assert spec_of({"tools": tools, "tool_choice": "none"}).sampling.get("structured_outputs") is None

    named = spec_of({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "b"}}})
    assert named.sampling["structured_outputs"].json == tools[1]["function"]["parameters"]
    assert named.field_names["structured_outputs.json"] == "tools[1].function.parameters"

    req_spec = spec_of({"tools": tools, "tool_choice": "required"})
    assert req_spec.field_names["structured_outputs.json"] == "tools"
    required = req_spec.sampling["structured_outputs"].json
    good = [{"name": "a", "parameters": {"city": "x"}}, {"name": "b", "parameters": {"n": 2}}]
    jsonschema.validate(good, required)
    for bad in ([], [{"name": "a", "parameters": {"n": 2}}], [{"name": "c", "parameters": {}}],
                [{"name": "b", "parameters": {"n": 1}, "x": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)

    single = spec_of({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    schema = single.sampling["structured_outputs"].json
    jsonschema.validate(good[0], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, schema)


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_object"}}, "tool_choice"),
    ({"structured_outputs": {"regex": "a+"}}, "tool_choice"),
    ({"guided_json": {"type": "object"}}, "tool_choice"),
])
def test_forced_tool_choice_with_another_constraint_is_400(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        spec_of({"tools": [tool("a")], "tool_choice": "required", **extra})
    assert e.value.param == field
    # auto and none leave the client's own constraint alone.
    assert spec_of({"tools": [tool("a")], **extra}).sampling["structured_outputs"] is not None


def test_keep_special_tokens_only_for_auto_with_special_marker() -> None:
    req = decode(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [tool("a")]}),
                 ChatCompletionRequest)
    plan = plan_request(req.tools, req.tool_choice, None, "llama3_json", keep_special_tokens=True)
    assert chat_spec(req, "http", "p", "m", None, plan).sampling["skip_special_tokens"] is False
    plan = plan_request(req.tools, "required", None, "llama3_json", keep_special_tokens=True)
    assert chat_spec(req, "http", "p", "m", None, plan).sampling["skip_special_tokens"] is True


def accumulate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold delta dicts with the openai SDK's own accumulator."""
    from openai.lib.streaming._deltas import accumulate_delta

    acc: dict[object, object] = {}
    for c in chunks:
        acc = accumulate_delta(acc, c)
    return acc


@pytest.mark.parametrize("choice, text", [
    ("auto", "Sure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"
             "\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"),
    ("required", "[{\"name\": \"a\", \"parameters\": {\"city\": \"Rome\"}}, "
                 "{\"name\": \"b\", \"parameters\": {\"city\": \"Oslo\"}}]"),
    ({"type": "function", "function": {"name": "a"}}, "{\"city\": \"Rome\"}"),
])
def test_stream_accumulates_to_the_whole_message(choice: Any, text: str) -> None:
    plan = plan_request([tool("a"), tool("b")], choice, None, "hermes")
    message, finish = whole_message(plan, "req1", 0, text, "stop")
    assert finish == "tool_calls"
    calls = message["tool_calls"]
    assert calls[0]["function"]["name"] == "a" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    assert calls[0]["id"] == call_id("req1", 0, 0) and calls[0]["id"].startswith("call_")
    stream = ChatToolStream(plan, "req1")
    deltas: list[dict[str, Any]] = []
    last: Optional[str] = None
    for i in range(0, len(text), 3):
        end = i + 3 >= len(text)
        d, last = stream.delta(0, text[i:i + 3], "stop" if end else None)
        deltas.append(d)
    assert last == "tool_calls"
    # Later deltas of a call carry no id/name (the SDK would concatenate them).
    firsts = [c for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert len(firsts) == len(calls)
    acc = accumulate(deltas)
    got = [{k: v for k, v in c.items() if k != "index"} for c in acc["tool_calls"]]  # type: ignore[union-attr]
    assert got == calls
    assert acc.get("content") == message["content"]


def test_length_cut_keeps_length_and_plain_text_is_content() -> None:
    plan = plan_request([tool("a")], {"type": "function", "function": {"name": "a"}}, None, "hermes")
    message, finish = whole_message(plan, "r", 0, "{\"city\": \"Ro", "length")
    assert finish == "length" and message["tool_calls"][0]["function"]["arguments"] == "{\"city\": \"Ro"
    auto = plan_request([tool("a")], None, None, "hermes")
    assert whole_message(auto, "r", 0, "Just text.", "stop") == (
        {"role": "assistant", "content": "Just text."}, "stop")


def test_tool_call_parser_option_and_detection(tmp_path: Any) -> None:
    import argparse
    from types import SimpleNamespace

    from server.api.context import ApiContext
    from server.models.demo_model import build_tokenizer
    from server.serving.settings import add_serve_arguments, settings_from_args
    from server.text.tokenizer import Tokenizer
    from tests.tiny_models import HERMES_TOOL_TEMPLATE, with_chat_template

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert settings_from_args(p.parse_args([]), {}).tool_call_parser == "auto"
    assert settings_from_args(p.parse_args(["--tool-call-parser", "llama3_json"]), {}).tool_call_parser == "llama3_json"
    assert settings_from_args(p.parse_args([]), {"PAGEWIRE_TOOL_CALL_PARSER": "none"}).tool_call_parser == "none"
    with pytest.raises(ValueError, match="PAGEWIRE_TOOL_CALL_PARSER"):
        settings_from_args(p.parse_args([]), {"PAGEWIRE_TOOL_CALL_PARSER": "mistral"})
    with pytest.raises(SystemExit):
        p.parse_args(["--tool-call-parser", "mistral"])

    build_tokenizer(tmp_path / "demo")
    demo = Tokenizer.from_dir(tmp_path / "demo")  # its template mentions tools but no call format
    hermes = Tokenizer.from_dir(with_chat_template(tmp_path / "demo", tmp_path / "h", HERMES_TOOL_TEMPLATE))

    def ctx(tok: Tokenizer, setting: str) -> ApiContext:
        return ApiContext(SimpleNamespace(tokenizer=tok, settings=SimpleNamespace(tool_call_parser=setting)),  # type: ignore[arg-type]
                          None)  # type: ignore[arg-type]

    assert ctx(hermes, "auto").tool_parser == "hermes"
    assert ctx(demo, "auto").tool_parser == "none"
    assert ctx(demo, "llama3_json").tool_parser == "llama3_json"
    # `<tool_call>` is plain text in the demo vocabulary, so special tokens need not be kept.
    assert ctx(hermes, "auto").tool_marker_special is False
    # A vocabulary where the marker is a special token (as `<|python_tag|>` is in Llama 3): the
    # detokenizer would drop it, so auto requests must keep special tokens.
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(str(tmp_path / "h" / "tokenizer.json"))
    backend.add_special_tokens(["<tool_call>", "<|python_tag|>"])
    special = Tokenizer(backend, chat_template=HERMES_TOOL_TEMPLATE)
    assert ctx(special, "auto").tool_marker_special is True
    assert ctx(special, "llama3_json").tool_marker_special is True
    assert ctx(special, "none").tool_marker_special is False
