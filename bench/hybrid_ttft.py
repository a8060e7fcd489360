"""Second-turn TTFT of a hybrid model (LFM2-shaped, random weights) with and without a saved state.

A chat's second turn repeats the first turn's prompt and answer and adds a message. With prefix
caching the engine saved the convolution layers' state at the first prompt's last block boundary
(server/engine/hybrid_states.py), so turn 2 restores it and prefills only the rest; without it
turn 2 prefills everything. Each repetition runs turn 1 then turn 2 on fresh random prompts, the
two engines interleaved (A, B, A, B, ...) in one process; TTFT is the wall time of a generate of
one token (prefill plus one sample). The issue's bar: with the saved state at least 5x faster.

    python -m bench.hybrid_ttft [--prompt 1536] [--reps 3] [--hidden 512] [--layers 8]
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from server import LLM, SamplingParams


def build(out: Path, hidden: int, layers: int) -> Path:
    from server.models.demo_model import build_tokenizer
    from tests.tiny_models import make_tiny_model

    info = build_tokenizer(out, vocab_size=512)
    # LFM2's pattern: mostly convolution layers, an attention layer every third.
    types = ["full_attention" if i % 3 == 2 else "conv" for i in range(layers)]
    make_tiny_model(out, "lfm2", vocab_size=info.vocab_size, bos_token_id=info.bos_token_id,
                    eos_token_id=list(info.eos_token_ids), hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=8, num_key_value_heads=4, intermediate_size=4 * hidden, layer_types=types,
                    max_position_embeddings=8192, initializer_range=0.02)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=1536, help="turn 1's prompt tokens")
    ap.add_argument("--answer", type=int, default=16, help="turn 1's answer tokens")
    ap.add_argument("--message", type=int, default=32, help="turn 2's new message tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build(Path(tmp), a.hidden, a.layers))
        engines = {"saved state": LLM(model, max_model_len=4096, kv_cache_tokens=16384, autotune=False),
                   "no prefix caching": LLM(model, max_model_len=4096, kv_cache_tokens=16384,
                                            enable_prefix_caching=False, autotune=False)}
        rng = random.Random(0)
        times: dict[str, list[float]] = {k: [] for k in engines}
        cached: dict[str, list[int]] = {k: [] for k in engines}
        for _ in range(a.reps):
            turn1 = [rng.randrange(4, 500) for _ in range(a.prompt)]
            message = [rng.randrange(4, 500) for _ in range(a.message)]
            for name, llm in engines.items():
                answer = llm.generate([turn1], SamplingParams(temperature=0.0, max_tokens=a.answer,
                                                              ignore_eos=True))[0].outputs[0].token_ids
                turn2 = turn1 + list(answer) + message
                t0 = time.perf_counter()
                out = llm.generate([turn2], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0]
                times[name].append(time.perf_counter() - t0)
                cached[name].append(out.num_cached_tokens)
        for name in engines:
            ts = sorted(times[name])
            print(f"{name:>18}: turn-2 TTFT median {ts[len(ts) // 2] * 1000:8.1f} ms (all: "
                  f"{', '.join(f'{t * 1000:.1f}' for t in times[name])}); cached tokens {cached[name]}")
        a_med = sorted(times["saved state"])[a.reps // 2]
        b_med = sorted(times["no prefix caching"])[a.reps // 2]
        print(f"speed-up with the saved state: {b_med / a_med:.1f}x (turn 2: {a.prompt + a.answer + a.message} tokens)")


if __name__ == "__main__":
    main()
