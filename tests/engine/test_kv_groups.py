"""KV groups (server/engine/kv_groups.py) and their sizing (kv_budget.py): which layers share a
block table, how many blocks a sequence holds per group, and what the pool and admission count."""
from __future__ import annotations

import pytest

from server.engine.config import ConfigError, EngineConfig
from server.engine.errors import CapacityLimits, KVCapacityError, check_capacity
from server.engine.kv_budget import kv_layout
from server.engine.kv_groups import kv_groups

GEMMA3 = [None if (i + 1) % 6 == 0 else 512 for i in range(36)]  # 5 local : 1 global


def test_gemma3_pattern_groups_of_six() -> None:
    g = kv_groups(GEMMA3)
    assert g.group_size == 6 and len(g.groups) == 6
    assert g.windows == (512, 0, 512, 512, 512, 512)  # numbered by first layer: (0-4, 6), (5, 11, ..), (7-10, 12, 13)..
    full = [grp for grp in g.groups if grp.window == 0]
    assert len(full) == 1 and full[0].layers == (5, 11, 17, 23, 29, 35)
    for layer in range(36):
        assert g.groups[g.layer_group[layer]].layers[g.layer_slot[layer]] == layer
        assert g.groups[g.layer_group[layer]].window == (GEMMA3[layer] or 0)
    assert g.describe() == "6 groups of 6 layers: 5 sliding 512, 1 full"


def test_uneven_counts_pad_the_last_group_and_one_window_is_one_group() -> None:
    g = kv_groups([None if i % 6 == 5 else 512 for i in range(26)])  # Gemma-3-1B: 4 global, 22 local
    assert g.group_size == 4 and len(g.groups) == 1 + 6  # 22 local layers: 5 full groups + one of 2
    assert sorted(len(grp.layers) for grp in g.groups if grp.window) == [2, 4, 4, 4, 4, 4]
    assert kv_groups([None] * 4).groups == kv_groups([0] * 4).groups
    assert len(kv_groups([16] * 3).groups) == 1 and kv_groups([16] * 3).group_size == 3
    with pytest.raises(ValueError, match="windows must be >= 0"):
        kv_groups([0, -1])


def test_blocks_per_group_follow_the_allocator_rule() -> None:
    g = kv_groups([None, 8])
    # 100 tokens, decoding (the last written from num_computed 99): the window sees 92..99.
    assert g.group_blocks(0, 100, 4) == 25
    assert g.group_blocks(1, 100, 4) == 25 - 92 // 4
    # A 40-token prefill chunk ending at 100 started at 60: the window of 60 sees 53..
    assert g.group_blocks(1, 100, 4, new_tokens=40) == 25 - 53 // 4
    assert g.blocks_for(100, 4) == 25 + 2


def test_layout_counts_bytes_per_group() -> None:
    cfg = EngineConfig("m", kv_cache_tokens=32768 * 8, block_size=16, max_model_len=32768)
    shape = dict(num_layers=36, num_kv_heads=4, head_dim=256, dtype="bfloat16", max_position_embeddings=131072)
    grouped = kv_layout(cfg, **shape, layer_windows=GEMMA3)
    flat = kv_layout(cfg, **shape)
    # The same byte budget either way.
    assert abs(grouped.total_bytes - flat.total_bytes) <= grouped.bytes_per_block
    assert grouped.bytes_per_block == 2 * 6 * 4 * 256 * 2 * 16
    ratio = grouped.seq_bytes(32768) / flat.seq_bytes(32768)
    assert ratio <= 0.3, ratio
    assert grouped.sequences_fitting(32768) >= 3 * flat.sequences_fitting(32768)
    assert "5 sliding 512, 1 full" in grouped.log_line() and "fits" in grouped.log_line()
    assert flat.log_line().startswith("KV cache: 147456 bytes/token")


