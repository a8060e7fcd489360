"""The CUDA implementations of the pagewire ops against the same float64 references (GPU only)."""
from __future__ import annotations

import pytest
import torch

from server.kernels import ops
from tests.kernels.paged_reference import TOLERANCE, make_paged_batch, reference_paged_attention, relative_error

pytestmark = pytest.mark.cuda

MIXED = [(0, 1), (15, 1), (16, 1), (33, 1), (0, 17), (13, 20), (40, 3), (100, 70)]


def needs_cuda_kernels() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    if not torch._C._dispatch_has_kernel_for_dispatch_key("pagewire::paged_attention", "CUDA"):
        pytest.skip("server._C was built without CUDA kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,head_dim", [((8, 2), 64), ((4, 4), 80), ((8, 1), 128), ((4, 2), 256)])
@pytest.mark.parametrize("window", [0, 17])
def test_paged_attention_cuda_matches_reference(dtype: torch.dtype, heads: tuple[int, int], head_dim: int,
                                                window: int) -> None:
    needs_cuda_kernels()
    gen = torch.Generator().manual_seed(head_dim + window)
    b = make_paged_batch(MIXED, heads[0], heads[1], head_dim, dtype, gen)
    dev = torch.device("cuda")
    out = torch.full_like(b.query, float("nan"), device=dev)
    ops.paged_attention(
        out, b.query.to(dev), b.key_cache.to(dev), b.value_cache.to(dev), b.block_tables.to(dev),
        b.seq_lens.to(dev), b.query_start_loc.to(dev), head_dim**-0.5, window, b.max_query_len, b.max_seq_len,
    )
    ref = reference_paged_attention(b, head_dim**-0.5, window)
    assert relative_error(out.cpu(), ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cache_ops_cuda_match_cpu(dtype: torch.dtype) -> None:
    needs_cuda_kernels()
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn((6, 2, 16, 64), generator=gen).to(dtype)
    vc = torch.randn((6, 2, 16, 64), generator=gen).to(dtype)
    key = torch.randn((20, 2, 64), generator=gen).to(dtype)
    value = torch.randn((20, 2, 64), generator=gen).to(dtype)
    slots = torch.randperm(96, generator=gen)[:20]
    slots[3] = -1
    kc_d, vc_d = kc.cuda(), vc.cuda()
    ops.write_kv_cache(key.cuda(), value.cuda(), kc_d, vc_d, slots.cuda())
    ops.write_kv_cache(key, value, kc, vc, slots)
    assert torch.equal(kc_d.cpu(), kc) and torch.equal(vc_d.cpu(), vc)

    mapping = torch.tensor([[0, 4], [2, 5]])
    ops.copy_blocks([kc_d, kc_d.clone()], [vc_d, vc_d.clone()], mapping.cuda())
    ops.copy_blocks([kc], [vc], mapping)
    assert torch.equal(kc_d.cpu(), kc) and torch.equal(vc_d.cpu(), vc)
