"""The engine's decode step against the bare model step (`bench.decode_step --engine`).

For each --batch size it runs an LLMEngine on the same model file, dtype and quantization as
bench/decode_step.py: `batch` greedy requests whose contexts cross --context while they decode, and
times every decode step of `LLMEngine.step` (scheduling, metadata, forward, logits, sampling,
output processing). After each of them it times the bare step that decode_step.py measures (the
model forward and the logits, on the engine's own model and active kernel rules, `batch` sequences at
--context). Alternating step by step keeps a shared machine's drift, and a guest's vCPUs moving
between core complexes, out of the ratio; best-of, median and the median of the paired ratios are
printed, and the engine's share over the bare step is what the issue's "within 5 %" reads.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

ROUNDS = 8
MEASURED_STEPS = 32  # decode steps a request runs (each timed, each followed by a timed bare step)


def time_engine_steps(model_dir: Path, a: argparse.Namespace, quantization: str) -> None:
    from bench.decode_step import decode_batch
    from server.engine.config import EngineConfig
    from server.engine.engine import LLMEngine
    from server.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=a.dtype, quantization=quantization,
                                    num_threads=a.threads, enable_prefix_caching=False,
                                    max_num_seqs=max(max(a.batch), 8)))
    model = engine.model
    params = SamplingParams(temperature=0.0, max_tokens=MEASURED_STEPS + 2, ignore_eos=True)
    prompt_len = max(1, a.context - MEASURED_STEPS // 2)
    vocab = engine.vocab_size
    for batch in a.batch:
        ids, positions, kv, meta = decode_batch(model, batch, a.context)

        def bare() -> None:
            # The forward as the runner calls it (model.forward: no nn.Module hook handling), in
            # the step modes held around both loops below.
            model.compute_logits(model.forward(ids, positions, kv, meta))

        eng_times: list[float] = []
        bare_times: list[float] = []
        # The step's thread modes (inference mode, batch-invariant mode, the autotune table) held
        # around the steps, as the engine thread and LLM.generate hold them (LLMEngine.step_modes):
        # neither side's timed steps enter them.
        with engine.step_modes():
            for r in range(ROUNDS):
                for b in range(batch):
                    engine.add_request(f"r{r}-{batch}-{b}", [(7 * r + 13 * b + i) % (vocab - 16) + 16 for i in range(prompt_len)],
                                       params)
                started: set[str] = set()
                while len(started) < batch:  # the prefills, untimed
                    started.update(d.request_id for d in engine.step() if any(x.token_ids for x in d.samples))
                bare()
                while engine.has_unfinished_requests():
                    # One engine step, then one bare step: each pair meets the machine in one state
                    # (a KVM guest's vCPUs move between core complexes minutes apart, and the bare
                    # step's time with them; bench/RESULTS.md sessions 31-34).
                    t0 = time.perf_counter()
                    engine.step()
                    eng_times.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    bare()
                    bare_times.append(time.perf_counter() - t0)
        be, me = min(eng_times), statistics.median(eng_times)
        bb, mb = min(bare_times), statistics.median(bare_times)
        paired = statistics.median(e / b for e, b in zip(eng_times, bare_times))
        print(f"engine batch {batch:3d} ({quantization}): LLMEngine.step best {be * 1e3:7.2f} ms, median "
              f"{me * 1e3:7.2f}; bare step best {bb * 1e3:7.2f}, median {mb * 1e3:7.2f}; engine / bare "
              f"{be / bb:5.3f} (best), {me / mb:5.3f} (median), {paired:5.3f} (paired median)  "
              f"deterministic {engine.deterministic}  load average {os.getloadavg()[0]:.2f}")
