"""--quantization gguf (a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL/IQ4_XS/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/Q8_0 matrices kept in
blocks, its IQ3_XXS/IQ3_S/IQ2_XXS/IQ2_XS/IQ2_S/IQ1_S/IQ1_M/TQ1_0/TQ2_0 ones rewritten exactly into blocks a kernel reads)
and int4 (Q4_0 at load): the model holds QuantizedWeights, and its logits track the same file loaded
dequantised (prefill exactly, up to GEMM order; decode within the 8-bit activation rounding)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.engine.config import ConfigError, EngineConfig
from server.kernels import linear_route
from server.kernels.quant import QuantizedWeight, x8_here
from server.models.decoder import DecoderForCausalLM
from server.models.gguf_transcode import TRANSCODED
from server.models.loader import load_model
from tests.gguf_files import write_gguf
from tests.models.paged_harness import VOCAB, PagedRun, random_tokens
from tests.tiny_models import make_tiny_model

PROMPT_LEN, DECODE_STEPS = 40, 6


@pytest.fixture(scope="module")
def k_sized_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows of 256 values (Q4_K's super-block) and grouped-query heads, so the Q/K row
    permutation is undone on rows of blocks; 2 layers keep it quick."""
    return make_tiny_model(tmp_path_factory.mktemp("k_sized") / "llama", "llama", vocab_size=VOCAB,
                           hidden_size=256, intermediate_size=512, num_hidden_layers=2)


def _logits(model: DecoderForCausalLM, tokens: list[int]) -> torch.Tensor:
    """A 40-token prefill (dequantised chunks + GEMM) then single-token decodes (the kernels)."""
    run = PagedRun(model)
    rows = [run.step({0: tokens[:PROMPT_LEN]})[0]]
    for t in tokens[PROMPT_LEN:]:
        rows.append(run.step({0: [t]})[0])
    return torch.cat(rows)


def _assert_tracks(ours: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(ours[:PROMPT_LEN], want[:PROMPT_LEN], rtol=1e-4, atol=1e-4)
    err = ((ours[PROMPT_LEN:] - want[PROMPT_LEN:]).abs().max() / want[PROMPT_LEN:].abs().max()).item()
    # Each linear's 8-bit activation rounding (0.3-1% of its output per op here, as for Q8_0;
    # tests/kernels/test_quant4.py bounds it per op) compounds over 2 layers x 4 matrices +
    # lm_head of random weights: 3-5% measured. A wrong block or row order would be ~100%.
    assert err < 8e-2


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS",
                                   "Q2_K", "Q3_K", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ1_S", "IQ2_XS", "IQ2_S", "IQ1_M",
                                   "TQ2_0", "TQ1_0"])
def test_gguf_blocks_kept_and_logits_track_the_dequantised_file(
    qtype: str, k_sized_model: Path, tmp_path: Path
) -> None:
    """(The lattice and ternary types are kept rewritten into IQ4_XS's and Q2_K's layouts: gguf_transcode.)"""
    path = write_gguf(tmp_path / f"{qtype}.gguf", k_sized_model, qtype)
    kept, _ = load_model(path, dtype="float32", keep_gguf_blocks=True)
    ref, _ = load_model(path, dtype="float32")
    held = TRANSCODED.get(qtype, qtype.lower())
    matrices = [getattr(layer, n) for layer in kept._layers for n in layer.MATRICES] + [kept.lm_head]
    assert all(isinstance(w, QuantizedWeight) and w.qtype == held for w in matrices)
    # The loader puts every type in the layout this CPU's kernel reads fastest.
    assert all(w.interleaved == x8_here() for w in matrices)
    assert not any(p.dtype == torch.uint8 for p in kept.parameters())
    # The kept blocks are the file's: dequantised, they are exactly what the float loader built
    # (which also checks the Q/K un-permutation of whole block rows).
    for lk, lr in zip(kept._layers, ref._layers):
        for n in lk.MATRICES:
            assert torch.equal(getattr(lk, n).dequantize(), getattr(lr, n)), n
    assert isinstance(kept.lm_head, QuantizedWeight)
    # The embedding table stays in its blocks (no float copy anywhere), and its rows are the
    # float loader's table exactly (tests/kernels/test_quant_embedding.py: every format and layout).
    assert isinstance(kept.embed_tokens, QuantizedWeight) and kept.embed_tokens.qtype == held
    assert not any(p.shape == ref.embed_tokens.shape for p in kept.parameters())
    assert torch.equal(linear_route.embedding(torch.arange(VOCAB), kept.embed_tokens, kept.dtype), ref.embed_tokens)
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, VOCAB, seed=3)
    _assert_tracks(_logits(kept, tokens), _logits(ref, tokens))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q5_1", "Q2_K", "IQ3_S", "IQ1_M", "F16"])
