"""Scheduler: decides, each step, which sequences get how many new tokens, within the step's budgets.

One rule (vLLM v1 style): every sequence catches `num_computed_tokens` up to `len(token_ids)`.
A step gives each scheduled sequence a prefill chunk, or one decode token, so that the total stays
within `max_num_batched_tokens` and at most `max_num_seqs` sequences run.

Order of a step:
1. running decodes first (one token each), so a long prefill never freezes running streams;
2. running prefills get chunks from what is left of the token budget, and with decodes in the
   step at most `prefill_limit(decode tokens)` in all (the ITL target's chunk size,
   engine/step_budget.py), admissions included;
3. waiting sequences are admitted in priority order (lower value first, then arrival) while the KV
   pool keeps a watermark of free blocks (room for the running ones to grow);
4. if a waiting sequence has strictly better priority than a running one and does not fit, the
   lowest-priority, latest-arrived running sequence is preempted to make room.
Background work (priority >= BACKGROUND_PRIORITY: the batch tier's lines) only fills idle steps:
while any other sequence is running or waiting, background sequences are neither scheduled nor
admitted (running ones keep their blocks, and are the first victims when KV or a seat is needed),
so an interactive stream's steps are the same size with or without a batch running.
When the KV pool runs out while growing a running sequence, the lowest-priority, latest-arrived
running sequence is preempted by recompute: its blocks are freed and it re-queues with
`num_computed_tokens = 0`; the prefix cache usually makes the recompute cheap.

Liveness: the engine admits a request only if one of its samples, grown to its longest possible
length, fits in `admission_limit_blocks` (the pool minus the watermark) and its `n` fits
`max_num_seqs`. Then the waiting queue's head is always admitted once nothing else runs, and the
best-ordered running sequence is never its own victim, so every step makes progress.
All block bookkeeping goes through the KVCacheManager.

Speculative decoding (engine/spec_decode.py) adds lookahead to decodes: a decode whose sequence
carries proposed tokens (`seq.spec_token_ids`) is scheduled for 1 + k tokens, all counted in the
token budget. Proposals are what gives way first: they are trimmed to the budget left, and
dropped before any sequence is preempted for KV room. Only verified tokens' blocks are offered
to the prefix cache here; the engine registers accepted ones after verification.
"""
from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from server.engine.hybrid_states import HybridStates
from server.engine.kv_budget import default_watermark
from server.engine.kv_cache_manager import KVCacheManager
from server.engine.priority import BACKGROUND_PRIORITY
from server.engine.request import SeqStatus, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch


_SORT_KEY = operator.attrgetter("sort_key")  # Sequence.sort_key, read in C


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    seq: Sequence
    num_new_tokens: int
    copies: list[tuple[int, int]] = field(default_factory=list)  # CoW (src, dst) before the write
    num_spec: int = 0  # of num_new_tokens, the proposed (unverified) tokens: seq.spec_token_ids
    # An embedding request's share: what its rows contribute to the pooled vector (set by the
    # runner after the forward; embedding_step.fold_pooled folds it in).
    pooled: "Optional[torch.Tensor]" = None

    @property
    def samples(self) -> bool:
        """This chunk brings the sequence up to date, so its last position's logits are sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_spec == self.seq.num_tokens

    @property
    def num_logit_rows(self) -> int:
        """Logits rows the forward returns for this share: 1 + num_spec when it samples, else 0
        (an embedding request never samples: its rows are pooled instead)."""
        return 1 + self.num_spec if self.samples and self.seq.request.pooler is None else 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def copies(self) -> list[tuple[int, int]]:
        return [c for s in self.scheduled for c in s.copies]


class Scheduler:
    """Owns the waiting and running queues; allocates their KV blocks through the KVCacheManager."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark_blocks: Optional[int] = None,
        states: Optional[HybridStates] = None,
    ) -> None:
        """states: a hybrid model's state slots (engine/hybrid_states.py): admission reserves one per
        sequence, prefix hits stop at a saved state, prefill chunks end on snapshot boundaries."""
        self.kv_cache = kv_cache
        self.states = states
        self.block_size = kv_cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Free blocks kept back at admission, so running sequences can grow without
        # immediately preempting the one just admitted (kv_budget.default_watermark).
        nb = kv_cache.num_blocks
        self.watermark = watermark_blocks if watermark_blocks is not None else default_watermark(nb)
        if not 0 <= self.watermark < kv_cache.num_blocks:
            raise ValueError(
                f"watermark_blocks: must be in [0, {kv_cache.num_blocks}) for a pool of "
                f"{kv_cache.num_blocks} blocks, got {self.watermark}"
            )
        # The most prefill tokens a step with this many decode tokens may add (None: no limit);
        # set by the engine when an ITL target is configured (engine/step_budget.py).
        self.prefill_limit: Optional[Callable[[int], Optional[int]]] = None
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue maintenance ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=_SORT_KEY)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins the running set directly (its blocks are shared with sample 0)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from the queues and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.kv_cache.free(seq)

    @property
    def admission_limit_blocks(self) -> int:
        """The most blocks a sequence can hold when admitted: the pool minus the watermark.

        A request whose every sample fits this (at its longest) is guaranteed to be admitted
        once the sequences ahead of it finish; a longer one could wait forever, so the engine
        refuses it at add_request.
        """
        return self.kv_cache.num_blocks - self.watermark

    # -- the step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[int, ScheduledSeq] = {}  # seq_id -> share, in scheduling order
        preempted: list[Sequence] = []
        if len(self.running) > 1:
            self.running.sort(key=_SORT_KEY)

        def preempt(victim: Sequence) -> None:
            nonlocal budget
            share = scheduled.pop(victim.seq_id, None)
            if share is not None:  # nothing has run yet this step, so it can be taken back
                budget += share.num_new_tokens
            self.running.remove(victim)
            victim.spec_token_ids = []
            self.kv_cache.free(victim)
            victim.num_computed_tokens = 0
            self.add(victim)
            preempted.append(victim)
            self.num_preemptions += 1

        # Background sequences sit out every step that has foreground work (running or waiting);
        # both lists are sorted by priority, so their heads tell.
        foreground = bool(self.running and self.running[0].request.priority < BACKGROUND_PRIORITY) or bool(
            self.waiting and self.waiting[0].request.priority < BACKGROUND_PRIORITY)
        active = [s for s in self.running if s.request.priority < BACKGROUND_PRIORITY] if foreground else self.running
        # 1 + 2: running sequences, decodes before prefill chunks (one pass, no properties: a
        # decode step's host work runs with the caches cold after the weights' stream).
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for s in active:
            left = len(s.token_ids) - s.num_computed_tokens
            if left == 1:
                decodes.append(s)
            elif left > 1:
                prefills.append(s)
        for seq in [*decodes, None, *prefills]:  # None: where the decodes end
            if seq is None:
                budget = self._prefill_room(budget)
                continue
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted as a victim earlier in this loop
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.states is not None:
                num_new = self.states.chunk(seq, num_new)
            num_spec = 0
            if seq.spec_token_ids:  # a decode with lookahead: as much of it as the budget holds
                num_spec = min(len(seq.spec_token_ids), budget - num_new)
                del seq.spec_token_ids[num_spec:]
            copies = self.kv_cache.allocate(seq, num_new + num_spec)
            if copies is None and num_spec:  # lookahead gives way before anyone is preempted
                seq.spec_token_ids, num_spec = [], 0
                copies = self.kv_cache.allocate(seq, num_new)
            while copies is None:
                victim = self.running[-1]  # lowest priority, latest arrival
                preempt(victim)
                if victim is seq:
                    break
                copies = self.kv_cache.allocate(seq, num_new)
            if copies is None:
                continue
            scheduled[seq.seq_id] = ScheduledSeq(seq, num_new + num_spec, copies, num_spec)
            budget -= num_new + num_spec

        # 3 + 4: admit waiting sequences. Not in a step that had to preempt for lack of KV:
        # admitting now would only evict what was just requeued.
        if not preempted and self.waiting:
            budget = self._admit(budget, scheduled, preempt, foreground)

        out = list(scheduled.values())
        self._register_full_blocks(out)
        return SchedulerOutput(out, preempted)

    def _prefill_room(self, budget: int) -> int:
        """What is left of the step's token budget for prefill chunks, once the decodes are in:
        at most `prefill_limit(decode tokens)` when an ITL target sets one."""
        decode_tokens = self.max_num_batched_tokens - budget
        limit = self.prefill_limit(decode_tokens) if self.prefill_limit is not None and decode_tokens else None
        return budget if limit is None else min(budget, limit)

    def _admit(
        self, budget: int, scheduled: dict[int, ScheduledSeq], preempt: Callable[[Sequence], None],
        foreground: bool = False,
    ) -> int:
        kv = self.kv_cache
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if foreground and seq.request.priority >= BACKGROUND_PRIORITY:
                break  # background waits for an idle step
            n_samples = seq.request.params.n if not seq.request.forked else 1
            pooler = seq.request.pooler
            # Mean and cls pooling need every position's hidden state, which the prefix cache does
            # not keep (its blocks hold K/V): such a request recomputes its prompt (pooling.py).
            if seq.num_computed_tokens == 0 and not kv.has_blocks(seq) and \
                    (pooler is None or not pooler.needs_every_position):
                seq.num_computed_tokens = kv.match_prefix(seq)
                if self.states is not None:  # a hit needs the recurrent state saved at its boundary
                    seq.num_computed_tokens = self.states.match(seq, seq.num_computed_tokens)
                if seq.index == 0 and seq.num_output_tokens == 0:
                    seq.request.num_cached_tokens = seq.num_computed_tokens
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.states is not None:
                num_new = self.states.chunk(seq, num_new)
            fits_seqs = len(self.running) + n_samples <= self.max_num_seqs
            if self.states is not None:  # a state slot per sample, reserved as blocks are
                fits_seqs = fits_seqs and self.states.free_slots >= n_samples
            need = kv.blocks_needed(seq, num_new)
            fits_kv = need <= kv.num_free_blocks - self.watermark
            if not (fits_seqs and fits_kv):
                victim = self.running[-1] if self.running else None
                if victim is not None and victim.sort_key[0] > seq.sort_key[0]:
                    preempt(victim)  # priority preemption: a strictly better class arrived
                    continue
                self._release_unadmitted(seq)
                break
            copies = kv.allocate(seq, num_new)
            if copies is None:  # cannot happen after the check above, but never admit half-way
                self._release_unadmitted(seq)
                break
            self.waiting.pop(0)
            if self.states is not None:
                self.states.admit(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.seq_id] = ScheduledSeq(seq, num_new, copies)
            budget -= num_new
        return budget

    def _release_unadmitted(self, seq: Sequence) -> None:
        """Give back prefix blocks a waiting sequence matched but could not use this step.

        They return to the LRU cache with their hashes, so the next attempt matches them again;
        holding them while waiting could starve the running sequences of blocks.
        """
        if self.kv_cache.has_blocks(seq):
            self.kv_cache.free(seq)
        seq.num_computed_tokens = 0

    def _register_full_blocks(self, out: list[ScheduledSeq]) -> None:
        """Offer newly full blocks to the prefix cache; their tokens are known at schedule time.

        Safe before the forward: every layer writes all of the step's K/V before attending, so a
        block matched by another sequence in this same step is written before it is read.
        """
        if not self.kv_cache.enable_prefix_caching:
            return
        for share in out:
            # Proposed tokens are unverified: never registered (see spec_decode.py).
            self.kv_cache.register_full_blocks(share.seq, share.num_new_tokens - share.num_spec)
