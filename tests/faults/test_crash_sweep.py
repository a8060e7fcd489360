"""Issue 29's crash-point sweep, a few rounds of each fault (bench/crash_sweep.py runs hundreds):
a mixed workload killed at a random moment, restarted on the same ledger, and the ledger's
invariants checked after every restart (see tests/faults/crash_sweep.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.crash_sweep import Sweep, ledger_folder, run_rounds

# The sweep reads and fills the SQLite file itself (its diskfull mode, its invariants' SQL);
# tests/scaleout/test_faults_pg.py kills PostgreSQL replicas.
pytestmark = pytest.mark.sqlite_only

# CI runs a handful; PAGEWIRE_SWEEP_ROUNDS asks for more.
ROUNDS = {"sigkill": int(os.environ.get("PAGEWIRE_SWEEP_ROUNDS", "6")), "sigterm": 2, "diskfull": 2}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sigkill", "sigterm", "diskfull"])
def test_crash_sweep(demo_model: Path, tmp_path: Path, mode: str) -> None:
    sweep = Sweep(demo_model, tmp_path, mode, seed=29)
    with ledger_folder(sweep) as folder:
        run_rounds(sweep, ROUNDS[mode], folder)
    assert sweep.violations == [], "\n".join(sweep.violations)
    assert sweep.rounds_done == ROUNDS[mode]
    assert len(sweep.acked) >= ROUNDS[mode]  # the kills landed among acknowledged requests
    if mode == "sigterm":
        assert max(sweep.exit_s) < 3.0 + 10.0, sweep.exit_s  # the grace (3 s), and a margin for a loaded box
