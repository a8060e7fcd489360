"""load_model reads HF folders into fused parameters, and every failure names the tensor and the file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from server.models import SUPPORTED_ARCHITECTURES, ModelFileNotFoundError, ModelLoadError, UnsupportedModelError
from server.models.loader import load_model
from tests.models.paged_harness import VOCAB
from tests.tiny_models import make_tiny_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_fused_qkv_and_gate_up_hold_the_checkpoint_pieces(tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs["qwen3"]
    model, config = load_model(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
        k = f.get_tensor("model.layers.1.self_attn.k_proj.weight")
        v = f.get_tensor("model.layers.1.self_attn.v_proj.weight")
        gate = f.get_tensor("model.layers.1.mlp.gate_proj.weight")
        up = f.get_tensor("model.layers.1.mlp.up_proj.weight")
        k_norm = f.get_tensor("model.layers.1.self_attn.k_norm.weight")
    layer = model.layers[1]
    assert torch.equal(layer.qkv_weight, torch.cat([q, k, v]))
    assert torch.equal(layer.gate_up_weight, torch.cat([gate, up]))
    assert torch.equal(layer.qk_norm[config.num_heads :], k_norm.expand(config.num_kv_heads, -1))
    assert config.head_dim == 32 and config.q_size == 128  # explicit head_dim, not hidden / heads
    assert model.kv_cache_shape(10, 16) == (10, config.num_kv_heads, 16, 32)
    assert model.kv_cache_bytes_per_token() == 2 * config.num_layers * config.num_kv_heads * 32 * 4
    assert not any(p.requires_grad for p in model.parameters())


def test_dtype_auto_follows_the_checkpoint_and_can_be_overridden(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "bf16", "llama", "bfloat16", vocab_size=VOCAB)
    assert load_model(model_dir)[0].embed_tokens.dtype == torch.bfloat16
    model, _ = load_model(model_dir, dtype="float32")
    assert model.dtype == torch.float32 and model.layers[0].qkv_weight.dtype == torch.float32
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(model_dir, dtype="int8")


def test_missing_tensor_names_tensor_and_file(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dirs["llama"], tmp_path / "m")
    weights = model_dir / "model.safetensors"
    _rewrite_tensors(weights, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError) as err:
        load_model(model_dir)
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert str(weights) in str(err.value)


def test_missing_tensor_in_a_shard_names_the_shard(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "sharded", "llama", vocab_size=VOCAB, num_shards=2)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.k_proj.weight"
    shard = model_dir / index[name]
    _rewrite_tensors(shard, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=rf"{name}.*{shard.name}"):
        load_model(model_dir)


def test_mis_shaped_tensor_names_tensor_file_and_shapes(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dirs["qwen2"], tmp_path / "m")
    weights = model_dir / "model.safetensors"
    name = "model.layers.0.self_attn.v_proj.bias"
    _rewrite_tensors(weights, lambda t: t.__setitem__(name, torch.zeros(7)))
    with pytest.raises(ModelLoadError) as err:
        load_model(model_dir)
    msg = str(err.value)
    assert name in msg and str(weights) in msg and "[7]" in msg and "[32]" in msg


def test_unexpected_tensor_is_an_error_naming_it(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dirs["llama"], tmp_path / "m")
    extra = "model.layers.0.mlp.up_proj.bias"
    _rewrite_tensors(model_dir / "model.safetensors", lambda t: t.__setitem__(extra, torch.zeros(128)))
    with pytest.raises(ModelLoadError, match=extra):
        load_model(model_dir)


def test_rotary_inv_freq_buffers_are_ignored(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dirs["llama"], tmp_path / "m")
    _rewrite_tensors(
        model_dir / "model.safetensors",
        lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)),
    )
    load_model(model_dir)


def test_unsupported_architecture_lists_the_supported_ones(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dirs["llama"], tmp_path / "m")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as err:
        load_model(model_dir)
    assert "GPT2LMHeadModel" in str(err.value)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_missing_folder_config_and_weights_name_the_path(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ModelFileNotFoundError, match=str(tmp_path / "nowhere")):
        load_model(tmp_path / "nowhere")

    no_config = _copy(tiny_model_dirs["llama"], tmp_path / "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=str(no_config / "config.json")):
        load_model(no_config)

    no_weights = _copy(tiny_model_dirs["llama"], tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelFileNotFoundError, match=str(no_weights / "model.safetensors")):
        load_model(no_weights)


def test_missing_shard_file_names_the_shard(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "sharded", "llama", vocab_size=VOCAB, num_shards=2)
    shard = model_dir / "model-00002-of-00002.safetensors"
    shard.unlink()
    with pytest.raises(ModelFileNotFoundError, match=str(shard)):
        load_model(model_dir)


def test_tied_config_with_a_stored_lm_head_follows_transformers(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "tied", "llama", vocab_size=VOCAB, tie_word_embeddings=True)
    weights = model_dir / "model.safetensors"
    # An identical copy (as some exporters write): loads, and stays one shared matrix.
    _rewrite_tensors(weights, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    model, _ = load_model(model_dir)
    assert model.lm_head is model.embed_tokens
    # A different matrix: transformers 5 then unties and projects with the stored lm_head.
    other = torch.randn(VOCAB, 64)
    _rewrite_tensors(weights, lambda t: t.__setitem__("lm_head.weight", other))
    model, _ = load_model(model_dir)
    assert model.lm_head is not model.embed_tokens and torch.equal(model.lm_head, other)
