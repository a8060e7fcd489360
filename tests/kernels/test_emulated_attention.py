"""The AVX-512 paged-attention kernel (csrc/cpu/attention_avx512.cpp: fp32 / fp16 on FMA, bf16 on
AVX512-BF16 dot products), run through emulated intrinsics.

On a CPU without AVX512-BF16 the extension never picks this kernel, so test_paged_attention.py skips
its family; here the same file is built against SIMDe (tests/kernels/emu_build.py) and checked against
the float64 reference of paged_reference.py: mixed prefill/decode batches, GQA, sliding windows,
logit soft-capping and a per-layer scale, query tiles of several sizes.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from tests.kernels import emu_build
from tests.kernels.paged_reference import (
    TOLERANCE,
    PagedBatch,
    make_paged_batch,
    reference_paged_attention,
    relative_error,
    release_out_of_window,
)

ELEM = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu::ElemType
MIXED = [(0, 1), (15, 1), (16, 1), (31, 1), (0, 17), (13, 20), (40, 3), (70, 9)]


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return emu_build.build("attention", ["attention_avx512.cpp"])


def run(lib: ctypes.CDLL, b: PagedBatch, scale: float, softcap: float, window: int, tile: int) -> torch.Tensor:
    out = torch.full_like(b.query, float("nan"))
    T, H, D = b.query.shape
    tables = b.block_tables.contiguous()
    p = ctypes.c_void_p
    i32 = ctypes.POINTER(ctypes.c_int32)
    lib.pw_paged_attention_avx512(
        ctypes.c_int(ELEM[b.query.dtype]), p(out.data_ptr()), p(b.query.data_ptr()), p(b.key_cache.data_ptr()),
        p(b.value_cache.data_ptr()), ctypes.cast(tables.data_ptr(), i32), ctypes.c_int64(tables.stride(0)),
        ctypes.cast(b.seq_lens.data_ptr(), i32), ctypes.cast(b.query_start_loc.data_ptr(), i32),
        ctypes.c_int(b.seq_lens.numel()), ctypes.c_int(H), ctypes.c_int(b.key_cache.shape[1]), ctypes.c_int(D),
        ctypes.c_int(b.key_cache.shape[2]), ctypes.c_float(scale), ctypes.c_float(softcap), ctypes.c_int(window),
        ctypes.c_int(tile))
    return out


@pytest.mark.parametrize("dtype", list(ELEM), ids=str)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("softcap,window", [(0.0, 0), (0.0, 17), (3.0, 0), (0.5, 21), (50.0, 5)])
def test_avx512_attention_matches_float64_reference(lib: ctypes.CDLL, dtype: torch.dtype, head_dim: int,
                                                    softcap: float, window: int) -> None:
    gen = torch.Generator().manual_seed(head_dim + window + int(softcap * 10))
    b = make_paged_batch(MIXED, 8, 2, head_dim, dtype, gen)
    scale = 256**-0.5 * 4  # a per-layer scale (Gemma's query_pre_attn_scalar), not head_dim ** -0.5
    ref = reference_paged_attention(b, scale, window, softcap)
    for tile in (1, 8):  # decode-sized and prefill-sized query tiles
        err = relative_error(run(lib, b, scale, softcap, window, tile), ref)
        assert err <= TOLERANCE[dtype], f"tile {tile}: relative error {err:.3g} > {TOLERANCE[dtype]}"


def test_avx512_attention_softcap_changes_the_result(lib: ctypes.CDLL) -> None:
    """The capped and uncapped kernels differ where the references do (the cap is really applied)."""
    gen = torch.Generator().manual_seed(3)
    b = make_paged_batch(MIXED, 4, 4, 64, torch.float32, gen)
    plain, capped = run(lib, b, 0.25, 0.0, 0, 8), run(lib, b, 0.25, 1.0, 0, 8)
    assert relative_error(plain, capped) > 100 * TOLERANCE[torch.float32]
    assert relative_error(capped, reference_paged_attention(b, 0.25, 0, 1.0)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", list(ELEM), ids=str)
def test_avx512_attention_reads_no_released_block(lib: ctypes.CDLL, dtype: torch.dtype) -> None:
    """Table entries before the window are -1 (a sliding-window KV group's released blocks)."""
    gen = torch.Generator().manual_seed(21)
    b = make_paged_batch([(60, 1), (70, 12), (150, 1), (200, 40)], 8, 2, 64, dtype, gen)
    ref = reference_paged_attention(b, 0.125, 40, 5.0)
    released = release_out_of_window(b, 40)
    for tile in (1, 8):
        assert relative_error(run(lib, released, 0.125, 5.0, 40, tile), ref) <= TOLERANCE[dtype]
