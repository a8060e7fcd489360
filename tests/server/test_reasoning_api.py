"""Reasoning output over HTTP (the openai SDK) and the WebSocket, on a tiny thinking Qwen3 whose
greedy answers are checked token for token against transformers: the thinking goes to
`reasoning_content` (whole and streamed), the answer to `content`, `max_tokens` counts both,
usage and the ledger count reasoning tokens apart, `chat_template_kwargs: {"enable_thinking":
false}` reaches the template, and a JSON schema applies after `</think>` only."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import httpx
import openai
import pytest

from server.text.reasoning import split_whole
from tests.server.harness import ServerProcess, WsClient, ledger_rows
from tests.thinking_model import PROMPT, greedy_reference, make_thinking_model

MAX = 24
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_thinking_model(tmp_path_factory.mktemp("thinking") / "qwen3-think")


@pytest.fixture(scope="module")
def srv(thinking: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # No --reasoning-parser: it is picked from the chat template (qwen3).
    proc = ServerProcess(thinking["path"], tmp_path_factory.mktemp("ledger") / "r.db", "--log-level", "info")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _reference(thinking: dict[str, Any], max_tokens: int = MAX, **kw: Any) -> tuple[str, list[int]]:
    _prompt, text, ids = greedy_reference(thinking["path"], PROMPT, max_tokens, thinking["eos"], **kw)
    return text, ids


def test_parser_is_detected_from_the_template(srv: ServerProcess) -> None:
    assert "reasoning parser: qwen3 (from the chat template)" in srv.read_log()


def test_whole_and_streamed_split_match_transformers(client: openai.OpenAI, thinking: dict[str, Any],
                                                     srv: ServerProcess) -> None:
    text, ids = _reference(thinking)
    want_reasoning, want_content = split_whole(text, starts_open=True)
    assert want_reasoning and want_content  # the model closes its block and goes on answering
    r = client.chat.completions.create(model="demo", messages=PROMPT, max_tokens=MAX, temperature=0)
    msg = r.choices[0].message
    assert msg.content == want_content
    assert msg.model_extra["reasoning_content"] == want_reasoning
    end = ids.index(thinking["end_id"])
    assert r.usage.completion_tokens == len(ids) == MAX  # max_tokens counted both parts
    assert r.usage.completion_tokens_details.reasoning_tokens == end + 1
    # The ledger keeps the count apart.
    row = ledger_rows(srv.db)[r.id.removeprefix("chatcmpl-")]
    assert row["reasoning_tokens"] == end + 1 and row["completion_tokens"] == MAX
    # And the usage report sums it apart from the rest of the completion tokens.
    report = httpx.get(srv.base + "/v1/usage").json()["data"]
    assert sum(u["reasoning_tokens"] for u in report) == sum(x["reasoning_tokens"] for x in ledger_rows(srv.db).values())
    assert sum(u["reasoning_tokens"] for u in report) >= end + 1
    assert row["output"]["samples"][0]["reasoning"] == want_reasoning

    reasoning, content = "", ""
    usage = None
    for chunk in client.chat.completions.create(model="demo", messages=PROMPT, max_tokens=MAX, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (want_reasoning, want_content)
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == end + 1


def test_max_tokens_inside_the_thinking_is_all_reasoning(client: openai.OpenAI, thinking: dict[str, Any]) -> None:
    text, ids = _reference(thinking, 2)
    r = client.chat.completions.create(model="demo", messages=PROMPT, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.model_extra["reasoning_content"] == split_whole(text, True)[0]
    assert r.choices[0].message.content == ""
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 2


def test_enable_thinking_false_reaches_the_template(client: openai.OpenAI, thinking: dict[str, Any]) -> None:
    text, _ids = _reference(thinking, enable_thinking=False)
    r = client.chat.completions.create(model="demo", messages=PROMPT, max_tokens=MAX, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # The template closed the block in the prompt: what the model writes is all answer.
    assert r.choices[0].message.content == split_whole(text, starts_open=False)[1]
    assert not r.choices[0].message.model_extra.get("reasoning_content")
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_chat_template_kwargs_bad_input_names_the_field(client: openai.OpenAI) -> None:
    for bad, field in (({"messages": []}, "chat_template_kwargs.messages"), ([1], "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="demo", messages=PROMPT, max_tokens=2,
                                           extra_body={"chat_template_kwargs": bad})
        assert e.value.body["param"] == field


def test_json_schema_applies_after_the_thinking(client: openai.OpenAI, thinking: dict[str, Any]) -> None:
    text, ids = _reference(thinking)
    want_reasoning = split_whole(text, True)[0]
    r = client.chat.completions.create(
        model="demo", messages=PROMPT, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    msg = r.choices[0].message
    # The thinking is exactly the unconstrained greedy output; the answer follows the schema.
    assert msg.model_extra["reasoning_content"] == want_reasoning
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(msg.content)) == {"city"}


def test_json_schema_without_thinking_starts_at_once(client: openai.OpenAI) -> None:
    """enable_thinking false: the first token is the grammar's (or an opening <think>)."""
    r = client.chat.completions.create(
        model="demo", messages=PROMPT, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"city"}


