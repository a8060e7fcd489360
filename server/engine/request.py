"""Request and Sequence: the engine's in-memory record of what each request has and still needs.

One mechanism, as in vLLM v1: a Sequence knows its token ids and how many of them already have
K/V in the cache (`num_computed_tokens`). Prefill, chunked prefill, decode, recompute after
preemption and prefix-cache hits are all "catch num_computed_tokens up to len(token_ids)".
A Request owns `n` Sequences (samples); with n > 1 only sample 0 exists until its prompt is
computed, then the others fork its blocks (copy-on-write).
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from server.engine.grammar import GrammarState
from server.engine.outputs import FinishReason, TokenLogprob
from server.engine.sampling_params import SamplingParams
from server.models.pooling import Pooler
from server.text.detokenizer import SampleText


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class SpecState:
    """A sequence's speculative-decoding acceptance window (engine/spec_decode.py; the proposer
    keeps its own state)."""

    __slots__ = ("win_proposed", "win_accepted", "off")

    def __init__(self) -> None:
        self.win_proposed = 0
        self.win_accepted = 0
        self.off = False  # acceptance stayed below min_acceptance_rate: no more proposals


class Sequence:
    """One sample of a request: the scheduling and KV-allocation unit.

    `seq_id` is the allocator's key. `token_ids` holds prompt + generated tokens; the last one's
    K/V is computed in the step after it was sampled (that step is also the one that samples the
    next token). After preemption `num_computed_tokens` drops to 0 and the whole list is recomputed.
    """

    __slots__ = (
        "seq_id", "request", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "status", "generator", "text_state", "finish_reason", "stop_reason",
        "new_token_ids", "new_logprobs", "spec_token_ids", "spec_state",
        "grammar", "sort_key",
    )

    def __init__(self, request: "Request", index: int, token_ids: list[int]) -> None:
        self.seq_id: int = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids: list[int] = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SeqStatus.WAITING
        self.generator: Optional[torch.Generator] = None
        self.text_state: Optional[SampleText] = None  # set by the output processor (init_sequence)
        self.finish_reason: Optional[FinishReason] = None
        self.stop_reason: Optional[int | str] = None
        # Tokens produced since the last delta was emitted (drained by the output processor).
        self.new_token_ids: list[int] = []
        self.new_logprobs: list[TokenLogprob] = []
        # Speculative decoding (engine/spec_decode.py): the tokens proposed for this step, scored
        # after the last verified token and never part of token_ids until accepted; and the
        # proposer's per-sequence state.
        self.spec_token_ids: list[int] = []
        self.spec_state: Optional[SpecState] = None
        # Structured outputs: the sequence's matcher (server.engine.structured drives it), set by
        # the engine for constrained requests; None otherwise.
        self.grammar: Optional[GrammarState] = None
        # Scheduling order: lower priority value first, then earlier arrival, then sample index.
        # Fixed for the sequence's life (none of the three changes), so kept rather than rebuilt
        # each time the scheduler sorts its running list (every step).
        self.sort_key: tuple[int, float, int] = (request.priority, request.arrival_time, index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request.request_id}#{self.index}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, {self.status.value})"
        )


@dataclass
class Request:
    """A submitted request: its prompt, parameters and samples."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    max_total_tokens: int  # prompt + output never exceeds this (max_model_len or max_tokens bound)
    sequences: list[Sequence] = field(default_factory=list)
    forked: bool = False  # n > 1: the other samples have been forked from sample 0
    num_cached_tokens: int = 0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    error: Optional[str] = None  # set by LLMEngine.fail_all; reported in the final delta
    # Set by the engine once every sample has finished (or the request was aborted); after that
    # the request emits its final delta and is forgotten.
    finished: bool = False
    # An embedding request: the model's pooling recipe, the pooled state so far (float32 [hidden]:
    # a running sum for mean pooling, the row itself for cls and last), and the final vector.
    pooler: Optional[Pooler] = None
    pooled: Optional[torch.Tensor] = None
    embedding: Optional[list[float]] = None
    # A LoRA adapter (server.models.lora): its name and slot (1..N; 0 = the base model alone). The
    # slot also keys the request's blocks in the prefix cache (KVCacheManager).
    lora: Optional[str] = None
    lora_slot: int = 0

    def all_samples_done(self) -> bool:
        """True when every sample exists (forked, for n > 1) and has finished."""
        if self.params.n > 1 and not self.forked:
            return False
        return all(s.is_finished for s in self.sequences)
