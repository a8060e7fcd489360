"""The crash-point sweep at length (issue 29): N rounds of a mixed workload, a fault at a random
moment (SIGKILL, SIGTERM, or the disk filling under the ledger), a restart on the same ledger,
and the ledger's invariants after each restart. The workload and the invariants are in
tests/faults/crash_sweep.py (tests/faults/test_crash_sweep.py runs a few rounds in CI).

    .venv/bin/python bench/crash_sweep.py --mode sigkill --rounds 100
    .venv/bin/python bench/crash_sweep.py --mode diskfull --rounds 30   # root: mounts a tmpfs
    .venv/bin/python bench/crash_sweep.py --mode sigterm --rounds 30
"""
from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from server.models.demo_model import ensure_demo_model  # noqa: E402
from tests.faults.crash_sweep import Sweep, ledger_folder, run_rounds  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("sigkill", "sigterm", "diskfull"), default="sigkill")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=None, help="start no round after this long")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix=f"pagewire-sweep-{a.mode}-"))
    model = ensure_demo_model(work / "cache")
    sweep = Sweep(model, work, a.mode, seed=a.seed)
    t0 = time.monotonic()
    with ledger_folder(sweep) as folder:
        until = t0 + a.minutes * 60 if a.minutes else None
        run_rounds(sweep, a.rounds, folder, until=until, progress=True)
    done = sum(s.usage is not None for s in sweep.acked.values())
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC crash sweep, mode {a.mode}, seed {a.seed}")
    print(f"rounds {sweep.rounds_done} of {a.rounds} asked, {time.monotonic() - t0:.0f}s; "
          f"acknowledged requests {len(sweep.acked)} "
          f"({done} with a done received), idempotent retries {len(sweep.retries)}, batches {len(sweep.batches)}; "
          f"violations {len(sweep.violations)}")
    if sweep.exit_s:
        print(f"SIGTERM exit: max {max(sweep.exit_s):.2f}s, mean {sum(sweep.exit_s) / len(sweep.exit_s):.2f}s")
    for v in sweep.violations:
        print("VIOLATION", v)
    print(f"(work folder {work})")
    return 1 if sweep.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
