"""The ReasoningGate on a grammar (server.engine.structured.GrammarState): no mask and no
grammar state while the reasoning block is open, the grammar from the token after `</think>`;
a prompt that did not open a block lets the first token open one or start the grammar; rollback
across the block's end restores the gate; forks copy it. Offline, through LLM: speculation with a
gated grammar stays exact (the grammar's output is valid) and unconstrained reasoning is greedy."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from server.engine.grammar import compile_params
from server.engine.sampling_params import ReasoningGate, SamplingParams, StructuredOutputsParams
from server.engine.structured import StructuredDecoder
from server.text.loader import load_tokenizer
from server.text.tokenizer import Tokenizer
from tests.thinking_model import make_thinking_model

SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 22, 333]}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_thinking_model(tmp_path_factory.mktemp("gate") / "m")


def _state(model: dict[str, Any], open_: bool) -> tuple[Any, Tokenizer]:
    tok = load_tokenizer(model["path"])
    grammar = compile_params(tok, StructuredOutputsParams(json=SCHEMA))
    gate = ReasoningGate(model["start_id"], model["end_id"], open_)
    st = StructuredDecoder.new_state(grammar, gate)
    assert st is not None
    return st, tok


def _allowed(dec: StructuredDecoder, st: Any) -> set[int]:
    seq = SimpleNamespace(grammar=st, seq_id=0)
    mask, dead = dec.masks([seq], None, [[]])
    if mask is None:
        return set(range(dec.vocab_size))
    row = mask[0].tolist()
    return {t for t in range(dec.vocab_size) if (row[t // 32] >> (t % 32)) & 1}


def test_open_block_is_unconstrained_until_its_end(model: dict[str, Any]) -> None:
    st, tok = _state(model, True)
    dec = StructuredDecoder(tok, model["vocab_size"])
    assert st.gate == "wait" and _allowed(dec, st) == set(range(model["vocab_size"]))
    for t in tok.encode("any thought at all", add_special_tokens=False):
        assert st.consume(t)
    assert st.num_consumed == 0 and not st.is_complete
    assert st.consume(model["end_id"]) and st.gate is None
    brace = tok.encode("{", add_special_tokens=False)[0]
    allowed = _allowed(dec, st)
    # The grammar applies now: `{` is allowed, a letter or another <think> is not.
    assert brace in allowed and model["start_id"] not in allowed
    assert tok.encode("x", add_special_tokens=False)[0] not in allowed
    assert st.consume(brace) and st.num_consumed == 1
    child = st.fork()
    st.rollback(2)  # the `{` and `</think>`: back inside the block
    assert st.gate == "wait" and st.num_consumed == 0
    assert child.gate is None and child.num_consumed == 1  # the fork kept its own state


def test_closed_prompt_first_token_opens_a_block_or_starts_the_grammar(model: dict[str, Any]) -> None:
    st, tok = _state(model, False)
    dec = StructuredDecoder(tok, model["vocab_size"])
    brace = tok.encode("{", add_special_tokens=False)[0]
    allowed = _allowed(dec, st)
    assert st.gate == "decide" and model["start_id"] in allowed and brace in allowed
    assert tok.encode("x", add_special_tokens=False)[0] not in allowed
    assert st.consume(brace) and st.gate is None and st.num_consumed == 1
    st.rollback(1)
    assert st.gate == "decide"
    assert st.consume(model["start_id"]) and st.gate == "wait"
    assert st.consume(model["end_id"]) and st.gate is None


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 2, "prompt_lookup_min": 1}])
def test_offline_gate_keeps_reasoning_greedy_and_answer_valid(model: dict[str, Any], spec: Any) -> None:
    from server.llm import LLM
    from tests.thinking_model import PROMPT, greedy_reference

    path: Path = model["path"]
    prompt, text, ids = greedy_reference(path, PROMPT, 24, model["eos"])
    end = ids.index(model["end_id"])
    llm = LLM(str(path), speculative_config=spec, kv_cache_tokens=2048, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA),
                            reasoning_gate=ReasoningGate(model["start_id"], model["end_id"], True))
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids[: end + 1] == ids[: end + 1]  # the block itself: unconstrained greedy
    answer = load_tokenizer(path).decode(out.token_ids[end + 1:])
    assert set(json.loads(answer)) == {"a"}
