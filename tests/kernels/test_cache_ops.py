"""write_kv_cache and copy_blocks against plain-PyTorch references, plus their argument checks."""
from __future__ import annotations

import pytest
import torch

from server.kernels import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_cache(num_blocks: int, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                 gen: torch.Generator) -> torch.Tensor:
    return torch.randn((num_blocks, kv_heads, block_size, head_dim), generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_write_kv_cache_scatters_tokens_and_skips_padding(dtype: torch.dtype, block_size: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim + block_size)
    num_blocks, kv_heads, T = 9, 2, 40
    key_cache = random_cache(num_blocks, kv_heads, block_size, head_dim, dtype, gen)
    value_cache = random_cache(num_blocks, kv_heads, block_size, head_dim, dtype, gen)
    key = torch.randn((T, kv_heads, head_dim), generator=gen).to(dtype)
    value = torch.randn((T, kv_heads, head_dim), generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[::7] = -1  # padding tokens
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, :, slot % block_size] = key[t]
            expected_v[slot // block_size, :, slot % block_size] = value[t]

    ops.write_kv_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_write_kv_cache_accepts_strided_views() -> None:
    """k and v may be slices of a fused qkv projection output."""
    gen = torch.Generator().manual_seed(5)
    key_cache = random_cache(4, 2, 16, 64, torch.float32, gen)
    value_cache = random_cache(4, 2, 16, 64, torch.float32, gen)
    qkv = torch.randn((10, 8, 64), generator=gen)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.arange(10) + 20
    ops.write_kv_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[1, :, 4:14], key.transpose(0, 1))
    assert torch.equal(value_cache[1, :, 4:14], value.transpose(0, 1))


def test_write_kv_cache_rejects_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = random_cache(2, 2, 16, 64, torch.float32, gen)
    key = torch.randn((3, 2, 64), generator=gen)
    before = cache.clone()
    with pytest.raises(RuntimeError, match=r"slot_mapping\[2\] = 32 is out of range"):
        ops.write_kv_cache(key, key, cache, cache.clone(), torch.tensor([0, 1, 32]))
    assert torch.equal(cache, before), "a rejected call must not write anything"
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        ops.write_kv_cache(key, key, cache, cache.clone(), torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="key dtype"):
        ops.write_kv_cache(key.half(), key.half(), cache, cache.clone(), torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="value shape"):
        ops.write_kv_cache(key, key[:2], cache, cache.clone(), torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="key_cache must be contiguous"):
        ops.write_kv_cache(key, key, cache.transpose(1, 2).contiguous().transpose(1, 2), cache.clone(),
                           torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_copies_every_layer(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    layers = 3
    key_caches = [random_cache(10, 2, 16, 64, dtype, gen) for _ in range(layers)]
    value_caches = [random_cache(10, 2, 16, 64, dtype, gen) for _ in range(layers)]
    mapping = torch.tensor([[0, 5], [3, 7], [0, 9]])
    expected_k = [c.clone() for c in key_caches]
    expected_v = [c.clone() for c in value_caches]
    for src, dst in mapping.tolist():
        for ek, ev in zip(expected_k, expected_v):
            ek[dst] = ek[src]
            ev[dst] = ev[src]

    ops.copy_blocks(key_caches, value_caches, mapping)
    for got, want in zip(key_caches + value_caches, expected_k + expected_v):
        assert torch.equal(got, want)


def test_copy_blocks_rejects_bad_mappings() -> None:
    gen = torch.Generator().manual_seed(2)
    k, v = [random_cache(4, 1, 16, 64, torch.float32, gen)], [random_cache(4, 1, 16, 64, torch.float32, gen)]
    with pytest.raises(RuntimeError, match=r"block_mapping\[0\] = \(0, 4\) is out of range"):
        ops.copy_blocks(k, v, torch.tensor([[0, 4]]))
    with pytest.raises(RuntimeError, match="destination block 2 appears more than once"):
        ops.copy_blocks(k, v, torch.tensor([[0, 2], [1, 2]]))
    with pytest.raises(RuntimeError, match="both a source and a destination"):
        ops.copy_blocks(k, v, torch.tensor([[0, 1], [1, 2]]))
    with pytest.raises(RuntimeError, match="block_mapping must be int64"):
        ops.copy_blocks(k, v, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="value_caches has 2"):
        ops.copy_blocks(k, v + v, torch.tensor([[0, 1]]))


def test_write_then_attend_sees_the_new_tokens() -> None:
    """The runner's order: write this step's K/V, then attend; a fresh prefill equals dense causal SDPA."""
    gen = torch.Generator().manual_seed(4)
    T, H, KVH, D = 21, 8, 2, 64
    key_cache = torch.full((4, KVH, 16, D), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    q = torch.randn((T, H, D), generator=gen)
    k = torch.randn((T, KVH, D), generator=gen)
    v = torch.randn((T, KVH, D), generator=gen)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, t // 16]) * 16 + t % 16 for t in range(T)])
    ops.write_kv_cache(k, v, key_cache, value_cache, slots)
    out = torch.full_like(q, float("nan"))
    ops.paged_attention(out, q, key_cache, value_cache, table, torch.tensor([T], dtype=torch.int32),
                        torch.tensor([0, T], dtype=torch.int32), D**-0.5, 0, T, T)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k.transpose(0, 1).repeat_interleave(H // KVH, 0).double(),
        v.transpose(0, 1).repeat_interleave(H // KVH, 0).double(), is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_opcheck_cache_ops() -> None:
    gen = torch.Generator().manual_seed(9)
    key_cache = random_cache(4, 2, 16, 64, torch.float32, gen)
    value_cache = random_cache(4, 2, 16, 64, torch.float32, gen)
    key = torch.randn((5, 2, 64), generator=gen)
    slots = torch.tensor([3, -1, 17, 40, 63])
    torch.library.opcheck(torch.ops.pagewire.write_kv_cache.default, (key, key.clone(), key_cache, value_cache, slots))
    torch.library.opcheck(
        torch.ops.pagewire.copy_blocks.default, ([key_cache], [value_cache], torch.tensor([[0, 2], [1, 3]]))
    )
