"""One decode step of a random-weight model, split into its GEMM time and everything else.

For batch sizes B (default 1 and 8), each sequence holding --context cached tokens, it times a full
decode step (forward + lm_head logits; best of --repeats; every layer in one DecodeStack call where
the model's layers allow it), the same step with one pagewire::decode_layer call per layer ("a call
per layer"), and with every decoder layer run op by op from Python ("Python layers"), then the
step's parts separately (through the Python layers, which is where they can be told apart):
  * GEMMs alone: exactly the step's linear calls (same weights, shapes and order, recorded from
    one step) replayed back to back;
  * non-GEMM alone: the same step with every linear call answered instantly by the output it
    recorded, leaving norms, RoPE, attention, KV writes, activations and all per-op overhead.
Each part is short, so its best-of time is far less disturbed by other processes on a shared
machine than the full step's; the non-GEMM share is non-GEMM / (GEMMs + non-GEMM).
It also prints tokens/s, weight bytes read per step and MBU = (weight + KV bytes read per step) /
step time / read bandwidth (bench/bandwidth.py, measured in the same run).

--quantization takes several values: each is loaded and timed in turn in the same run, and the
batch-1 step of each is compared with the first one's ("x first"), e.g. bf16 vs int8 vs 4-bit.
On a random --shape, 4-bit is int4 (Q4_0 quantised at load); on a GGUF --model it is gguf (the
file's own Q4_0/Q4_1/Q4_K/Q8_0 blocks kept; "none" is the file dequantised to --dtype).

Examples:
    .venv/bin/python -m bench.decode_step --shape llama-246m --batch 1 8 --quantization none int8 int4
    .venv/bin/python -m bench.decode_step --model default --batch 1 --quantization none int8 gguf
    .venv/bin/python -m bench.decode_step --model default --batch 1 8 --quantization gguf --engine
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import server.models.decoder as llama_mod
import server.models.decoder_layer as layer_mod
from bench.bandwidth import read_bandwidth_gbs
from bench.shapes import SHAPES, is_built, make_random_model, model_dir_for
from server import hugepages
from server.kernels import ops
from server.models.attention import AttentionMetadata
from server.models.default_model import find_default_model
from server.models.loader import load_model


def best_and_median(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def set_linear(fn: Callable[..., torch.Tensor]) -> None:
    """Route the model's `linear` calls through fn: the layers' (server.models.decoder_layer) and the
    model's own (server.models.decoder: lm_head, per-layer inputs)."""
    llama_mod.linear = fn  # type: ignore[assignment]
    layer_mod.linear = fn  # type: ignore[assignment]


def decode_batch(model: Any, batch: int, context: int, block_size: int = 16) -> tuple[Any, ...]:
    """Inputs of one decode step: `batch` sequences, each with `context` tokens already cached."""
    blocks_per_seq = context // block_size + 1
    c = model.config
    # Each layer's own K/V shape (Gemma 4's global layers differ); a layer that reads another
    # layer's KV gets that layer's tensors.
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(c.num_layers):
        if c.kv_source(i) != i:
            kv.append(kv[c.kv_source(i)])
            continue
        shape = (batch * blocks_per_seq, c.kv_heads_of(i), block_size, c.head_dim_of(i))
        kv.append((torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)))
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    pos = context  # the new token's position
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([int(tables[s, pos // block_size]) * block_size + pos % block_size
                                   for s in range(batch)], dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=context + 1,
    )
    ids = torch.randint(16, model.config.vocab_size, (batch,))
    positions = torch.full((batch,), pos, dtype=torch.int64)
    return ids, positions, kv, meta


def weight_bytes(w: Any) -> int:
    return int(w.nbytes) if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()


def main() -> None:
    print(f"command: {shlex.join(sys.orig_argv)}")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-246m", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default=None,
                   help="a Hugging Face folder or .gguf file instead of --shape ('default': the default model)")
    p.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8", "int4", "gguf"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=96)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    p.add_argument("--engine", action="store_true",
                   help="also time the engine's own decode steps (LLMEngine.step, same model and batch, "
                        "contexts around --context) and print engine step / this step: the engine's per-step overhead")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)

    if a.model is None:
        model_dir: Path = model_dir_for(a.shape, a.dtype)
        if not is_built(model_dir, a.shape, a.dtype):
            make_random_model(a.shape, model_dir, a.dtype)
    elif a.model == "default":
        found = find_default_model()
        if found is None:
            raise SystemExit("--model default: the default model package is not installed")
        model_dir = found.path
    else:
        model_dir = Path(a.model)
    bw = read_bandwidth_gbs()
    first: dict[str, float] = {}
    for quantization in a.quantization:
        model, _ = load_model(model_dir, a.dtype, keep_gguf_blocks=quantization == "gguf")
        if quantization in ("int8", "int4"):
            model.quantize_weights(quantization)
        model.interleave_bf16()  # as the engine does: bf16 matrices in the x8 layout on AVX2
        hugepages.pack(model)  # and its weights on 2 MB pages
        print(f"{a.model or a.shape} {a.dtype} quantization={quantization}  CPU kernels: "
              f"{getattr(ops, 'cpu_isa', lambda: '?')()}  threads {torch.get_num_threads()}  "
              f"read bandwidth {bw:.1f} GB/s  load average {os.getloadavg()[0]:.2f}")
        one = time_batches(model, a, bw)
        first.setdefault("step", one)
        print(f"  {quantization}: batch-1 step {one * 1e3:.2f} ms, {1 / one:.1f} tok/s, "
              f"{first['step'] / one:.2f}x {a.quantization[0]}")
        del model
        if a.engine:
            from bench.engine_step import time_engine_steps

            time_engine_steps(model_dir, a, quantization)


