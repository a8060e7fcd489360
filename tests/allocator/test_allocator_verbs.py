"""Unit tests for server._C.BlockAllocator: one behaviour per test, small hand-checked cases."""
import pytest

from server._C import BlockAllocator


def checked(alloc: BlockAllocator) -> BlockAllocator:
    alloc.check_invariants()
    return alloc


def prefill(alloc, seq_id, tokens, cache=True):
    """Match, allocate and register a prompt the way the engine does; returns tokens covered."""
    covered = alloc.match_prefix(seq_id, tokens[:-1])
    assert alloc.allocate_slots(seq_id, covered, len(tokens) - covered) == []
    if cache:
        alloc.cache_full_blocks(seq_id, tokens)
    checked(alloc)
    return covered


def test_fresh_allocator_reports_its_size_and_hands_out_blocks_in_order():
    a = BlockAllocator(8, 4)
    assert (a.num_blocks, a.block_size, a.num_free_blocks) == (8, 4, 8)
    assert a.allocate_slots(1, 0, 9) == []
    assert a.block_table(1) == [0, 1, 2]
    assert [a.refcount(b) for b in range(4)] == [1, 1, 1, 0]
    assert checked(a).stats() == {
        "num_blocks": 8, "used_blocks": 3, "free_blocks": 5, "cached_blocks": 0,
        "prefix_hit_tokens": 0, "prefix_miss_tokens": 0, "evictions": 0,
    }


def test_allocate_slots_grows_only_when_a_block_fills():
    a = BlockAllocator(8, 4)
    a.allocate_slots(1, 0, 5)
    assert a.block_table(1) == [0, 1]
    assert a.blocks_needed(1, 5, 3) == 0
    a.allocate_slots(1, 5, 3)
    assert a.block_table(1) == [0, 1]
    assert a.blocks_needed(1, 8, 1) == 1
    a.allocate_slots(1, 8, 1)
    assert checked(a).block_table(1) == [0, 1, 2]


def test_free_returns_unhashed_blocks_to_the_free_list_and_forgets_the_sequence():
    a = BlockAllocator(8, 4)
    prefill(a, 1, list(range(10)), cache=False)
    a.free(1)
    assert not a.has_sequence(1)
    assert checked(a).stats()["free_blocks"] == 8
    a.free(1)  # unknown ids are a no-op
    a.free(12345)


def test_fork_shares_every_block_by_refcount():
    a = BlockAllocator(8, 4)
    a.allocate_slots(1, 0, 6)
    a.fork(1, 2)
    assert a.block_table(2) == a.block_table(1) == [0, 1]
    assert [a.refcount(0), a.refcount(1)] == [2, 2]
    a.free(2)
    assert [a.refcount(0), a.refcount(1)] == [1, 1]
    checked(a)


def test_appending_to_a_shared_partial_block_copies_it_and_the_parent_keeps_its_block():
    a = BlockAllocator(8, 4)
    a.allocate_slots(1, 0, 6)
    a.fork(1, 2)
    assert a.blocks_needed(2, 6, 1) == 1
    copies = a.allocate_slots(2, 6, 1)
    assert copies == [(1, 2)]
    assert a.block_table(1) == [0, 1]
    assert a.block_table(2) == [0, 2]
    assert [a.refcount(0), a.refcount(1), a.refcount(2)] == [2, 1, 1]
    # The parent is the only holder of block 1 now: no copy on its next append.
    assert a.allocate_slots(1, 6, 1) == []
    checked(a)


def test_write_range_starting_on_a_block_boundary_copies_nothing():
    a = BlockAllocator(8, 4)
    a.allocate_slots(1, 0, 8)
    a.fork(1, 2)
    assert a.allocate_slots(2, 8, 1) == []
    assert a.block_table(2) == [0, 1, 2]
    checked(a)


def test_write_range_spanning_several_shared_blocks_copies_each_of_them():
    a = BlockAllocator(8, 4)
    a.allocate_slots(1, 0, 12)  # e.g. speculative lookahead slots
    a.fork(1, 2)
    assert a.blocks_needed(2, 6, 6) == 2
    assert a.allocate_slots(2, 6, 6) == [(1, 3), (2, 4)]
    assert a.block_table(2) == [0, 3, 4]
    assert checked(a).block_table(1) == [0, 1, 2]


