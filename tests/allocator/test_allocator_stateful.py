"""Random operation sequences against BlockAllocator, checked against a simulated KV store.

The simulated store maps block id -> what each slot holds and applies returned copy-on-write pairs
exactly as copy_blocks would. Real KV at position p depends on every token up to p, so a slot
holds the whole prefix tokens[:p + 1]: a block served under the wrong parent is caught too. After every
step each live sequence must read its
own tokens back from its blocks: that proves prefix hits attach correct contents, copy-on-write
protects sharers, and no block is handed out while someone still reads it.

KV groups: the allocator runs with 1-3 groups, full attention (0) or sliding windows of 1-6 tokens.
Every group of a sequence must read back, through its own table, every position the next token can
see (all of them in a full group, the window in a sliding one), and a sliding group must hold no
block wholly before that window once a step has run: its blocks went back to the pool.
"""
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from server._C import BlockAllocator

ALPHABET = st.integers(0, 2)  # tiny, so prompts share prefixes and full blocks repeat


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.integers(1, 4),
        hash_bits=st.sampled_from([2, 64]),
        caching=st.booleans(),
        windows=st.lists(st.sampled_from([0, 0, 1, 2, 3, 5, 6]), min_size=1, max_size=3),
    )
    def setup(self, num_blocks, block_size, hash_bits, caching, windows):
        self.alloc = BlockAllocator(num_blocks, block_size, caching, hash_bits, windows)
        assert self.alloc.num_groups == len(windows) and self.alloc.group_windows == windows
        self.windows = windows
        self.caching = caching
        self.bs = block_size
        self.kv = {b: [None] * block_size for b in range(num_blocks)}
        # seq id -> {"tokens": known token ids, "computed": tokens with KV written,
        #            "reset": reset_prefix_cache ran since it was admitted}
        self.seqs = {}
        self.finished = []  # token lists of freed sequences, to come back as repeated prompts
        self.next_id = 0

    # -- helpers -------------------------------------------------------------------------------

    def pick(self, index):
        return sorted(self.seqs)[index % len(self.seqs)]

    def tables(self, sid):
        return [self.alloc.block_table(sid, g) for g in range(len(self.windows))]

    def visible_from(self, g, computed):
        """The first position the next token (at `computed`) sees in group g."""
        w = self.windows[g]
        return max(0, computed - w + 1) if w else 0

    def check_reads(self, sid, tokens, computed, what):
        """Every group reads back what the next token can see; a sliding group holds nothing wholly
        below its window (-1 there), and nothing it holds is stale."""
        for g, table in enumerate(self.tables(sid)):
            lo = self.visible_from(g, computed)
            for pos in range(lo, computed):
                assert table[pos // self.bs] >= 0, (what, g, pos, "a visible block was released")
                assert self.kv[table[pos // self.bs]][pos % self.bs] == tuple(tokens[:pos + 1]), (what, sid, g, pos)
            if self.windows[g] == 0:
                assert -1 not in table

    def admit(self, prompt):
        sid, self.next_id = self.next_id, self.next_id + 1
        covered = self.alloc.match_prefix(sid, prompt[:-1])
        assert covered % self.bs == 0 and 0 <= covered <= len(prompt) - 1
        for g, table in enumerate(self.tables(sid)):
            assert len(table) * self.bs == covered
            # A hit attaches only what the next token sees: blocks wholly below its window are -1.
            lo = self.visible_from(g, covered)
            assert all(b == -1 for b in table[: lo // self.bs]) and -1 not in table[lo // self.bs :], (g, table)
        self.check_reads(sid, prompt, covered, "hit served wrong KV")
        self.seqs[sid] = {"tokens": list(prompt), "computed": covered, "reset": False}

    def rollback_floor(self, sid):
        """The least num_tokens truncate accepts: a sliding group's released blocks stay released."""
        floor = 0
        for g, table in enumerate(self.tables(sid)):
            released = next((i for i, b in enumerate(table) if b != -1), len(table))
            if released:
                floor = max(floor, released * self.bs + self.windows[g] - 1)
        return floor

    # -- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: len(self.seqs) < 8)
    @rule(prompt=st.lists(ALPHABET, min_size=1, max_size=14))
    def add_sequence(self, prompt):
        self.admit(prompt)

    @precondition(lambda self: self.finished and len(self.seqs) < 8)
    @rule(index=st.integers(0, 100), extra=st.lists(ALPHABET, max_size=3))
    def readmit_a_finished_prompt(self, index, extra):
        self.admit(self.finished[index % len(self.finished)] + extra + [0])

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 6), sampled=ALPHABET)
    def step(self, index, chunk, sampled):
        """One engine step: compute a chunk of the prompt, or decode one sampled token."""
        sid = self.pick(index)
        seq = self.seqs[sid]
        if seq["computed"] == len(seq["tokens"]):
            seq["tokens"].append(sampled)
        start = seq["computed"]
        num_new = min(chunk, len(seq["tokens"]) - start)
        free_before = self.alloc.num_free_blocks
        needed = self.alloc.blocks_needed(sid, start, num_new)
        copies = self.alloc.allocate_slots(sid, start, num_new)
        if copies is None:
            assert needed > free_before
            return
        assert self.alloc.num_free_blocks == free_before - needed
        for src, dst in copies:  # copy_blocks runs before the step writes
            self.kv[dst] = list(self.kv[src])
        for g, table in enumerate(self.tables(sid)):
            assert len(table) * self.bs >= start + num_new
            # What the first new token cannot see went back to the pool.
            lo = self.visible_from(g, start)
            assert all(b == -1 for b in table[: lo // self.bs]), (g, lo, table)
            for pos in range(start, start + num_new):
                block = table[pos // self.bs]
                assert self.alloc.refcount(block) == 1, "writing into a block someone else reads"
                self.kv[block][pos % self.bs] = tuple(seq["tokens"][:pos + 1])
        seq["computed"] = start + num_new
        # The engine's way (KVCacheManager): pass only this step's tokens, from the first block
        # they touch. The allocator knows how far the sequence is registered: exactly to that
        # block, unless reset_prefix_cache dropped the registrations (or caching is off).
        first = start // self.bs * self.bs
        registered = self.alloc.registered_tokens(sid)
        if self.caching and not seq["reset"]:
            assert registered == first, (registered, first)
        else:
            first = min(first, registered)
        self.alloc.cache_full_blocks(sid, seq["tokens"][first:seq["computed"]], first)
        if self.caching and not seq["reset"]:
            assert self.alloc.registered_tokens(sid) == seq["computed"] // self.bs * self.bs
        elif self.caching:  # a sliding group re-registering after a reset stops at its first released block
            assert self.alloc.registered_tokens(sid) >= seq["computed"] // self.bs * self.bs

    @precondition(lambda self: self.seqs and len(self.seqs) < 8)
    @rule(index=st.integers(0, 100))
    def fork(self, index):
        parent = self.pick(index)
        child, self.next_id = self.next_id, self.next_id + 1
        self.alloc.fork(parent, child)
        assert self.tables(child) == self.tables(parent)
        self.seqs[child] = {"tokens": list(self.seqs[parent]["tokens"]), "computed": self.seqs[parent]["computed"],
                            "reset": self.seqs[parent]["reset"]}

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100), rejected=st.integers(0, 5))
    def rollback(self, index, rejected):
        """Speculative-decoding rollback: drop the last `rejected` computed tokens."""
        sid = self.pick(index)
        seq = self.seqs[sid]
        keep = max(0, seq["computed"] - rejected)
        floor = self.rollback_floor(sid)
        if keep < floor:  # below what a sliding group released: refused, nothing changes
            with pytest.raises(ValueError, match="truncate: num_tokens"):
                self.alloc.truncate(sid, keep)
            keep = floor
        self.alloc.truncate(sid, keep)
        assert all(len(t) == -(-keep // self.bs) for t in self.tables(sid))
        seq["computed"] = keep
        del seq["tokens"][keep:]  # later steps sample different tokens into the same slots

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100), sampled=ALPHABET, drafts=st.lists(ALPHABET, min_size=1, max_size=5),
          accepted=st.integers(0, 5), bonus=ALPHABET)
    def speculative_step(self, index, sampled, drafts, accepted, bonus):
        """The engine's speculative decode (server/engine/spec_decode.py): write K/V for the last
        sampled token plus k proposals, register verified tokens only, accept a prefix, then roll
        back (KVCacheManager.rollback: truncate, register the newly verified full blocks)."""
        sid = self.pick(index)
        seq = self.seqs[sid]
        if seq["computed"] == len(seq["tokens"]):
            seq["tokens"].append(sampled)
        start = seq["computed"]
        if len(seq["tokens"]) - start != 1:
            return  # still prefilling: the engine proposes for decodes only
        k = len(drafts)
        copies = self.alloc.allocate_slots(sid, start, 1 + k)
        if copies is None:
            return  # the engine drops the proposals and decodes plainly (the `step` rule)
        for src, dst in copies:
            self.kv[dst] = list(self.kv[src])
        looked_ahead = seq["tokens"] + drafts
        for table in self.tables(sid):
            for pos in range(start, start + 1 + k):
                block = table[pos // self.bs]
                assert self.alloc.refcount(block) == 1, "writing into a block someone else reads"
                self.kv[block][pos % self.bs] = tuple(looked_ahead[:pos + 1])
        # At schedule time only the verified token is offered to the prefix cache.
        registered = self.alloc.registered_tokens(sid)
        first = min(start // self.bs * self.bs, registered)
        self.alloc.cache_full_blocks(sid, seq["tokens"][first:start + 1], first)
        # Verification: a proposals accepted, then the target's own token.
        a = min(accepted, k)
        seq["tokens"] += drafts[:a] + [bonus]
        seq["computed"] = start + 1 + a
        self.alloc.truncate(sid, seq["computed"])  # never below the allocated start: always accepted
        assert all(len(t) == -(-seq["computed"] // self.bs) for t in self.tables(sid))
        registered = self.alloc.registered_tokens(sid)
        end = seq["computed"] // self.bs * self.bs
        if end > registered:
            self.alloc.cache_full_blocks(sid, seq["tokens"][registered:end], registered)
        registered = self.alloc.registered_tokens(sid)
        assert registered <= seq["computed"], "a token past the verified ones is registered"
        if self.caching and not seq["reset"]:
            assert registered == end

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100))
    def free(self, index):
        sid = self.pick(index)
        seq = self.seqs.pop(sid)
        if seq["computed"] >= 2:
            self.finished.append(seq["tokens"][:seq["computed"]])
        self.alloc.free(sid)
        assert not self.alloc.has_sequence(sid)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100))
    def preempt_and_recompute(self, index):
        """Out of KV: free a sequence and admit its tokens again (the prefix cache helps)."""
        sid = self.pick(index)
        tokens = self.seqs.pop(sid)["tokens"]
        self.alloc.free(sid)
        if len(tokens) >= 1:
            self.admit(tokens)

    @rule()
    def reset_prefix_cache(self):
        self.alloc.reset_prefix_cache()
        assert self.alloc.stats()["cached_blocks"] == 0
        for seq in self.seqs.values():
            seq["reset"] = True

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def bookkeeping_is_consistent(self):
        self.alloc.check_invariants()
        s = self.alloc.stats()
        assert s["used_blocks"] + s["free_blocks"] + s["cached_blocks"] == s["num_blocks"]
        assert self.alloc.num_free_blocks == s["free_blocks"] + s["cached_blocks"]
        holders = {}
        for sid in self.seqs:
            for table in self.tables(sid):
                for block in table:
                    if block != -1:
                        holders[block] = holders.get(block, 0) + 1
        for block in range(s["num_blocks"]):
            assert self.alloc.refcount(block) == holders.get(block, 0) >= 0
        assert s["used_blocks"] == len(holders)

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        for sid, seq in self.seqs.items():
            self.check_reads(sid, seq["tokens"], seq["computed"], "stale KV")

    def teardown(self):
        if not hasattr(self, "alloc"):
            return
        for sid in list(self.seqs):
            self.alloc.free(sid)
        self.alloc.check_invariants()
        assert self.alloc.stats()["used_blocks"] == 0, "blocks leaked"


AllocatorMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# 300 random programs of 40 steps: minutes on a loaded 2-core machine, so `make test` only.
TestAllocatorStateMachine = pytest.mark.slow(AllocatorMachine.TestCase)
