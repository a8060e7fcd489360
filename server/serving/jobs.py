"""Jobs: one accepted request's in-memory life — what was asked, what came back, and its stored form.

A `GenerationSpec` is what an edge (HTTP or WebSocket) hands to the service after parsing. A
`Job` is an accepted request: it accumulates each sample's text, token ids and logprobs from the
engine's deltas, together with "seq marks" (for each delta: its seq and how much text and how
many tokens the sample had after it). The marks are stored in the ledger with the final output,
so a client can resume a finished request from any seq it saw, without a gap or a duplicate,
long after the in-memory stream is gone (`events_from_output`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from server.engine.outputs import RequestDelta, SampleDelta, TokenLogprob, fold_delta
from server.engine.sampling_params import SamplingParams
from server.serving.lifecycle import END_RULES, CancelReason, EndReason, JobState, end_reason_of_row
from server.serving.streams import DeltaEvent, EndEvent, RequestStream, Usage
from server.serving.truncation import Truncation
from server.text.harmony import HarmonySplitter
from server.text.reasoning import ReasoningFormat, ReasoningSplitter, new_splitter


@dataclass
class GenerationSpec:
    """A parsed generation request, edge-independent.

    Args:
        kind: "completion" (prompt), "chat" (messages through the chat template) or "embedding"
            (prompt, pooled by an embedding model: sampling carries `embedding`, max_tokens is 1).
        api: "http" (OpenAI), "ws", "batch", "anthropic" or "ollama" (recorded in the ledger).
        client: fairness key (the `user` field, else the peer address).
        sampling: SamplingParams keyword arguments, except max_tokens.
        max_tokens: what the client asked for, or None.
        default_max_tokens: used when max_tokens is None; None means "the rest of the context".
        klass: admission class (INTERACTIVE or BATCH).
        params_record: the client's parameters as sent, for the ledger.
        tools: chat tool definitions (OpenAI shape), passed to the chat template.
        tool_format: the call format the output is parsed in (server.text.tool_parsers), which
            is also how a tool-unaware template is shown tools and earlier calls.
        key_id: the API key that owns the request (None when auth is off).
        lora: the LoRA adapter the request's `model` named (the model pool's names; set by the service), None for
            the base model.
    """

    kind: str
    api: str
    client: str
    model: str
    prompt: Optional[str | list[int]] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the final (assistant) message is continued (a prefill)
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: Optional[int] = None
    max_tokens_field: str = "max_tokens"
    default_max_tokens: Optional[int] = None
    priority: int = 0
    klass: int = 0
    idempotency_key: Optional[str] = None
    detach: bool = False
    timeout_s: Optional[float] = None
    params_record: dict[str, Any] = field(default_factory=dict)
    # Internal field names (e.g. "structured_outputs.json") -> the names the client used
    # ("response_format.json_schema.schema"), for errors found after parsing.
    field_names: dict[str, str] = field(default_factory=dict)
    tools: Optional[list[dict[str, Any]]] = None
    tool_format: str = "none"
    key_id: Optional[str] = None  # the owning API key (server.gateway.auth.bind); None: auth off
    lora: Optional[str] = None  # a LoRA adapter's name (its request named it as `model`)
    # How the edge names a chat's conversation in errors (the Responses API: `input`).
    messages_field: str = "messages"
    # How the edge names the prompt in errors (`input` for embeddings).
    prompt_field: str = "prompt"
    # How long its model stays loaded once idle after it (Ollama's keep_alive, seconds; negative:
    # until its memory is needed); None: the server's --keep-alive (server.serving.model_pool).
    keep_alive_s: Optional[float] = None
    # Extra chat-template variables (`chat_template_kwargs`, e.g. {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # An embedding input that does not fit is cut this way instead of refused (server.serving.truncation).
    truncate: Optional[Truncation] = None


class SampleAcc:
    """Everything one sample produced so far."""

    __slots__ = ("index", "parts", "text_len", "token_ids", "logprobs", "finish_reason", "stop_reason", "marks",
                 "reasoning_parts", "reasoning_len", "splitter")

    def __init__(self, index: int, want_logprobs: bool,
                 splitter: Optional[ReasoningSplitter | HarmonySplitter] = None) -> None:
        self.index = index
        self.parts: list[str] = []
        self.text_len = 0
        # With a reasoning parser: the thinking, apart from the answer in `parts`.
        self.splitter = splitter
        self.reasoning_parts: list[str] = []
        self.reasoning_len = 0
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[TokenLogprob]] = [] if want_logprobs else None
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[int | str] = None
        self.marks: list[tuple[int, ...]] = []  # (seq, text length, tokens[, reasoning length])

    def add_text(self, text: str) -> None:
        self.parts.append(text)
        self.text_len += len(text)

    @property
    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    @property
    def reasoning(self) -> str:
        if len(self.reasoning_parts) > 1:
            self.reasoning_parts = ["".join(self.reasoning_parts)]
        return self.reasoning_parts[0] if self.reasoning_parts else ""

    @property
    def reasoning_tokens(self) -> int:
        return self.splitter.reasoning_tokens if self.splitter is not None else 0

    def split(self, delta: SampleDelta) -> tuple[SampleDelta, str]:
        """(the delta with only its answer text, its thinking text), releasing what the splitter
        held when the sample finishes."""
        assert self.splitter is not None
        thought, answer = self.splitter.feed(delta.text, delta.token_ids)
        if delta.finish_reason is not None:
            more_thought, more_answer = self.splitter.finish()
            thought, answer = thought + more_thought, answer + more_answer
        if thought:
            self.reasoning_parts.append(thought)
            self.reasoning_len += len(thought)
        return replace(delta, text=answer), thought


class Job:
    """An accepted request. Lives on the event loop and is changed only by the service;
    `state` moves queued → running → ending → ended."""

    def __init__(self, request_id: str, spec: GenerationSpec, prompt_token_ids: list[int],
                 params: SamplingParams, created_wall: float, created_mono: float,
                 reasoning: Optional[ReasoningFormat] = None) -> None:
        """`reasoning`: split each sample's thinking from its answer (a chat with a reasoning parser)."""
        self.request_id = request_id
        self.spec = spec
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.want_logprobs = params.logprobs is not None
        self.stream = RequestStream(request_id)
        self.reasoning = reasoning
        opened = reasoning.starts_open(prompt_token_ids) if reasoning is not None else False
        self.samples = [SampleAcc(i, self.want_logprobs,
                                  new_splitter(reasoning, opened) if reasoning is not None else None)
                        for i in range(params.n)]
        self.created_wall = created_wall
        self.created_mono = created_mono
        self.admitted_mono: Optional[float] = None
        self.first_token_mono: Optional[float] = None
        self.first_token_wall: Optional[float] = None
        self.last_token_mono: Optional[float] = None
        self.queue_time_observed = False
        self.cached_tokens = 0
        self.state = JobState.QUEUED
        self.cancel_reason: Optional[CancelReason] = None
        self.error: Optional[str] = None
        self.detached = spec.detach
        self.deadline_timer: Any = None
        self.end: Optional[EndEvent] = None
        self.output_bytes = 0  # its reservation in the output budget, released at the end
        self.embedding: Optional[list[float]] = None  # an embedding request's vector (its final delta)
        # Its model's lane (server.serving.model_lane.ModelLane: admission, engine); set by the
        # service at acceptance (the adapter its `model` named is `spec.lora`).
        self.lane: Any = None

    def __repr__(self) -> str:
        return f"Job({self.request_id}, {self.state})"

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    def apply(self, delta: RequestDelta) -> list[DeltaEvent]:
        """Fold one engine step's delta into the samples and publish its events."""
        self.cached_tokens = delta.num_cached_tokens
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.error:
            self.error = delta.error
        samples = delta.samples
        thoughts: Optional[dict[int, str]] = None
        if self.reasoning is not None:
            samples, thoughts = [], {}
            for d in delta.samples:
                if d.index < len(self.samples):
                    d, thoughts[d.index] = self.samples[d.index].split(d)
                samples.append(d)
        events = self.stream.publish(samples, self.want_logprobs, thoughts)
        fold_delta(self.samples, samples)
        # One event per sample per step, so each sample's totals now are those after its event.
        for ev in events:
            if ev.index < len(self.samples):
                s = self.samples[ev.index]
                if self.reasoning is not None:
                    s.marks.append((ev.seq, s.text_len, len(s.token_ids), s.reasoning_len))
                else:
                    s.marks.append((ev.seq, s.text_len, len(s.token_ids)))
        return events

    def usage(self) -> Usage:
        return Usage(len(self.prompt_token_ids), self.completion_tokens, self.cached_tokens,
                     sum(s.reasoning_tokens for s in self.samples))

    def output(self) -> dict[str, Any]:
        """The stored form of the output (ledger `output_json`)."""
        return {
            "last_seq": self.stream.last_seq,
            "samples": [
                {
                    "index": s.index,
                    "text": s.text,
                    "token_ids": s.token_ids,
                    "logprobs": None if s.logprobs is None else [
                        [lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in s.logprobs
                    ],
                    "finish_reason": s.finish_reason,
                    "stop_reason": s.stop_reason,
                    "marks": [list(m) for m in s.marks],
                    **({"reasoning": s.reasoning, "reasoning_tokens": s.reasoning_tokens}
                       if s.splitter is not None else {}),
                }
                for s in self.samples
            ],
            # Kept with the output, so an idempotent retry answered from the ledger has it too.
            **({"embedding": self.embedding} if self.embedding is not None else {}),
        }

    def finish_reasons(self) -> list[Optional[str]]:
        return [s.finish_reason for s in self.samples]


def logprobs_from_stored(raw: Optional[list[Any]]) -> Optional[list[TokenLogprob]]:
    if raw is None:
        return None
    return [TokenLogprob(int(t), float(lp), [(int(a), float(b)) for a, b in top]) for t, lp, top in raw]


def events_from_output(output: dict[str, Any], after_seq: int) -> list[DeltaEvent]:
    """Rebuild, from a stored output, one delta per sample covering everything after `after_seq`.

    Each rebuilt delta carries the seq of its sample's last delta, so a client that resumes from
    here and later resumes again with the last seq it saw still gets no gap and no duplicate.
    """
    events: list[DeltaEvent] = []
    for s in output.get("samples", []):
        marks = s.get("marks") or []
        text_len = tok_len = reasoning_len = 0
        for mark in marks:  # (seq, text length, token count[, reasoning length]) after each delta
            if mark[0] > after_seq:
                break
            text_len, tok_len = mark[1], mark[2]
            reasoning_len = mark[3] if len(mark) > 3 else 0
        if not marks or marks[-1][0] <= after_seq:
            continue  # the client has all of this sample
        lps = logprobs_from_stored(s.get("logprobs"))
        events.append(DeltaEvent(
            seq=marks[-1][0],
            index=s["index"],
            text=s["text"][text_len:],
            token_ids=list(s["token_ids"][tok_len:]),
            logprobs=lps[tok_len:] if lps is not None else None,
            finish_reason=s.get("finish_reason"),
            reasoning=(s.get("reasoning") or "")[reasoning_len:],
        ))
    events.sort(key=lambda e: e.seq)
    return events


def end_from_record(record: Any) -> EndEvent:
    """The terminal event of a ledger row (a finished request whose stream is gone, or a row
    interrupted by a previous process)."""
    output = record.output or {"samples": [], "last_seq": 0}
    reason = end_reason_of_row(record.state, record.finish_reason)
    message = None if reason is EndReason.FINISHED else (record.error or END_RULES[reason].message)
    return EndEvent(
        request_id=record.request_id,
        reason=reason,
        finish_reasons=[s.get("finish_reason") for s in output.get("samples", [])] or [record.finish_reason],
        usage=Usage(record.prompt_tokens, record.completion_tokens, record.cached_tokens, record.reasoning_tokens),
        last_seq=int(output.get("last_seq", 0)),
        message=message,
        output=output,
    )


def now_pair() -> tuple[float, float]:
    """(wall clock for the ledger, monotonic clock for latencies)."""
    return time.time(), time.monotonic()
