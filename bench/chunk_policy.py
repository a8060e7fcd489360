"""The ITL target's chunk policy in the offline engine: a closed-loop serving workload, step by step.

Runs `--num-requests` requests of `--input-len` random tokens and `--output-len` greedy tokens
(ignore_eos) through one LLMEngine per `--itl-target-ms` value, keeping `--concurrency` in flight
(a new request enters when one finishes, as bench/serving.py's clients do), for each
`--itl-target-factor` too (a step may also take that many times its decodes' own step), in
`--rounds` interleaved rounds (the host's drift falls on every setting alike), and reads every step's
decode rows, prefill tokens and wall time from the engine's StepBudget (server/engine/step_budget.py).
It prints, per target (0: off, the whole token budget every step, the baseline of the same run):
TTFT and ITL percentiles and output tok/s from the engine's own step times, and what the policy
chose beside decodes (prefill tokens per mixed step, and their step times). No HTTP: this isolates
the policy from the server, so a change to the fit shows here before it shows in serving.

Example (issue 31's serving workload, the default model):
    PYTHONPATH=. .venv/bin/python -m bench.chunk_policy --itl-target-ms 0 50 --threads 2
    PYTHONPATH=. .venv/bin/python -m bench.chunk_policy --itl-target-ms 50 --itl-target-factor 0 2 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import percentile  # noqa: E402  (bench/serving.py)


def run(model: str, quantization: str, target_ms: float, factor: float, a: argparse.Namespace) -> None:
    from server.engine.config import EngineConfig
    from server.engine.engine import LLMEngine
    from server.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, quantization=quantization, num_threads=a.threads,
                                    enable_prefix_caching=False, itl_target_ms=target_ms or None,
                                    itl_target_factor=factor,
                                    max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=max(16, a.concurrency)))
    vocab = engine.vocab_size
    rng = random.Random(a.seed)
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    sent_at: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    mixed: list[tuple[int, float]] = []  # (prefill tokens, seconds) of steps with decodes in them
    sent = 0

    def send() -> None:
        nonlocal sent
        rid = f"r{sent}"
        sent += 1
        engine.add_request(rid, [rng.randrange(16, vocab) for _ in range(a.input_len)], params)
        sent_at[rid] = time.perf_counter()

    for _ in range(a.concurrency):
        send()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        deltas = engine.step()
        now = time.perf_counter()
        rows = engine._step_rows  # (decode rows, prefill tokens) of the step that just ran (any target)
        if rows[0] and rows[1]:
            mixed.append((rows[1], now - t0))
        for d in deltas:
            if any(s.token_ids for s in d.samples):
                if d.request_id not in first:
                    first[d.request_id] = now - sent_at[d.request_id]
                else:
                    gaps.append(now - last[d.request_id])
                last[d.request_id] = now
            if d.finished and sent < a.num_requests:
                send()
    wall = time.perf_counter() - start
    ttft = sorted(first.values())
    gaps.sort()
    p_mixed = [p for p, _ in mixed]
    t_mixed = [t for _, t in mixed]
    label = (f"target {target_ms:g} ms" + (f" or {factor:g}x" if factor else "")) if target_ms else "target off"
    print(f"{label:>16}: output tok/s {a.num_requests * a.output_len / wall:6.1f}; TTFT p50 {percentile(ttft, 50) * 1e3:7.0f}"
          f" p99 {percentile(ttft, 99) * 1e3:7.0f} ms; ITL p50 {percentile(gaps, 50) * 1e3:6.1f} p99"
          f" {percentile(gaps, 99) * 1e3:6.1f} max {gaps[-1] * 1e3:6.1f} ms; beside decodes: {len(mixed)} steps,"
          f" prefill tokens median {statistics.median(p_mixed) if p_mixed else 0:g}"
          f" (min {min(p_mixed, default=0)}, max {max(p_mixed, default=0)}),"
          f" step median {statistics.median(t_mixed) * 1e3 if t_mixed else 0:.1f} ms", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a model folder or .gguf file; default: SmolLM2-135M-Instruct")
    p.add_argument("--quantization", default=None, help="default: gguf for a .gguf file, else none")
    p.add_argument("--itl-target-ms", type=float, nargs="+", default=[0.0, 50.0], help="0: off (the baseline)")
    p.add_argument("--itl-target-factor", type=float, nargs="+", default=[0.0],
                   help="each target also with each of these factors (0: the fixed target alone)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the settings")
    p.add_argument("--max-num-batched-tokens", type=int, default=128, help="pagewire serve's default")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=31)
    a = p.parse_args(argv)
    print("# " + shlex.join([sys.executable, "-m", "bench.chunk_policy", *(argv if argv is not None else sys.argv[1:])]))
    from bench.model_arg import resolve_model

    model = resolve_model(a.model)
    quantization = a.quantization or ("gguf" if model.endswith(".gguf") else "none")
    print(f"# model {model}, quantization {quantization}, threads {a.threads}, load average {os.getloadavg()[0]:.2f}")
    for _ in range(a.rounds):
        for target in a.itl_target_ms:
            for factor in (a.itl_target_factor if target else [0.0]):
                run(model, quantization, target, factor, a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
