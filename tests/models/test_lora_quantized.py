"""LoRA over quantised bases: a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 blocks kept (--quantization gguf) and
int8/int4 at load. With an adapter, the logits track the same file or checkpoint loaded with its
dequantised weights and the same adapter (prefill exactly up to GEMM order, decode within the
kernels' 8-bit activation rounding, as without an adapter: tests/models/test_gguf_quantized.py),
while the adapter itself moves them far more than that tolerance."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from server.kernels import batch_invariant
from server.kernels.quant import QuantizedWeight
from server.models.decoder import DecoderForCausalLM
from server.models.loader import load_model
from server.models.lora import LoraSet
from server.models.lora_config import read_lora_config
from tests.gguf_files import write_gguf
from tests.lora_adapters import make_lora_adapter
from tests.models.paged_harness import VOCAB, PagedRun, random_tokens
from tests.tiny_models import make_tiny_model

PROMPT_LEN, DECODE_STEPS = 40, 6


@pytest.fixture(scope="module")
def k_sized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A llama with rows of 256 values (Q4_K's super-block), and an adapter on all seven projections."""
    root = tmp_path_factory.mktemp("lora_quant")
    model = make_tiny_model(root / "llama", "llama", vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=2)
    return model, make_lora_adapter(model, root / "adapter", r=8, alpha=16, std=0.05)


class _WithAdapter:
    """The model as PagedRun drives it, every row over adapter slot 1."""

    def __init__(self, model: DecoderForCausalLM, adapter: Path) -> None:
        self.model, self.config, self.dtype = model, model.config, model.dtype
        self.lora = LoraSet(model.lora_layout(), model.dtype, model.device, model.config.vocab_size)
        self.lora.load("a", read_lora_config(adapter))

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, kv: Any, meta: Any) -> torch.Tensor:
        return self.model(ids, positions, kv, meta, lora=self.lora.step([1] * ids.shape[0]))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def _logits(model: Any, tokens: list[int]) -> torch.Tensor:
    run = PagedRun(model)
    rows = [run.step({0: tokens[:PROMPT_LEN]})[0]]
    for t in tokens[PROMPT_LEN:]:
        rows.append(run.step({0: [t]})[0])
    return torch.cat(rows)


def _check(quant: DecoderForCausalLM, ref: DecoderForCausalLM, adapter: Path, exact_prefill: bool = True) -> None:
    """exact_prefill False: deterministic mode, whose quantised linear runs the 8-bit kernel for
    the prefill rows too, so they carry its activation rounding like the decode rows."""
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, VOCAB, seed=3)
    ours, want = _logits(_WithAdapter(quant, adapter), tokens), _logits(_WithAdapter(ref, adapter), tokens)
    if exact_prefill:
        torch.testing.assert_close(ours[:PROMPT_LEN], want[:PROMPT_LEN], rtol=1e-4, atol=1e-4)
    first = PROMPT_LEN if exact_prefill else 0
    err = ((ours[first:] - want[first:]).abs().max() / want[first:].abs().max()).item()
    # The bound test_gguf_quantized.py sets without an adapter (2.8-5 % measured here), or the same
    # model's own error without the adapter, whichever is larger (deterministic int8: 8.7 %).
    base_ref = _logits(ref, tokens)
    base_err = ((_logits(quant, tokens)[first:] - base_ref[first:]).abs().max() / base_ref[first:].abs().max()).item()
    assert err < max(8e-2, 1.25 * base_err), (err, base_err)
    # The adapter moves the logits by far more than the tolerance they were checked to.
    moved = (base_ref[:PROMPT_LEN] - want[:PROMPT_LEN]).abs().max().item()
    assert moved > 1e-2, moved


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_adapter_over_kept_gguf_blocks(qtype: str, k_sized: tuple[Path, Path], tmp_path: Path) -> None:
    model, adapter = k_sized
    path = write_gguf(tmp_path / f"{qtype}.gguf", model, qtype)
    kept, _ = load_model(path, dtype="float32", keep_gguf_blocks=True)
    assert all(isinstance(getattr(layer, n), QuantizedWeight) for layer in kept._layers for n in layer.MATRICES)
    ref, _ = load_model(path, dtype="float32")
    _check(kept, ref, adapter)


@pytest.mark.parametrize("quantization, deterministic", [("int8", False), ("int4", False), ("int8", True)])
def test_adapter_over_weights_quantised_at_load(quantization: str, deterministic: bool,
                                                k_sized: tuple[Path, Path]) -> None:
    """Also in deterministic mode, whose per-adapter terms take the batch-invariant linear path."""
    model, adapter = k_sized
    quant, _ = load_model(model, dtype="float32")
    quant.quantize_weights(quantization)
    ref, _ = load_model(model, dtype="float32")
    with torch.no_grad():  # the reference: every matrix replaced by its exact dequantisation
        for lq, lr in zip(quant._layers, ref._layers):
            for n in lq.MATRICES:
                getattr(lr, n).copy_(getattr(lq, n).dequantize(torch.float32))
        assert isinstance(quant.lm_head, QuantizedWeight)
        ref.lm_head.copy_(quant.lm_head.dequantize(torch.float32))
    with batch_invariant.mode(deterministic):
        _check(quant, ref, adapter, exact_prefill=not deterministic)
