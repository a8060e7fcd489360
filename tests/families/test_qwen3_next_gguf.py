"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE from llama.cpp's GGUF forms (`qwen3next`, `qwen35`,
`qwen35moe`, server/models/qwen3_next_gguf.py), written from tiny random HF folders the way
llama.cpp's converter lays them out (tests/gguf_qwen3_next.py): an F32 copy loads into exactly
the folder's parameters and config; F32, BF16 and Q8_0 copies give transformers' greedy tokens on
a mixed-length batch, token for token -- for the BF16 and Q8_0 files, transformers runs the
weights the file holds (dequantised by the `gguf` package, every converter step undone). Also:
llama.cpp's layer-kind and MTP keys, the first converter's `ssm_in`, `--quantization gguf` (every
matrix kept, exactly the dequantised values), dtype "auto", `pagewire plan`, bad files.

The tiny Qwen3-Next has every layer sparse here: llama.cpp's qwen3next requires experts in every
layer (its converter has no name for a dense layer's MLP).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from server import LLM
from server.models.gguf_file import GGUFFile
from server.models.loader import load_model
from tests.families.test_families_vs_transformers import _greedy, _prompts, _tokens, _vocab, hf_greedy
from tests.gguf_files import write_gguf
from tests.gguf_qwen3_next import hf_state_from_gguf

HYBRIDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
GGUF_ARCH = {"qwen3_next": "qwen3next", "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}
_FILES: dict[tuple[str, str], Path] = {}


@pytest.fixture(scope="module")
def hybrid(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """hybrid(arch, "hf" | qtype): the tiny folder, or its GGUF copy of that type (built once)."""

    def make(arch: str, source: str) -> Path:
        hf_dir = tiny_model(arch, mlp_only_layers=[]) if arch == "qwen3_next" else tiny_model(arch)
        if source == "hf":
            return hf_dir
        if (arch, source) not in _FILES:
            out = tmp_path_factory.mktemp(f"{arch}-{source}") / f"{arch}-{source}.gguf"
            _FILES[arch, source] = write_gguf(out, hf_dir, source)
        return _FILES[arch, source]

    return make


def _reference_folder(hf_dir: Path, gguf_path: Path, out: Path) -> Path:
    """A transformers folder holding the weights of `gguf_path` (dequantised), with hf_dir's config."""
    if not out.exists():
        out.mkdir(parents=True)
        shutil.copy(hf_dir / "config.json", out / "config.json")
        cfg = json.loads((hf_dir / "config.json").read_text())
        save_file(hf_state_from_gguf(gguf_path, cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("arch", HYBRIDS)
def test_f32_gguf_holds_exactly_the_hf_parameters_and_config(hybrid: Callable[..., Path], arch: str) -> None:
    hf_dir, path = hybrid(arch, "hf"), hybrid(arch, "F32")
    g_model, g_cfg = load_model(path)
    h_model, h_cfg = load_model(hf_dir)
    hp = dict(h_model.named_parameters())  # type: ignore[attr-defined]
    gp = dict(g_model.named_parameters())  # type: ignore[attr-defined]
    assert gp.keys() == hp.keys()
    for name, p in gp.items():
        assert torch.equal(p, hp[name]), name
    assert g_cfg.model_type == GGUF_ARCH[arch] and g_cfg.architecture == h_cfg.architecture
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "layer_types", "linear_num_key_heads",
                  "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "conv_kernel",
                  "attn_output_gate", "qk_norm", "layer_mlp_kinds", "num_experts", "num_experts_per_tok",
                  "norm_topk_prob", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "tie_word_embeddings", "layer_ropes", "vocab_size"):
        assert getattr(g_cfg, field) == getattr(h_cfg, field), field
    assert g_cfg.norm_weight_offset == 0.0 and h_cfg.norm_weight_offset == 1.0  # the file holds 1 + w
    (g_rope,), (h_rope,) = g_cfg.ropes, h_cfg.ropes
    assert (g_rope.theta, g_rope.rotary_dim, g_rope.scaling) == (h_rope.theta, h_rope.rotary_dim, h_rope.scaling)
    assert g_cfg.attention_scale == pytest.approx(h_cfg.attention_scale, rel=1e-7)
    assert g_cfg.rms_norm_eps == pytest.approx(h_cfg.rms_norm_eps, rel=1e-6)
    # The test's own way back (used for the quantised references) gives the folder's tensors.
    want = load_file(str(hf_dir / "model.safetensors"))
    got = hf_state_from_gguf(path, json.loads((hf_dir / "config.json").read_text()))
    assert got.keys() == want.keys()
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("qtype", ["F32", "BF16", "Q8_0"])
def test_mixed_length_batch_matches_transformers(hybrid: Callable[..., Path], arch: str, qtype: str,
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    hf_dir, path = hybrid(arch, "hf"), hybrid(arch, qtype)
    ref_dir = hf_dir if qtype == "F32" else _reference_folder(hf_dir, path, path.parent / "reference")
    prompts = _prompts(4, _vocab(hf_dir), 30, 90, seed=21)
    prompts[0] = prompts[0][:3]  # shorter than the 4-tap conv window
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_tokens=4096)
    assert _tokens(llm.generate(prompts, _greedy())) == [hf_greedy(ref_dir, p) for p in prompts]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_dtype_auto_is_the_files_float_type(hybrid: Callable[..., Path], arch: str) -> None:
    """A BF16 file serves in bfloat16 although its conv kernels (and routers) are F32, as llama.cpp's
    converter always writes them; a quantised file in float32."""
    assert load_model(hybrid(arch, "BF16"))[1].torch_dtype == "bfloat16"
    assert load_model(hybrid(arch, "Q8_0"))[0].dtype == torch.float32  # type: ignore[attr-defined]


def test_layer_kinds_from_the_attention_interval_and_mtp_layers_skipped(
        hybrid: Callable[..., Path], tmp_path: Path) -> None:
    """Without `attention.recurrent_layers`, every `full_attention_interval`-th layer is full
    attention (llama.cpp's rule); with `nextn_predict_layers`, the last blocks are the multi-token
    prediction head, whose tensors are skipped."""
    hf_dir = hybrid("qwen3_5", "hf")
    path = write_gguf(tmp_path / "interval.gguf", hf_dir, "F32", drop_metadata=["qwen35.attention.recurrent_layers"],
                      extra_metadata={"qwen35.full_attention_interval": 2})
    model, config = load_model(path)
    plain, h_cfg = load_model(hf_dir)
    assert config.layer_types == h_cfg.layer_types == ("gated_deltanet", "attention") * 2
    _add_mtp_block(path, tmp_path / "mtp.gguf")
    mtp, m_cfg = load_model(tmp_path / "mtp.gguf")
    assert m_cfg.num_layers == 4 and m_cfg.layer_types == config.layer_types
    mp = dict(mtp.named_parameters())  # type: ignore[attr-defined]
    for name, p in plain.named_parameters():  # type: ignore[attr-defined]
        assert torch.equal(mp[name], p), name


def _add_mtp_block(src: Path, out: Path) -> None:
    """A copy of `src` with one more block (a copy of block 3, plus the nextn projection) and
    nextn_predict_layers = 1, as the converter writes a checkpoint's MTP head."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(src))
    hidden = int(r.fields["qwen35.embedding_length"].contents())
    extra = {"blk.4." + t.name.split(".", 2)[2]: np.array(t.data) for t in r.tensors if t.name.startswith("blk.3.")}
    extra["blk.4.nextn.eh_proj.weight"] = np.zeros((hidden, 2 * hidden), dtype=np.float32)
    _rewrite(src, out, extra=extra, metadata={"qwen35.block_count": 5, "qwen35.nextn_predict_layers": 1})


def _rewrite(src: Path, out: Path, *, drop: tuple[str, ...] = (), extra: dict[str, Any] | None = None,
             metadata: dict[str, int] | None = None) -> None:
    """A copy of the F32 file `src` without the tensors `drop`, with `extra` tensors and integer
    `metadata` keys set."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    metadata = dict(metadata or {})
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        _add(w, field, metadata.pop(field.name, field.contents()))
    for key, value in metadata.items():
        w.add_uint32(key, value)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.array(t.data))
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3_next_files_of_the_first_converter_with_ssm_in(hybrid: Callable[..., Path], tmp_path: Path) -> None:
    """llama.cpp's first qwen3next converter kept in_proj_qkvz as it is (`ssm_in`, grouped per key
    head); those files load into the same parameters as the split attn_qkv / attn_gate ones."""
    from safetensors.torch import load_file

    hf_dir, path = hybrid("qwen3_next", "hf"), hybrid("qwen3_next", "F32")
    state = load_file(str(hf_dir / "model.safetensors"))
    gdn = [i for i, t in enumerate(json.loads((hf_dir / "config.json").read_text())["layer_types"])
           if t == "linear_attention"]
    extra = {f"blk.{i}.ssm_in.weight": state[f"model.layers.{i}.linear_attn.in_proj_qkvz.weight"].numpy()
             for i in gdn}
    drop = tuple(f"blk.{i}.{n}" for i in gdn for n in ("attn_qkv.weight", "attn_gate.weight"))
    _rewrite(path, tmp_path / "legacy.gguf", drop=drop, extra=extra)
    tensors = GGUFFile.open(tmp_path / "legacy.gguf").tensors
    assert "blk.0.ssm_in.weight" in tensors and "blk.0.attn_qkv.weight" not in tensors
    legacy, _ = load_model(tmp_path / "legacy.gguf")
    plain, _ = load_model(hf_dir)
    pp = dict(plain.named_parameters())  # type: ignore[attr-defined]
    for name, p in legacy.named_parameters():  # type: ignore[attr-defined]
        assert torch.equal(p, pp[name]), name


def _add(w: Any, field: Any, value: Any) -> None:
    import gguf

    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        w.add_array(field.name, value)
    elif kind == gguf.GGUFValueType.STRING:
        w.add_string(field.name, value)
    elif kind == gguf.GGUFValueType.BOOL:
        w.add_bool(field.name, value)
    elif kind == gguf.GGUFValueType.FLOAT32:
        w.add_float32(field.name, value)
    else:
        w.add_uint32(field.name, value)


@pytest.mark.parametrize("arch,head,qtype", [("qwen3_next", 16, "Q8_0"), ("qwen3_5", 16, "Q8_0"),
                                             ("qwen3_5", 32, "Q8_0"), ("qwen3_5_moe", 16, "Q8_0"),
                                             ("qwen3_next", 16, "Q5_0"), ("qwen3_5", 32, "Q5_0"),
                                             ("qwen3_5", 16, "IQ4_NL")])
def test_kept_q8_blocks_hold_the_dequantised_files_values(tiny_model: Callable[..., Path], tmp_path: Path,
                                                          arch: str, head: int, qtype: str) -> None:
    """--quantization gguf keeps every matrix in its blocks, rows (and blocks) moved to the
    model's order: the gated attention's qkv (attn_q's per-head query and gate rows apart), the
    DeltaNet's in_proj (Qwen3.5's tiled value heads regrouped, Qwen3-Next's ssm_ba split), its
    out_proj (Qwen3.5's value-head columns moved as whole blocks where a head fills whole 32-value
    blocks, head size 32; with heads of 16 the blocks stay in the file's column order and the layer
    gathers its input by out_columns), the MLPs and experts. Each kept matrix holds exactly the
    values the dequantised file loads (columns permuted back where they stayed in the file's order).
    Q5_0 and IQ4_NL files: the same, in their own blocks."""
    from operator import attrgetter

    from server.kernels.quant import QuantizedExperts, QuantizedWeight

    sizes = {"linear_key_head_dim": head, "linear_value_head_dim": head}
    hf_dir = tiny_model(arch, mlp_only_layers=[], **sizes) if arch == "qwen3_next" else tiny_model(arch, **sizes)
    path = write_gguf(tmp_path / f"{qtype}.gguf", hf_dir, qtype)
    kept, config = load_model(path, dtype="float32", keep_gguf_blocks=True)
    plain, _ = load_model(path, dtype="float32")
    blocks_moved = arch == "qwen3_next" or head % 32 == 0
    for i, (k, p) in enumerate(zip(kept._layers, plain._layers)):  # type: ignore[attr-defined]
        names = ["gdn.in_proj", "gdn.out_proj"] if config.layer_types[i] == "gated_deltanet" else ["qkv_weight",
                                                                                                    "o_weight"]
        names += ["moe.experts_gate_up", "moe.experts_down"] if config.is_moe else ["gate_up_weight", "down_weight"]
        for name in names:
            got, want = attrgetter(name)(k), attrgetter(name)(p)
            assert isinstance(got, (QuantizedWeight, QuantizedExperts)), (i, name)
            values = got.dequantize()
            if name == "gdn.out_proj":
                assert (k.gdn.out_columns is None) == blocks_moved, i
                if not blocks_moved:  # file column c meets model column out_columns[c]
                    values = values[:, torch.argsort(k.gdn.out_columns)]
            assert torch.equal(values, want), (i, name)


# A first token the kept model picks differently must be one the dequantised model itself nearly
# tied with its choice: within TIE_NATS of its top logprob. Quantising the activations to 8 bits
# moves these tiny random models' logprobs by up to ~0.07 nats (dense) and ~0.25 (a flipped
# expert route), and their top two are often closer than that (0.0002-0.015 nats where the CI and
# this machine's runs differed). A broken kernel gives tokens nowhere near the reference's top.
TIE_NATS = 0.1


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_kept_q8_blocks_serve_like_the_dequantised_file(hybrid: Callable[..., Path], arch: str) -> None:
    """Served with --quantization gguf, the kept model's first greedy token of each prompt is the
    dequantised file's, or one that file's model nearly tied with its own (the integer kernels run
    on 8-bit activations); most of 16 agree outright."""
    from server import SamplingParams

    path = hybrid(arch, "Q8_0")
    config = load_model(path, dtype="float32")[1]
    prompts = _prompts(16, config.vocab_size, 20, 60, seed=22)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    # autotune=False: the start-up autotune picks each row-count bucket's path by timing (integer
    # kernel or dequantise + GEMM, which round differently), so under load the kept model's floats
    # could change from run to run; the fixed rules make them a function of the file and the CPU.
    kw: dict[str, Any] = dict(dtype="float32", max_model_len=256, kv_cache_tokens=4096, autotune=False)
    kept = LLM(str(path), quantization="gguf", **kw).generate(prompts, first)
    ref = LLM(str(path), **kw).generate(prompts, first)
    agree = 0
    for i, (k, r) in enumerate(zip(kept, ref)):
        token, want = k.outputs[0].token_ids[0], r.outputs[0].logprobs[0]
        if token == want.token_id:
            agree += 1
            continue
        top = dict(want.top)
        assert token in top and want.logprob - top[token] <= TIE_NATS, (i, token, want)
    assert agree >= 13, agree


@pytest.mark.parametrize("change,message", [
    (dict(drop_metadata=["qwen35.ssm.group_count"]), r"qwen35\.ssm\.group_count"),
    (dict(extra_metadata={"qwen35.ssm.time_step_rank": 3}), r"qwen35\.ssm\.time_step_rank 3 must be a multiple"),
    (dict(extra_metadata={"qwen35.ssm.conv_kernel": 1}), r"qwen35\.ssm\.conv_kernel must be at least 2"),
    (dict(skip_tensors=["blk.0.ssm_a"]), r"tensor 'blk\.0\.ssm_a' \(model\.layers\.0\.linear_attn\.A_log\) not found"),
    (dict(skip_tensors=["blk.2.attn_gate.weight"]), r"tensor 'blk\.2\.attn_gate\.weight' .* not found"),
])
def test_bad_files_fail_naming_the_key_or_tensor(hybrid: Callable[..., Path], tmp_path: Path,
                                                 change: dict[str, Any], message: str) -> None:
    from server.models import ModelLoadError

    path = write_gguf(tmp_path / "bad.gguf", hybrid("qwen3_5", "hf"), "F32", **change)
    with pytest.raises(ModelLoadError, match=message):
        load_model(path)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_plan_counts_what_each_source_loads(hybrid: Callable[..., Path], arch: str) -> None:
    """`pagewire plan` counts exactly the bytes the model holds: the DeltaNet layers' projections,
    conv kernel and small vectors, the attention output gate's rows; from the folder, the F32
    file, and the Q8_0 file with --quantization gguf (the blocks it keeps)."""
    from server.engine.config import EngineConfig
    from server.engine.plan import make_plan, read_model_config
    from tests.gateway.test_plan import _loaded_weight_bytes

    for source, quantization in (("hf", "none"), ("F32", "none"), ("Q8_0", "gguf")):
        path = hybrid(arch, source)
        model, _ = load_model(path, dtype="float32", keep_gguf_blocks=quantization == "gguf")
        config = EngineConfig(str(path), dtype="float32", quantization=quantization, kv_cache_tokens=1024)
        plan = make_plan("m", read_model_config(path), config, None, None)
        assert plan.weights.total == _loaded_weight_bytes(model), source
