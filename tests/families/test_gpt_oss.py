"""gpt-oss beyond what every family is checked for (tests/families/test_family_*.py run its float
folder and F32 GGUF copy against transformers): YaRN as transformers' gpt-oss builds it, the config
translation, and MXFP4 experts as the checkpoints ship them -- decoded exactly (equal to a float64
decode of the blocks), the MXFP4 folder giving transformers' greedy tokens (transformers dequantises
it on CPU), and the GGUF copy with MXFP4 experts holding exactly the folder's parameters and logits.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from server import LLM, SamplingParams
from server.models.config import ModelLoadError, UnsupportedModelError
from server.models.loader import load_model
from server.models.registry import config_from_hf
from server.models.rope import RotaryEmbedding, rope_inv_freq
from tests.families.test_families_vs_transformers import hf_greedy
from tests.gguf_files import write_gguf
from tests.gpt_oss_files import decode_reference, hf_unpack, write_mxfp4_folder
from tests.models.paged_harness import PagedRun, random_tokens


@pytest.fixture(scope="module")
def mxfp4_dir(family_model: Callable[[str, str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mxfp4_folder(family_model("gpt_oss", "hf"), tmp_path_factory.mktemp("gpt-oss-mxfp4") / "m")


@pytest.mark.parametrize("orig,head_dim", [(4096, 64), (64, 32)])
def test_yarn_tables_equal_transformers_gpt_oss_rotary_embedding(orig: int, head_dim: int) -> None:
    """gpt-oss's YaRN (factor 32, beta 32/1, truncate false): the checkpoints' own parameters, and the
    tiny config's short original context whose ramp covers the tiny head's frequencies."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": orig}
    raw = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim, "num_hidden_layers": 2,
           "intermediate_size": 32, "vocab_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2,
           "max_position_embeddings": 32 * orig, "sliding_window": 128, "rope_parameters": rope}
    ours = config_from_hf(raw)
    spec = ours.ropes[0]
    assert spec.scaling is not None and spec.scaling.truncate is False
    hf = GptOssRotaryEmbedding(GptOssConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    assert torch.equal(rope_inv_freq(head_dim, spec.theta, spec.scaling), hf.inv_freq)
    assert spec.scaling.attention_factor == pytest.approx(hf.attention_scaling, rel=1e-12)
    positions = torch.arange(0, 4096, 7)
    cos_hf, sin_hf = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    table = RotaryEmbedding(head_dim, 4096, spec.theta, spec.scaling)
    cos, sin = table.lookup(positions, torch.float32)
    assert torch.equal(cos[:, 0], cos_hf[0]) and torch.equal(sin[:, 0], sin_hf[0])


def test_config_translation(family_model: Callable[[str, str], Path], mxfp4_dir: Path) -> None:
    hf_dir = family_model("gpt_oss", "hf")
    raw = json.loads((hf_dir / "config.json").read_text())
    c = config_from_hf(raw)
    assert c.layer_sliding_windows == (24, None, 24, None)  # even layers slide
    assert c.layer_mlp_kinds == ("sparse",) * 4 and (c.num_experts, c.num_experts_per_tok) == (8, 2)
    assert (c.moe_router, c.moe_activation, c.moe_bias, c.attention_sinks) == ("topk_softmax", "swiglu_oai", True, True)
    assert (c.swiglu_alpha, c.swiglu_limit, c.qkv_bias, c.o_bias) == (1.702, 7.0, True, True)
    assert c.experts_quantization == ""
    assert config_from_hf(json.loads((mxfp4_dir / "config.json").read_text())).experts_quantization == "mxfp4"
    # The checkpoints' transformers-4 layout: rope_scaling beside rope_theta, experts_per_token.
    params = dict(raw.pop("rope_parameters"))
    v4 = {**raw, "rope_theta": params.pop("rope_theta"), "rope_scaling": params, "experts_per_token": 2}
    del v4["num_experts_per_tok"]
    assert config_from_hf(v4).ropes == c.ropes and config_from_hf(v4).num_experts_per_tok == 2
    with pytest.raises(UnsupportedModelError, match="quantization_config.quant_method 'awq'"):
        config_from_hf({**raw, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        config_from_hf({**raw, "num_experts_per_tok": 9})


def test_mxfp4_experts_decode_exactly(mxfp4_dir: Path) -> None:
    """Every expert value equals a float64 decode of the checkpoint's blocks and scales (the gate/up
    rows de-interleaved: even rows are gate, odd rows up)."""
    model, _ = load_model(mxfp4_dir)
    state = load_file(str(mxfp4_dir / "model.safetensors"))
    for i, layer in enumerate(model._layers):  # type: ignore[attr-defined]
        x = f"model.layers.{i}.mlp.experts."
        gu = decode_reference(hf_unpack(state[x + "gate_up_proj_blocks"].numpy()), state[x + "gate_up_proj_scales"].numpy())
        dn = decode_reference(hf_unpack(state[x + "down_proj_blocks"].numpy()), state[x + "down_proj_scales"].numpy())
        want_gu = np.concatenate([gu[:, 0::2], gu[:, 1::2]], axis=1)
        assert torch.equal(layer.moe.experts_gate_up.double(), torch.from_numpy(want_gu)), i
        assert torch.equal(layer.moe.experts_down.double(), torch.from_numpy(dn)), i


@pytest.mark.slow  # transformers' greedy decode of three prompts, as the family tests' (slow) ones
def test_mxfp4_folder_matches_transformers(mxfp4_dir: Path) -> None:
    """A mixed-length batch (past the 24-token windows) from the MXFP4 folder gives transformers'
    greedy tokens for the same folder."""
    import random

    rng = random.Random(7)
    vocab = json.loads((mxfp4_dir / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(30, 90))] for _ in range(3)]
    llm = LLM(str(mxfp4_dir), max_model_len=256, kv_cache_tokens=4096)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(mxfp4_dir, p) for p in prompts]


def test_mxfp4_gguf_holds_the_folders_parameters_and_logits(mxfp4_dir: Path, tmp_path: Path) -> None:
    """llama.cpp's layout of the same model (architecture `gpt-oss`, experts as GGML MXFP4 with gate
    and up apart, F32 elsewhere) loads into exactly the folder's parameters and logits."""
    path = write_gguf(tmp_path / "gpt-oss-mxfp4.gguf", mxfp4_dir, "F32")
    from server.models.gguf_file import GGUFFile

    kinds = {t.type_name for t in GGUFFile.open(path).tensors.values() if "_exps.weight" in t.name}
    assert kinds == {"MXFP4"}
    g_model, g_cfg = load_model(path)
    h_model, h_cfg = load_model(mxfp4_dir)
    hp = dict(h_model.named_parameters())  # type: ignore[attr-defined]
    for name, p in g_model.named_parameters():  # type: ignore[attr-defined]
        assert torch.equal(p, hp[name]), name
    assert g_cfg.ropes == h_cfg.ropes and g_cfg.layer_sliding_windows == h_cfg.layer_sliding_windows
    tokens = random_tokens(60, g_cfg.vocab_size, seed=3)
    a = PagedRun(g_model).step({0: tokens})[0]  # type: ignore[arg-type]
    b = PagedRun(h_model).step({0: tokens})[0]  # type: ignore[arg-type]
    assert torch.equal(a, b)


def test_mxfp4_gguf_experts_stay_in_their_blocks(mxfp4_dir: Path, tmp_path: Path) -> None:
    """--quantization gguf keeps the file's MXFP4 experts as they are (moe_experts runs the 4-bit
    integer kernels on their blocks): the bytes the file holds, and each MoE layer's output equal to
    the decoded load's up to the kernels' 8-bit activation rounding (the logits are not compared:
    this tiny model's clamps and near-tied routes turn such rounding into other routes)."""
    from server.kernels.quant import QuantizedExperts

    path = write_gguf(tmp_path / "gpt-oss-mxfp4.gguf", mxfp4_dir, "F32")
    kept, _ = load_model(path, keep_gguf_blocks=True)
    plain, cfg = load_model(path)
    moe = kept._layers[0].moe  # type: ignore[attr-defined]
    assert isinstance(moe.experts_gate_up, QuantizedExperts) and moe.experts_gate_up.qtype == "mxfp4"
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert moe.experts_gate_up.nbytes + moe.experts_down.nbytes == 3 * E * I * H // 32 * 17
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(5))
    for i, layer in enumerate(kept._layers):  # type: ignore[attr-defined]
        a, b = layer.moe(x), plain._layers[i].moe(x)  # type: ignore[attr-defined]
        torch.testing.assert_close(a, b, atol=3e-2 * float(b.abs().max()), rtol=0)
