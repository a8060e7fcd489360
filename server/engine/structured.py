"""Structured outputs in the engine step: one grammar matcher per constrained sequence, its
next-token bitmask computed while the model's forward runs, and the matcher advanced with each
accepted token.

The step, for the constrained rows only (an unconstrained batch costs nothing here):

    begin(scheduled)   before the forward: hand the sampling sequences' matchers to a worker
                       thread, which fills one bitmask row each (llguidance drops the GIL, so
                       this overlaps the forward's torch kernels)
    (forward)
    collect()          after the forward, before anything touches a matcher: join the worker
    fork(parent, child) n > 1: a forked sample copies its parent's matcher (same state: neither
                       has sampled yet)
    masks(seqs, ...)   the step's [S, W] int32 bitmask in row order (rows the worker did not fill,
                       such as just-forked children, are computed now), with tokens the sampler
                       blocks cleared, and the rows that allow nothing at all (dead ends)
    (sample: the sampler applies the whole bitmask in one batched op)
    (emit: OutputProcessor.emit advances the matcher with each emitted token, a rejected
                       token ending the sample as a dead end, and stops a complete grammar)

Why the worker is joined before `_advance`/`fork`: an LLMatcher must not be used from two threads
at once, and forking copies the parent's matcher. Nothing else touches matchers between begin
and collect (the forward reads only token ids and the KV cache).

Preemption needs nothing: a preempted sequence keeps its token ids and recomputes only their
K/V, so its matcher (which has consumed exactly its output tokens) stays valid. Prefix caching
changes only which K/V is recomputed, never the tokens. `rollback(seq, k)` undoes the last k
accepted tokens, for callers that remove tokens again (speculative decoding's rejected drafts).
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional, Sequence

import llguidance
import torch

from server.engine.grammar import GATE_DECIDE, GATE_WAIT, CompiledGrammar, GrammarState, compile_params
from server.engine.outputs import FinishReason
from server.engine.sampling_params import ReasoningGate, SamplingParams
from server.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from server.engine.request import Sequence as Seq
    from server.engine.scheduler import ScheduledSeq

logger = logging.getLogger("pagewire.engine")

# The finish reason of a sample whose grammar allows no token (see docs/structured_outputs.md).
DEAD_END = FinishReason.GRAMMAR_DEAD_END


def _matcher_failed(state: Optional[GrammarState]) -> bool:
    # While gated (inside a reasoning block) the matcher has consumed nothing: it cannot fail.
    return state is not None and state.gate is None and bool(state.matcher.is_error())


def _mask_threads() -> int:
    # llguidance's own pool computes the batch's masks in parallel; keep it small so that it
    # leaves the cores to the forward it overlaps with.
    return max(1, min(4, (os.cpu_count() or 1) // 4))


class PendingMasks:
    """The worker's in-flight job: which sequence fills which row of `bitmask`."""

    __slots__ = ("bitmask", "rows", "future")

    def __init__(self, bitmask: torch.Tensor, rows: dict[int, int], future: Future[None]) -> None:
        self.bitmask = bitmask
        self.rows = rows
        self.future = future


