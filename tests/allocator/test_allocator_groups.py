"""KV groups in the block allocator: a sliding-window group gives its blocks back once they leave the
window, prefix hits attach what every group still needs (also after the window slid), and the
persistent block-table fill. The random programs of test_allocator_stateful.py cover the same rules
with every verb; these pin the cases down one by one."""
from __future__ import annotations

import numpy as np
import pytest

from server._C import BlockAllocator

BS = 2


def run(a: BlockAllocator, sid: int, tokens: list[int], start: int, chunk: int) -> None:
    """Compute tokens[start:] in chunks, registering full blocks as the engine does."""
    pos = start
    while pos < len(tokens):
        n = min(chunk, len(tokens) - pos)
        assert a.allocate_slots(sid, pos, n) is not None
        first = pos // BS * BS
        a.cache_full_blocks(sid, tokens[first : pos + n], first)
        pos += n
        a.check_invariants()


def test_sliding_group_releases_blocks_that_leave_the_window() -> None:
    a = BlockAllocator(64, BS, True, 64, [0, 4])
    tokens = list(range(20))
    run(a, 1, tokens, 0, 1)  # decode-sized steps: the window slides one token at a time
    full, sliding = a.block_table(1, 0), a.block_table(1, 1)
    assert len(full) == len(sliding) == 10 and -1 not in full
    # The last step wrote position 19 from num_computed 19: it sees 16..19, blocks 8 and 9.
    assert sliding[:8] == [-1] * 8 and -1 not in sliding[8:]
    assert a.stats()["used_blocks"] == 10 + 2
    # Released blocks were registered, so they wait in the LRU for prefix hits (evictable).
    assert a.stats()["cached_blocks"] == 8
    # The same sequence without the window would hold twice the full group's blocks.
    b = BlockAllocator(64, BS, True, 64, [0, 0])
    run(b, 1, tokens, 0, 1)
    assert b.stats()["used_blocks"] == 20


def test_blocks_needed_counts_what_the_window_gives_back() -> None:
    a = BlockAllocator(8, BS, False, 64, [3])
    run(a, 1, list(range(6)), 0, 2)  # 3 blocks; the step from 4 sees 2.. and released block 0
    t = a.block_table(1, 0)
    assert len(t) == 3 and t[0] == -1 and -1 not in t[1:]
    # Growing by 2 from 6: one new block, and positions < 4 are released (block 1): net 0.
    assert a.blocks_needed(1, 6, 2) == 0
    free = a.num_free_blocks
    assert a.allocate_slots(1, 6, 2) == []
    assert a.num_free_blocks == free
    # A pool with no free block still grows a sliding sequence: it reuses what it gives back.
    c = BlockAllocator(3, BS, False, 64, [2])
    run(c, 1, list(range(40)), 0, 1)
    assert c.stats()["used_blocks"] <= 2


@pytest.mark.parametrize("window", [1, 3, 4, 7])
def test_prefix_hit_after_the_window_slid(window: int) -> None:
    """Sequence 1 runs on past its prompt, so its sliding group released the prompt's early
    blocks; a second request with that prompt still hits the whole prompt in every group, with
    only the window's blocks attached in the sliding one (the same blocks sequence 1 wrote)."""
    a = BlockAllocator(64, BS, True, 64, [0, window])
    prompt = list(range(100, 112))  # 6 blocks
    run(a, 1, prompt + list(range(30)), 0, 3)
    assert a.block_table(1, 1)[0] == -1, "the window slid past the prompt's first block"
    hit = a.match_prefix(2, prompt + [7])
    assert hit == 12
    first_needed = max(0, hit - window + 1) // BS
    full, sliding = a.block_table(2, 0), a.block_table(2, 1)
    assert full == a.block_table(1, 0)[:6]
    assert sliding[:first_needed] == [-1] * first_needed
    # Sequence 1 released these when its window passed them; they were cached, and now serve seq 2.
    assert all(b >= 0 and a.refcount(b) == 1 for b in sliding[first_needed:])
    a.check_invariants()
    run(a, 2, prompt + [7, 8, 9], 12, 2)
    assert a.registered_tokens(2) == 14


