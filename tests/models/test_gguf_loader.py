"""GGUF files load into the same model as the Hugging Face folder they were converted from; every
tensor type dequantises as an independent reference does; bad files fail naming file and tensor/key.

The files are written by the tests themselves (tests.gguf_files) from tiny random checkpoints.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from server import LLM, SamplingParams
from server.models import ModelFileNotFoundError, ModelLoadError, UnsupportedModelError
from server.models.gguf_file import GGUFFile
from server.models.loader import load_model
from server.text.loader import load_tokenizer
from server.text.tokenizer import TokenizerError
from tests.gguf_files import K_BLOCK_BYTES, llama_cpp_permute, write_gguf
from tests.models.paged_harness import ARCHS, VOCAB
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def f32_files(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_f32")
    out = {}
    for arch in ARCHS:
        window = 24 if arch == "mistral" else None  # tiny_models' Mistral window
        out[arch] = write_gguf(root / f"{arch}.gguf", tiny_model_dirs[arch], "F32", sliding_window=window)
    return out


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_holds_exactly_the_hf_weights(arch: str, f32_files: dict[str, Path],
                                                tiny_model_dirs: dict[str, Path]) -> None:
    g_model, g_cfg = load_model(f32_files[arch])
    h_model, h_cfg = load_model(tiny_model_dirs[arch])
    # Equal weights mean the name map, the fused layout and (Llama/Mistral) the Q/K un-permutation
    # are all right: a wrong row order would put other heads' rows in q/k.
    hp = _params(h_model)
    for name, p in _params(g_model).items():
        assert torch.equal(p, hp[name]), name
    assert g_cfg.architecture == h_cfg.architecture
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size", "qkv_bias", "qk_norm", "tie_word_embeddings", "layer_sliding_windows",
                  "max_position_embeddings", "bos_token_id", "eos_token_ids"):
        assert getattr(g_cfg, field) == getattr(h_cfg, field), field
    assert g_cfg.rms_norm_eps == pytest.approx(h_cfg.rms_norm_eps, rel=1e-6)
    if arch == "mistral":
        assert g_cfg.sliding_window == 24


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_from_gguf_equal_the_hf_folder(arch: str, tiny_model: Callable[..., Path],
                                                    tmp_path: Path) -> None:
    hf_dir = tiny_model(arch)  # with the demo tokenizer, so the engine can run the folder too
    gguf_path = write_gguf(tmp_path / "m.gguf", hf_dir, sliding_window=24 if arch == "mistral" else None)
    prompts = [[5 + (i * 7 + j * 13) % 250 for j in range(n)] for i, n in enumerate((3, 30, 61))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw: dict[str, Any] = dict(max_model_len=256, kv_cache_tokens=1024)
    g = [o.outputs[0].token_ids for o in LLM(str(gguf_path), **kw).generate(prompts, params)]
    h = [o.outputs[0].token_ids for o in LLM(str(hf_dir), **kw).generate(prompts, params)]
    assert g == h and all(len(t) == 12 for t in g)


def _unpermute_reference(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute, by brute force: find where each HF row went."""
    rows = w.shape[0]
    index = np.arange(rows, dtype=np.float32)[:, None]
    moved = llama_cpp_permute(index, n_heads)[:, 0].astype(np.int64)  # gguf row r holds HF row moved[r]
    out = torch.empty_like(w)
    out[torch.from_numpy(moved)] = w
    return out


