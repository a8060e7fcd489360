"""gpt-oss's harmony format (server.text.harmony): the reasoning split and the tool-call parser give
the same result for a whole text and for every split of it into two pieces; analysis goes to the
reasoning, final to the answer, `to=functions.NAME` messages become calls (through the splitter,
or read raw when no reasoning parser runs); the detection from gpt-oss's chat template."""
from __future__ import annotations

import itertools

import pytest

from server.text.harmony import HarmonySplitter, HarmonyToolParser
from server.text.reasoning import detect_reasoning_parser, new_splitter, reasoning_format
from server.text.tool_parsers import detect_parser, fold
from tests.test_reasoning import feed_in_pieces

THINK = "<|channel|>analysis<|message|>The user wants the weather. I should call the tool.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 21 °C in Paris."
CASES = [
    # (the model's output after the prompt's `<|start|>assistant`, reasoning, content, calls)
    (THINK + FINAL, "The user wants the weather. I should call the tool.", "It is 21 °C in Paris.", []),
    (THINK + FINAL + "<|return|>", "The user wants the weather. I should call the tool.", "It is 21 °C in Paris.", []),
    (THINK + CALL, "The user wants the weather. I should call the tool.", "", [("get_weather", '{"city": "Paris"}')]),
    (THINK + CALL + "<|call|>", "The user wants the weather. I should call the tool.", "",
     [("get_weather", '{"city": "Paris"}')]),
    # the recipient before the channel, and a preamble (commentary to the user) before the call
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather<|channel|>"
     'commentary json<|message|>{"city": "Oslo"}<|call|>', "", "Checking.", [("get_weather", '{"city": "Oslo"}')]),
    # two calls in a row
    (CALL + "<|call|>" + CALL.replace("Paris", "Rome"), "", "",
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]),
    ("<|channel|>final<|message|>a <| b |> c", "", "a <| b |> c", []),  # text like a tag, but not one
    ("<|channel|>analysis<|message|>cut off by max_tok", "cut off by max_tok", "", []),
    ("<|channel|>analy", "", "", []),  # cut off inside the header
    ('<|channel|>commentary to=functions.unknown<|message|>{"a": 1}<|call|>', "", '{"a": 1}', []),
]


def _split(text: str, cuts: tuple[int, ...]) -> tuple[str, str]:
    return feed_in_pieces(HarmonySplitter(), text, cuts)


def _calls(text: str, cuts: tuple[int, ...]) -> tuple[str, list[tuple[str, str]]]:
    p = HarmonyToolParser(["get_weather"])
    pieces = []
    bounds = (0, *cuts, len(text))
    for a, b in zip(bounds, bounds[1:]):
        pieces += p.feed(text[a:b])
    pieces += p.finish()
    return fold(pieces)


@pytest.mark.parametrize("text,reasoning,content,calls", CASES)
def test_split_then_tool_parser_at_every_split(text: str, reasoning: str, content: str,
                                               calls: list[tuple[str, str]]) -> None:
    whole = _split(text, ())
    assert whole[0] == reasoning
    assert _calls(whole[1], ()) == (content, calls)
    for cuts in itertools.combinations(range(1, len(text)), 1):
        got = _split(text, cuts)
        assert got == whole, cuts
        assert _calls(got[1], cuts[:1] if cuts[0] < len(got[1]) else ()) == (content, calls), cuts


@pytest.mark.parametrize("text,reasoning,content,calls", CASES)
def test_the_tool_parser_reads_raw_harmony(text: str, reasoning: str, content: str,
                                           calls: list[tuple[str, str]]) -> None:
    """Without a reasoning parser the raw output reaches the tool parser: analysis is dropped."""
    raw = "<|start|>assistant" + text  # the prompt's header, as a whole transcript would hold it
    for t in (text, raw):
        assert _calls(t, ()) == (content, calls)
        for cut in range(1, len(t)):
            assert _calls(t, (cut,)) == (content, calls), cut