class StructuredDecoder:
    """Owns the engine's grammar work. Called only from the engine's own thread (the worker it
    starts touches only the matchers handed to it, between begin and collect)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # logits width
        self._words = -(-max(tokenizer.vocab_size, 1) // 32)
        self._executor: Optional[llguidance.LLExecutor] = None
        self._worker: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[PendingMasks] = None
        self.num_dead_ends = 0

    # -- requests ---------------------------------------------------------------------------------
    def prepare(self, params: SamplingParams) -> Optional[CompiledGrammar]:
        """The request's compiled grammar: the one admission attached, else compiled now (the
        offline API, which has no separate admission). Raises GrammarError (a ValueError naming
        the field) for a constraint that does not compile."""
        so = params.structured_outputs
        if so is None:
            return None
        assert not isinstance(so, dict)  # SamplingParams.validate turned it into the dataclass
        if isinstance(so.compiled, CompiledGrammar):
            return so.compiled
        return compile_params(self.tokenizer, so)

    @staticmethod
    def new_state(grammar: Optional[CompiledGrammar], reasoning: Optional[ReasoningGate] = None
                  ) -> Optional[GrammarState]:
        return GrammarState(grammar, reasoning=reasoning) if grammar is not None else None

    @staticmethod
    def fork(parent: "Seq", child: "Seq") -> None:
        state: Optional[GrammarState] = parent.grammar
        if state is not None:
            child.grammar = state.fork()

    # -- before and after the forward -------------------------------------------------------------
    def _ensure_threads(self) -> tuple[llguidance.LLExecutor, ThreadPoolExecutor]:
        # Created lazily on the engine thread, so both inherit its blocked shutdown signals.
        if self._executor is None:
            self._executor = llguidance.LLExecutor(_mask_threads())
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagewire-grammar")
        return self._executor, self._worker

    def begin(self, scheduled: Sequence["ScheduledSeq"]) -> None:
        """Start computing the masks of this step's sampling, constrained sequences."""
        assert self._pending is None, "collect() was not called after the previous begin()"
        jobs: list[tuple[llguidance.LLMatcher, int]] = []
        rows: dict[int, int] = {}
        for share in scheduled:
            state: Optional[GrammarState] = share.seq.grammar
            if state is None or not share.samples or state.gate == GATE_WAIT:
                continue
            rows[share.seq.seq_id] = len(jobs)
            jobs.append((state.matcher, len(jobs)))
        if not jobs:
            return
        executor, worker = self._ensure_threads()
        bitmask = torch.zeros((len(jobs), self._words), dtype=torch.int32)
        ptr, row_bytes = bitmask.data_ptr(), self._words * 4

        def fill() -> None:
            executor.unsafe_compute_mask_ptr(jobs, ptr, row_bytes, len(jobs))

        self._pending = PendingMasks(bitmask, rows, worker.submit(fill))

    def collect(self) -> Optional[PendingMasks]:
        """Wait for the worker (after the forward, or when the step fails). Safe to call always."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.result()
        return pending

    def masks(
        self,
        seqs: Sequence["Seq"],
        pending: Optional[PendingMasks],
        blocked: Sequence[Sequence[int]],
    ) -> tuple[Optional[torch.Tensor], list[int]]:
        """The step's bitmask, one row per entry of `seqs` (all bits set on unconstrained rows),
        or None when no row is constrained; and the indices of dead-end rows. A dead-end row's
        mask is reset to all-allowed so the sampler stays well-defined; its token is discarded.

        `blocked[i]` are tokens the sampler will forbid on row i anyway (EOS before min_tokens):
        they are cleared here so that a row left with nothing allowed is detected as a dead end.
        """
        # Rows inside a reasoning block are unconstrained (the grammar starts after it).
        idx = [i for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.gate != GATE_WAIT]
        if not idx:
            return None, []
        out = torch.full((len(seqs), self._words), -1, dtype=torch.int32)
        dst: list[int] = []
        src: list[int] = []
        late: list[tuple[llguidance.LLMatcher, int]] = []
        for i in idx:
            seq = seqs[i]
            row = pending.rows.get(seq.seq_id) if pending is not None else None
            if row is not None:
                dst.append(i)
                src.append(row)
            else:
                assert seq.grammar is not None  # idx holds the constrained rows only
                late.append((seq.grammar.matcher, i))
        if dst and pending is not None:  # one gather for every row the worker filled
            out[torch.tensor(dst)] = pending.bitmask[torch.tensor(src)]
        if late:  # e.g. samples forked this step: their matchers did not exist at begin()
            executor, _ = self._ensure_threads()
            executor.unsafe_compute_mask_ptr(late, out.data_ptr(), self._words * 4, len(seqs))
        for i in idx:
            state = seqs[i].grammar
            assert state is not None  # idx holds the constrained rows only
            if state.gate == GATE_DECIDE and state.reasoning is not None:  # the first token may open the block
                t = state.reasoning.start_token_id
                if 0 <= t < self._words * 32:
                    out[i, t // 32] |= (1 << (t % 32)) if t % 32 != 31 else -0x80000000
            for t in blocked[i]:  # usually none: only EOS / stop ids before min_tokens
                if 0 <= t < self._words * 32:
                    b = t % 32
                    out[i, t // 32] &= ~(1 << b) if b != 31 else 0x7FFFFFFF
        # A row allows nothing when every bit of a token id the logits have is clear.
        full, rem = divmod(min(self.vocab_size, self._words * 32), 32)
        rows = out[idx]
        any_allowed = (rows[:, :full] != 0).any(dim=1)
        if rem:
            any_allowed |= (rows[:, full] & ((1 << rem) - 1)) != 0
        dead = [i for i, ok in zip(idx, any_allowed.tolist())
                if not ok or _matcher_failed(seqs[i].grammar)]
        for i in dead:
            out[i] = -1
        return out, dead

    # -- after sampling ---------------------------------------------------------------------------
    @staticmethod
    def rollback(seq: "Seq", k: int) -> None:
        """Undo the last `k` tokens `seq`'s matcher accepted (speculative decoding, replay)."""
        state: Optional[GrammarState] = seq.grammar
        if state is not None:
            state.rollback(k)

    @staticmethod
    def validate_draft(seq: "Seq", tokens: list[int]) -> int:
        """How many of `tokens` (a speculative draft) the grammar accepts in order, without
        advancing the matcher."""
        state: Optional[GrammarState] = seq.grammar
        if state is None:
            return len(tokens)
        if state.gate is not None:  # gated sequences do not speculate (server.engine.spec_decode)
            return 0
        return int(state.matcher.validate_tokens(tokens))

    def draft_masks(self, items: Sequence[tuple["Seq", int, list[int]]], num_rows: int) -> torch.Tensor:
        """Bitmasks for speculative verification: for each (seq, first row, draft), the mask of the
        position after the sequence's last token at row `first` and, at row `first + j`, the mask
        after the first j draft tokens. llguidance advances each matcher through its draft and
        rolls it back, so the matchers end where they started. Rows of no item allow everything.
        The drafts must have passed `validate_draft`."""
        out = torch.full((num_rows, self._words), -1, dtype=torch.int32)
        jobs = [(seq.grammar.matcher, first, list(draft)) for seq, first, draft in items
                if seq.grammar is not None and seq.grammar.gate is None]
        if jobs:
            executor, _ = self._ensure_threads()
            executor.unsafe_compute_mask_ptr_with_draft_token(jobs, out.data_ptr(), self._words * 4, num_rows)
        return out

    def shutdown(self) -> None:
        self.collect()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