def test_admission_counts_blocks_per_group() -> None:
    cfg = EngineConfig("m", kv_cache_tokens=4096, block_size=16, max_num_batched_tokens=64)
    shape = dict(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float32", max_position_embeddings=1 << 20)
    lay = kv_layout(cfg, **shape, layer_windows=[32] * 4)  # every layer sliding: length is unbounded by KV
    assert lay.max_model_len == 1 << 20
    limits = CapacityLimits(lay.max_model_len, 16, lay.num_blocks, lay.watermark_blocks, 8, lay.groups,
                            lay.chunk_tokens)
    check_capacity(100_000, 100, 1, limits)  # holds a window (+ one step's chunk), not 100k tokens
    full = kv_layout(cfg, **shape)
    with pytest.raises(KVCapacityError):
        check_capacity(100_000, 100, 1, CapacityLimits(1 << 20, 16, full.num_blocks, full.watermark_blocks, 8))
    with pytest.raises(ConfigError, match="layer_windows"):
        kv_layout(cfg, **shape, layer_windows=[32] * 3)


def test_layers_of_different_sizes_share_slots_and_readers_hold_nothing() -> None:
    """Gemma 4's shape: global layers' K/V twice a local one's, the last two layers reading earlier
    layers' KV. Two local layers pack into one slot; every writing layer of a group has its own
    (slot, place), so no two layers of a block overlap; a reader takes its source's place."""
    from server.engine.kv_groups import kv_layer_groups

    windows, elems, sources = [24, 24, None, 24, 24, None], [32, 32, 64, 32, 32, 64], [None] * 4 + [3, 2]
    g = kv_layer_groups(windows, elems, sources)
    assert g.slot_elems == 64 and g.group_size == 1
    assert g.layer_ratio == (2, 2, 1, 2, 2, 1) and g.layer_source == (0, 1, 2, 3, 3, 2)
    assert [(grp.window, grp.layers) for grp in g.groups] == [(24, (0, 1)), (0, (2,)), (24, (3,))]
    for grp_index, grp in enumerate(g.groups):
        places = [(g.layer_slot[i], g.layer_sub[i]) for i in grp.layers]
        assert len(set(places)) == len(places)
        assert all(g.layer_group[i] == grp_index and g.layer_sub[i] < g.layer_ratio[i] for i in grp.layers)
    for reader, source in ((4, 3), (5, 2)):
        assert (g.layer_group[reader], g.layer_slot[reader], g.layer_sub[reader]) == \
            (g.layer_group[source], g.layer_slot[source], g.layer_sub[source])
    assert g.describe() == "3 groups of 1 slots: 2 sliding 24, 1 full; 2 layers read another layer's KV"
    # Gemma-4-E2B-like: 35 layers, 15 writing (13 local of 256, 2 global of 512), 20 reading.
    n = 35
    kinds = [(i + 1) % 6 != 0 for i in range(n)]
    big = kv_layer_groups([512 if s else None for s in kinds], [256 if s else 512 for s in kinds],
                          [None] * 15 + [14 if s else 11 for s in kinds[15:]])
    assert big.group_size == 2 and sum(len(grp.layers) for grp in big.groups) == 15
    with pytest.raises(ValueError, match="earlier layer"):
        kv_layer_groups([None, None], [8, 8], [1, None])


def test_layout_counts_only_the_layers_that_write_kv() -> None:
    cfg = EngineConfig("m", kv_cache_tokens=4096, block_size=16, max_model_len=256)
    shape = dict(num_layers=6, num_kv_heads=2, head_dim=16, dtype="float32", max_position_embeddings=512)
    lay = kv_layout(cfg, **shape, layer_windows=[24, 24, None, 24, 24, None], layer_elems=[32, 32, 64, 32, 32, 64],
                    layer_sources=[None] * 4 + [3, 2])
    assert lay.bytes_per_token == 2 * (3 * 32 + 64) * 4  # layers 4 and 5 keep nothing
    assert lay.bytes_per_block == 2 * 1 * 64 * 4 * 16  # one slot of 64 values per token, K and V
    # A 256-token sequence: the full group holds 16 blocks, each sliding group 3 (its window + the step).
    assert lay.seq_blocks(256) == 16 + 2 * lay.groups.group_blocks(0, 256, 16)
