"""The demo model folder: built once, deterministic, loadable by transformers, usable tokenizer."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from server.models.demo_model import (
    BOS_TOKEN,
    DEMO_MODEL_NAME,
    EOS_TOKEN,
    IM_END,
    IM_START,
    build_tokenizer,
    ensure_demo_model,
)
from server.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


def test_builds_a_complete_llama_folder(model_dir: Path) -> None:
    assert model_dir.name == DEMO_MODEL_NAME
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"]) == (256, 4, 8, 4, 512)
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0
    assert cfg["vocab_size"] == Tokenizer.from_dir(model_dir).vocab_size == 2000
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.3.self_attn.k_proj.weight").shape == (4 * 32, 256)
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    per_layer = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                 "post_attention_layernorm"}
    want = {f"model.layers.{i}.{n}.weight" for i in range(4) for n in per_layer}
    want |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert keys == want


def test_second_call_reuses_the_cached_folder(model_dir: Path) -> None:
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(model_dir.parent) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_builds_are_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = ensure_demo_model(tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_tokenizer_round_trips_and_chat_template_renders(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    for text in ["The lighthouse keeper counts the boats.", "café 東京 🎉", "  spaced\nlines\t"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids) == text
    assert tok.eos_token_ids == {tok.token_to_id(EOS_TOKEN), tok.token_to_id(IM_END)}
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert prompt == f"{BOS_TOKEN}{IM_START}user\nHello{IM_END}\n{IM_START}assistant\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [tok.bos_token_id, tok.token_to_id(IM_START)]
    # Ordinary English from the corpus compresses well: trained merges, not just bytes.
    assert len(tok.encode(" the river", add_special_tokens=False)) == 2


def test_transformers_loads_it_and_logits_are_well_spread(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.tensor([Tokenizer.from_dir(model_dir).encode("The market opens on Saturdays")])
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert logits.shape == (ids.shape[1], 2000)
    assert logits.dtype == torch.float32
    top2 = logits.topk(2, dim=-1).values
    # Greedy comparisons between implementations need margins far above float32 noise.
    assert logits.std() > 1.0 and (top2[:, 0] - top2[:, 1]).max() > 1e-2


def test_build_tokenizer_reports_ids_for_other_tiny_models(tmp_path: Path) -> None:
    info = build_tokenizer(tmp_path, vocab_size=600)
    tok = Tokenizer.from_dir(tmp_path)
    assert info.vocab_size == tok.vocab_size == 600
    assert info.bos_token_id == tok.bos_token_id
    assert set(info.eos_token_ids) == tok.eos_token_ids
    assert tok.decode(tok.encode("A small vocabulary still round-trips ✓")) == "A small vocabulary still round-trips ✓"
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path, vocab_size=100)


def test_module_does_not_import_transformers() -> None:
    code = "import sys, server.models.demo_model; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent).returncode == 0