def test_a_freed_prompt_is_served_from_the_cache():
    a = BlockAllocator(8, 4)
    prompt = list(range(100, 110))
    assert prefill(a, 1, prompt) == 0
    a.free(1)
    s = checked(a).stats()
    assert (s["cached_blocks"], s["free_blocks"], a.num_free_blocks) == (2, 6, 8)
    assert a.match_prefix(2, prompt[:-1]) == 8
    assert a.block_table(2) == [0, 1]
    assert [a.refcount(0), a.refcount(1)] == [1, 1]
    s = checked(a).stats()
    assert s["cached_blocks"] == 0 and s["used_blocks"] == 2
    assert (s["prefix_hit_tokens"], s["prefix_miss_tokens"]) == (8, 9 + 1)


def test_a_running_sequences_blocks_are_shared_by_a_match():
    a = BlockAllocator(8, 4)
    prefill(a, 1, list(range(9)))
    assert a.match_prefix(2, list(range(9))) == 8
    assert a.block_table(2) == [0, 1]
    assert [a.refcount(0), a.refcount(1)] == [2, 2]
    checked(a)


def test_match_stops_at_the_first_differing_block():
    a = BlockAllocator(8, 4)
    prefill(a, 1, list(range(13)))
    assert a.match_prefix(2, [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11]) == 4
    assert a.block_table(2) == [0]


def test_an_equal_block_under_a_different_prefix_does_not_match():
    a = BlockAllocator(8, 4)
    prefill(a, 1, [1, 1, 1, 1, 2, 2, 2, 2, 0])
    a.free(1)
    assert a.match_prefix(2, [9, 9, 9, 9, 2, 2, 2, 2]) == 0
    assert a.block_table(2) == []


def test_prefix_caching_disabled_never_matches_and_frees_blocks_outright():
    a = BlockAllocator(8, 4, enable_prefix_caching=False)
    prompt = list(range(9))
    assert prefill(a, 1, prompt) == 0
    a.free(1)
    assert checked(a).stats()["cached_blocks"] == 0
    assert a.match_prefix(2, prompt) == 0
    assert a.has_sequence(2) and a.block_table(2) == []


def test_eviction_takes_the_least_recently_freed_and_a_sequences_tail_first():
    a = BlockAllocator(4, 2)
    prefill(a, 1, [1, 2, 3, 4, 5])  # blocks 0, 1 (full) + 2 (partial)
    a.free(1)  # LRU order: 1, 0 (tail first); block 2 is free
    assert a.allocate_slots(2, 0, 4) == []  # takes free blocks 3, 2: nothing evicted
    assert a.stats()["evictions"] == 0
    assert a.allocate_slots(3, 0, 1) == []
    assert a.block_table(3) == [1]  # the tail of seq 1 goes first
    assert a.stats()["evictions"] == 1
    a.free(2)
    a.free(3)
    assert a.match_prefix(4, [1, 2, 3, 4]) == 2  # the head is still cached
    assert checked(a).block_table(4) == [0]


def test_a_cache_hit_makes_blocks_most_recently_used():
    a = BlockAllocator(2, 2)
    prefill(a, 1, [1, 1])
    a.free(1)  # block 0 cached
    prefill(a, 2, [2, 2])
    a.free(2)  # block 1 cached; LRU: 0 (older), 1
    assert a.match_prefix(3, [1, 1]) == 2
    a.free(3)  # block 0 is the most recent now, so block 1 goes first
    a.allocate_slots(4, 0, 1)
    assert a.block_table(4) == [1]
    checked(a)


def test_truncate_drops_the_tail_and_unhashes_the_partial_last_block():
    a = BlockAllocator(8, 4)
    tokens = list(range(10))
    prefill(a, 1, tokens)
    a.truncate(1, 6)
    assert a.block_table(1) == [0, 1]
    assert a.refcount(2) == 0
    # Block 1 lost its hash: only the first block is still a hit.
    assert checked(a).match_prefix(2, tokens[:9]) == 4
    # Sampling different tokens after the rollback registers block 1 under them.
    a.allocate_slots(1, 6, 2)
    accepted = tokens[:6] + [60, 61]
    a.cache_full_blocks(1, accepted)
    a.free(1)
    assert checked(a).match_prefix(3, accepted + [0]) == 8


def test_truncate_to_a_block_boundary_keeps_full_blocks_registered():
    a = BlockAllocator(8, 4)
    tokens = list(range(10))
    prefill(a, 1, tokens)
    a.truncate(1, 8)
    assert a.block_table(1) == [0, 1]
    a.free(1)
    assert checked(a).match_prefix(2, tokens[:9]) == 8


