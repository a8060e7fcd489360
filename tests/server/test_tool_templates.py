"""Tool conversations through chat templates: a Hermes/Qwen-style template that supports tools
(tests.tiny_models.HERMES_TOOL_TEMPLATE) renders tools, assistant tool_calls and tool results
natively; SmolLM2's template (no tool support) gets them rewritten into plain messages
(server.serving.tool_render). Requests go through the real edge: JSON → ChatCompletionRequest →
chat_spec → PromptPreparer."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from server.api.decode import decode
from server.api.openai_format import chat_spec
from server.api.protocol import ChatCompletionRequest
from server.api.tools import plan_request
from server.models.demo_model import build_tokenizer
from server.serving.prompts import PromptPreparer
from server.text.loader import load_tokenizer
from server.text.tokenizer import Tokenizer
from tests.tiny_models import HERMES_TOOL_TEMPLATE, with_chat_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
]


@pytest.fixture(scope="module")
def hermes_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    base = tmp_path_factory.mktemp("tok")
    build_tokenizer(base)
    return Tokenizer.from_dir(with_chat_template(base, base.parent / "hermes-tok", HERMES_TOOL_TEMPLATE))


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Tokenizer:
    from server.models.default_model import find_default_model, missing_default_model_message

    found = find_default_model()
    if found is None:
        pytest.skip(missing_default_model_message())
    return load_tokenizer(found.path)


def render(tok: Tokenizer, body: dict[str, Any], parser: str = "hermes") -> str:
    req = decode(json.dumps(body), ChatCompletionRequest)
    plan = plan_request(req.tools, req.tool_choice, req.parallel_tool_calls, parser)
    spec = chat_spec(req, "http", "peer", "m", None, plan)
    ids = asyncio.run(PromptPreparer(tok).token_ids(spec))
    return tok.decode(ids, skip_special_tokens=False)


def test_tool_template_renders_tools_calls_and_results_natively(hermes_tokenizer: Tokenizer) -> None:
    text = render(hermes_tokenizer, {"messages": CONVERSATION, "tools": [WEATHER]})
    tool_json = json.dumps(WEATHER, ensure_ascii=False)
    assert text == (
        "<|im_start|>system\nBe brief.\n\nTools:\n<tools>\n" + tool_json + "\n</tools>\n"
        "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        # The arguments arrive as an object (tojson of a mapping), not as a quoted JSON string.
        "<|im_start|>assistant\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tool_template_without_tools_renders_plain(hermes_tokenizer: Tokenizer) -> None:
    text = render(hermes_tokenizer, {"messages": [{"role": "user", "content": "hi"}]})
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_smollm2_template_gets_tools_in_system_and_calls_as_text(smollm2_tokenizer: Tokenizer) -> None:
    text = render(smollm2_tokenizer, {"messages": CONVERSATION, "tools": [WEATHER]})
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nYou can use these tools")
    assert "\"name\": \"get_weather\"" in system and system.endswith("</tool_call>\n\nBe brief.")
    assert rest == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_llama3_format_and_merged_tool_results(smollm2_tokenizer: Tokenizer) -> None:
    conv = CONVERSATION[1:3] + [
        {"role": "tool", "tool_call_id": "call_1", "content": "a"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "b"}]},
    ]
    text = render(smollm2_tokenizer, {"messages": conv, "tools": [WEATHER]}, parser="llama3_json")
    assert "<|im_start|>assistant\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}<|im_end|>" in text
    # Two tool results in a row are one user turn (templates that insist on alternation accept it).
    assert "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response><|im_end|>" in text
    assert "\"parameters\": {<arguments>}" in text  # the llama3 call format is what it is taught


def test_smollm2_without_tools_is_unchanged(smollm2_tokenizer: Tokenizer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert render(smollm2_tokenizer, body) == smollm2_tokenizer.apply_chat_template(body["messages"])


def test_tool_template_is_detected_as_hermes(hermes_tokenizer: Tokenizer) -> None:
    from server.text.tool_parsers import detect_parser

    assert detect_parser(hermes_tokenizer.template_source(tools=[])) == "hermes"