def test_a_hit_needs_every_group() -> None:
    """When a sliding group's cached chain was evicted, the hit is what every group still has."""
    a = BlockAllocator(14, BS, True, 64, [0, 2])
    prompt = list(range(10))  # 5 blocks
    run(a, 1, prompt, 0, 1)
    a.free(1)
    assert a.match_prefix(2, prompt + [1]) == 10
    a.free(2)
    # Fill the pool with another sequence until the cached sliding blocks are evicted (LRU: the
    # sliding group's early blocks were released first, so they go first).
    run(a, 3, list(range(50, 70)), 0, 1)
    assert a.stats()["evictions"] > 0
    a.free(3)
    hit = a.match_prefix(4, prompt + [1])
    full_chain_left = hit < 10
    assert full_chain_left, "an evicted sliding chain must shorten the hit"
    for g in (0, 1):
        assert len(a.block_table(4, g)) * BS == hit
    a.check_invariants()


def test_groups_never_match_each_others_blocks() -> None:
    """Identical tokens in two groups hash apart (each group's chain has its own root)."""
    a = BlockAllocator(16, BS, True, 2, [0, 0, 0])  # 2 hash bits: collisions everywhere
    run(a, 1, list(range(8)), 0, 8)
    a.check_invariants()  # no duplicate registration across groups
    a.free(1)
    assert a.match_prefix(2, list(range(8)) + [0]) == 8
    tables = [a.block_table(2, g) for g in range(3)]
    assert len({b for t in tables for b in t}) == 12  # 3 groups x 4 blocks, all distinct


def test_truncate_refuses_to_go_below_the_released_window() -> None:
    a = BlockAllocator(32, BS, False, 64, [0, 3])
    run(a, 1, list(range(12)), 0, 1)
    with pytest.raises(ValueError, match="truncate: num_tokens \\(4\\) is below what group 1's window"):
        a.truncate(1, 4)
    a.check_invariants()
    a.truncate(1, 11)  # a speculative rollback keeps the allocated start: always fine
    assert len(a.block_table(1, 1)) == 6


def test_fill_block_tables_writes_every_group_in_one_call() -> None:
    a = BlockAllocator(64, BS, True, 64, [0, 3])
    run(a, 1, list(range(9)), 0, 1)
    run(a, 2, list(range(4)), 0, 4)
    out = np.full((2, 4, 8), 99, dtype=np.int32)
    longest = a.fill_block_tables([2, 1], out)
    assert longest == 5
    for g in (0, 1):
        assert list(out[g, 0, :2]) == a.block_table(2, g) and list(out[g, 0, 2:5]) == [0, 0, 0]
        assert list(out[g, 1, :5]) == a.block_table(1, g)
    assert -1 in out[1, 1] and (out[:, 2:] == 99).all() and (out[:, :, 5:] == 99).all()
    with pytest.raises(ValueError, match="more than the 3 columns"):
        a.fill_block_tables([1], np.zeros((2, 1, 3), dtype=np.int32))
    with pytest.raises(ValueError, match="int32"):
        a.fill_block_tables([1], np.zeros((2, 1, 8), dtype=np.int64))
    with pytest.raises(ValueError, match="room for 1 groups"):
        a.fill_block_tables([1], np.zeros((1, 1, 8), dtype=np.int32))
    with pytest.raises(ValueError, match="unknown seq_id 7"):
        a.fill_block_tables([7], out)


def test_bad_group_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="group_windows must name at least one group"):
        BlockAllocator(4, BS, True, 64, [])
    with pytest.raises(ValueError, match="must be >= 0"):
        BlockAllocator(4, BS, True, 64, [0, -2])
    a = BlockAllocator(4, BS, True, 64, [0, 2])
    a.allocate_slots(1, 0, 1)
    with pytest.raises(ValueError, match="group 2 out of range"):
        a.block_table(1, 2)
