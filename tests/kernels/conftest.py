"""The kernel tests' CPU families: a test that takes `cpu_isa` runs once per kernel family THIS
CPU can execute (`pytest_generate_tests`), never once per family with skips for the missing ones,
so the counts say what ran. Families the CPU lacks are covered by the emulated builds instead
(test_emulated_*.py: the same kernel sources compiled against SIMDe, tests/kernels/emu_build.py),
and the run ends with one line naming both.

PAGEWIRE_CPU_ISA caps the family the C++ ops pick (read on every call), so one machine covers
its own best kernels and every lower one, down to "portable" (the torch / scalar fallbacks).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch  # noqa: F401  (loads libc10 before the extension)

import server._C

ORDER = ["portable", "avx2", "avx512", "avx512bf16", "amx"]


def available_isas() -> list[str]:
    """Families usable here, lowest first: always "portable", then up to the detected one."""
    best = server._C.detected_cpu_isa()
    return ORDER[: ORDER.index(best) + 1]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test needing `cpu_isa` (directly or through a fixture) runs on each family here,
    unless it parametrizes `cpu_isa` itself (indirectly, with the families it wants)."""
    if "cpu_isa" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if "cpu_isa" in ([n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)):
            return
    metafunc.parametrize("cpu_isa", available_isas(), indirect=True)


@pytest.fixture
def cpu_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Forces the C++ ops onto one kernel family (one of `available_isas()`) for the test."""
    isa = str(request.param)
    assert isa in available_isas(), f"{isa} is not a family this CPU has ({available_isas()})"
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", isa)
    assert server._C.cpu_isa() == isa
    return isa


# -- the summary line --------------------------------------------------------------------------------
_ran: dict[str, int] = {}  # family -> tests that passed on it natively
_emulated: dict[str, int] = {}  # family -> emulated-build tests that passed for it


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # The family rides on the report's user_properties (set at collection), so this also counts
    # under pytest-xdist, where the reports reach a controller that collected nothing.
    if report.when != "call" or not report.passed:
        return
    props = dict(report.user_properties)
    item_isa = props.get("cpu_isa")
    if item_isa is not None:
        _ran[str(item_isa)] = _ran.get(str(item_isa), 0) + 1
    family = props.get("emulates")
    if family is not None:
        _emulated[str(family)] = _emulated.get(str(family), 0) + 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        callspec: Any = getattr(item, "callspec", None)
        if callspec is not None and "cpu_isa" in callspec.params:
            item.user_properties.append(("cpu_isa", str(callspec.params["cpu_isa"])))
        module = getattr(item, "module", None)
        family = getattr(module, "EMULATED_FAMILY", None)
        if family is not None:
            item.user_properties.append(("emulates", str(family)))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _ran and not _emulated:
        return
    native = ", ".join(f"{isa} ({_ran.get(isa, 0)} passed)" for isa in available_isas())
    missing = [isa for isa in ORDER if isa not in available_isas()]
    emulated = ", ".join(f"{isa} ({_emulated.get(isa, 0)} passed)" for isa in missing) or "none"
    terminalreporter.write_line(
        f"CPU kernel families: run natively: {native}; covered only by emulated builds: {emulated} "
        f"(detected {server._C.detected_cpu_isa()})")
