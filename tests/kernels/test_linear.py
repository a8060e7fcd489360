"""server.kernels.ops.linear and pagewire::linear against a float64 reference and F.linear's semantics."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from server.kernels import ops
from tests.kernels.conftest import available_isas
from tests.pairwise import pairwise


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


# Every pair of (family, rows, shape, bias) values (tests/pairwise.py), and in full for each family:
# one decode row and 16 (the kernel's largest) and 40 rows (torch's GEMM) on the largest shape and
# on the odd tails (N = 1001, K = 1000; N = 7, K = 8), with a bias.
LINEAR_GRID = [(isa, m, n, k, bias) for isa, m, (n, k), bias in pairwise(
    [available_isas(), [1, 2, 3, 4, 5, 8, 12, 13, 16, 40], [(64, 64), (1001, 96), (24, 1000), (512, 2048), (7, 8)],
     [False, True]],
    edges=[(isa, m, nk, True) for isa in available_isas() for m in (1, 16, 40)
           for nk in ((512, 2048), (1001, 96), (24, 1000), (7, 8))])]


@pytest.mark.parametrize("cpu_isa,M,N,K,with_bias", LINEAR_GRID, indirect=["cpu_isa"])
def test_bf16_matches_float64_reference(cpu_isa: str, M: int, N: int, K: int, with_bias: bool) -> None:
    """Every kernel family this CPU has (and the torch fallback, "portable"), odd N and K tails included."""
    gen = torch.Generator().manual_seed(M * 7 + N + K)
    x = torch.randn((M, K), generator=gen).bfloat16()
    w = (torch.randn((N, K), generator=gen) / K**0.5).bfloat16()
    b = torch.randn((N,), generator=gen).bfloat16() if with_bias else None
    y = ops.linear(x, w, b)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    ref = reference(x, w, b)
    # bf16 output rounding alone is 2**-9 relative; the kernel must be no worse than torch itself.
    assert rel_err(y, ref) <= max(1e-2, 1.5 * rel_err(F.linear(x, w, b), ref))


def test_kernel_op_directly_including_strided_rows(cpu_isa: str) -> None:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn((3, 200), generator=gen).bfloat16()
    x = big[:, 8:136]  # rows 200 apart, 128 contiguous columns
    w = torch.randn((40, 128), generator=gen).bfloat16()
    y = torch.ops.pagewire.linear(x, w, None)
    assert rel_err(y, reference(x, w, None)) <= 1e-2


def test_leading_dims_are_kept() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((2, 3, 64), generator=gen).bfloat16()
    w = torch.randn((32, 64), generator=gen).bfloat16()
    b = torch.randn((32,), generator=gen).bfloat16()
    y = ops.linear(x, w, b)
    assert y.shape == (2, 3, 32)
    assert rel_err(y, reference(x, w, b)) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes_equal_f_linear(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn((3, 64), generator=gen).to(dtype)
    w = torch.randn((16, 64), generator=gen).to(dtype)
    b = torch.randn((16,), generator=gen).to(dtype)
    assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))
    if dtype == torch.float32 and ops.cpu_isa() != "portable":
        # The op's fp32 kernel (deterministic mode's path): fp32 rounding of the exact result.
        exact = x.double() @ w.double().T + b.double()
        assert torch.allclose(torch.ops.pagewire.linear(x, w, b).double(), exact, rtol=1e-5, atol=1e-4)
    else:
        assert torch.equal(torch.ops.pagewire.linear(x, w, b), F.linear(x, w, b))


def test_autograd_still_works() -> None:
    """Inputs that need gradients take F.linear, so training-style use keeps working."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn((8, 32), generator=gen).bfloat16().requires_grad_()
    x = torch.randn((2, 32), generator=gen).bfloat16()
    ops.linear(x, w).float().sum().backward()
    assert w.grad is not None and torch.equal(w.grad, x.sum(0, keepdim=True).expand(8, 32).to(w.grad.dtype))


def test_bad_arguments_name_the_argument() -> None:
    x = torch.randn(2, 32).bfloat16()
    with pytest.raises(RuntimeError, match="K = weight.size"):
        torch.ops.pagewire.linear(x, torch.randn(8, 16).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.pagewire.linear(x, torch.randn(8, 32).bfloat16(), torch.randn(9).bfloat16())
    with pytest.raises(RuntimeError, match="weight dtype"):
        torch.ops.pagewire.linear(x, torch.randn(8, 32), None)


def test_opcheck_linear() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn((3, 64), generator=gen).bfloat16()
    w = torch.randn((16, 64), generator=gen).bfloat16()
    b = torch.randn((16,), generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.pagewire.linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.pagewire.linear.default, (x, w, None))


def test_cpu_dispatch_is_reported() -> None:
    """The detected family follows from the CPUID flags, and the env cap only ever lowers it."""
    f = ops.cpu_features()
    best = server_C_detected()
    if not (f["avx2"] and f["fma"] and f["f16c"]):
        assert best == "portable"
    elif not (f["avx512f"] and f["avx512bw"] and f["avx512vl"] and f["avx512vnni"]):
        assert best == "avx2"
    elif not f["avx512bf16"]:
        assert best == "avx512"
    elif not (f["amx_tile"] and f["amx_bf16"] and f["amx_int8"]):
        assert best == "avx512bf16"
    else:
        assert best == "amx"
    # The tile state counts only once the OS granted it to this process (arch_prctl on Linux).
    assert f["os_amx"] or not (f["amx_tile"] or f["amx_bf16"] or f["amx_int8"])
    # The display family (Zen 4's Q6_K prefetch keys on it) is the kernel's own reading of CPUID.
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        families = {int(line.split(":")[1]) for line in cpuinfo.read_text().splitlines() if line.startswith("cpu family")}
        if families:
            assert f["family"] in families, (f["family"], families)


def server_C_detected() -> str:
    import server._C

    return str(server._C.detected_cpu_isa())


def test_isa_cap_cannot_raise_the_family(monkeypatch: pytest.MonkeyPatch) -> None:
    best = server_C_detected()
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", "amx")
    assert ops.cpu_isa() == best
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", "portable")
    assert ops.cpu_isa() == "portable"
