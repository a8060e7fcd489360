"""DecoderForCausalLM.interleave_bf16: on AVX2 and AVX512-BF16 CPUs a bf16 model's decoder matrices (and its lm_head,
or its tied embedding table, which then serves both ends) move into the x8 layout, and on AVX512-BF16
with `pack` into the packed layout (~12.5 bits a value, lossless). Neither may
change a single float: the same logits and KV bytes as the row-layout model, through the fused
decode_layer and the Python layers, prefill chunks and decodes, tied and untied; and it must leave
models it does not apply to (fp32, CPUs whose family is not AVX2) as they were."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.kernels import ops
from server.kernels.quant import QuantizedWeight
from server.models.decoder import BF16_PACKED, BF16_X8_MAX_K, DecoderForCausalLM
from server.models.loader import load_model
from tests.models.paged_harness import VOCAB, PagedRun, random_tokens
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(ops.cpu_isa() not in BF16_X8_MAX_K,
                                reason="the x8 bf16 layout is made on AVX2 and AVX512-BF16 CPUs (BF16_X8_MAX_K)")


def _steps() -> list[dict[int, list[int]]]:
    toks = {s: random_tokens(30, VOCAB, seed=s) for s in range(3)}
    steps = [{0: toks[0][:12]}, {1: toks[1][:9], 2: toks[2][:5]}]
    return steps + [{s: [toks[s][t]] for s in range(3)} for t in range(12, 20)]


def _run(model: DecoderForCausalLM, fused: bool) -> tuple[list[dict[int, torch.Tensor]], PagedRun]:
    model.fused_decode = fused
    run = PagedRun(model, seed=3)
    return [run.step(s) for s in _steps()], run


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("pack", [False, True])
def test_moved_matrices_give_the_same_floats(tmp_path: Path, tied: bool, fused: bool, pack: bool) -> None:
    path = make_tiny_model(tmp_path / "m", "qwen2", vocab_size=VOCAB, hidden_size=128, intermediate_size=160,
                           num_hidden_layers=2, tie_word_embeddings=tied)
    plain, _ = load_model(path, dtype="bfloat16")
    moved, _ = load_model(path, dtype="bfloat16")
    assert isinstance(moved, DecoderForCausalLM)
    moved.interleave_bf16(pack=pack)
    # K = 128 and 160 rows pack to 0.82-0.84x their bytes, over PACK_MIN_SAVING
    kind = "bf16zx8" if pack and ops.cpu_isa() in BF16_PACKED else "bf16x8"
    layer = moved._layers[0]
    for name in layer.MATRICES:
        w = getattr(layer, name)
        assert isinstance(w, QuantizedWeight) and w.op_qtype == kind, name
        assert name not in dict(layer.named_parameters())  # moved, not copied
    assert isinstance(moved.lm_head, QuantizedWeight) and moved.lm_head.op_qtype == kind
    assert (moved.lm_head is moved.embed_tokens) == tied
    if fused:
        assert moved._layers[0].linear_kinds(torch.bfloat16, 1) == (kind,) * 4
    want, run_p = _run(plain, fused)
    got, run_m = _run(moved, fused)
    for a, b in zip(want, got):
        for sid in a:
            assert torch.equal(a[sid], b[sid]), sid
    for (kp, vp), (km, vm) in zip(run_p.kv_caches, run_m.kv_caches):
        assert torch.equal(kp, km) and torch.equal(vp, vm)


def test_models_it_does_not_apply_to_stay_as_they_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_model(tmp_path / "m", "llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=1)
    fp32, _ = load_model(path, dtype="float32")
    assert isinstance(fp32, DecoderForCausalLM)
    fp32.interleave_bf16()
    assert isinstance(fp32._layers[0].qkv_weight, torch.Tensor)
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", "portable")
    bf16, _ = load_model(path, dtype="bfloat16")
    assert isinstance(bf16, DecoderForCausalLM)
    bf16.interleave_bf16()
    assert isinstance(bf16._layers[0].qkv_weight, torch.Tensor)