def test_call_arguments_stream_as_they_arrive() -> None:
    p = HarmonyToolParser(["get_weather"])
    head = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    first = p.feed(head + '{"ci')
    assert [type(x).__name__ for x in first] == ["CallStart"] and first[0].arguments == '{"ci'  # type: ignore[union-attr]
    more = p.feed('ty": "Paris"}<|ca')
    assert [type(x).__name__ for x in more] == ["ArgsDelta"] and more[0].text == 'ty": "Paris"}'  # type: ignore[union-attr]
    assert p.feed("ll|>") == [] and p.finish() == []


def test_reasoning_tokens_and_state() -> None:
    sp = HarmonySplitter()
    sp.feed("<|channel|>analysis<|message|>hm", [1, 2, 3])
    assert sp.in_reasoning
    sp.feed(" ok<|end|>", [4, 5])
    sp.feed("<|start|>assistant<|channel|>final<|message|>4", [6, 7, 8, 9, 10])
    assert not sp.in_reasoning and sp.reasoning_tokens == 5


GPT_OSS_TEMPLATE_EXCERPT = ("{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
                            "{{- '<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}"
                            "{{- ' to=functions.' + tc.name + '<|channel|>commentary json<|message|>' }}")


def test_detection_and_format() -> None:
    assert detect_reasoning_parser(GPT_OSS_TEMPLATE_EXCERPT) == "openai_gptoss"
    assert detect_parser(GPT_OSS_TEMPLATE_EXCERPT) == "openai"
    ids = {"<|channel|>": 200005, "<|end|>": 200007}
    fmt = reasoning_format("openai_gptoss", ids.get)
    assert (fmt.start_token_id, fmt.end_token_id) == (200005, 200007) and not fmt.starts_open([200005])
    assert isinstance(new_splitter(fmt, False), HarmonySplitter)
    with pytest.raises(ValueError, match="<\\|channel\\|> and <\\|end\\|> as a single token"):
        reasoning_format("openai_gptoss", {}.get)


def test_a_job_splits_harmony_deltas_and_resumes_from_the_ledger_at_every_seq() -> None:
    """A chat job served with openai_gptoss: live events and the stored output's replay after any
    seq give the analysis as reasoning and the final message as the answer."""
    from server.engine.outputs import RequestDelta, SampleDelta
    from server.engine.sampling_params import SamplingParams
    from server.serving.jobs import GenerationSpec, Job, events_from_output

    fmt = reasoning_format("openai_gptoss", {"<|channel|>": 5, "<|end|>": 6}.get)
    pieces = [("<|channel|>analysis<|mess", [5, 10, 11]), ("age|>Easy: 2+2", [12, 13]), ("=4.<|end|><|start|>", [14, 6, 15]),
              ("assistant<|channel|>final<|message|>It is", [16, 5, 17, 11, 18]), (" 4.", [19])]
    job = Job("req-h", GenerationSpec(kind="chat", api="ws", client="c", model="m"), [1, 2], SamplingParams(),
              0.0, 0.0, fmt)
    live = []
    for i, (text, ids) in enumerate(pieces):
        last = i == len(pieces) - 1
        live += job.apply(RequestDelta("req-h", [SampleDelta(0, ids, text, finish_reason="stop" if last else None)],
                                       last, 2, 0, 0.0))
    want = ("Easy: 2+2=4.", "It is 4.")
    assert ("".join(e.reasoning for e in live), "".join(e.text for e in live)) == want
    assert job.usage().reasoning_tokens == 8  # the three deltas that were in the analysis message
    out = job.output()
    for k in range(len(live) + 1):
        seen = [e for e in live if e.seq <= k]
        rest = events_from_output(out, k)
        assert "".join(e.reasoning for e in seen + rest) == want[0]
        assert "".join(e.text for e in seen + rest) == want[1]
