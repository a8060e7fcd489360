"""GGUF files of K-quant mixes (llama.cpp's Q4_K_M: Q4_K matrices, Q6_K for some, Q5_K in Q5_K_M)
run from their own bytes with --quantization gguf: every matrix, MoE experts included, is kept as
a QuantizedWeight / QuantizedExperts of the file's blocks, dequantises to exactly what the `gguf`
package reads from the file, and the model gives transformers' greedy tokens for the same
(dequantised) weights.

K-quant blocks cannot be made by the `gguf` package's quantiser, so tests/gguf_files writes random
valid blocks; the transformers reference is the HF folder rewritten with the weights the file's
blocks hold (pagewire's float GGUF load, which dequantises with the `gguf` package).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from server import LLM, SamplingParams
from server.kernels.quant import QuantizedExperts, QuantizedWeight, x8_here
from server.models.loader import load_model
from tests.gguf_files import write_gguf
from tests.models.paged_harness import random_tokens


def q4_k_m(name: str) -> str:
    """A Q4_K_M-like mix: Q6_K for ffn_down(_exps) and the output, Q5_K for the attention's q/k/v
    (a Q5_K_M choice, so every K-quant appears; llama.cpp's own Q4_K_M may give attn_v alone Q6_K,
    whose fused qkv is then a QuantizedParts: tests/models/test_mixed_gguf.py), Q4_K for the rest."""
    if name.endswith(("ffn_down.weight", "ffn_down_exps.weight", "output.weight")):
        return "Q6_K"
    if name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):
        return "Q5_K"
    return "Q4_K"


# Rows of 256 values (the K-quants' super-block) everywhere: hidden 256, experts of 256, 4 heads of 64.
_SIZES = {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory: pytest.TempPathFactory, tiny_model: Callable[..., Path]) -> tuple[Path, Path]:
    """(the Q4_K_M-mixed GGUF of a tiny Qwen3-MoE, an HF folder holding the weights its blocks hold)."""
    hf_dir = tiny_model("qwen3moe", **_SIZES, moe_intermediate_size=256)
    out = tmp_path_factory.mktemp("kquant-moe")
    path = write_gguf(out / "q4_k_m.gguf", hf_dir, "Q4_K", qtype_of=q4_k_m)
    ref_dir = out / "hf"
    shutil.copytree(hf_dir, ref_dir)
    model, _ = load_model(path, dtype="float32")
    targets = model.checkpoint_tensors()  # type: ignore[attr-defined]
    saved = load_file(str(hf_dir / "model.safetensors"))
    assert set(saved) == set(targets) and all(t.convert is None and t.offset == 0 for t in targets.values())
    # The matrices as the file's blocks hold them; a target whose parameter is laid out otherwise
    # (q_norm / k_norm, spread per head) is an F32 tensor in the file: the folder's own values.
    state = {name: t.dest.detach().clone().contiguous() if tuple(t.dest.shape) == tuple(t.shape) else saved[name]
             for name, t in targets.items()}
    assert all(state[n].shape == saved[n].shape for n in saved)
    save_file(state, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    return path, ref_dir


def test_every_matrix_and_expert_stays_in_the_files_blocks(moe_files: tuple[Path, Path]) -> None:
    path, _ = moe_files
    kept, config = load_model(path, dtype="float32", keep_gguf_blocks=True)
    plain, _ = load_model(path, dtype="float32")
    seen = set()
    for i, (lk, lp) in enumerate(zip(kept._layers, plain._layers)):  # type: ignore[attr-defined]
        for n in lk.MATRICES:
            w = getattr(lk, n)
            if config.mlp_kind(i) != "dense" and n in ("gate_up_weight", "down_weight"):
                continue  # a sparse layer has experts instead
            assert isinstance(w, QuantizedWeight), (i, n)
            seen.add(w.qtype)
            assert torch.equal(w.dequantize(), getattr(lp, n)), (i, n)
        if lk.moe is not None:
            gu, dn = lk.moe.experts_gate_up, lk.moe.experts_down
            assert isinstance(gu, QuantizedExperts) and gu.qtype == "q4_k"
            assert isinstance(dn, QuantizedExperts) and dn.qtype == "q6_k"
            assert gu.interleaved == dn.interleaved == x8_here()  # Q4_K and Q6_K: x8 from AVX2 up
            assert torch.equal(gu.dequantize(), lp.moe.experts_gate_up)
            assert torch.equal(dn.dequantize(), lp.moe.experts_down)
    assert seen == {"q4_k", "q5_k", "q6_k"}
    assert isinstance(kept.lm_head, QuantizedWeight) and kept.lm_head.qtype == "q6_k"  # type: ignore[attr-defined]
    assert not any(p.dtype == torch.uint8 for p in kept.parameters())  # type: ignore[attr-defined]


def test_greedy_tokens_match_transformers(moe_files: tuple[Path, Path]) -> None:
    """The file dequantised (float kernels) gives transformers' greedy tokens exactly; kept in its
    blocks (8-bit activations into the integer kernels), it gives them too, except that it may take
    the other branch where transformers' top two logits are a near-tie (within the activation
    rounding, 2 % of the logits' range here), never elsewhere."""
    from transformers import AutoModelForCausalLM

    path, ref_dir = moe_files
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [random_tokens(n, 400, seed=n) for n in (7, 23, 40)]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    plain = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_tokens=1024)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == want
    kept = LLM(str(path), quantization="gguf", dtype="float32", max_model_len=128, kv_cache_tokens=1024)
    for prompt, ours, ref in zip(prompts, [o.outputs[0].token_ids for o in kept.generate(prompts, params)], want):
        if ours == ref:
            continue
        i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1]
        gap = float(logits[ref[i]] - logits[ours[i]])
        assert gap <= 0.02 * float(logits.max() - logits.min()), (prompt, i, ours, ref, gap)
