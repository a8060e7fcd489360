"""Each family's logits against transformers' (eager attention), float32, through a prefill and
decode steps on a paged cache with shuffled blocks; and each family's GGUF copy loads into exactly
the HF folder's parameters with the same config.

Logits, not only argmax: the final soft-cap (Gemma 2) and Granite's logits divisor are monotonic,
so greedy tokens alone would not see them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from server.models.loader import load_model
from tests.families.conftest import FAMILIES
from tests.models.paged_harness import PagedRun, hf_logits, random_tokens


@pytest.mark.parametrize("arch", FAMILIES)
def test_logits_match_transformers_through_prefill_and_decode(family_model: Callable[[str, str], Path],
                                                              arch: str) -> None:
    hf_dir = family_model(arch, "hf")
    model, config = load_model(hf_dir)
    tokens = random_tokens(72, config.vocab_size, seed=2)  # past the windows and Phi-3's threshold
    run = PagedRun(model)
    # Two sequences in one batch, then decode steps; for Phi-3 the first stays within its 64
    # original positions (short factors) and the second is beyond them from its prompt on (long),
    # which is what one transformers forward over the whole sequence picks as well.
    first = run.step({0: tokens[:40], 1: tokens[:66]})
    ours = {0: [first[0]], 1: [first[1]]}
    for i in range(3):
        step = run.step({0: [tokens[40 + i]], 1: [tokens[66 + i]]})
        ours[0].append(step[0])
        ours[1].append(step[1])
    for sid, n in ((0, 43), (1, 69)):
        ref = hf_logits(hf_dir, tokens[:n])
        got = torch.cat(ours[sid])
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4, msg=f"{arch} sequence {sid}")


# Layers pagewire::decode_layer expresses, per tiny family config (DecoderLayer.fusable): all of
# them, Gemma's four norms, OLMo's post-norms and projection q/k norm, Phi-3's partial rotary,
# SmolLM3's NoPE layer, Granite's residual multiplier and Gemma 4's parts included; the sparse
# layers of the mixture-of-experts families too (decode_layer's attention half, then moe_decode;
# gpt-oss's fp32-weight norm only in bf16/fp16 keeps its layers in Python, and these load float32),
# GLM-4.5's per-head q/k norm on half-rotary heads (use_qk_norm) too.
_FUSED = {"gemma2": (4, 4), "gemma3": (6, 6), "gemma4": (6, 6), "phi3": (2, 2), "olmo2": (2, 2), "olmo3": (4, 4),
          "smollm3": (4, 4), "granite": (2, 2), "qwen3moe": (3, 3), "mixtral": (2, 2), "olmoe": (2, 2), "qwen2moe": (2, 2),
          "gpt_oss": (4, 4), "dots1": (3, 3), "glm4_moe": (3, 3), "ernie4_5_moe": (3, 3)}


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_fused_layer_choice_is_explicit(family_model: Callable[[str, str], Path], arch: str) -> None:
    model, _ = load_model(family_model(arch, "hf"))
    fused, total = _FUSED[arch]
    assert [layer.fusable for layer in model._layers].count(True) == fused  # type: ignore[attr-defined]
    assert f"fused decode_layer (CPU, up to 16 tokens) for {fused} of {total};" in model.summary()


@pytest.mark.parametrize("arch", FAMILIES)
def test_gguf_copy_holds_exactly_the_hf_parameters(family_model: Callable[[str, str], Path], arch: str) -> None:
    g_model, g_cfg = load_model(family_model(arch, "gguf"))
    h_model, h_cfg = load_model(family_model(arch, "hf"))
    hp = dict(h_model.named_parameters())  # type: ignore[attr-defined]
    for name, p in g_model.named_parameters():  # type: ignore[attr-defined]
        assert torch.equal(p, hp[name]), name
    for field in ("architecture", "num_layers", "head_dim", "layer_sliding_windows", "norm_placement", "activation",
                  "qk_norm", "qk_norm_over", "fused_checkpoint", "tie_word_embeddings"):
        assert getattr(g_cfg, field) == getattr(h_cfg, field), field
    for field in ("attention_scale", "attn_logit_softcap", "final_logit_softcap", "embedding_multiplier",
                  "residual_multiplier", "logits_divisor"):
        assert getattr(g_cfg, field) == pytest.approx(getattr(h_cfg, field), rel=1e-6), field
    # The same table per layer (the GGUF side may hold two equal tables as one); the file's
    # longrope factors are float32, as transformers' tables use them.
    for g, h in zip(g_cfg.layer_ropes, h_cfg.layer_ropes):
        assert (g is None) == (h is None)
        if g is not None and h is not None:
            gr, hr = g_cfg.ropes[g], h_cfg.ropes[h]
            assert (gr.theta, gr.rotary_dim) == (hr.theta, hr.rotary_dim)
            assert (gr.scaling is None) == (hr.scaling is None)
            if gr.scaling is not None and hr.scaling is not None:
                assert gr.scaling.rope_type == hr.scaling.rope_type
                assert gr.scaling.factor == pytest.approx(hr.scaling.factor)
                assert gr.scaling.long_factor == pytest.approx(hr.scaling.long_factor)
                assert gr.scaling.attention_factor == pytest.approx(hr.scaling.attention_factor)


@pytest.mark.parametrize("arch", FAMILIES)
def test_plan_counts_what_each_family_loads(family_model: Callable[[str, str], Path], arch: str,
                                            tmp_path: Path) -> None:
    """`pagewire plan` counts exactly the bytes a family's model holds: float32 from the HF
    folder, and with --quantization gguf the Q8_0 blocks kept from a GGUF file (Phi-3's fused
    attn_qkv / ffn_up included)."""
    from server.engine.config import EngineConfig
    from server.engine.plan import make_plan, read_model_config
    from server.kernels.quant import QuantizedExperts, QuantizedWeight
    from tests.gateway.test_plan import _loaded_weight_bytes
    from tests.gguf_files import write_gguf

    hf_dir = family_model(arch, "hf")
    model, _ = load_model(hf_dir, dtype="float32")
    config = EngineConfig(str(hf_dir), dtype="float32", kv_cache_tokens=1024)
    assert make_plan("m", read_model_config(hf_dir), config, None, None).weights.total == _loaded_weight_bytes(model)

    path = write_gguf(tmp_path / f"{arch}-q8.gguf", hf_dir, "Q8_0")
    kept, _ = load_model(path, dtype="float32", keep_gguf_blocks=True)
    layer = kept._layers[0]  # type: ignore[attr-defined]
    assert isinstance(layer.qkv_weight, QuantizedWeight)
    if layer.moe is None:
        assert isinstance(layer.gate_up_weight, QuantizedWeight)
    else:  # a sparse layer: its experts' Q8_0 blocks, as the file's ffn_*_exps hold them
        assert isinstance(layer.moe.experts_gate_up, QuantizedExperts)
        assert isinstance(layer.moe.experts_down, QuantizedExperts)
    config = EngineConfig(str(path), dtype="float32", quantization="gguf", kv_cache_tokens=1024)
    assert make_plan("m", read_model_config(path), config, None, None).weights.total == _loaded_weight_bytes(kept)
    # The kept blocks compute what the dequantised file computes (same values, other kernels).
    plain, _ = load_model(path, dtype="float32")
    tokens = random_tokens(30, plain.config.vocab_size, seed=4)
    a, b = PagedRun(kept).step({0: tokens})[0], PagedRun(plain).step({0: tokens})[0]
    if plain.config.is_moe:
        # The experts run the integer kernels at every prefill size (a few rows per expert), so
        # their activations are 8-bit where the dense matrices' prefill dequantises; and a token
        # whose k-th and (k+1)-th experts are near-tied may route the other way: most rows agree.
        # Each token is its own sequence here, so one such flip changes its own row only, not
        # every later row through attention (in gpt-oss's tiny config one flip at token 8 of a
        # 30-token prompt moved 15 later rows past the bound).
        batch = {i: [t] for i, t in enumerate(tokens)}
        a = torch.cat(list(PagedRun(kept).step(batch).values()))
        b = torch.cat(list(PagedRun(plain).step(batch).values()))
        rows = (a - b).abs().amax(-1) <= 0.05 * b.abs().amax()
        assert rows.float().mean() >= 0.9 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    else:
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_phi3_full_rotary_longrope_runs_fused_and_matches(tiny_model: Callable[..., Path]) -> None:
    """Phi-3-mini's shape of the part: longrope over the whole head. Its layers are ones
    decode_layer expresses; the long table's rows reach the C++ layer as positions, so decode
    steps (fused) on both sides of the threshold still give transformers' logits."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.5 + 0.5 * i for i in range(8)]}
    hf_dir = tiny_model("phi3", rope_parameters=rope)
    model, config = load_model(hf_dir)
    assert all(layer.fusable for layer in model._layers)  # type: ignore[attr-defined]
    tokens = random_tokens(72, config.vocab_size, seed=6)
    run = PagedRun(model)
    first = run.step({0: tokens[:40], 1: tokens[:66]})
    ours = {0: [first[0]], 1: [first[1]]}
    for i in range(3):
        step = run.step({0: [tokens[40 + i]], 1: [tokens[66 + i]]})
        ours[0].append(step[0])
        ours[1].append(step[1])
    for sid, n in ((0, 43), (1, 69)):
        torch.testing.assert_close(torch.cat(ours[sid]), hf_logits(hf_dir, tokens[:n]), atol=2e-4, rtol=1e-4)


