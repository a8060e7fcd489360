"""Result types that leave the engine: per-step deltas (streaming) and final outputs (offline API),
and `fold_delta`, the one place that folds a step's deltas into per-sample results (used by the
offline `LLM` and by the server's jobs alike).

Torch-free plain dataclasses, so the network edge can consume them without importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Protocol, Sequence

from server.strenum import StrEnum


class FinishReason(StrEnum):
    """Why one sample stopped (`Sequence.finish_reason`, `SampleDelta.finish_reason`). The engine
    reports stop, length, abort, error and grammar_dead_end; `cancelled` is what a WebSocket
    `done` frame says for the samples of a request the client cancelled (server.serving).

    `grammar_dead_end` (structured outputs): the sample's grammar allowed no token at all (for
    example only EOS, while min_tokens still forbade it, or llguidance hit one of its limits), so
    the sample ended with the valid prefix it had rather than emit a token outside the grammar.
    A grammar that is complete stops the sample with `stop`, as EOS does. A request whose samples
    end this way has still completed (its request ends `finished`, HTTP 200): the reason is the
    sample's, in `finish_reason`, and nothing was cut short by the server or the client.

    `tool_calls` is what a chat response says for a normal stop whose text held tool calls
    (server.api.tool_output): the engine and the ledger record that sample as `stop`, and should
    it ever be recorded as `tool_calls` it is still a complete request.
    """

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    CANCELLED = "cancelled"
    GRAMMAR_DEAD_END = "grammar_dead_end"  # server.engine.structured.DEAD_END
    TOOL_CALLS = "tool_calls"


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's logprob plus the top-N alternatives, as (token_id, logprob) pairs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class SampleDelta:
    """What one sample (index < n) of a request produced in one engine step.

    `text` is the newly decoded text (never a broken UTF-8 sequence; stop strings removed).
    `finish_reason` is None while running, else why it stopped (`FinishReason`).
    `stop_reason` is the matched stop string or stop token id, when finish_reason is STOP.
    """

    index: int
    token_ids: list[int]
    text: str
    logprobs: Optional[list[TokenLogprob]] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[int | str] = None


@dataclass(slots=True)
class RequestDelta:
    """One request's news from one engine step. The engine posts a list of these per step."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool  # every sample has finished: no more deltas for this request
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    error: Optional[str] = None  # set with finish_reason "error"
    # An embedding request's vector (set in its final delta; server.models.pooling's recipe).
    embedding: Optional[list[float]] = None


class SampleResult(Protocol):
    """What `fold_delta` needs of one sample's accumulated result."""

    token_ids: list[int]
    logprobs: Optional[list[TokenLogprob]]  # None: logprobs were not requested
    finish_reason: Optional[str]
    stop_reason: Optional[int | str]

    def add_text(self, text: str) -> None: ...


def fold_delta(results: Sequence[SampleResult], samples: Iterable[SampleDelta]) -> None:
    """Append one step's sample deltas to the per-sample results (indexed by sample index).

    A sample appears at most once per step, so after this call each result reflects exactly the
    deltas folded so far. Indices past `results` are ignored.
    """
    for s in samples:
        if s.index >= len(results):
            continue
        r = results[s.index]
        if s.text:
            r.add_text(s.text)
        r.token_ids.extend(s.token_ids)
        if s.logprobs and r.logprobs is not None:
            r.logprobs.extend(s.logprobs)
        if s.finish_reason is not None:
            r.finish_reason = s.finish_reason
            r.stop_reason = s.stop_reason


@dataclass
class CompletionOutput:
    """One finished (or in-progress) sample, as returned by `LLM.generate`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    stop_reason: Optional[int | str] = None
    logprobs: Optional[list[TokenLogprob]] = None
    # LLM.chat only (server.chat_reading): the reply read as the chat APIs read it.
    reasoning_content: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None

    def add_text(self, text: str) -> None:
        self.text += text


@dataclass
class RequestOutput:
    """Everything one prompt produced, as returned by `LLM.generate`."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    embedding: Optional[list[float]] = None  # an embedding request's vector (`LLM.embed`)
