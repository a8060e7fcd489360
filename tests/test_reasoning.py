"""The reasoning split (server.text.reasoning): the incremental splitter gives the whole-text split
at every split of the text into two and three pieces, and the parser detection from templates."""
from __future__ import annotations

import itertools
from typing import Any

import pytest

from server.text.reasoning import (
    ReasoningFormat,
    ReasoningSplitter,
    detect_reasoning_parser,
    reasoning_format,
    split_whole,
)

FMT = ReasoningFormat("qwen3", start_token_id=7, end_token_id=8)
R1 = ReasoningFormat("deepseek_r1", start_token_id=7, end_token_id=8)

TEXTS = [
    "<think>\nLet me see.\n</think>\n\nThe answer is 4.",
    "  <think>a</think>b",
    "<think>unfinished thought </thi",
    "<think></think>",
    "no thinking here",
    "   ",
    "<thi",
    "<thinking> is not the tag",
    "a < b and c </think> d",
    "</think>\n\nafter a block the prompt opened",
    "<think>x</think>\n\n\n",
    "<think>two </think> ends </think> here",
    "",
    "é<think>ü</think>ö",
]


def _incremental(text: str, cuts: tuple[int, ...], starts_open: bool) -> tuple[str, str]:
    return feed_in_pieces(ReasoningSplitter(FMT, starts_open), text, cuts)


def feed_in_pieces(sp: Any, text: str, cuts: tuple[int, ...]) -> tuple[str, str]:
    """(reasoning, answer) of a splitter fed `text` cut at `cuts`, then finished (any splitter
    with feed(text, token_ids) and finish(), e.g. ReasoningSplitter, HarmonySplitter)."""
    reasoning, answer = [], []
    bounds = (0, *cuts, len(text))
    for a, b in zip(bounds, bounds[1:]):
        r, c = sp.feed(text[a:b], [])
        reasoning.append(r)
        answer.append(c)
    r, c = sp.finish()
    return "".join(reasoning) + r, "".join(answer) + c


@pytest.mark.parametrize("starts_open", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_every_split_gives_the_whole_split(text: str, starts_open: bool) -> None:
    want = split_whole(text, starts_open)
    for k in (1, 2):
        for cuts in itertools.combinations(range(1, len(text)), k):
            assert _incremental(text, cuts, starts_open) == want, (text, cuts)
    assert _incremental(text, (), starts_open) == want


def test_the_rules() -> None:
    assert split_whole("<think>\nx\n</think>\n\nA", False) == ("\nx\n", "A")
    assert split_whole("plain", False) == ("", "plain")
    assert split_whole("plain", True) == ("plain", "")
    assert split_whole("x</think>\n\nA", True) == ("x", "A")
    assert split_whole("<think>cut by max_tokens", False) == ("cut by max_tokens", "")


def test_answer_is_released_as_soon_as_it_cannot_be_a_marker() -> None:
    sp = ReasoningSplitter(FMT, False)
    assert sp.feed("<th", []) == ("", "")
    assert sp.feed("ink>abc <", []) == ("abc ", "")  # "<" may start </think>: held
    assert sp.feed("b", []) == ("<b", "")
    assert sp.feed("</think>\n", []) == ("", "")
    assert sp.feed("\nHi", []) == ("", "Hi")


def test_reasoning_tokens_count_to_the_end_tag() -> None:
    sp = ReasoningSplitter(FMT, False)
    sp.feed("<think>", [7])
    sp.feed("ab", [100, 101])
    assert sp.reasoning_tokens == 3
    sp.feed("c</think>\n\nd", [102, 8, 5, 103])
    assert sp.reasoning_tokens == 5
    sp.feed("e", [104])
    assert sp.reasoning_tokens == 5
    plain = ReasoningSplitter(FMT, False)
    plain.feed("hello", [1, 2])
    plain.finish()
    assert plain.reasoning_tokens == 0
    cut = ReasoningSplitter(R1, True)
    cut.feed("thinking", [1, 2, 3])
    cut.finish()
    assert cut.reasoning_tokens == 3


def test_open_block_from_the_prompt() -> None:
    assert FMT.starts_open([1, 7, 5])  # the template opened <think>
    assert not FMT.starts_open([1, 7, 5, 8, 5])  # enable_thinking false: <think></think> in the prompt
    assert not FMT.starts_open([1, 2])
    assert R1.starts_open([1, 2])


QWEN3_TEMPLATE = ("{% for m in messages %}...{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                  "{% endif %}{% endif %}{% if '</think>' in content %}{% endif %}")
R1_TEMPLATE = ("{% for m in messages %}{% if '</think>' in m.content %}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")


def test_detection() -> None:
    assert detect_reasoning_parser(QWEN3_TEMPLATE) == "qwen3"
    assert detect_reasoning_parser(R1_TEMPLATE) == "deepseek_r1"
    assert detect_reasoning_parser("{{ messages }}") is None
    assert detect_reasoning_parser(None) is None


def test_format_needs_single_tokens() -> None:
    vocab = {"<think>": 3, "</think>": 4}
    assert reasoning_format("qwen3", vocab.get) == ReasoningFormat("qwen3", 3, 4)
    with pytest.raises(ValueError, match="needs </think> as a single token"):
        reasoning_format("qwen3", {"<think>": 3}.get)
    with pytest.raises(ValueError, match="expected one of"):
        reasoning_format("granite", vocab.get)


def test_a_job_splits_its_deltas_and_resumes_from_the_ledger_at_every_seq() -> None:
    """The job's split (live events) and the stored output's replay after any seq (a resume from
    the ledger) give the same thinking and answer, with the reasoning-token count kept."""
    from server.engine.outputs import RequestDelta, SampleDelta
    from server.engine.sampling_params import SamplingParams
    from server.serving.jobs import GenerationSpec, Job, events_from_output

    pieces = [("<th", [7]), ("ink>I think", [100, 101]), (" so</th", [102, 103]), ("ink>\n\nYes", [8, 104]),
              (", done.", [105])]
    job = Job("req-x", GenerationSpec(kind="chat", api="ws", client="c", model="m"), [1, 2], SamplingParams(),
              0.0, 0.0, FMT)
    live = []
    for i, (text, ids) in enumerate(pieces):
        last = i == len(pieces) - 1
        live += job.apply(RequestDelta("req-x", [SampleDelta(0, ids, text, finish_reason="stop" if last else None)],
                                       last, 2, 0, 0.0))
    want = split_whole("".join(t for t, _ in pieces), False)
    assert ("".join(e.reasoning for e in live), "".join(e.text for e in live)) == want == ("I think so", "Yes, done.")
    assert job.usage().reasoning_tokens == 6  # the <think> token, 2, 2, and the </think> token
    out = job.output()
    assert out["samples"][0]["reasoning"] == want[0] and out["samples"][0]["reasoning_tokens"] == 6
    for k in range(len(live) + 1):
        seen = [e for e in live if e.seq <= k]
        rest = events_from_output(out, k)
        assert "".join(e.reasoning for e in seen + rest) == want[0]
        assert "".join(e.text for e in seen + rest) == want[1]
