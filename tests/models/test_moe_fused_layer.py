"""The mixture-of-experts families' layers in a fused step: pagewire::decode_layer's attention
half (gate_up kind "none") and then pagewire::moe_decode must give exactly the Python layers'
floats (logits and every KV cache byte) for Qwen3-MoE (with its dense layer), Mixtral (sliding
window), OLMoE (no renormalisation, projection q/k norm), Qwen2-MoE (shared expert) and gpt-oss
(sinks, router and expert biases, clamped SwiGLU), float and bf16, float and quantised experts,
batches of 1 and 3; every layer of every small step runs fused."""
from __future__ import annotations

from pathlib import Path

import pytest

from server.models.loader import load_model
from tests.models.paged_harness import VOCAB
from tests.models.test_decode_layer import _assert_same, _count_fused_calls, _steps
from tests.tiny_models import make_tiny_model

MOE_FAMILIES = ("qwen3moe", "mixtral", "olmoe", "qwen2moe", "gpt_oss")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: make_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch, vocab_size=VOCAB)
            for arch in MOE_FAMILIES}


@pytest.mark.parametrize("arch", MOE_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("batch", [1, 3])
def test_moe_layers_run_fused_with_the_python_layers_floats(
    moe_models: dict[str, Path], arch: str, dtype: str, quantization: str, batch: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, _ = load_model(moe_models[arch], dtype=dtype)
    if quantization != "none":
        model.quantize_weights(quantization)
    # gpt-oss's norm rounds its weight in fp32 (transformers' GptOssRMSNorm), which decode_layer's
    # norms do not: in bf16 its layers stay in Python.
    python_only = arch == "gpt_oss" and dtype != "float32"
    assert all(layer.fusable != python_only for layer in model._layers)
    calls = _count_fused_calls(monkeypatch)
    _assert_same(model, batch)
    small = sum(sum(map(len, step.values())) <= 16 for step in _steps(batch))
    assert calls == ([] if python_only else list(range(model.config.num_layers)) * small)
