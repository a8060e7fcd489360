"""Memory read bandwidth of this machine, measured the way decode reads weights (for MBU figures).

A single best-of figure read 23-38 GB/s between runs on one machine (issue 31), so an MBU computed
from it could exceed what it means. `measure()` therefore:
  * reads a float32 buffer 4x the 32 MiB last-level cache (torch's sum, vectorised) with every core
    (intra-op threads = the CPU count, as decode runs), restoring the thread count afterwards;
  * repeats it in several passes, each the best of `repeat` reads, with a short pause between
    passes so a burst of other work on a shared host spoils at most a pass;
  * reports the best read of all passes (`best_gbs`: what the memory can deliver, the figure MBU
    divides by), the median of the passes' bests, and the spread (worst pass best / best pass best),
    so a reader sees how far one figure can be trusted; and the same for one core.
`read_bandwidth_gbs()` returns `measure().best_gbs` for the benchmarks that print an MBU.
Run alone: .venv/bin/python -m bench.bandwidth [--passes 5] [--repeat 20]
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bandwidth:
    """GB/s (1e9 bytes/s) of reading the buffer once."""

    threads: int
    best_gbs: float  # the best read over every pass
    median_gbs: float  # the median of the passes' best reads
    worst_gbs: float  # the worst pass's best read
    passes: tuple[float, ...]

    @property
    def spread(self) -> float:
        """Worst pass best / best pass best (1.0: every pass agreed)."""
        return self.worst_gbs / self.best_gbs

    def line(self) -> str:
        return (f"{self.best_gbs:.1f} GB/s best with {self.threads} thread(s) (median of {len(self.passes)} passes "
                f"{self.median_gbs:.1f}, worst pass {self.worst_gbs:.1f}: spread {self.spread:.2f}; passes "
                f"{' '.join(f'{p:.1f}' for p in self.passes)})")


def measure(size_mib: int = 128, passes: int = 5, repeat: int = 20, threads: int = 0,
            pause_s: float = 0.05) -> Bandwidth:
    """Read bandwidth in `passes` passes of best-of-`repeat` reads of `size_mib` MiB, with
    `threads` intra-op threads (0: one per CPU)."""
    n = threads if threads > 0 else (os.cpu_count() or 1)
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        buf = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32)
        buf.sum()  # fault the pages in
        nbytes = buf.numel() * 4
        bests: list[float] = []
        for i in range(passes):
            if i:
                time.sleep(pause_s)
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                buf.sum()
                best = min(best, time.perf_counter() - t0)
            bests.append(nbytes / best / 1e9)
    finally:
        torch.set_num_threads(before)
    return Bandwidth(n, max(bests), statistics.median(bests), min(bests), tuple(bests))


def read_bandwidth_gbs(size_mib: int = 128, repeat: int = 20) -> float:
    """The best read bandwidth (GB/s) over several passes with every core: what MBU divides by."""
    return measure(size_mib, repeat=repeat).best_gbs


def main() -> None:
    print(f"command: {shlex.join(sys.orig_argv)}")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--repeat", type=int, default=20, help="reads per pass (its best counts)")
    p.add_argument("--size-mib", type=int, default=128)
    a = p.parse_args()
    every = measure(a.size_mib, a.passes, a.repeat)
    one = measure(a.size_mib, a.passes, a.repeat, threads=1)
    print(f"read bandwidth, all cores: {every.line()}")
    print(f"read bandwidth, one core:  {one.line()}")
    print(f"load average {os.getloadavg()[0]:.2f} (a loaded host lowers the median and widens the spread; "
          f"the best is the figure MBU uses)")


if __name__ == "__main__":
    main()