def test_websocket_deltas_carry_reasoning_content(srv: ServerProcess, thinking: dict[str, Any]) -> None:
    text, ids = _reference(thinking)
    want = split_whole(text, True)

    async def main() -> list[dict[str, Any]]:
        async with WsClient(srv.ws_url) as ws:
            got = await ws.run({"a": {"kind": "chat", "messages": PROMPT,
                                      "params": {"max_tokens": MAX, "temperature": 0}}})
            return got["a"]

    frames = asyncio.run(main())
    deltas = [f for f in frames if f["type"] == "delta"]
    assert "".join(f.get("reasoning_content", "") for f in deltas) == want[0]
    assert "".join(f["text"] for f in deltas) == want[1]
    assert [t for f in deltas for t in f["token_ids"]] == ids  # token for token, thinking included
    done = frames[-1]
    assert done["type"] == "done" and done["usage"]["reasoning_tokens"] > 0


def test_responses_api_gives_a_reasoning_item(client: openai.OpenAI, thinking: dict[str, Any]) -> None:
    text, ids = _reference(thinking)
    want_reasoning, want_content = split_whole(text, True)
    r = client.responses.create(model="demo", input=PROMPT, max_output_tokens=MAX, temperature=0)  # type: ignore[arg-type]
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == want_reasoning and r.output_text == want_content
    assert r.usage.output_tokens_details.reasoning_tokens == ids.index(thinking["end_id"]) + 1
    reasoning, kinds = "", []
    with client.responses.stream(model="demo", input=PROMPT, max_output_tokens=MAX,  # type: ignore[arg-type]
                                 temperature=0) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.reasoning_text.delta":
                reasoning += ev.delta
    assert reasoning == want_reasoning
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.done")


def test_forced_tool_call_waits_for_the_end_of_the_thinking(client: openai.OpenAI, thinking: dict[str, Any],
                                                            srv: ServerProcess) -> None:
    """A named tool call is grammar-forced; while the model thinks nothing is forced: with tools in
    the prompt this model keeps thinking past 24 tokens, and those are exactly its unconstrained
    greedy tokens (a grammar applied from the first token would have forced JSON instead)."""
    import httpx
    import torch
    import transformers as tf

    tool = {"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}
    prompt = httpx.post(srv.base + "/tokenize", json={"messages": PROMPT, "tools": [tool]}).json()["tokens"]
    model = tf.AutoModelForCausalLM.from_pretrained(thinking["path"], dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = [int(t) for t in out[0, len(prompt):]]
    assert thinking["end_id"] not in ref
    want = httpx.post(srv.base + "/detokenize", json={"tokens": ref}).json()["prompt"]
    r = client.chat.completions.create(model="demo", messages=PROMPT, max_tokens=MAX, temperature=0,
                                       tools=[tool], tool_choice={"type": "function", "function": {"name": "lookup"}})
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == split_whole(want, True)[0]
    # Cut by max_tokens before the answer began: the named call has no arguments yet (a call cut
    # by length keeps what it has, as OpenAI's do), and the finish reason stays `length`.
    assert r.choices[0].finish_reason == "length"
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls or []] in ([], [("lookup", "")])
    assert r.usage.completion_tokens_details.reasoning_tokens == MAX


@pytest.fixture
def claude(srv: ServerProcess) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=120)