def test_tied_table_is_the_lm_heads_blocks(qtype: str, tmp_path: Path) -> None:
    """A tied model's embedding rows are gathered from the lm_head's own QuantizedWeight (x8 on
    AVX2 CPUs): one copy of token_embd, and exactly the float loader's rows and logits' inputs. A
    float table (F16) stays a float table, tied to a float lm_head."""
    hf = make_tiny_model(tmp_path / "tied", "llama", vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=1, tie_word_embeddings=True)
    path = write_gguf(tmp_path / f"{qtype}.gguf", hf, qtype)
    kept, _ = load_model(path, dtype="float32", keep_gguf_blocks=True)
    ref, _ = load_model(path, dtype="float32")
    assert ref.lm_head is ref.embed_tokens
    if qtype == "F16":
        assert isinstance(kept.embed_tokens, torch.Tensor) and kept.lm_head is kept.embed_tokens
        assert torch.equal(kept.embed_tokens, ref.embed_tokens)
        return
    assert isinstance(kept.lm_head, QuantizedWeight) and kept.embed_tokens is kept.lm_head
    assert kept.lm_head.interleaved == x8_here()
    assert not any(p.shape == ref.embed_tokens.shape for p in kept.parameters())
    assert torch.equal(linear_route.embedding(torch.arange(VOCAB), kept.embed_tokens, kept.dtype), ref.embed_tokens)
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, VOCAB, seed=5)
    _assert_tracks(_logits(kept, tokens), _logits(ref, tokens))


def test_gemma4_per_layer_table_stays_in_blocks(tmp_path: Path) -> None:
    """Gemma 4's per-layer input table (vocab x layers * P, the largest tensor of its small models)
    stays in its blocks like the token table, its rows exactly the dequantised table's; the kept
    model's prefill gives exactly the dequantised file's floats, and `pagewire plan` counts the blocks."""
    hf = make_tiny_model(tmp_path / "gemma4", "gemma4", vocab_size=VOCAB, hidden_size_per_layer_input=16)
    path = write_gguf(tmp_path / "gemma4-q8.gguf", hf, "Q8_0")  # 6 layers x 16: rows of 96 values
    kept, config = load_model(path, dtype="float32", keep_gguf_blocks=True)
    plain, _ = load_model(path, dtype="float32")
    for table in ("embed_tokens", "embed_tokens_per_layer"):
        assert isinstance(getattr(kept, table), QuantizedWeight), table
        ids = torch.arange(getattr(plain, table).shape[0])
        assert torch.equal(linear_route.embedding(ids, getattr(kept, table), kept.dtype), getattr(plain, table))
    tokens = random_tokens(30, config.vocab_size, seed=6)
    assert torch.equal(PagedRun(kept).step({0: tokens})[0], PagedRun(plain).step({0: tokens})[0])
    from server.engine.plan import make_plan, read_model_config
    from tests.gateway.test_plan import _loaded_weight_bytes

    engine_config = EngineConfig(str(path), dtype="float32", quantization="gguf", kv_cache_tokens=1024)
    plan = make_plan("m", read_model_config(path), engine_config, None, None)
    assert plan.weights.total == _loaded_weight_bytes(kept)


