"""Memory read bandwidth of this machine, measured the way decode reads weights (for MBU figures).

A single best-of figure read 23-38 GB/s between runs on one machine (issue 31), so an MBU computed
from it could exceed what it means. `measure()` therefore:
  * reads a float32 buffer at least 4x this CPU's last-level cache (`buffer_mib`; torch's sum,
    vectorised) with every core (intra-op threads = the CPU count, as decode runs), restoring the
    thread count afterwards. A buffer that fits the cache measures the cache: on an AMX Xeon whose
    guest sees a 480 MiB L3, the old fixed 128 MiB read 37-49 GB/s where 1-2 GiB reads 28.8-29.5
    with every pass within 1-4 % (bench/RESULTS.md, session 20), so every MBU computed from it was
    a third too low;
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

import server._C


@dataclass(frozen=True)
class Bandwidth:
    """GB/s (1e9 bytes/s) of reading the buffer once."""

    threads: int
    best_gbs: float  # the best read over every pass
    median_gbs: float  # the median of the passes' best reads
    worst_gbs: float  # the worst pass's best read
    passes: tuple[float, ...]
    # The threads' cores: an empty handoff to every other thread and back, in ns (server._C
    # core_handoff_ns; -1: one thread). On a KVM guest the vCPUs move between core complexes, and
    # this figure with them: about 150-240 ns within one, 580-1,040 across two on the Zen 4 guest,
    # where the far placement also read 1.5x the bandwidth (bench/RESULTS.md, session 33).
    handoff_ns: int = -1

    @property
    def placement(self) -> str:
        """"close" (one core complex), "far" (the crew's 400 ns line) or "one thread"."""
        return "one thread" if self.handoff_ns < 0 else ("close" if self.handoff_ns < 400 else "far")

    @property
    def spread(self) -> float:
        """Worst pass best / best pass best (1.0: every pass agreed)."""
        return self.worst_gbs / self.best_gbs

    def line(self) -> str:
        return (f"{self.best_gbs:.1f} GB/s best with {self.threads} thread(s) (median of {len(self.passes)} passes "
                f"{self.median_gbs:.1f}, worst pass {self.worst_gbs:.1f}: spread {self.spread:.2f}; passes "
                f"{' '.join(f'{p:.1f}' for p in self.passes)}); cores {self.placement}"
                + (f" (handoff {self.handoff_ns} ns)" if self.handoff_ns >= 0 else ""))


MIN_BUFFER_MIB = 128
READS_PER_PASS_MIB = 128 * 20  # a pass reads about this much: 20 reads of the smallest buffer


def last_level_cache_mib() -> int:
    """The largest CPU cache the OS reports (MiB; 32 if it reports none)."""
    sizes = [0]
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = [e for e in os.listdir(base) if e.startswith("index")]
    except OSError:
        entries = []
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip().upper()
            scale = {"K": 1 / 1024, "M": 1, "G": 1024}.get(text[-1:], 1 / 2**20)
            sizes.append(int(float(text.rstrip("KMG")) * scale))
        except (OSError, ValueError):
            continue
    return max(sizes) or 32


def buffer_mib() -> int:
    """The buffer to read: 4x the last-level cache, at least MIN_BUFFER_MIB, at most an eighth of RAM."""
    ram_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    return max(MIN_BUFFER_MIB, min(4 * last_level_cache_mib(), ram_mib // 8))


def measure(size_mib: int | None = None, passes: int = 5, repeat: int | None = None, threads: int = 0,
            pause_s: float = 0.05) -> Bandwidth:
    """Read bandwidth in `passes` passes of best-of-`repeat` reads of `size_mib` MiB (default
    buffer_mib()), with `threads` intra-op threads (0: one per CPU). `repeat` defaults to as many
    reads as keep a pass near READS_PER_PASS_MIB (at least 3): a big buffer is its own average."""
    size_mib = size_mib or buffer_mib()
    repeat = repeat or max(3, READS_PER_PASS_MIB // size_mib)
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
        handoff = int(server._C.core_handoff_ns(n)) if n > 1 else -1
    finally:
        torch.set_num_threads(before)
    return Bandwidth(n, max(bests), statistics.median(bests), min(bests), tuple(bests), handoff)


def read_bandwidth_gbs(size_mib: int | None = None, repeat: int | None = None) -> float:
    """The best read bandwidth (GB/s) over several passes with every core: what MBU divides by."""
    return measure(size_mib, repeat=repeat).best_gbs


def main() -> None:
    print(f"command: {shlex.join(sys.orig_argv)}")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--repeat", type=int, default=None, help="reads per pass (its best counts; default: by size)")
    p.add_argument("--size-mib", type=int, default=None, help="buffer size (default: 4x the last-level cache)")
    a = p.parse_args()
    every = measure(a.size_mib, a.passes, a.repeat)
    one = measure(a.size_mib, a.passes, a.repeat, threads=1)
    print(f"buffer {a.size_mib or buffer_mib()} MiB (last-level cache {last_level_cache_mib()} MiB)")
    print(f"read bandwidth, all cores: {every.line()}")
    print(f"read bandwidth, one core:  {one.line()}")
    print(f"load average {os.getloadavg()[0]:.2f} (a loaded host lowers the median and widens the spread; "
          f"the best is the figure MBU uses)")


if __name__ == "__main__":
    main()
