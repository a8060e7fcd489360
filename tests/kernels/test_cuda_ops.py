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
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (17, 0.0), (0, 3.0), (17, 0.5)])
def test_paged_attention_cuda_matches_reference(dtype: torch.dtype, heads: tuple[int, int], head_dim: int,
                                                window: int, softcap: float) -> None:
    needs_cuda_kernels()
    gen = torch.Generator().manual_seed(head_dim + window)
    b = make_paged_batch(MIXED, heads[0], heads[1], head_dim, dtype, gen)
    dev = torch.device("cuda")
    out = torch.full_like(b.query, float("nan"), device=dev)
    scale = 256**-0.5 * 4 if softcap else head_dim**-0.5  # a per-layer scale with the cap
    ops.paged_attention(
        out, b.query.to(dev), b.key_cache.to(dev), b.value_cache.to(dev), b.block_tables.to(dev),
        b.seq_lens.to(dev), b.query_start_loc.to(dev), scale, window, b.max_query_len, b.max_seq_len, softcap,
    )
    ref = reference_paged_attention(b, scale, window, softcap)
    assert relative_error(out.cpu(), ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [0, 17])
def test_paged_attention_cuda_sinks_match_reference(dtype: torch.dtype, window: int) -> None:
    """gpt-oss's attention sinks on the CUDA kernel: from far below the scores to far above them."""
    needs_cuda_kernels()
    gen = torch.Generator().manual_seed(window)
    b = make_paged_batch(MIXED, 8, 2, 64, dtype, gen)
    dev = torch.device("cuda")
    sinks = torch.tensor([-30.0, -2.0, 0.0, 0.5, 1.5, 3.0, 8.0, 60.0])
    out = torch.full_like(b.query, float("nan"), device=dev)
    ops.paged_attention(
        out, b.query.to(dev), b.key_cache.to(dev), b.value_cache.to(dev), b.block_tables.to(dev),
        b.seq_lens.to(dev), b.query_start_loc.to(dev), 64**-0.5, window, b.max_query_len, b.max_seq_len, 0.0,
        sinks.to(dev),
    )
    ref = reference_paged_attention(b, 64**-0.5, window, sinks=sinks)
    assert relative_error(out.cpu()[:, :7], ref[:, :7]) <= TOLERANCE[dtype]
    assert torch.isfinite(out).all() and out.cpu()[:, 7].abs().max() < 1e-6


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


def test_paged_attention_cuda_rejects_bad_arguments_like_the_cpu_op() -> None:
    """One argument check (csrc/attention_checks.h) serves both devices: same calls, same messages."""
    needs_cuda_kernels()
    gen = torch.Generator().manual_seed(0)
    b = make_paged_batch([(5, 2)], 4, 2, 64, torch.float32, gen)
    cases = [(4, b.block_tables.long()), (5, b.seq_lens.long()), (2, b.key_cache.double()),
             (0, torch.empty_like(b.query)[:1]), (7, float("nan"))]
    for dev in (torch.device("cpu"), torch.device("cuda")):
        args = [torch.empty_like(b.query), b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                b.query_start_loc, 0.125, 0, 2, 7]
        args = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]
        messages = []
        for i, value in cases:
            bad = list(args)
            bad[i] = value.to(dev) if isinstance(value, torch.Tensor) else value
            with pytest.raises(RuntimeError) as e:
                ops.paged_attention(*bad)  # type: ignore[arg-type]
            messages.append(str(e.value).splitlines()[0])
        if dev.type == "cpu":
            cpu_messages = messages
        else:
            assert messages == cpu_messages
    # A tensor on the wrong device is named too.
    mixed = list(args)  # the CUDA arguments, but seq_lens left on the host
    mixed[5] = b.seq_lens
    with pytest.raises(RuntimeError, match="seq_lens must be on cuda"):
        ops.paged_attention(*mixed)  # type: ignore[arg-type]
