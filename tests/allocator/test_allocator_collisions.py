"""Hash collisions never serve wrong KV: with the prefix hash cut to a few bits, every prefix hit
must still attach blocks whose contents are exactly the requested tokens."""
import random

import pytest

from server._C import BlockAllocator


def test_every_two_token_block_matches_only_itself_under_a_one_bit_hash():
    a = BlockAllocator(16, 2, hash_bits=1)
    prompts = [[x, y] for x in (0, 1) for y in (0, 1)]  # 4 blocks, 2 hash values: collisions
    owner = {}
    for sid, prompt in enumerate(prompts):
        assert a.match_prefix(sid, prompt[:1]) == 0
        a.allocate_slots(sid, 0, 2)
        a.cache_full_blocks(sid, prompt)
        owner[tuple(prompt)] = a.block_table(sid)[0]
    for sid in range(len(prompts)):
        a.free(sid)
    a.check_invariants()
    for sid, prompt in enumerate(prompts, start=100):
        assert a.match_prefix(sid, prompt + [0]) == 2
        assert a.block_table(sid) == [owner[tuple(prompt)]]
        a.free(sid)
    assert a.match_prefix(200, [2, 2, 0]) == 0


@pytest.mark.parametrize("hash_bits", [1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_random_prompts_under_a_tiny_hash_only_hit_blocks_holding_their_tokens(hash_bits, block_size):
    rng = random.Random(hash_bits * 100 + block_size)
    a = BlockAllocator(24, block_size, hash_bits=hash_bits)
    # block id -> what each slot holds; KV at position p depends on all of tokens[:p + 1]
    kv = {}
    running = []  # seq ids still holding blocks, oldest first
    for sid in range(300):
        # A small alphabet and shared openings make prefixes repeat and blocks collide.
        opening = rng.choice([[], [0, 1], [2, 2, 1], [1, 0, 1, 0]])
        prompt = opening + [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        covered = a.match_prefix(sid, prompt[:-1])
        table = a.block_table(sid)
        for pos in range(covered):
            assert kv[table[pos // block_size]][pos % block_size] == tuple(prompt[:pos + 1]), "hit served wrong KV"
        while a.allocate_slots(sid, covered, len(prompt) - covered) is None:
            a.free(running.pop(0))
        for pos in range(covered, len(prompt)):
            block = a.block_table(sid)[pos // block_size]
            kv.setdefault(block, [None] * block_size)[pos % block_size] = tuple(prompt[:pos + 1])
        a.cache_full_blocks(sid, prompt)
        running.append(sid)
        if len(running) > 3:
            a.free(running.pop(0))
        if sid % 25 == 0:
            a.check_invariants()
    assert a.stats()["prefix_hit_tokens"] > 0  # hits did happen, so the checks above bit
    for sid in running:
        a.free(sid)
    a.check_invariants()
    assert a.stats()["used_blocks"] == 0


def test_a_rewritten_parent_never_adopts_the_children_of_its_old_contents():
    # Truncating into a held block and rewriting it must cut it off from the children that were
    # registered under its old contents, even when the new chained hash collides with the old.
    # With a 1-bit hash, some of these rewrites collide; none may let the old child match.
    for x in range(2, 10):
        a = BlockAllocator(8, 2, hash_bits=1)
        old = [0, 0, 1, 1, 2, 2, 5]
        a.match_prefix(1, old[:-1])
        a.allocate_slots(1, 0, len(old))
        a.cache_full_blocks(1, old)  # blocks 0 [0,0], 1 [1,1], 2 [2,2] registered
        a.truncate(1, 3)  # block 2 is cached, block 1 holds [1, _] and loses its hash
        a.allocate_slots(1, 3, 1)
        a.cache_full_blocks(1, [0, 0, 1, x])  # block 1 registered again with new contents
        assert a.match_prefix(2, [0, 0, 1, x, 2, 2, 5]) == 4, x
        a.check_invariants()
