"""Random request streams through the real Scheduler, KVCacheManager and state pool (HybridStates),
for a hybrid model and an attention-only model side by side, with the block allocator's and the
state pool's invariants checked after every step.

No model runs: a simulated forward stands in for the recurrent layers. A sequence's state slot
holds a rolling hash of the tokens it has consumed, updated for exactly the tokens a step
schedules for it (as a convolution or DeltaNet state is). So after every step each running
hybrid sequence's slot must equal the hash of its first num_computed_tokens tokens: that proves
slots start from zeros, are never shared or handed to two sequences, follow chunked prefill,
are copied on fork (n > 1), dropped and rebuilt on preemption, and that a prefix hit resumes
only from a snapshot of exactly the prefix it reuses. The pools' own invariants: every running
slot free xor held by one running sequence (waiting, finished and preempted ones hold none),
every snapshot slot free xor holding one snapshot, and the allocator's check_invariants.
"""
from __future__ import annotations

import time

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from server.engine.hybrid_states import HybridStates
from server.engine.kv_cache_manager import KVCacheManager
from server.engine.request import Request, SeqStatus, Sequence
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import Scheduler
from server.engine.state_cache import StateCache
from server.models.state_specs import StateSpec

MOD = 1_000_003  # hashes stay exact in float64


def roll(h: float, tokens: list[int]) -> float:
    for t in tokens:
        h = float((int(h) * 31 + t + 1) % MOD)
    return h


class Engine:
    """One model's scheduler and pools, stepped with a simulated forward."""

    def __init__(self, hybrid: bool, num_blocks: int, block_size: int, max_seqs: int, budget: int,
                 snapshots: int, interval: int, caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.states = None
        if hybrid:
            self.cache = StateCache([(StateSpec("h", (1,), "float64"),)], torch.float64, max_seqs, snapshots)
            self.states = HybridStates(self.cache, self.kv, interval)
        self.sched = Scheduler(self.kv, max_seqs, budget, states=self.states)
        self.max_seqs = max_seqs
        self.live: list[Sequence] = []

    def slot_value(self, seq: Sequence) -> float:
        return float(self.cache.layers[0]["h"][self.cache.slot(seq), 0])

    def add(self, rid: str, prompt: list[int], n: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n)
        req = Request(rid, list(prompt), params, 0, time.time(), len(prompt) + max_tokens)
        seq = Sequence(req, 0, list(prompt))
        req.sequences.append(seq)
        self.sched.add(seq)
        self.live.append(seq)

    def step(self, next_token: int) -> None:
        out = self.sched.schedule()
        for share in out.scheduled:
            seq = share.seq
            c, n = seq.num_computed_tokens, share.num_new_tokens
            if self.states is not None:  # the recurrent layers consume exactly the scheduled tokens
                slot = self.cache.slot(seq)
                t = self.cache.layers[0]["h"]
                t[slot, 0] = roll(float(t[slot, 0]), seq.token_ids[c:c + n])
            seq.num_computed_tokens += n
            if self.states is not None:
                self.states.after_compute(seq, c)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            req = seq.request
            if req.params.n > 1 and not req.forked:  # the engine's fork of n > 1 samples
                for i in range(1, req.params.n):
                    child = Sequence(req, i, list(seq.token_ids))
                    req.sequences.append(child)
                    self.kv.fork(seq, child)
                    if self.states is not None:
                        self.states.fork(seq, child)
                    child.num_computed_tokens = seq.num_computed_tokens
                    self.sched.add_running(child)
                    self.live.append(child)
                    self._emit(child, next_token + i)
                req.forked = True
            self._emit(seq, next_token)

    def _emit(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        if seq.num_tokens >= seq.request.max_total_tokens:
            self.finish(seq)

    def finish(self, seq: Sequence) -> None:
        self.sched.finish(seq)
        self.live.remove(seq)

    def check(self) -> None:
        self.kv.check_invariants()
        running = {s.seq_id for s in self.sched.running}
        assert all(s.status is SeqStatus.RUNNING for s in self.sched.running)
        if self.states is None:
            return
        self.cache.check_invariants(live_seq_ids=running)
        assert self.cache.num_free_slots == self.max_seqs - len(running)
        assert self.states.free_slots >= 0
        for seq in self.sched.running:
            assert self.slot_value(seq) == roll(0.0, seq.token_ids[: seq.num_computed_tokens]), seq


class StatePoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(12, 40), block_size=st.integers(1, 4), max_seqs=st.integers(1, 4),
                budget=st.integers(1, 12), snapshots=st.integers(0, 6), interval=st.integers(1, 3),
                caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, max_seqs: int, budget: int, snapshots: int, interval: int,
              caching: bool) -> None:
        self.engines = [Engine(h, num_blocks, block_size, max_seqs, budget, snapshots, interval, caching)
                        for h in (True, False)]
        self.bs = block_size
        self.num_blocks = num_blocks
        self.max_seqs = max_seqs
        self.prompts: list[list[int]] = [[1, 2, 1, 2, 1, 2, 1, 2, 1]]
        self.next = 0
        self.token = 0

    @rule(which=st.integers(0, 1), base=st.integers(0, 10), cut=st.one_of(st.integers(0, 12), st.just(64)),
          tail=st.lists(st.integers(0, 2), min_size=1, max_size=10), n=st.integers(1, 3),
          max_tokens=st.integers(1, 6))
    def add(self, which: int, base: int, cut: int, tail: list[int], n: int, max_tokens: int) -> None:
        eng = self.engines[which]
        prompt = self.prompts[base % len(self.prompts)][:cut] + tail  # shared prefixes: hits and snapshots
        # What add_request admits: a sample at its longest fits the pool (minus the watermark), n fits seats.
        if n > self.max_seqs or -(-(len(prompt) + max_tokens) // self.bs) > eng.sched.admission_limit_blocks:
            return
        self.prompts.append(prompt)
        eng.add(f"r{self.next}", prompt, n, max_tokens)
        self.next += 1

    @rule(which=st.integers(0, 1))
    def step(self, which: int) -> None:
        self.token = (self.token + 1) % 3
        self.engines[which].step(self.token)

    @rule(which=st.integers(0, 1))
    def drain(self, which: int) -> None:
        """Step until every request has finished, so a later prompt sharing a prefix finds its
        blocks cached and its state saved (liveness bounds the steps)."""
        eng = self.engines[which]
        for _ in range(200):
            if not eng.live:
                break
            self.step(which)
            eng.check()
        assert not eng.live, "requests left after 200 steps"

    @rule(which=st.integers(0, 1), index=st.integers(0, 50))
    def abort(self, which: int, index: int) -> None:
        eng = self.engines[which]
        if eng.live:
            eng.finish(eng.live[index % len(eng.live)])

    @precondition(lambda self: not any(eng.sched.running for eng in self.engines))
    @rule()
    def reset_prefix_cache(self) -> None:
        # Only between requests: KVCacheManager.register_full_blocks of a sequence running across a
        # reset asks the allocator for blocks past its (now empty) registered chain, which it refuses.
        for eng in self.engines:
            eng.kv.reset_prefix_cache()
            if eng.states is not None:
                eng.states.reset()

    @invariant()
    def pools_are_sound(self) -> None:
        for eng in getattr(self, "engines", []):
            eng.check()


TestStatePool = StatePoolMachine.TestCase
TestStatePool.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
