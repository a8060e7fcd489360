"""KV memory with KV groups: a Gemma-3-shaped model (5 local : 1 global layers, sliding window 512
or 1024) against the same shape with every layer global, at 32k context, through `pagewire plan`.

It writes two config.json folders per shape (no weights: plan reads configs only) under
bench/out/kv_groups/, Qwen2-style configs whose `layer_types` give Gemma 3's pattern (every sixth
layer global), and runs `make_plan` (what `pagewire plan` prints) on each: KV bytes one 32k
sequence holds, sequences of 32k that fit the same memory, and the ratio. The issue's bar: at most
0.3x the all-global bytes. Reproduce the plan output with the printed `pagewire plan` commands.

With --serve it also runs the engine: a tiny random-weight model with the same 5 : 1 pattern
(window --serve-window) is given a KV pool that holds --serve-fit sequences of --serve-len tokens
(+ --serve-max-tokens outputs) with every layer global, and --serve-requests such prompts at once; it reports how many sequences
held their whole prompt in the pool at the same time, and preemptions, with KV groups and with the
same model's layers all global (capacity only: the two models compute different things).

    python -m bench.kv_groups [--memory 24GiB] [--context 32768] [--serve]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from server.engine.config import EngineConfig
from server.engine.plan import make_plan, parse_bytes, read_model_config, render

OUT = Path(__file__).resolve().parent / "out" / "kv_groups"

# (name, layers, heads, kv heads, head_dim, hidden, intermediate, window): Gemma 3 1B and 4B shapes.
SHAPES = [
    ("gemma3-1b-shape", 26, 4, 1, 256, 1152, 6912, 512),
    ("gemma3-4b-shape", 34, 8, 4, 256, 2560, 10240, 1024),
]


def write_config(name: str, layers: int, heads: int, kv: int, head_dim: int, hidden: int, inter: int,
                 window: int, every_layer_global: bool) -> Path:
    d = OUT / (name + ("-all-global" if every_layer_global else ""))
    d.mkdir(parents=True, exist_ok=True)
    types = ["full_attention" if (i + 1) % 6 == 0 or every_layer_global else "sliding_attention" for i in range(layers)]
    cfg = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": 262144, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_sliding_window": True, "sliding_window": window, "max_window_layers": 0, "layer_types": types,
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def serve_run(window: int, seq_len: int, fit: int, requests: int, every_layer_global: bool,
              max_tokens: int) -> dict[str, int]:
    """Runs `requests` prompts of seq_len tokens (+ max_tokens outputs) through an engine whose pool
    holds `fit` all-global sequences; returns the peak of sequences holding their whole prompt at once."""
    import random

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from server import SamplingParams
    from server.engine.engine import LLMEngine
    from server.models.demo_model import build_tokenizer

    layers = 12
    d = OUT / f"serve-w{window}{'-all-global' if every_layer_global else ''}"
    if not (d / "config.json").exists():
        info = build_tokenizer(d, vocab_size=512)
        types = ["full_attention" if (i + 1) % 6 == 0 or every_layer_global else "sliding_attention"
                 for i in range(layers)]
        cfg = Qwen2Config(vocab_size=info.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=8192,
                          use_sliding_window=True, sliding_window=window, max_window_layers=0, layer_types=types,
                          bos_token_id=info.bos_token_id, eos_token_id=list(info.eos_token_ids))
        torch.manual_seed(0)
        Qwen2ForCausalLM(cfg).eval().save_pretrained(d)
    bpt_tokens = fit * (seq_len + max_tokens)  # tokens of every layer's KV: `fit` sequences all-global
    engine = LLMEngine(EngineConfig(str(d), kv_cache_tokens=bpt_tokens, max_model_len=seq_len + max_tokens,
                                    max_num_seqs=64, max_num_batched_tokens=512))
    rng = random.Random(0)
    for i in range(requests):
        prompt = [rng.randrange(4, 500) for _ in range(seq_len)]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        held = sum(1 for r in engine.requests.values() for s in r.sequences
                   if s.num_computed_tokens >= len(r.prompt_token_ids) and engine.kv_cache.has_blocks(s))
        peak = max(peak, held)
    return {"num_blocks": engine.kv_cache.num_blocks, "peak_full_prompts_held": peak,
            "preemptions": engine.scheduler.num_preemptions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", default="24GiB")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--serve-window", type=int, default=256)
    ap.add_argument("--serve-len", type=int, default=2048)
    ap.add_argument("--serve-fit", type=int, default=2)
    ap.add_argument("--serve-requests", type=int, default=16)
    ap.add_argument("--serve-max-tokens", type=int, default=64)
    args = ap.parse_args()
    memory = parse_bytes(args.memory)
    print(f"# python -m bench.kv_groups --memory {args.memory} --context {args.context}")
    for name, *shape in SHAPES:
        plans = {}
        for flat in (False, True):
            d = write_config(name, *shape, every_layer_global=flat)
            cfg = EngineConfig(str(d), dtype="bfloat16", max_model_len=args.context)
            plans[flat] = make_plan(str(d), read_model_config(d), cfg, memory, bandwidth_gbs=None)
            print(f"\n$ pagewire plan {d.relative_to(Path.cwd()) if d.is_relative_to(Path.cwd()) else d} "
                  f"--memory {args.memory} --max-model-len {args.context} --dtype bfloat16")
            print(render(plans[flat]))
        g, f = plans[False].layout, plans[True].layout
        ratio = g.seq_bytes(args.context) / f.seq_bytes(args.context)
        print(f"\n{name} (window {shape[-1]}): one {args.context}-token sequence holds {g.seq_bytes(args.context)} "
              f"bytes of KV with KV groups vs {f.seq_bytes(args.context)} with every layer global: {ratio:.3f}x "
              f"({'meets' if ratio <= 0.3 else 'MISSES'} the 0.3x bar); {g.sequences_fitting(args.context)} vs "
              f"{f.sequences_fitting(args.context)} such sequences fit {args.memory}")
    if args.serve:
        print(f"\n# serving run: {args.serve_requests} prompts of {args.serve_len} tokens at once "
              f"({args.serve_max_tokens} outputs each), a pool holding {args.serve_fit} all-global sequences, "
              f"window {args.serve_window}")
        for flat in (False, True):
            r = serve_run(args.serve_window, args.serve_len, args.serve_fit, args.serve_requests, flat,
                          args.serve_max_tokens)
            print(f"{'all layers global' if flat else 'KV groups (5 local : 1 global)'}: {r}")


if __name__ == "__main__":
    main()
