"""Fixtures for the kernel tests: `cpu_isa` runs a test once per CPU kernel family this machine can execute.

PAGEWIRE_CPU_ISA caps the family the C++ ops pick (read on every call), so one machine covers
its own best kernels and every lower one, down to "portable" (the torch / scalar fallbacks).
"""
from __future__ import annotations

import pytest
import torch  # noqa: F401  (loads libc10 before the extension)

import server._C

ORDER = ["portable", "avx2", "avx512", "avx512bf16", "amx"]


def available_isas() -> list[str]:
    """Families usable here, lowest first: always "portable", then up to the detected one."""
    best = server._C.detected_cpu_isa()
    return ORDER[: ORDER.index(best) + 1]


@pytest.fixture(params=ORDER)
def cpu_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Forces the C++ ops onto one kernel family for the test; skips families this CPU lacks."""
    isa = str(request.param)
    if isa not in available_isas():
        pytest.skip(f"this CPU has no {isa} (detected {server._C.detected_cpu_isa()})")
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", isa)
    assert server._C.cpu_isa() == isa
    return isa
