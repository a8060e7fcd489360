"""Mixture-of-experts models beyond the family tests (tests/families): the HF translations' layer
kinds and routing flags, experts quantised at load (int8 / int4) and kept from a GGUF file's
blocks, and what the start-up summary and `pagewire plan` say about active parameters."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from server.kernels.quant import QuantizedExperts, QuantizedWeight, x8_here
from server.models.config import ModelLoadError, UnsupportedModelError
from server.models.loader import load_model
from server.models.registry import config_from_hf
from tests.models.paged_harness import PagedRun, random_tokens

_BASE: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}


def _cfg(name: str, **fields: Any) -> Any:
    return config_from_hf({"architectures": [name], **_BASE, **fields})


def test_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step() -> None:
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    c = _cfg("Qwen3MoeForCausalLM", **moe, mlp_only_layers=[2])
    assert c.layer_mlp_kinds == ("sparse", "sparse", "dense", "sparse") and c.is_moe and c.qk_norm
    c = _cfg("Qwen3MoeForCausalLM", **moe, decoder_sparse_step=2)
    assert c.layer_mlp_kinds == ("dense", "sparse", "dense", "sparse")
    assert c.moe_intermediate_size == 32 and c.intermediate_size == 128 and not c.norm_topk_prob
    c = _cfg("Qwen2MoeForCausalLM", **moe, shared_expert_intermediate_size=64, norm_topk_prob=True)
    assert c.shared_expert_intermediate_size == 64 and c.norm_topk_prob and c.qkv_bias and not c.o_bias
    # Mixtral always renormalises, names its experts w1/w3/w2 and slides every layer.
    c = _cfg("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2, sliding_window=16)
    assert c.norm_topk_prob and c.moe_checkpoint == "mixtral" and c.layer_sliding_windows == (16,) * 4
    assert c.layer_mlp_kinds == ("sparse",) * 4 and c.moe_intermediate_size == 128
    c = _cfg("OlmoeForCausalLM", num_experts=8, num_experts_per_tok=3)
    assert c.qk_norm and c.qk_norm_over == "projection" and not c.norm_topk_prob
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        _cfg("OlmoeForCausalLM", num_experts=2, num_experts_per_tok=3)
    with pytest.raises(UnsupportedModelError, match="clip_qkv"):
        _cfg("OlmoeForCausalLM", num_experts=8, num_experts_per_tok=2, clip_qkv=8.0)


@pytest.mark.parametrize("quantization,qtype", [("int8", "q8_0"), ("int4", "q4_0")])
def test_experts_quantised_at_load(tiny_model: Callable[..., Path], quantization: str, qtype: str) -> None:
    hf_dir = tiny_model("qwen2moe")
    plain, config = load_model(hf_dir)
    quant, _ = load_model(hf_dir)
    quant.quantize_weights(quantization)
    for layer in quant._layers:  # type: ignore[attr-defined]
        moe = layer.moe
        assert isinstance(moe.experts_gate_up, QuantizedExperts) and moe.experts_gate_up.qtype == qtype
        assert isinstance(moe.experts_down, QuantizedExperts) and isinstance(moe.shared_down_weight, QuantizedWeight)
        assert isinstance(moe.router_weight, torch.Tensor)  # routing stays float
        assert isinstance(layer.qkv_weight, QuantizedWeight)
    # The float model of the quantised weights: only the 8-bit activations (and, for a token near an
    # expert tie, its routing) tell the two apart.
    with torch.no_grad():
        for lq, lp in zip(quant._layers, plain._layers):  # type: ignore[attr-defined]
            for n in lq.MATRICES:
                getattr(lp, n).copy_(getattr(lq, n).dequantize())
            for n in ("experts_gate_up", "experts_down", "shared_gate_up_weight", "shared_down_weight"):
                getattr(lp.moe, n).copy_(getattr(lq.moe, n).dequantize())
        plain.lm_head.copy_(quant.lm_head.dequantize())  # type: ignore[attr-defined]
    tokens = random_tokens(24, config.vocab_size, seed=3)
    a, b = PagedRun(quant).step({0: tokens})[0], PagedRun(plain).step({0: tokens})[0]
    rows = (a - b).abs().amax(-1) <= 0.05 * b.abs().amax()
    assert rows.float().mean() >= 0.9


def test_gguf_q4_0_experts_are_kept_in_their_blocks(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    from tests.gguf_files import write_gguf

    hf_dir = tiny_model("qwen3moe")
    path = write_gguf(tmp_path / "q4.gguf", hf_dir, "Q4_0")
    kept, config = load_model(path, dtype="float32", keep_gguf_blocks=True)
    plain, _ = load_model(path, dtype="float32")
    for i, layer in enumerate(kept._layers):  # type: ignore[attr-defined]
        if config.mlp_kind(i) == "dense":
            assert layer.moe is None and isinstance(layer.gate_up_weight, QuantizedWeight)
            continue
        gu = layer.moe.experts_gate_up
        assert isinstance(gu, QuantizedExperts) and gu.qtype == "q4_0" and gu.shape == (8, 64, 64)
        assert gu.interleaved == x8_here()  # this CPU's layout of the same bytes
        ref = plain._layers[i].moe  # type: ignore[attr-defined]
        torch.testing.assert_close(gu.dequantize(), ref.experts_gate_up, rtol=0, atol=0)
        torch.testing.assert_close(layer.moe.experts_down.dequantize(), ref.experts_down, rtol=0, atol=0)


def test_summary_and_plan_report_active_parameters(tiny_model: Callable[..., Path]) -> None:
    from server.engine.config import EngineConfig
    from server.engine.plan import make_plan, read_model_config, render

    hf_dir = tiny_model("qwen3moe")
    model, config = load_model(hf_dir)
    total = sum(p.numel() for p in model.parameters())  # type: ignore[attr-defined]
    # Two sparse layers, each with 8 experts of 3 x 32 x 64 values, 2 of them used per token.
    active = total - 2 * 6 * 3 * 32 * 64
    summary = model.summary()
    assert f"{total / 1e3:.1f}K parameters, {active / 1e3:.1f}K active per token (2 of 8 experts in 2 of 3 layers)" \
        in summary, summary
    plan = make_plan("m", read_model_config(hf_dir), EngineConfig(str(hf_dir), dtype="float32",
                                                                  kv_cache_tokens=1024), None, None)
    assert plan.weights.parameters == total and plan.weights.active_parameters == active
    # A batch-1 step reads the top-k experts only.
    assert plan.weights.total - plan.weights.read_per_step == (model.embed_tokens.numel()  # type: ignore[attr-defined]
                                                                + 2 * 6 * 3 * 32 * 64) * 4
    assert "active per token" in render(plan) and plan.to_json()["active_parameters"] == active


@pytest.mark.parametrize("dtype,quantization", [("bfloat16", "none"), ("float32", "int8")])
def test_deterministic_mode_a_requests_tokens_do_not_depend_on_its_batch(tiny_model: Callable[..., Path],
                                                                         dtype: str, quantization: str) -> None:
    """Deterministic mode holds for MoE: the same prompt alone and among others (which route other
    tokens to the same experts) gives the same tokens and logprobs."""
    from server import LLM, SamplingParams

    hf_dir = tiny_model("olmoe", dtype=dtype)
    llm = LLM(str(hf_dir), dtype=dtype, quantization=quantization, deterministic=True, max_model_len=256,
              kv_cache_tokens=4096)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [random_tokens(n, 500, seed=n) for n in (9, 40, 23, 31)]
    alone = llm.generate(prompts[:1], params)[0].outputs[0]
    together = llm.generate(prompts, params)[0].outputs[0]
    assert together.token_ids == alone.token_ids
    assert [lp for lp in together.logprobs] == [lp for lp in alone.logprobs]  # type: ignore[union-attr]
