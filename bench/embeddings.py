"""Embeddings per second (`LLM.embed`, `--task embed`) against a same-run baseline: `generate` with
max_tokens=1 on the same prompts (prefill plus one sampled token), on one model, interleaved
rounds. An embedding request is prefill-only, so the two should cost the same: a ratio well
below 1 would mean the pooling path (float32 hidden states, the pooled vector in the final delta)
costs more than sampling one token.

    .venv/bin/python -m bench.embeddings                 # the demo model, 64 prompts of 64 tokens
    .venv/bin/python -m bench.embeddings --model PATH --prompts 128 --tokens 256
"""
from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    print(f"command: {shlex.join(sys.orig_argv)}")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="a Hugging Face folder, or 'demo' (the random demo model)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64, help="tokens per prompt")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()

    from server import LLM, SamplingParams

    model = a.model
    if model == "demo":
        from server.models.demo_model import ensure_demo_model

        model = str(ensure_demo_model(Path(tempfile.gettempdir()) / "pagewire-bench-cache"))
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 500) for _ in range(a.tokens)] for _ in range(a.prompts)]
    kw = dict(num_threads=a.threads, enable_prefix_caching=False, max_model_len=a.tokens + 64,
              kv_cache_tokens=max(16384, 2 * a.tokens * a.prompts), max_num_batched_tokens=256)
    emb = LLM(model, task="embed", **kw)
    gen = LLM(model, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    emb.embed(prompts[:4])  # warm-up
    gen.generate(prompts[:4], sp)
    e_rates, g_rates = [], []
    for rnd in range(a.rounds):
        t = time.perf_counter()
        emb.embed(prompts)
        te = time.perf_counter() - t
        t = time.perf_counter()
        gen.generate(prompts, sp)
        tg = time.perf_counter() - t
        e_rates.append(a.prompts / te)
        g_rates.append(a.prompts / tg)
        print(f"round {rnd}: embed {e_rates[-1]:.1f} inputs/s; generate max_tokens=1 {g_rates[-1]:.1f} req/s")
    e, g = statistics.median(e_rates), statistics.median(g_rates)
    print(f"median: embed {e:.1f} inputs/s, generate(max_tokens=1) {g:.1f} req/s, ratio {e / g:.2f}")


if __name__ == "__main__":
    main()
