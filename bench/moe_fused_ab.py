"""A/B of a mixture-of-experts GGUF file's single-sequence decode step in one process: the sparse
layers fused (decode_layer's attention half + pagewire::moe_decode) against the path before it (the
Python layer, the router's torch ops and pagewire::moe_experts), on the same loaded model
(`--quantization gguf`, bf16 activations), alternating one step of each, so a shared host's load
falls on both alike.

A step is one token of one sequence with --context tokens cached (bench.decode_step.decode_batch):
forward + the lm_head's logits; each mode's best (and median) of --steps samples is reported, the
best being the least disturbed by other processes. MBU = the file's bytes per decode token
(bench.moe_gguf.decode_bytes_per_token: the top-k experts' share, one embedding row, the lm_head,
the rest whole; the KV cache left out) / best step time / the read bandwidth bench/bandwidth.py
measures at the start. RSS after load is printed beside the file size plus the KV pool.

    PYTHONPATH=$PWD .venv/bin/python -m bench.moe_fused_ab /tmp/moebench/qwen3moe-2.5b/qwen3moe-2.5b-Q8_0.gguf
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from bench.bandwidth import measure
from bench.decode_step import decode_batch
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
    ap.add_argument("--steps", type=int, default=40, help="timed steps per mode, alternating")
    ap.add_argument("--context", type=int, default=96, help="tokens cached before the step")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from server import LLM
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
    ids, positions, kv_caches, meta = decode_batch(model, 1, args.context)

    def step() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.compute_logits(model.forward(ids, positions, kv_caches, meta))
            return time.perf_counter() - t0

    def set_fused(on: bool) -> None:
        model.fused_decode = on
        for m in moes:
            m.fused_decode = on

    modes = (("before (Python layer, route + moe_experts)", False), ("fused (moe_decode)", True))
    times: dict[bool, list[float]] = {False: [], True: []}
    for on in (True, False):  # warm both paths
        set_fused(on)
        step()
    for _ in range(args.steps):
        for _, on in modes:
            set_fused(on)
            times[on].append(step())
    for name, on in modes:
        best = min(times[on])
        print(f"{name}: best {best * 1e3:.2f} ms ({1 / best:.2f} tok/s), median {statistics.median(times[on]) * 1e3:.2f} ms; "
              f"MBU {per_token / best / 1e9 / bw.best_gbs * 100:.0f} % ({per_token / 1e6:.1f} MB per token)")
    print(f"fused / before, best steps: {min(times[False]) / min(times[True]):.2f}x; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)

if __name__ == "__main__":
    main()