def test_gemma4_conditional_generation_folder_serves_its_language_model(
        family_model: Callable[[str, str], Path], tmp_path: Path) -> None:
    """A Gemma4ForConditionalGeneration folder (config under text_config, tensors under
    model.language_model., vision and audio towers beside them) loads as its language model:
    the same logits as the text model's folder, the towers skipped."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    hf_dir = family_model("gemma4", "hf")
    out = tmp_path / "gemma4-mm"
    shutil.copytree(hf_dir, out)
    text = json.loads((hf_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({"architectures": ["Gemma4ForConditionalGeneration"],
                                                 "model_type": "gemma4", "text_config": text,
                                                 "tie_word_embeddings": text["tie_word_embeddings"]}))
    state = load_file(str(hf_dir / "model.safetensors"))
    wrapped = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
               for k, v in state.items()}
    wrapped["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = torch.zeros(4, 4)
    save_file(wrapped, str(out / "model.safetensors"), metadata={"format": "pt"})
    model, config = load_model(out)
    plain, _ = load_model(hf_dir)
    assert config.architecture == "Gemma4ForConditionalGeneration" and config.layer_kv_sources[-2:] == (3, 2)
    tokens = random_tokens(40, config.vocab_size, seed=7)
    assert torch.equal(PagedRun(model).step({0: tokens})[0], PagedRun(plain).step({0: tokens})[0])


def test_gemma4_gguf_keeps_every_attention_matrix_in_blocks(family_model: Callable[[str, str], Path],
                                                            tmp_path: Path) -> None:
    """--quantization gguf on Gemma 4: each layer's qkv is stacked from the tensors that layer
    projects (a global layer's attn_q and attn_k: its values are its keys; a KV-sharing layer's
    attn_q alone), so every attention matrix stays in its Q8_0 blocks, with the layer's own rows.
    The kept model computes what the dequantised file computes: a prefill (over 16 rows the
    kernels dequantise the blocks) gives the same floats; decode steps run the integer kernels
    (8-bit activations), fused exactly as the Python layers, within a few % of the float logits."""
    from server.kernels.quant import QuantizedWeight
    from tests.gguf_files import write_gguf

    path = write_gguf(tmp_path / "gemma4-q8.gguf", family_model("gemma4", "hf"), "Q8_0")
    kept, config = load_model(path, dtype="float32", keep_gguf_blocks=True)
    layers = kept._layers  # type: ignore[attr-defined]
    assert {(layer.shares_kv, layer.value_from_key) for layer in layers} == {(False, False), (False, True), (True, False)}
    for layer in layers:
        assert isinstance(layer.qkv_weight, QuantizedWeight) and isinstance(layer.o_weight, QuantizedWeight)
        own_kv = 0 if layer.shares_kv else (1 if layer.value_from_key else 2) * layer.kv_size
        assert layer.qkv_weight.shape == (layer.q_size + own_kv, config.hidden_size)
        assert layer.o_weight.shape == (config.hidden_size, layer.q_size)
    plain, _ = load_model(path, dtype="float32")
    tokens = random_tokens(40, config.vocab_size, seed=4)
    fused, python, ref = PagedRun(kept), PagedRun(kept), PagedRun(plain)

    def step(run: PagedRun, new: dict[int, list[int]], on: bool) -> dict[int, torch.Tensor]:
        kept.fused_decode = on  # type: ignore[attr-defined]
        return run.step(new)

    prefill = {0: tokens[:30], 1: tokens[:12]}
    a, b, c = step(fused, prefill, True), step(python, prefill, False), ref.step(prefill)
    assert all(torch.equal(a[s], c[s]) and torch.equal(b[s], c[s]) for s in prefill)
    for i, t in enumerate(tokens[30:33]):
        new = {0: [t], 1: [t]}
        a, b, c = step(fused, new, True), step(python, new, False), ref.step(new)
        for s in new:
            assert torch.equal(a[s], b[s])
            if i == 0:  # the first decode step over the same context: only its own rounding
                assert (a[s] - c[s]).abs().max() <= 0.05 * c[s].abs().max()