def time_batches(model: Any, a: argparse.Namespace, bw: float) -> float:
    """Times each --batch size of `model` (bw: read bandwidth, GB/s); returns the batch-1 step (or
    the first batch's) in seconds."""
    step_one: dict[int, float] = {}
    for batch in a.batch:
        ids, positions, kv, meta = decode_batch(model, batch, a.context)

        def step() -> None:
            hidden = model(ids, positions, kv, meta)
            model.compute_logits(hidden)

        # Record the step's linear calls: (x shape, weight, bias), in order.
        calls: list[tuple[torch.Size, Any, Any]] = []
        outputs: list[torch.Tensor] = []
        real_linear = llama_mod.linear

        def recording(x: torch.Tensor, w: Any, b: Any = None) -> torch.Tensor:
            calls.append((x.shape, w, b))
            outputs.append(real_linear(x, w, b))
            return outputs[-1]

        replay = iter(range(1 << 60))

        def replaying(x: torch.Tensor, w: Any, b: Any = None) -> torch.Tensor:
            return outputs[next(replay) % len(outputs)]

        def non_gemm() -> None:
            set_linear(replaying)
            try:
                step()
            finally:
                set_linear(real_linear)

        set_linear(recording)
        try:
            step()
        finally:
            set_linear(real_linear)
        xs = [torch.randn(shape).to(model.dtype) for shape, _, _ in calls]

        def gemms() -> None:
            for x, (_, w, b) in zip(xs, calls):
                real_linear(x, w, b)

        with torch.inference_mode():
            t_step, m_step = best_and_median(step, a.repeats)
            # One decode_layer call per layer instead of one DecodeStack call per step: the stack's gain.
            model.stacked_decode = False
            try:
                t_lbl, m_lbl = best_and_median(step, a.repeats)
            finally:
                model.stacked_decode = True
            # The same step with every layer in Python (pagewire::decode_layer off): the C++ layer's gain.
            model.fused_decode = False
            try:
                t_py, m_py = best_and_median(step, a.repeats)
            finally:
                model.fused_decode = True
            t_gemm, m_gemm = best_and_median(gemms, a.repeats)
            # Short (milliseconds): many more tries to find an undisturbed one on a loaded machine.
            t_other, m_other = best_and_median(non_gemm, 10 * a.repeats)
        if batch == 1 or not step_one:
            step_one[batch] = t_step
        wbytes = sum(weight_bytes(w) for _, w, _ in calls)
        kv_bytes = batch * (a.context + 1) * model.kv_cache_bytes_per_token()
        mbu = (wbytes + kv_bytes) / t_step / (bw * 1e9)
        rel = f"  step / batch-1 step {t_step / step_one[1]:.2f}x" if 1 in step_one and batch != 1 else ""
        print(f"batch {batch:3d}: step {t_step * 1e3:7.2f} ms (median {m_step * 1e3:7.2f}; a call per layer "
              f"{t_lbl * 1e3:7.2f}, median {m_lbl * 1e3:7.2f}: {m_lbl / m_step:4.2f}x; Python layers "
              f"{t_py * 1e3:7.2f}, median {m_py * 1e3:7.2f}: {m_py / m_step:4.2f}x)  GEMMs alone "
              f"{t_gemm * 1e3:7.2f} ms  non-GEMM alone {t_other * 1e3:6.2f} ms "
              f"({t_other / (t_gemm + t_other) * 100:4.1f}% of GEMMs + non-GEMM)  {batch / t_step:7.1f} tok/s  "
              f"weights {wbytes / 1e6:6.1f} MB + KV {kv_bytes / 1e6:5.1f} MB per step  MBU {mbu * 100:4.1f}% "
              f"(GEMMs alone: {wbytes / t_gemm / (bw * 1e9) * 100:4.1f}%){rel}  "
              f"load average {os.getloadavg()[0]:.2f}")
    return step_one.get(1, t_step)


if __name__ == "__main__":
    main()
