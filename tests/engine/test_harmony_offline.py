"""Harmony offline: the engine's harmony ReasoningGate (structured outputs wait for the
`<|channel|>final…<|message|>` header; analysis and tool-call messages stay free; rollback and
forks keep the header state) and `LLM.chat` reading harmony replies as the chat APIs do --
reasoning_content, tool calls, content -- on the tiny gpt-oss of tests/harmony_model.py, whose
answers are transformers' greedy output (checked when it is built)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from server import LLM, SamplingParams
from server.engine.grammar import compile_params
from server.engine.sampling_params import ReasoningGate, SamplingParamsError, StructuredOutputsParams
from server.engine.structured import StructuredDecoder
from server.text.loader import load_tokenizer
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

SCHEMA = {"type": "object", "properties": {"weather": {"type": "string"}, "sky": {"type": "string"}},
          "additionalProperties": False}


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_harmony_model(tmp_path_factory.mktemp("harmony") / "m")


@pytest.fixture(scope="module")
def llm(harmony: dict[str, Any]) -> LLM:
    return LLM(str(harmony["path"]), max_model_len=512, kv_cache_tokens=4096)


def test_the_harmony_gate_lifts_after_the_final_header_only(harmony: dict[str, Any]) -> None:
    tok = load_tokenizer(harmony["path"])
    ids = {s: tok.token_to_id(s) for s in ("<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")}
    final = tok.encode("final", add_special_tokens=False)
    analysis = tok.encode("analysis", add_special_tokens=False)
    gate = ReasoningGate.from_value({"start_token_id": ids["<|channel|>"], "end_token_id": ids["<|message|>"],
                                     "answer_channel": final})
    assert gate.answer_channel == tuple(final)
    st = StructuredDecoder.new_state(compile_params(tok, StructuredOutputsParams(json=SCHEMA)), gate)
    assert st is not None and st.gate == "wait"
    free = tok.encode("free text {", add_special_tokens=False)
    for t in [ids["<|channel|>"], *analysis, ids["<|message|>"], *free, ids["<|end|>"]]:
        assert st.consume(t)
    assert st.gate == "wait" and st.num_consumed == 0  # an analysis message: still free
    header = [ids["<|channel|>"], *final, *tok.encode(" ", add_special_tokens=False), ids["<|constrain|>"],
              *tok.encode("json", add_special_tokens=False)]
    for t in header:
        assert st.consume(t)
    child = st.fork()
    assert st.consume(ids["<|message|>"]) and st.gate is None  # `final <|constrain|>json<|message|>`
    brace = tok.encode("{", add_special_tokens=False)[0]
    assert st.consume(brace) and st.num_consumed == 1
    st.rollback(2)  # back across the <|message|>: inside the final header again
    assert st.gate == "wait" and st.num_consumed == 0
    assert st.consume(ids["<|message|>"]) and st.gate is None
    assert child.gate == "wait" and child.consume(ids["<|message|>"]) and child.gate is None
    with pytest.raises(SamplingParamsError, match="answer_channel"):
        ReasoningGate.from_value({"start_token_id": 1, "end_token_id": 2, "answer_channel": [-1]})


def test_llm_chat_reads_reasoning_and_tool_calls(llm: LLM, harmony: dict[str, Any]) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    call, final = llm.chat([USER, with_tool_result()], greedy, tools=TOOLS)
    c = call.outputs[0]
    assert c.token_ids == harmony["call_ids"] and c.reasoning_content == REASON_CALL and not c.content
    assert c.tool_calls is not None and len(c.tool_calls) == 1
    fn = c.tool_calls[0]["function"]
    assert (fn["name"], json.loads(fn["arguments"])) == ("get_weather", json.loads(ARGS))
    assert c.tool_calls[0]["id"].startswith("call_") and "<|channel|>" in c.text  # the raw text keeps the tags
    f = final.outputs[0]
    assert f.token_ids == harmony["final_ids"]
    assert (f.reasoning_content, f.content, f.tool_calls) == (REASON_FINAL, ANSWER, None)


def test_llm_chat_structured_output_applies_to_the_final_channel(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    [out] = llm.chat(with_tool_result(), params)
    o = out.outputs[0]
    assert o.reasoning_content == REASON_FINAL and json.loads(o.content or "") == json.loads(ANSWER)
