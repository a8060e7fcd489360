"""Memory read bandwidth of this machine, measured the way decode reads weights (for MBU figures).

`read_bandwidth_gbs()` sums a float32 buffer 4x the 32 MiB last-level cache with torch's
intra-op threads (the same threads the kernels use) and reports the best of several passes in GB/s.
Run alone: .venv/bin/python -m bench.bandwidth
"""
from __future__ import annotations

import shlex
import sys
import time

import torch


def read_bandwidth_gbs(size_mib: int = 128, repeat: int = 40) -> float:
    """Best-of-`repeat` GB/s (1e9 bytes/s) of reading `size_mib` MiB once."""
    buf = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def main() -> None:
    print(f"command: {shlex.join(sys.orig_argv)}")
    import os

    print(f"read bandwidth: {read_bandwidth_gbs():.1f} GB/s  (threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