def test_truncate_keeps_the_hash_of_a_shared_partial_tail_and_writing_copies_it():
    a = BlockAllocator(8, 4)
    tokens = list(range(10))
    prefill(a, 1, tokens)
    assert a.match_prefix(2, tokens[:9]) == 8  # seq 2 shares blocks 0, 1
    a.truncate(1, 6)
    assert a.allocate_slots(1, 6, 2) == [(1, 2)]
    a.free(1)
    assert a.match_prefix(3, tokens[:9]) == 8  # block 1's registration survived
    assert checked(a).block_table(3) == [0, 1]


def test_writing_over_an_unshared_cached_block_drops_its_hash():
    a = BlockAllocator(8, 4)
    tokens = list(range(10))
    prefill(a, 1, tokens)
    a.free(1)
    assert a.match_prefix(2, tokens[:9]) == 8
    assert a.allocate_slots(2, 4, 6) == []  # rewrite from token 4 on: block 1 is overwritten
    rewritten = tokens[:4] + [40, 41, 42, 43, 44, 45]
    a.cache_full_blocks(2, rewritten)
    a.free(2)
    assert checked(a).match_prefix(3, tokens[:9]) == 4
    a.free(3)
    assert a.match_prefix(4, rewritten[:9]) == 8  # block 1 registered under its new tokens


def test_out_of_blocks_returns_none_and_changes_nothing():
    a = BlockAllocator(4, 4)
    a.allocate_slots(1, 0, 12)
    before = a.stats()
    assert a.blocks_needed(2, 0, 8) == 2
    assert a.allocate_slots(2, 0, 8) is None
    assert not a.has_sequence(2)
    a.fork(1, 3)
    assert a.blocks_needed(3, 10, 3) == 2  # copy block 2 + one new block
    assert a.allocate_slots(3, 10, 3) is None
    assert a.block_table(3) == [0, 1, 2]
    assert checked(a).stats() == before


def test_identical_blocks_computed_twice_are_registered_once_and_chains_continue():
    a = BlockAllocator(16, 4)
    common = list(range(8))
    first, second = common + [50], common + [60, 61, 62, 63, 64]
    # Both prompts are admitted in the same step, before either registers its blocks.
    assert a.match_prefix(1, first[:-1]) == a.match_prefix(2, second[:-1]) == 0
    a.allocate_slots(1, 0, len(first))
    a.allocate_slots(2, 0, len(second))
    a.cache_full_blocks(1, first)
    a.cache_full_blocks(2, second)
    assert a.block_table(2) == [3, 4, 5, 6]
    a.free(1)
    a.free(2)
    s = checked(a).stats()
    # Seq 2's first two blocks duplicated seq 1's and were not registered.
    assert s["cached_blocks"] == 3
    assert a.match_prefix(3, common + [60, 61, 62, 63, 64]) == 12
    assert a.block_table(3) == [0, 1, 5]


def test_cache_full_blocks_is_idempotent():
    a = BlockAllocator(8, 4)
    tokens = list(range(9))
    prefill(a, 1, tokens)
    a.cache_full_blocks(1, tokens)
    a.cache_full_blocks(1, tokens[:5])
    a.free(1)
    assert checked(a).stats()["cached_blocks"] == 2


def test_reset_prefix_cache_forgets_every_hash_but_keeps_held_blocks():
    a = BlockAllocator(8, 4)
    prefill(a, 1, list(range(9)))
    prefill(a, 2, list(range(20, 29)))
    a.free(1)
    a.reset_prefix_cache()
    s = checked(a).stats()
    assert (s["cached_blocks"], s["used_blocks"]) == (0, 3)
    assert a.match_prefix(3, list(range(9))) == 0
    assert a.block_table(2) == [3, 4, 5]
    # Seq 2 registers again from scratch.
    a.cache_full_blocks(2, list(range(20, 29)))
    a.free(2)
    assert checked(a).match_prefix(4, list(range(20, 29))) == 8


def test_constructor_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(4, -1)
    with pytest.raises(ValueError, match="hash_bits"):
        BlockAllocator(4, 4, True, 0)
    with pytest.raises(ValueError, match="hash_bits"):
        BlockAllocator(4, 4, hash_bits=65)


