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
