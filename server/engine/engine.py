"""LLMEngine: the synchronous core loop, schedule -> execute -> sample -> process outputs.

Single-threaded by contract: whoever owns an LLMEngine (the offline `LLM`, or the EngineThread)
calls every method from one thread. It never awaits and never touches sockets.

Liveness contract: `add_request` refuses (ValueError naming the field and the limit) any request
that could never be scheduled; every request it accepts finishes, and every `step` with
unfinished requests schedules work (`last_step_progressed` records it, so callers can assert it).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator, Optional
from typing import Sequence as Seq

import torch

from server import heap, hugepages
from server.engine.adapters import adapter_slot, load_adapters
from server.engine.config import EngineConfig, Quantization
from server.engine.draft_proposer import (
    DraftModelProposer,
    draft_block_bytes_per_token,
    draft_kv_groups,
    load_draft_model,
)
from server.engine.embedding_step import check_task, fold_pooled
from server.engine.errors import CapacityLimits, ConfigError, check_capacity
from server.engine.hybrid_states import HybridStates
from server.engine.isolation import execute_isolating
from server.engine.kv_budget import kv_layout
from server.engine.kv_cache_manager import KVCacheManager
from server.engine.kv_groups import KVGroupLayout
from server.engine.output_processor import OutputProcessor
from server.engine.outputs import FinishReason, RequestDelta, TokenLogprob
from server.engine.request import Request, Sequence
from server.engine.runner import ModelRunner
from server.engine.sampler import Sampler, SamplingBatch, plain_greedy
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from server.engine.spec_config import SpeculativeConfig
from server.engine.spec_decode import SpecDecoder, SpecStats
from server.engine.state_cache import StateCache
from server.engine.step_pacing import pace_steps
from server.engine.structured import PendingMasks, StructuredDecoder
from server.kernels import autotune, batch_invariant
from server.kernels.ops import argmax_list, release_small_blocks, use_small_blocks
from server.models import load_progress
from server.models.loader import load_model
from server.models.pooling import Pooler, resolve_pooler
from server.models.registry import kv_shape
from server.models.state_specs import is_hybrid, state_slot_bytes, state_specs
from server.text.loader import load_tokenizer
from server.text.vocab import check_token_ids

logger = logging.getLogger("pagewire.engine")


@dataclass
class EngineStats:
    """A snapshot for metrics; cumulative counters never decrease."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    prefix_hit_tokens: int = 0
    prefix_miss_tokens: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    cpu_threads: int = 0  # the steps' CPU threads now (0: the governor is off, the count fixed)
    cpu_thread_switches: int = 0  # changes of it (server.engine.thread_governor)
    spec: Optional[SpecStats] = None  # speculative decoding's counters, when it is configured


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu" and os.environ.get("PAGEWIRE_SMALL_BLOCKS", "1") != "0":
            use_small_blocks(True)  # a step's few hundred small tensors off glibc's memalign path (ops.py)
        # An embedding model (None: generation): pools prompts instead of sampling.
        self.pooler: Optional[Pooler] = resolve_pooler(config.task, config.model)
        if self.pooler is not None and config.speculative_config is not None:
            raise ConfigError("speculative_config", "an embedding model samples nothing to speculate on")
        # Model first: its loader names a missing folder or weights file precisely. An embedding
        # checkpoint may lack the LM head (a base model saved without it).
        self.model, self.model_config = load_model(
            config.model, config.dtype, config.device, keep_gguf_blocks=config.quantization is Quantization.GGUF,
            headless=self.pooler is not None,
        )
        if config.quantization not in (Quantization.NONE, Quantization.GGUF):  # GGUF is done by the loader
            load_progress.stage("quantise and repack")
            self.model.quantize_weights(config.quantization)
        self.model.interleave_bf16()  # bf16 matrices into the x8 layout, or packed losslessly (AVX2, AVX512-BF16)
        hugepages.pack_weights(self.model, "model")  # into one mapping on 2 MB pages (moved, not copied)
        self.tokenizer = load_tokenizer(config.model)
        mc = self.model_config
        self.device = torch.device(config.device)
        kv_dtype = next(self.model.parameters()).dtype
        spec_cfg = config.speculative_config if isinstance(config.speculative_config, SpeculativeConfig) else None
        hybrid = is_hybrid(mc)
        if hybrid and spec_cfg is not None:
            # Verification would need the recurrent state at every draft position to roll back to
            # the accepted one (a checkpoint per position); until then hybrids decode plainly.
            logger.warning("speculative decoding: off: %s is a hybrid model (recurrent layers keep a state that "
                           "a rejected proposal cannot be rolled back from); decoding without speculation",
                           mc.architecture)
            spec_cfg = None
        draft = None
        draft_bpt = 0
        draft_groups: Optional[KVGroupLayout] = None
        if spec_cfg is not None and spec_cfg.method == "draft_model":
            # Loaded before the KV is sized: its pool is carved from the same budget.
            draft, dmc = load_draft_model(spec_cfg, config, mc, self.tokenizer)
            hugepages.pack_weights(draft, "draft model")
            draft_groups = draft_kv_groups(dmc)
            draft_bpt = draft_block_bytes_per_token(draft_groups, dmc, next(draft.parameters()).element_size())
        # One sizing function for the engine and `pagewire plan`, so their figures always agree.
        layout = kv_layout(
            config, dtype=str(kv_dtype).replace("torch.", ""), max_position_embeddings=mc.max_position_embeddings,
            draft_bytes_per_token=draft_bpt, **kv_shape(mc),
            state_slot_bytes=state_slot_bytes(mc, str(kv_dtype).replace("torch.", "")) if hybrid else 0,
        )
        self.kv_layout = layout
        bs = layout.block_size
        num_blocks = layout.num_blocks
        max_model_len = layout.max_model_len
        # One pool, a block table per KV group (sliding-window layers hold only their window).
        self.kv_cache = KVCacheManager(num_blocks, bs, config.enable_prefix_caching, layout.groups.windows)
        # A hybrid model's second pool: a state slot per running sequence, plus prefix-cache snapshots.
        state_cache = (StateCache(state_specs(mc), kv_dtype, layout.state_slots, layout.snapshot_slots, self.device)
                       if hybrid else None)
        self.states = HybridStates(state_cache, self.kv_cache) if state_cache is not None else None
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   watermark_blocks=layout.watermark_blocks, states=self.states)
        self.max_model_len = max_model_len
        self.limits = CapacityLimits(
            max_model_len=max_model_len,
            block_size=bs,
            num_blocks=num_blocks,
            watermark_blocks=self.scheduler.watermark,
            max_num_seqs=config.max_num_seqs,
            groups=layout.groups,
            chunk_tokens=layout.chunk_tokens,
        )
        load_progress.stage("kv pool", layout.total_bytes)
        self.lora = load_adapters(config, self.model, mc, self.device, kv_dtype, embedding=self.pooler is not None)
        self.runner = ModelRunner(self.model, num_blocks, bs, self.kv_cache, self.device, kv_dtype, layout.groups,
                                  state_cache, self.lora)
        self.sampler = Sampler(seed=config.seed)
        eos = set(self.tokenizer.eos_token_ids) | set(getattr(mc, "eos_token_ids", ()) or ())
        self.outputs = OutputProcessor(self.tokenizer, eos, max_model_len)
        self.spec: Optional[SpecDecoder] = None
        self.draft: Optional[DraftModelProposer] = None
        if draft is not None:
            self.draft = DraftModelProposer(draft, num_blocks, bs, self.device, config.max_num_batched_tokens,
                                            config.enable_prefix_caching, self.kv_cache, draft_groups)
        if spec_cfg is not None:
            self.spec = SpecDecoder(spec_cfg, self.kv_cache, self.outputs, self.sampler, self.device, self.draft)
        self.vocab_size = mc.vocab_size
        # Structured outputs (grammar masks); idle unless a request carries a constraint.
        self.structured = StructuredDecoder(self.tokenizer, mc.vocab_size)
        if self.spec is not None:
            self.spec.structured = self.structured
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestDelta] = []  # abort deltas produced between steps
        self.last_step_progressed = True  # the latest step scheduled work or emitted deltas
        self._stats = EngineStats(num_blocks=num_blocks)
        logger.info("%s", self.model.summary())
        logger.info("%s", layout.log_line())
        pacing = pace_steps(config, self.model, draft, kv_dtype)
        self.deterministic = pacing.deterministic
        self.linear_table = pacing.linear_table
        self.step_budget = pacing.step_budget
        if self.step_budget is not None:
            self.scheduler.prefill_limit = self.step_budget.prefill_tokens
        self.thread_governor = pacing.thread_governor
        self._step_rows = (0, 0)  # (decode rows, prefill tokens) of the step being run
        self._step_threads = 0  # the thread count step() restores after a step the governor changed (0: none)
        # The load's and the autotune's freed copies back to the OS (glibc keeps them resident):
        # tens of MB of a GGUF load's RSS (issue 27). The small-block cache's load-time blocks first.
        release_small_blocks()
        heap.trim(force=True)

    # -- requests in ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        lora: Optional[str] = None,
    ) -> None:
        """Queue a request, over LoRA adapter `lora` (a name of `lora_modules`; None: the base
        model). Raises ValueError (naming the field) for anything invalid, and for a request that
        could never be scheduled (see errors.check_capacity)."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        lora_slot = adapter_slot(self.lora, lora)
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        check_token_ids(ids, self.vocab_size, "prompt")
        check_task(params, self.pooler, self.config.model, self.model_config.hidden_size)
        n = len(ids)
        check_capacity(n, params.max_tokens, params.n, self.limits)
        grammar = self.structured.prepare(params)  # structured outputs; raises naming the field
        max_total = n + params.max_tokens if params.max_tokens is not None else self.max_model_len
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            priority=priority,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            max_total_tokens=max_total,
            pooler=self.pooler,
            lora=lora,
            lora_slot=lora_slot,
        )
        seq = self._add_sequence(req, 0, list(ids))
        gate = params.reasoning_gate
        assert not isinstance(gate, dict)  # SamplingParams.validate made it a ReasoningGate
        seq.grammar = StructuredDecoder.new_state(grammar, gate)
        self.scheduler.add(seq)
        self.requests[request_id] = req

    def _add_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(req, index, token_ids)
        if req.params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(req.params.seed + index)
        self.outputs.init_sequence(seq)
        req.sequences.append(seq)
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Free the request's blocks now (we are between steps) and queue its final delta."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = FinishReason.ABORT
        req.finished = True
        delta = self.outputs.make_delta(req)
        if delta is not None:
            self._pending.append(delta)
        return True

    def fail_request(self, request_id: str, message: str) -> None:
        """End a request now with finish_reason "error" and `message` (its forward raised, see
        isolation): free its blocks and queue its final delta."""
        if not self.abort_request(request_id):
            return
        for delta in reversed(self._pending):
            if delta.request_id == request_id:
                delta.error = message
                for s in delta.samples:
                    if s.finish_reason in (None, FinishReason.ABORT):
                        s.finish_reason = FinishReason.ERROR
                break

    def abort_all(self) -> list[RequestDelta]:
        """Abort every request now; returns their final deltas (with any already queued)."""
        for rid in list(self.requests):
            self.abort_request(rid)
        deltas, self._pending = self._pending, []
        return deltas

    def fail_all(self, message: str) -> list[RequestDelta]:
        """Fail every request with `message` (after a step raised): frees their blocks and returns
        final deltas whose unfinished samples end with finish_reason "error"."""
        deltas, self._pending = self._pending, []
        for rid in list(self.requests):
            req = self.requests.pop(rid)
            for seq in req.sequences:
                if not seq.is_finished:
                    self.scheduler.finish(seq)
                    seq.finish_reason = FinishReason.ERROR
            req.error = message
            req.finished = True
            delta = self.outputs.make_delta(req)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # -- the step -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step_modes(self) -> Iterator[None]:
        """The thread modes every step runs in, for a loop of steps to hold: torch inference mode,
        batch-invariant mode as `deterministic` says, and the autotune table. `step` enters
        whatever the calling thread does not hold already; the engine thread and LLM.generate hold
        them around their loops, since entering them cost about 30 us a step right after a decode
        step's weights had streamed through the caches (server/inference_mode.py)."""
        with torch.inference_mode(), batch_invariant.mode(self.deterministic), autotune.active(self.linear_table):
            yield

    def step(self) -> list[RequestDelta]:
        # Deterministic mode: every op of the step (forward, sampling, verification) on this
        # thread takes its batch-invariant path (server.kernels.batch_invariant).
        # The autotuned linear paths (None: the fixed rules) are followed on this thread too.
        t0 = time.perf_counter()
        self._step_rows = (0, 0)
        plans = self.linear_table.plans if self.linear_table is not None else None
        self._step_threads = 0
        try:
            if batch_invariant.enabled() == self.deterministic and autotune.active_table() is plans:
                deltas = self._step()  # the caller holds the modes (step_modes)
            else:
                with batch_invariant.mode(self.deterministic), autotune.active(self.linear_table):
                    deltas = self._step()
        finally:
            if self._step_threads:  # the governor's count was this step's alone
                torch.set_num_threads(self._step_threads)
        if self._step_rows != (0, 0):
            elapsed = time.perf_counter() - t0
            if self.step_budget is not None:
                self.step_budget.observe(*self._step_rows, elapsed)
            if self.thread_governor is not None:
                self.thread_governor.observe(*self._step_rows, elapsed)
        return deltas

    def _step(self) -> list[RequestDelta]:
        deltas, self._pending = self._pending, []
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        # With requests left, an empty schedule would be a liveness bug (add_request refuses what
        # can never run); owners check this flag rather than spin on it.
        self.last_step_progressed = bool(out.scheduled) or bool(deltas) or not self.requests
        if not out.scheduled:
            return deltas
        # (decode rows, prefill tokens): the chunk policy's observation, and bench/chunk_policy.py's.
        # One pass over the shares (a decode step's host work is a share of it; issue 31).
        dec = total = 0
        now = time.time()
        # Every sampled row plain greedy (no lookahead to verify): its argmax is all the step needs
        # of the logits, so they stay in the lm_head's dtype (runner.execute_greedy): widening
        # SmolLM2's bf16 row took 24 us a step (issue 31).
        greedy = self.spec is None
        for share in out.scheduled:
            seq = share.seq
            total += share.num_new_tokens
            if len(seq.token_ids) - seq.num_computed_tokens == 1:
                dec += share.num_new_tokens
            if greedy and not plain_greedy(seq):
                greedy = False
            req = seq.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                self._stats.prompt_tokens += len(req.prompt_token_ids)
        self._step_rows = (dec, total - dec)
        governor = self.thread_governor
        if governor is not None:
            # Fewer (or, probing, other) threads than the engine's, for this step only, on this
            # thread: set once the step's shape is known, so a probe times decode-only steps alone.
            threads = governor.threads_for(dec, total - dec)
            if threads != governor.full:
                torch.set_num_threads(threads)
                self._step_threads = governor.full  # what step() puts back
        # Structured outputs: the grammar masks of the sampling rows are computed on a worker
        # thread while the forward runs, and joined right after it (before _advance forks any
        # matcher), also when the forward raises.
        if not greedy:  # (a plain-greedy row has no grammar: nothing to mask)
            self.structured.begin(out.scheduled)
        execute = self.runner.execute_greedy if greedy else self.runner.execute
        try:
            # The forward; if it raises, isolation finds and fails only the request(s) that cause it.
            if not self.deterministic and self._verify_step(out, dec):
                with batch_invariant.mode(True):
                    step = execute_isolating(execute, out)
            else:  # step() has set the mode already
                step = execute_isolating(execute, out)
        finally:
            grammar_masks = self.structured.collect()
        logits, out = step.logits, step.out
        # Failed only after the mask worker has joined: it may have been reading their matchers.
        for rid, exc in step.failed.items():
            self.fail_request(rid, f"engine error: {type(exc).__name__}: {exc}")
        if step.failed and self.config.enable_prefix_caching:
            self.kv_cache.reset_prefix_cache()  # their blocks may hold unwritten K/V (see isolation)
            if self.states is not None:
                self.states.reset()
        touched: dict[str, Request] = {}
        if self.pooler is not None:
            fold_pooled(out.scheduled, touched)
        rows, one_each = self._advance(out.scheduled)
        if rows and self.spec is not None:  # sequences with proposals: verified and applied there
            rows, emitted = self.spec.verify(logits, rows, touched, now)
            self._stats.generation_tokens += emitted
            one_each = [r for r, _ in rows] == list(range(logits.shape[0]))
        if rows:
            if not one_each:  # forked samples reuse sample 0's row
                row_idx = [r for r, _ in rows]
                logits = logits.index_select(0, torch.tensor(row_idx, device=logits.device))
            seqs = [s for _, s in rows]
            self._sample_and_apply(logits, seqs, touched, grammar_masks, greedy)
        self._stats.num_steps += 1
        for req in touched.values():
            ended = False  # a sample with a finish_reason: only then can the request be done
            for seq in req.sequences:
                if seq.finish_reason is not None:
                    ended = True
                    if not seq.is_finished:
                        self.scheduler.finish(seq)
            if ended and req.all_samples_done():
                req.finished = True
                self.requests.pop(req.request_id, None)
            delta = self.outputs.make_delta(req, now)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _verify_step(self, out: SchedulerOutput, decode_rows: int) -> bool:
        """A step of decode rows only, some of them speculative proposals: its forward runs in
        batch-invariant mode even where deterministic mode is off, so that each verify row (1 + k
        per sequence) takes the path a lone decode row takes and rounds as plain decoding would.
        Without it, on AVX-512 CPUs a bf16 step from 4 rows goes through AMX tiles or oneDNN,
        whose sums round differently from the single-row kernel, and greedy speculation could
        change the text (docs/determinism.md). Decode-sized steps only: a prefill chunk keeps the
        fast batched path (plain decoding computes the prompt that way too), and the mode's
        kernels cost little at decode row counts, since those stream the weights either way."""
        return (self.spec is not None and decode_rows == out.num_batched_tokens
                and any(share.num_spec for share in out.scheduled))

    def _advance(self, scheduled: list[ScheduledSeq]) -> tuple[list[tuple[int, Sequence]], bool]:
        """Mark the step's tokens computed; fork n > 1 samples. Returns (first logits row, seq)
        pairs, and whether they are the logits' rows one each, in order (no fork, no lookahead
        rows, no row without a sample): then the rows need no gather."""
        rows: list[tuple[int, Sequence]] = []
        row = 0
        one_each = True
        for share in scheduled:
            seq = share.seq
            before = seq.num_computed_tokens
            # 0 for a chunk that does not sample and for an embedding request (pooled in
            # embedding_step.fold_pooled). Read before num_computed_tokens advances.
            n_rows = share.num_logit_rows
            seq.num_computed_tokens += share.num_new_tokens - share.num_spec  # proposals: see verify
            if self.states is not None:  # a prompt's snapshot boundary: save the recurrent state
                self.states.after_compute(seq, before)
            if n_rows == 0:
                continue
            if n_rows != 1 or row != len(rows):
                one_each = False
            rows.append((row, seq))
            req = seq.request
            if req.params.n > 1 and not req.forked:
                for i in range(1, req.params.n):
                    child = self._add_sequence(req, i, list(seq.token_ids))
                    self.structured.fork(seq, child)
                    self.kv_cache.fork(seq, child)
                    if self.states is not None:  # a recurrent state is copied, never shared
                        self.states.fork(seq, child)
                    child.num_computed_tokens = seq.num_computed_tokens
                    self.scheduler.add_running(child)
                    rows.append((row, child))
                    one_each = False
                req.forked = True
            row += n_rows
        return rows, one_each

    def _sample_and_apply(self, logits: torch.Tensor, seqs: list[Sequence], touched: dict[str, Request],
                          grammar_masks: Optional[PendingMasks] = None, greedy: bool = False) -> None:
        """Sample each row of `logits` for its sequence and emit the token. `greedy`: the step found
        every sampled row plain greedy before its forward (and took its logits unwidened)."""
        if grammar_masks is None and (greedy or all(plain_greedy(s) for s in seqs)):
            # What SamplingBatch.build and the sampler would come to (their fast_greedy): one
            # argmax, without building the batch (a decode step's host work; issue 31). A plain
            # greedy row has no grammar and no logprobs: emit() is append_token, never a dead end.
            now = time.time()
            append = self.outputs.append_token
            for seq, token in zip(seqs, argmax_list(logits)):
                req = seq.request
                touched[req.request_id] = req
                append(seq, token, None)
                if req.first_token_time is None:
                    req.first_token_time = now
            self._stats.generation_tokens += len(seqs)
            return
        params = [s.request.params for s in seqs]
        penalties = any(p.needs_penalties for p in params)
        blocked = [self.outputs.blocked_tokens(s) for s in seqs]
        bitmask, dead_ends = self.structured.masks(seqs, grammar_masks, blocked)
        batch = SamplingBatch.build(
            params=params,
            generators=[s.generator for s in seqs],
            output_token_ids=[s.output_token_ids for s in seqs] if penalties else [[] for _ in seqs],
            prompt_token_ids=[s.request.prompt_token_ids for s in seqs] if penalties else [[] for _ in seqs],
            blocked_token_ids=blocked,
            vocab_size=logits.shape[-1],
            device=logits.device,
            token_bitmask=bitmask,
        )
        so = self.sampler(logits, batch)
        tokens: list[int] = so.token_ids.tolist()
        lps: Optional[list[float]] = so.logprobs.tolist() if so.logprobs is not None else None
        top_ids: Optional[list[list[int]]] = so.top_ids.tolist() if so.top_ids is not None else None
        top_lps: Optional[list[list[float]]] = so.top_logprobs.tolist() if so.top_logprobs is not None else None
        now = time.time()
        dead = set(dead_ends)
        for i, seq in enumerate(seqs):
            req = seq.request
            touched[req.request_id] = req
            if i in dead:
                # The grammar allows no token here: end the sample rather than emit an invalid one.
                self.outputs.finish(seq, FinishReason.GRAMMAR_DEAD_END)
                self.structured.num_dead_ends += 1
                logger.info("request %s sample %d: grammar dead end (%s)", req.request_id, seq.index,
                            (seq.grammar.error if seq.grammar is not None else "") or "no token allowed")
                continue
            k = seq.request.params.logprobs
            lp: Optional[TokenLogprob] = None
            if k is not None and lps is not None:
                top = (
                    list(zip(top_ids[i][:k], top_lps[i][:k]))
                    if (k and top_ids is not None and top_lps is not None)
                    else []
                )
                lp = TokenLogprob(tokens[i], lps[i], top)
            if not self.outputs.emit(seq, tokens[i], lp):  # a dead end: unreachable while the mask was applied
                dead.add(i)
                continue
            if req.first_token_time is None:
                req.first_token_time = now
        self._stats.generation_tokens += len(seqs) - len(dead)

    # -- introspection ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        a = self.kv_cache.stats()
        s = self._stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.free_blocks = a.free_blocks
        s.cached_blocks = a.cached_blocks
        s.kv_usage = a.used_blocks / max(1, a.num_blocks)
        s.prefix_hit_tokens = a.prefix_hit_tokens
        s.prefix_miss_tokens = a.prefix_miss_tokens
        s.num_preemptions = self.scheduler.num_preemptions
        s.spec = self.spec.stats.snapshot() if self.spec is not None else None
        if self.thread_governor is not None:
            s.cpu_threads = self.thread_governor.threads
            s.cpu_thread_switches = self.thread_governor.switches
        return EngineStats(**s.__dict__)

