"""Issue 29: a huge grammar compiles where it cannot stall the engine step (one lowest-priority
thread), and its compile time is bounded with a 400 naming the field."""
from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest


def test_grammar_compile_is_bounded_and_off_the_engine(demo_model: Path) -> None:
    from server.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from server.serving.errors import InvalidRequest
    from server.serving.jobs import GenerationSpec
    from server.serving.prompts import PromptPreparer
    from server.text.loader import load_tokenizer

    prep = PromptPreparer(load_tokenizer(demo_model), grammar_timeout_s=0.5)
    seen: dict[str, int] = {}
    original = prep._compile

    def spy(so):  # type: ignore[no-untyped-def]
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen["thread"] = threading.current_thread().name  # type: ignore[assignment]
        return original(so)

    prep._compile = spy  # type: ignore[method-assign]
    huge = [f"option number {i} of many" for i in range(50_000)]
    spec = GenerationSpec(kind="completion", api="http", client="c", model="m", prompt="x",
                          sampling={"structured_outputs": StructuredOutputsParams(choice=huge)})
    spec.field_names = {"structured_outputs": "structured_outputs", "structured_outputs.choice": "guided_choice"}

    async def admit(s: GenerationSpec) -> None:
        params = SamplingParams(max_tokens=4, **s.sampling)
        await prep.compile_structured(params, s)

    with pytest.raises(InvalidRequest) as e:
        asyncio.run(admit(spec))
    assert e.value.status == 400 and e.value.param == "guided_choice", e.value
    assert "did not compile within 0.5s" in e.value.message
    # A small constraint still compiles (after the huge one, which runs on in the background).
    prep.grammar_timeout_s = 600
    small = GenerationSpec(kind="completion", api="http", client="c", model="m", prompt="x",
                           sampling={"structured_outputs": StructuredOutputsParams(choice=["yes", "no"])})
    asyncio.run(admit(small))
    assert seen["thread"] == "pagewire-grammar"
    assert seen["nice"] == 19  # the lowest priority, for that thread alone
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19