def test_int4_model_tracks_its_dequantised_weights(k_sized_model: Path) -> None:
    quant, _ = load_model(k_sized_model, dtype="float32")
    quant.quantize_weights("int4")
    matrices = [getattr(layer, n) for layer in quant._layers for n in layer.MATRICES] + [quant.lm_head]
    assert all(isinstance(w, QuantizedWeight) and w.qtype == "q4_0" for w in matrices)
    assert all(w.interleaved == x8_here() for w in matrices)
    ref, _ = load_model(k_sized_model, dtype="float32")
    with torch.no_grad():
        for lq, lr in zip(quant._layers, ref._layers):
            for n in lq.MATRICES:
                getattr(lr, n).copy_(getattr(lq, n).dequantize())
        if ref.lm_head is ref.embed_tokens:
            ref.lm_head = quant.lm_head.dequantize()  # type: ignore[union-attr]
        else:
            ref.lm_head.copy_(quant.lm_head.dequantize())  # type: ignore[union-attr]
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, VOCAB, seed=4)
    _assert_tracks(_logits(quant, tokens), _logits(ref, tokens))


def test_gguf_quantization_is_validated(k_sized_model: Path) -> None:
    with pytest.raises(ConfigError, match="quantization: 'gguf' keeps a GGUF file's quantised blocks"):
        EngineConfig(model=str(k_sized_model), quantization="gguf")
    with pytest.raises(ConfigError, match="quantization: 'gguf' runs on CPU only"):
        EngineConfig(model="m.gguf", quantization="gguf", device="cuda")
    with pytest.raises(ConfigError, match="quantization: 'int4' runs on CPU only"):
        EngineConfig(model="m", quantization="int4", device="cuda")
    assert EngineConfig(model="m.gguf", quantization="gguf").quantization == "gguf"
    with pytest.raises(ValueError, match="quantization: 'gguf' keeps a GGUF file's quantised blocks"):
        load_model(k_sized_model, keep_gguf_blocks=True)


@pytest.mark.parametrize("qtype,tied", [("Q4_1", False), ("F32", False), ("Q4_K", True), ("Q5_1", True), ("Q5_0", True),
                                        ("Q2_K", True), ("Q3_K", False), ("IQ2_XXS", True), ("TQ1_0", False)])
def test_plan_counts_the_kept_blocks(qtype: str, tied: bool, k_sized_model: Path, tmp_path: Path) -> None:
    """`pagewire plan --quantization gguf` counts exactly the bytes the loaded model holds (F32: nothing
    kept; tied: one table, the lm_head's blocks, or a float one where the type has no row dequantiser)."""
    from server.engine.plan import make_plan, read_model_config
    from tests.gateway.test_plan import _loaded_weight_bytes

    hf = k_sized_model if not tied else make_tiny_model(
        tmp_path / "tied", "llama", vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        tie_word_embeddings=True)
    path = write_gguf(tmp_path / f"{qtype}.gguf", hf, qtype)
    model, _ = load_model(path, dtype="float32", keep_gguf_blocks=True)
    config = EngineConfig(str(path), dtype="float32", quantization="gguf", kv_cache_tokens=1024)
    plan = make_plan("m", read_model_config(path), config, None, None)
    assert plan.weights.total == _loaded_weight_bytes(model)


def test_llm_and_serve_flag_reach_the_kept_blocks(k_sized_model: Path, tmp_path: Path) -> None:
    """LLM(quantization="gguf") and `--quantization gguf` run the file's blocks end to end."""
    import argparse

    from server import LLM, SamplingParams
    from server.serving.settings import add_serve_arguments, settings_from_args

    path = write_gguf(tmp_path / "q4_0.gguf", k_sized_model, "Q4_0")
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert settings_from_args(p.parse_args(["--quantization", "gguf"]), {}).engine_config(str(path)).quantization == "gguf"
    llm = LLM(str(path), quantization="gguf", kv_cache_tokens=256, max_model_len=64)
    layer = llm.engine.model._layers[0]
    assert isinstance(layer.qkv_weight, QuantizedWeight) and layer.qkv_weight.qtype == "q4_0"
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
