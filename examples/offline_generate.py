"""Offline batch generation with pagewire's vLLM-shaped API.

Usage:
    .venv/bin/python examples/offline_generate.py [MODEL_DIR]

Without MODEL_DIR it uses the built-in demo model (random weights: the text is gibberish).
"""
from __future__ import annotations

import sys

from server import LLM, SamplingParams
from server.models.demo_model import ensure_demo_model


def main() -> None:
    model_dir = sys.argv[1] if len(sys.argv) > 1 else str(ensure_demo_model())
    llm = LLM(model_dir, dtype="auto", max_model_len=1024)
    prompts = ["The quick brown fox", "Once upon a time", "In a distant galaxy"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=24, n=2)
    for out in llm.generate(prompts, greedy):
        print(f"[greedy] {out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    for out in llm.generate(prompts[:1], sampled):
        for c in out.outputs:
            print(f"[sample {c.index}] {out.prompt!r} -> {c.text!r}")


if __name__ == "__main__":
    main()
