"""A/B of a mixture-of-experts GGUF file's single-sequence decode in one process: the sparse layers
fused (decode_layer's attention half + pagewire::moe_decode) against the path before it (the Python
layer, the router's torch ops and pagewire::moe_experts), on the same loaded model, alternating
rounds so a shared host's load falls on both alike.

Decode tok/s = (N - 1) / (T(N tokens) - T(1 token)) for one 32-token prompt (best of --repeats each);
MBU = the file's bytes per decode token (bench.moe_gguf.decode_bytes_per_token: the top-k experts'
share, one embedding row, the lm_head, the rest whole; the KV cache is left out) x tok/s / the read
bandwidth bench/bandwidth.py measures at the start. RSS after load is printed beside the file size
plus the KV pool.

    PYTHONPATH=$PWD .venv/bin/python -m bench.moe_fused_ab /tmp/moebench/qwen3moe-2.5b/qwen3moe-2.5b-Q8_0.gguf
"""
from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch

from bench.bandwidth import measure
from bench.moe_gguf import decode_bytes_per_token


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per timed run")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per measurement (best kept)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from server import LLM, SamplingParams
    from server.models.moe import SparseMoE

    bw = measure(threads=args.threads)
    print(f"read bandwidth: {bw.line()}", flush=True)
    llm = LLM(str(args.model), dtype="bfloat16", quantization="gguf", max_model_len=512, kv_cache_tokens=1024)
    rss = _rss_mib()
    kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
             for k, v in {(id(k), id(v)): (k, v) for k, v in llm.engine.runner.kv_caches}.values()) / 2**20
    size = os.path.getsize(args.model) / 2**20
    print(f"RSS after load {rss:.0f} MiB; file {size:.0f} MiB + KV pool {kv:.0f} MiB = {size + kv:.0f} MiB "
          f"(ratio {rss / (size + kv):.2f})", flush=True)
    model = llm.engine.model
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    per_token = decode_bytes_per_token(args.model).total
    prompt = [random.Random(0).randrange(100, 1000) for _ in range(32)]

    def sp(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def rate() -> float:
        best = {1: float("inf"), args.tokens: float("inf")}
        for _ in range(args.repeats):
            for n in best:
                t0 = time.perf_counter()
                llm.generate([prompt], sp(n))
                best[n] = min(best[n], time.perf_counter() - t0)
        return (args.tokens - 1) / (best[args.tokens] - best[1])

    def set_fused(on: bool) -> None:
        model.fused_decode = on
        for m in moes:
            m.fused_decode = on

    for on in (True, False):  # warm both paths
        set_fused(on)
        llm.generate([prompt], sp(4))
    for r in range(args.rounds):
        for name, on in (("before (Python layer, route + moe_experts)", False), ("fused (moe_decode)", True)):
            set_fused(on)
            tok_s = rate()
            print(f"round {r + 1} {name}: {tok_s:.2f} tok/s, MBU {per_token * tok_s / 1e9 / bw.best_gbs * 100:.0f} % "
                  f"({per_token / 1e6:.1f} MB per token), load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
