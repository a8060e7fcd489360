"""--quantization int8: every decoder matrix and lm_head kept as Q8_0 blocks, checked against the same
model running the dequantised weights in float32 (the float64-exact dequantisation is the reference)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.engine.config import ConfigError, EngineConfig
from server.kernels.quant import QuantizedWeight
from server.models.loader import load_model
from tests.models.paged_harness import ARCHS, VOCAB, PagedRun, random_tokens

PROMPT_LEN, DECODE_STEPS = 40, 6


def _logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """A 40-token prefill (dequantise + GEMM path) then single-token decodes (the int8 kernel)."""
    run = PagedRun(model)  # type: ignore[arg-type]
    rows = [run.step({0: tokens[:PROMPT_LEN]})[0]]
    for t in tokens[PROMPT_LEN:]:
        rows.append(run.step({0: [t]})[0])
    return torch.cat(rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_model_tracks_its_dequantised_weights(arch: str, tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs[arch]
    quant, _ = load_model(model_dir, dtype="float32")
    quant.quantize_weights("int8")
    matrices = [getattr(layer, n) for layer in quant._layers for n in layer.MATRICES] + [quant.lm_head]
    assert all(isinstance(w, QuantizedWeight) and w.qtype == "q8_0" for w in matrices)
    assert not any(p.dtype == torch.uint8 for p in quant.parameters())  # the float matrices are gone

    # Reference: the same checkpoint with every matrix replaced by its exact dequantisation.
    ref, _ = load_model(model_dir, dtype="float32")
    with torch.no_grad():
        for lq, lr in zip(quant._layers, ref._layers):
            for n in lq.MATRICES:
                getattr(lr, n).copy_(getattr(lq, n).dequantize(torch.float32))
        if ref.lm_head is ref.embed_tokens:
            ref.lm_head = quant.lm_head.dequantize(torch.float32)  # type: ignore[union-attr]
        else:
            ref.lm_head.copy_(quant.lm_head.dequantize(torch.float32))  # type: ignore[union-attr]

    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, VOCAB, seed=3)
    ours, want = _logits(quant, tokens), _logits(ref, tokens)
    # The prefill row is exact up to GEMM order; decode rows carry the 8-bit activation rounding.
    torch.testing.assert_close(ours[:PROMPT_LEN], want[:PROMPT_LEN], rtol=1e-4, atol=1e-4)
    err = ((ours[PROMPT_LEN:] - want[PROMPT_LEN:]).abs().max() / want[PROMPT_LEN:].abs().max()).item()
    assert err < 3e-2


def test_quantization_option_is_validated() -> None:
    with pytest.raises(ConfigError, match="quantization: must be one of none, int8, int4, gguf"):
        EngineConfig(model="m", quantization="int3")
    with pytest.raises(ConfigError, match="quantization: 'int8' runs on CPU only"):
        EngineConfig(model="m", quantization="int8", device="cuda")


def test_quantization_flag_and_env_reach_the_engine_config() -> None:
    import argparse

    from server.serving.settings import add_serve_arguments, settings_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert settings_from_args(p.parse_args(["--quantization", "int8"]), {}).engine_config("/m").quantization == "int8"
    s = settings_from_args(p.parse_args([]), {"PAGEWIRE_QUANTIZATION": "int8"})
    assert s.engine_config("/m").quantization == "int8"
    assert settings_from_args(p.parse_args([]), {}).engine_config("/m").quantization == "none"