@pytest.fixture(scope="module")
def k_sized_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows of 256 values, the K-quant super-block size; 1 layer keeps it quick."""
    return make_tiny_model(tmp_path_factory.mktemp("k_sized") / "llama", "llama", vocab_size=VOCAB,
                           hidden_size=256, intermediate_size=256, num_hidden_layers=1)


# (type, max abs error vs the original weights; None: K-quant blocks are random, compare only to the reference)
# (the IQ types after IQ4_XS have no kernel: dequantised at load)
QUANT_CASES = [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 0.02), ("Q4_0", 0.15), ("Q4_1", 0.1),
               ("Q4_K", None), ("Q5_K", None), ("Q6_K", None), ("Q3_K", None), ("Q2_K", None), ("IQ4_NL", None),
               ("IQ4_XS", None), ("IQ3_S", None), ("IQ3_XXS", None), ("IQ2_S", None), ("IQ2_XS", None),
               ("IQ2_XXS", None), ("IQ1_S", None)]


@pytest.mark.parametrize("qtype,tolerance", QUANT_CASES)
def test_every_supported_type_dequantises_like_an_independent_reference(
    qtype: str, tolerance: float | None, k_sized_model: Path, tmp_path: Path
) -> None:
    from gguf import GGMLQuantizationType
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    path = write_gguf(tmp_path / f"{qtype}.gguf", k_sized_model, qtype)
    model, config = load_model(path, dtype="float32")
    hf_model, _ = load_model(k_sized_model)
    layer, hf_layer = model.layers[0], hf_model.layers[0]
    f = GGUFFile.open(path)
    q, kv = config.q_size, config.kv_size
    checks = {
        "blk.0.attn_q.weight": (layer.qkv_weight[:q], config.num_heads, hf_layer.qkv_weight[:q]),
        "blk.0.attn_k.weight": (layer.qkv_weight[q:q + kv], config.num_kv_heads, hf_layer.qkv_weight[q:q + kv]),
        "blk.0.ffn_down.weight": (layer.down_weight, None, hf_layer.down_weight),
        "token_embd.weight": (model.embed_tokens, None, hf_model.embed_tokens),
    }
    for name, (loaded, heads, original) in checks.items():
        t = f.tensors[name]
        assert t.type_name == qtype
        raw = torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(-1)
        if qtype in ("F16", "BF16"):
            ref = raw.view(torch.float16 if qtype == "F16" else torch.bfloat16).float()
        else:
            ref = hf_dequantize(raw, int(GGMLQuantizationType[qtype]))
        ref = ref.reshape(t.shape)
        if heads is not None:
            ref = _unpermute_reference(ref, heads)
        assert torch.equal(loaded, ref), name
        if tolerance is not None:
            assert (loaded - original).abs().max().item() < tolerance, name
    if qtype in K_BLOCK_BYTES:
        assert torch.isfinite(model.layers[0].gate_up_weight).all()


def test_dtype_auto_and_explicit(k_sized_model: Path, tmp_path: Path) -> None:
    q = write_gguf(tmp_path / "q8.gguf", k_sized_model, "Q8_0")
    assert load_model(q)[0].dtype == torch.float32  # quantised: exact fp32 dequantisation
    model, _ = load_model(q, dtype="bfloat16")
    assert model.layers[0].qkv_weight.dtype == torch.bfloat16 and model.norm.dtype == torch.bfloat16
    f16 = write_gguf(tmp_path / "f16.gguf", k_sized_model, "F16")
    assert load_model(f16)[0].dtype == torch.float16


def test_llama_arch_with_sliding_window_metadata_slides(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", tiny_model_dirs["mistral"], arch="llama", sliding_window=24)
    _, config = load_model(path)
    assert config.layer_sliding_windows == (24,) * config.num_layers


# -- errors name the file and the tensor or key ----------------------------------------------------


def test_unknown_architecture_lists_the_supported_ones(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "f.gguf", tiny_model_dirs["llama"], arch="falcon")
    with pytest.raises(UnsupportedModelError, match=r"'falcon'.*llama, mistral, qwen2, qwen3") as e:
        load_model(path)
    assert "f.gguf" in str(e.value)


def test_unsupported_tensor_type_names_type_and_tensor(k_sized_model: Path, tmp_path: Path) -> None:
    """A type the `gguf` package has no dequantiser for (an integer tensor where a matrix belongs)."""
    path = write_gguf(tmp_path / "i32.gguf", k_sized_model, "I32")
    with pytest.raises(UnsupportedModelError, match=r"tensor '[\w.]+' has type I32") as e:
        load_model(path)
    assert "i32.gguf" in str(e.value) and "Q4_K" in str(e.value)


def test_q5_and_ternary_types_load_dequantised(k_sized_model: Path, tmp_path: Path) -> None:
    """llama.cpp's fallback types (a Q4_K_M file's matrices whose rows are not whole 256-value
    super-blocks are Q5_0, a Q5_K_M's Q5_1) and the ternary TQ1_0 / TQ2_0: dequantised at load by
    the `gguf` package, as the other types (transformers has no dequantiser for these)."""
    from gguf import GGMLQuantizationType, quants

    for qtype in ("Q5_0", "Q5_1", "TQ1_0", "TQ2_0"):
        path = write_gguf(tmp_path / f"{qtype}.gguf", k_sized_model, qtype)
        model, _ = load_model(path, dtype="float32")
        w = load_model(k_sized_model, dtype="float32")[0]._layers[0].o_weight  # type: ignore[attr-defined]
        want = quants.dequantize(quants.quantize(w.numpy(), GGMLQuantizationType[qtype]), GGMLQuantizationType[qtype])
        assert torch.equal(model._layers[0].o_weight, torch.from_numpy(want))  # type: ignore[attr-defined]


def test_missing_tensor_is_named(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", tiny_model_dirs["llama"], skip_tensors=["blk.1.ffn_up.weight"])
    with pytest.raises(ModelLoadError, match=r"m\.gguf: tensor 'blk\.1\.ffn_up\.weight'"):
        load_model(path)


def test_missing_metadata_key_is_named(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", tiny_model_dirs["qwen2"], drop_metadata=["qwen2.block_count"])
    with pytest.raises(ModelLoadError, match=r"m\.gguf: missing metadata key 'qwen2\.block_count'"):
        load_model(path)


def test_unknown_pre_tokenizer_names_it_and_the_known_ones(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", tiny_model_dirs["llama"], pre="made-up")
    with pytest.raises(TokenizerError, match=r"m\.gguf: .*tokenizer\.ggml\.pre.*'made-up'.*gpt-2.*smollm.*llama-bpe.*qwen2"):
        load_tokenizer(path)


@pytest.mark.parametrize("keep", [0.999, 0.6, 0.02, 0.0005])
def test_truncated_file_fails_cleanly(keep: float, f32_files: dict[str, Path], tmp_path: Path) -> None:
    data = f32_files["qwen3"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: max(5, int(len(data) * keep))])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        load_model(path)


def test_corrupt_header_fails_cleanly(f32_files: dict[str, Path], tmp_path: Path) -> None:
    data = bytearray(f32_files["llama"].read_bytes())
    path = tmp_path / "bad.gguf"
    # Tensor count and metadata count (u64 each after magic and version) claim absurd sizes.
    data[8:24] = b"\xff" * 16
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf"):
        load_model(path)
    # A string length inside the metadata pointing far past the end of the file.
    data = bytearray(f32_files["llama"].read_bytes())
    data[24:32] = (2**40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf"):
        load_model(path)


def test_not_a_gguf_and_missing_file(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(ModelLoadError, match=r"notes\.gguf: not a GGUF file"):
        load_model(text)
    with pytest.raises(ModelFileNotFoundError, match=r"GGUF file not found: .*absent\.gguf"):
        load_model(tmp_path / "absent.gguf")


def test_gguf_copy_is_reparsed_when_the_file_changes(f32_files: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    shutil.copy(f32_files["llama"], path)
    assert GGUFFile.open(path).get_str("general.architecture") == "llama"
    shutil.copy(f32_files["qwen2"], path)
    assert GGUFFile.open(path).get_str("general.architecture") == "qwen2"