def test_bad_arguments_raise_value_errors_that_name_them():
    a = BlockAllocator(8, 4)
    a.allocate_slots(1, 0, 6)
    cases = [
        (lambda: a.allocate_slots(1, -1, 1), "num_computed_tokens"),
        (lambda: a.allocate_slots(1, 0, -2), "num_new_tokens"),
        (lambda: a.allocate_slots(1, 9, 1), "num_computed_tokens"),
        (lambda: a.blocks_needed(1, 0, -1), "num_new_tokens"),
        (lambda: a.match_prefix(1, [1, 2, 3, 4]), "already has"),
        (lambda: a.fork(9, 10), "unknown seq_id 9"),
        (lambda: a.fork(1, 1), "parent_id and child_id"),
        (lambda: a.truncate(1, -1), "num_tokens"),
        (lambda: a.truncate(1, 9), "num_tokens"),
        (lambda: a.truncate(7, 0), "unknown seq_id 7"),
        (lambda: a.block_table(7), "unknown seq_id 7"),
        (lambda: a.refcount(8), "block_id"),
        (lambda: a.refcount(-1), "block_id"),
        (lambda: a.cache_full_blocks(7, []), "unknown seq_id 7"),
        (lambda: a.cache_full_blocks(1, list(range(9))), "hold only 8"),
        (lambda: a.match_prefix(5, [1, 2, 3, -3]), r"token_ids\[3\]"),
        (lambda: a.match_prefix(5, [2**31, 0, 0, 0]), r"token_ids\[0\]"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    a.allocate_slots(2, 0, 1)
    with pytest.raises(ValueError, match="child seq_id 2 already has blocks"):
        a.fork(1, 2)
    with pytest.raises(TypeError):
        a.match_prefix(6, [1.5, 2.0, 3.0, 4.0])
    with pytest.raises(TypeError):
        a.cache_full_blocks(1, 7)
    checked(a)


def test_cache_full_blocks_rejects_tokens_that_contradict_a_registered_shared_block():
    a = BlockAllocator(8, 4)
    prefill(a, 1, list(range(9)))
    a.fork(1, 3)
    a.reset_prefix_cache()  # empties both chains
    a.cache_full_blocks(1, list(range(9)))  # seq 1 registers the shared blocks again...
    with pytest.raises(ValueError, match="differ from the tokens block 0 holds"):
        a.cache_full_blocks(3, [7] * 9)  # ...and seq 3 claims other tokens for them
    checked(a)


def test_sequences_accept_tuples_and_large_ids():
    a = BlockAllocator(8, 4)
    sid = 2**62
    assert a.match_prefix(sid, tuple(range(9))) == 0
    a.allocate_slots(sid, 0, 10)
    a.cache_full_blocks(sid, tuple(range(10)))
    assert a.has_sequence(sid) and a.block_table(sid) == [0, 1, 2]
    assert "BlockAllocator(num_blocks=8" in repr(a)


def test_cache_full_blocks_takes_only_the_new_tokens_from_a_start_position():
    a = BlockAllocator(8, 4)
    tokens = list(range(10, 23))  # 13 tokens: three full blocks and one token
    a.allocate_slots(1, 0, 6)
    a.cache_full_blocks(1, tokens[:6])
    assert a.registered_tokens(1) == 4
    # The next step writes positions 6..12: pass them from the first block they touch (4).
    a.allocate_slots(1, 6, 7)
    a.cache_full_blocks(1, tokens[4:13], 4)
    assert a.registered_tokens(1) == 12
    # Tokens before the registration point are never read: garbage there is ignored...
    a.cache_full_blocks(1, [-5] * 8 + tokens[8:12], 0)
    assert a.registered_tokens(1) == 12
    a.free(1)
    # ...and the chain registered piecewise matches like one registered in one call.
    assert checked(a).match_prefix(2, tokens) == 12
    assert a.block_table(2) == [0, 1, 2]


def test_cache_full_blocks_refuses_a_gap_before_start():
    a = BlockAllocator(8, 4)
    a.allocate_slots(1, 0, 12)
    with pytest.raises(ValueError, match=r"start at position 8 .* registered only 0 tokens; positions \[0, 8\)"):
        a.cache_full_blocks(1, [1, 2, 3, 4], 8)
    with pytest.raises(ValueError, match="start must be >= 0"):
        a.cache_full_blocks(1, [1], -1)
    with pytest.raises(ValueError, match="registered_tokens: unknown seq_id 9"):
        a.registered_tokens(9)
    assert checked(a).registered_tokens(1) == 0


def test_import_server_C_on_its_own_in_a_fresh_interpreter():
    """`import server._C` must not need `import torch` first (its RUNPATH finds libtorch)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, server._C as C\n"
        "assert 'torch' not in sys.modules, 'server._C imported torch'\n"
        "a = C.BlockAllocator(4, 2)\n"
        "assert a.allocate_slots(0, 0, 3) == [] and a.block_table(0) == [0, 1]\n"
        "import torch\n"
        "assert hasattr(torch.ops.pagewire, 'paged_attention')\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