def test_anthropic_thinking_blocks_whole_and_streamed(claude: Any, thinking: dict[str, Any]) -> None:
    """`thinking: {type: enabled, budget_tokens}` on /v1/messages, with the anthropic SDK: the
    model's thinking (transformers' greedy tokens) comes first as a `thinking` block with a
    signature, the answer as a `text` block; streamed, as thinking_delta events and a
    signature_delta before the block stops, which the SDK's accumulator folds into the same
    message."""
    import base64
    import hashlib

    text, ids = _reference(thinking)
    want_reasoning, want_content = split_whole(text, True)
    # This SDK release has no `temperature` argument: it goes in extra_body, as older clients send it.
    args: dict[str, Any] = {"model": "demo", "max_tokens": MAX, "messages": PROMPT, "extra_body": {"temperature": 0},
                            "thinking": {"type": "enabled", "budget_tokens": 16}}
    m = claude.messages.create(**args)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == want_reasoning and m.content[1].text == want_content
    assert m.content[0].signature == base64.b64encode(hashlib.sha256(want_reasoning.encode()).digest()).decode()
    assert m.usage.output_tokens == len(ids) == MAX and m.stop_reason == "max_tokens"

    kinds: list[str] = []
    with claude.messages.stream(**args) as stream:
        for ev in stream:
            if ev.type == "content_block_delta":
                kinds.append(ev.delta.type)
            elif ev.type in ("content_block_start", "content_block_stop"):
                kinds.append(ev.type)
        final = stream.get_final_message()
    def blocks(msg: Any) -> list[tuple[str, Any, Any]]:
        return [(b.type, getattr(b, "thinking", getattr(b, "text", None)), getattr(b, "signature", None))
                for b in msg.content]

    assert blocks(final) == blocks(m) and final.usage.output_tokens == MAX
    # One thinking block (its deltas, then the signature), then the text block.
    first_stop = kinds.index("content_block_stop")
    assert set(kinds[1:first_stop - 1]) == {"thinking_delta"} and kinds[first_stop - 1] == "signature_delta"
    assert kinds[first_stop + 1] == "content_block_start" and "text_delta" in kinds[first_stop:]

    # Without `thinking` the answer is as before: the text alone (the thinking is not shown).
    plain = claude.messages.create(model="demo", max_tokens=MAX, messages=PROMPT, extra_body={"temperature": 0})
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == want_content


def test_anthropic_thinking_disabled_reaches_the_template(claude: Any, thinking: dict[str, Any]) -> None:
    text, _ids = _reference(thinking, enable_thinking=False)
    args: dict[str, Any] = {"model": "demo", "messages": PROMPT, "thinking": {"type": "disabled"}}
    m = claude.messages.create(max_tokens=MAX, extra_body={"temperature": 0}, **args)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == split_whole(text, False)[1]
    # count_tokens renders the same prompt: the template's closed, empty block included.
    prompt_tokens = m.usage.input_tokens + m.usage.cache_read_input_tokens  # (cache hits are apart)
    assert claude.messages.count_tokens(**args).input_tokens == prompt_tokens
    assert claude.messages.count_tokens(model="demo", messages=PROMPT).input_tokens < prompt_tokens


@pytest.mark.parametrize("value, field", [
    ({"type": "enabled"}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": MAX}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": "16"}, "thinking.budget_tokens"),
    ({"type": "sometimes"}, "thinking.type"),
])
def test_anthropic_bad_thinking_is_a_400_naming_the_field(claude: Any, value: dict[str, Any], field: str) -> None:
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="demo", max_tokens=MAX, messages=PROMPT, thinking=value)
    assert e.value.body["error"]["message"].startswith(field + ":")
