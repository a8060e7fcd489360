"""GGUF files whose fused matrices mix block types (llama.cpp's Q4_K_M gives attn_v, and some
ffn_up, a larger type than attn_q / attn_k / ffn_gate) run from their own bytes with
--quantization gguf: such a qkv or gate_up is kept as a QuantizedParts (each run of one type in
its own blocks, nothing dequantised, not even while loading), which dequantises to exactly what the
`gguf` package reads from the file; the fused C++ layer (decode_layer's "parts:" kind, the MoE
layers' attention half and shared expert through moe_decode) gives exactly the Python layer's
floats; the logits track the file loaded dequantised; and the model gives transformers' greedy
tokens for the same (dequantised) weights.

K-quant blocks are random valid blocks (tests/gguf_files), as in tests/models/test_kquant_gguf.py.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

import server.models.gguf_loader as gguf_loader
from server import LLM, SamplingParams
from server.kernels import batch_invariant, ops
from server.kernels.quant import QuantizedWeight, x8_here
from server.kernels.quant_parts import QuantizedParts
from server.models.decoder import DecoderForCausalLM
from server.models.loader import load_model
from tests.gguf_files import write_gguf
from tests.models.paged_harness import VOCAB, PagedRun, random_tokens

# Rows of 256 values (the K-quants' super-block) everywhere: hidden 256, MLPs of 256, heads of 64.
_SIZES = {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "num_hidden_layers": 2}


def k_mix(name: str) -> str:
    """Q4_K_M as llama.cpp writes it for many layers: Q4_K q/k/gate, Q6_K attn_v / ffn_down /
    output, and (a Q5_K_M choice, so three types meet) Q5_K ffn_up and the shared expert's up."""
    if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight", "ffn_down_exps.weight")):
        return "Q6_K"
    if name.endswith(("ffn_up.weight", "ffn_up_shexp.weight")):
        return "Q5_K"
    return "Q4_K"


def legacy_mix(name: str) -> str:
    """The 32-value formats mixed: Q4_0 q/k, Q8_0 v, Q4_1 gate, Q8_0 up (Q4_0 elsewhere)."""
    if name.endswith(("attn_v.weight", "ffn_up.weight", "ffn_up_shexp.weight")):
        return "Q8_0"
    if name.endswith(("ffn_gate.weight", "ffn_gate_shexp.weight")):
        return "Q4_1"
    return "Q4_0"


MIXES = {"k": (k_mix, ("q4_k", "q6_k"), ("q4_k", "q5_k")), "legacy": (legacy_mix, ("q4_0", "q8_0"), ("q4_1", "q8_0"))}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, tiny_model: Callable[..., Path]) -> dict[tuple[str, str], Path]:
    """(arch, mix) -> the GGUF: a dense Llama (Q/K rows permuted by the converter) and a Qwen2-MoE
    (q/k/v bias, a shared expert whose gate_up mixes too; one dense layer of 256 rows)."""
    out: dict[tuple[str, str], Path] = {}
    llama = tiny_model("llama", **_SIZES)
    qwen2moe = tiny_model("qwen2moe", **_SIZES, moe_intermediate_size=256, shared_expert_intermediate_size=256)
    root = tmp_path_factory.mktemp("mixed-gguf")
    for arch, hf_dir in (("llama", llama), ("qwen2moe", qwen2moe)):
        for mix, (qtype_of, _, _) in MIXES.items():
            out[arch, mix] = write_gguf(root / f"{arch}-{mix}.gguf", hf_dir, "Q4_K", qtype_of=qtype_of)
    return out


def _fused_matrices(model: Any) -> list[tuple[str, Any]]:
    """Every matrix whose GGUF parts differ in type here: each layer's qkv, the dense layers'
    gate_up, the sparse layers' shared-expert gate_up."""
    out = []
    for i, layer in enumerate(model._layers):
        out.append((f"{i}.qkv", layer.qkv_weight))
        if layer.moe is None:
            out.append((f"{i}.gate_up", layer.gate_up_weight))
        elif layer.moe.shared_gate_up_weight is not None:
            out.append((f"{i}.shared_gate_up", layer.moe.shared_gate_up_weight))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2moe"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_mixed_matrices_stay_in_their_blocks(files: dict[tuple[str, str], Path], arch: str, mix: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _, qkv_types, gate_up_types = MIXES[mix]
    read: list[str] = []  # every tensor the loader dequantises
    real = gguf_loader.dequantize
    monkeypatch.setattr(gguf_loader, "dequantize", lambda t, path: read.append(t.name) or real(t, path))
    kept, _ = load_model(files[arch, mix], dtype="float32", keep_gguf_blocks=True)
    # No part of a kept matrix was dequantised on the way (the load's peak never holds it as floats).
    assert not [n for n in read if n.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight",
                                                "ffn_up.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight"))]
    monkeypatch.undo()
    plain, _ = load_model(files[arch, mix], dtype="float32")
    matrices = _fused_matrices(kept)
    assert len(matrices) == 4  # two layers' qkv and gate_up (the MoE's: its shared expert's)
    for (name, w), (_, ref) in zip(matrices, _fused_matrices(plain)):
        assert isinstance(w, QuantizedParts), name
        # q and k (one type) share a run; gate and up are each their own.
        assert w.qtypes == (qkv_types if name.endswith("qkv") else gate_up_types), name
        # Each part in this CPU's fastest layout.
        assert all(p.interleaved == x8_here() for p in w.parts), name
        assert all(p.data.data_ptr() == w.data[off:].data_ptr()  # the parts are views of one buffer
                   for p, off in zip(w.parts, [0, w.parts[0].nbytes]))
        # The file's blocks, Q/K rows un-permuted on whole rows: exactly the float load's matrix.
        assert torch.equal(w.dequantize(), ref), name
    assert not any(p.dtype == torch.uint8 for p in kept.parameters())


def test_linear_runs_each_part_by_its_own_kernel(files: dict[tuple[str, str], Path]) -> None:
    """ops.linear on a QuantizedParts: each part's own kernel (bit for bit what the part alone
    gives, bias sliced), within the 8-bit activation rounding of a float64 product."""
    model, _ = load_model(files["qwen2moe", "k"], dtype="float32", keep_gguf_blocks=True)
    layer = model._layers[0]
    w, bias = layer.qkv_weight, layer.qkv_bias
    assert isinstance(w, QuantizedParts) and bias is not None
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0))
    got = ops.linear(x, w, bias)
    rows = [p.shape[0] for p in w.parts]
    want = torch.cat([ops.linear(x, p, b) for p, b in zip(w.parts, bias.split(rows))], dim=1)
    assert torch.equal(got, want)
    ref = (x.double() @ w.dequantize(torch.float64).T + bias.double()).float()
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 2e-2
    # Above the kernels' 16 rows each part takes its own prefill path (dequantised chunks + GEMM).
    xl = torch.randn(40, w.shape[1], generator=torch.Generator().manual_seed(1))
    got = ops.linear(xl, w, bias)
    assert torch.equal(got, torch.cat([ops.linear(xl, p, b) for p, b in zip(w.parts, bias.split(rows))], dim=1))
    ref = (xl.double() @ w.dequantize(torch.float64).T + bias.double()).float()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * ref.abs().max().item())  # fp32 GEMM order only


def _run(model: DecoderForCausalLM, fused: bool, steps: list[dict[int, list[int]]]) -> tuple[list, PagedRun]:
    model.fused_decode = fused
    run = PagedRun(model, seed=5)
    return [run.step(s) for s in steps], run


@pytest.mark.parametrize("arch", ["llama", "qwen2moe"])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("invariant", [False, True])
def test_fused_layer_gives_the_python_layers_floats(files: dict[tuple[str, str], Path], arch: str, mix: str,
                                                    dtype: str, invariant: bool) -> None:
    """decode_layer (and moe_decode's shared expert) run the "parts:" kind: the same kernels on
    views of the same bytes, so exactly the Python layer's logits and KV cache bytes."""
    model, _ = load_model(files[arch, mix], dtype=dtype, keep_gguf_blocks=True)
    batch = 3
    with batch_invariant.mode(invariant):
        kinds = model._layers[0].linear_kinds(model.dtype, batch)
        assert kinds is not None and kinds[0].startswith("parts:")
        if arch == "llama":
            assert kinds[2].startswith("parts:")
        toks = {s: random_tokens(30, VOCAB, seed=s) for s in range(batch)}
        steps = [{0: toks[0][:12]}, {s: toks[s][:12] for s in range(1, batch)}]
        steps += [{s: [toks[s][t]] for s in range(batch)} for t in range(12, 20)]
        fused, run_f = _run(model, True, steps)
        plain, run_p = _run(model, False, steps)
    for a, b in zip(fused, plain):
        for sid in a:
            assert torch.equal(a[sid], b[sid]), sid
    for (kf, vf), (kp, vp) in zip(run_f.kv_caches, run_p.kv_caches):
        assert torch.equal(kf, kp) and torch.equal(vf, vp)


def test_logits_track_the_dequantised_file(files: dict[tuple[str, str], Path]) -> None:
    """Prefill (dequantised chunks + GEMM, part by part) gives the float load's logits up to GEMM
    order; decodes (the integer kernels) within the 8-bit activation rounding."""
    path = files["llama", "k"]
    kept, _ = load_model(path, dtype="float32", keep_gguf_blocks=True)
    ref, _ = load_model(path, dtype="float32")
    tokens = random_tokens(46, VOCAB, seed=3)
    out = []
    for model in (kept, ref):
        run = PagedRun(model)
        rows = [run.step({0: tokens[:40]})[0]] + [run.step({0: [t]})[0] for t in tokens[40:]]
        out.append(torch.cat(rows))
    ours, want = out
    torch.testing.assert_close(ours[:40], want[:40], rtol=1e-4, atol=1e-4)
    err = ((ours[40:] - want[40:]).abs().max() / want[40:].abs().max()).item()
    assert err < 8e-2  # as tests/models/test_gguf_quantized.py: ~3-5 % measured, a wrong row order ~100 %


def test_plan_counts_the_mixed_blocks(files: dict[tuple[str, str], Path]) -> None:
    """`pagewire plan --quantization gguf` counts exactly the bytes the loaded model holds."""
    from server.engine.config import EngineConfig
    from server.engine.plan import make_plan, read_model_config
    from tests.gateway.test_plan import _loaded_weight_bytes

    for arch in ("llama", "qwen2moe"):
        path = files[arch, "k"]
        model, _ = load_model(path, dtype="float32", keep_gguf_blocks=True)
        config = EngineConfig(str(path), dtype="float32", quantization="gguf", kv_cache_tokens=1024)
        plan = make_plan("m", read_model_config(path), config, None, None)
        assert plan.weights.total == _loaded_weight_bytes(model), arch


@pytest.fixture(scope="module")
def reference(files: dict[tuple[str, str], Path], tiny_model: Callable[..., Path],
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen2-MoE's HF folder rewritten with the weights the K-mix file's blocks hold."""
    hf_dir = tiny_model("qwen2moe", **_SIZES, moe_intermediate_size=256, shared_expert_intermediate_size=256)
    ref_dir = tmp_path_factory.mktemp("mixed-ref") / "hf"
    shutil.copytree(hf_dir, ref_dir)
    model, _ = load_model(files["qwen2moe", "k"], dtype="float32")
    targets = model.checkpoint_tensors()  # type: ignore[attr-defined]
    saved = load_file(str(hf_dir / "model.safetensors"))
    assert set(saved) == set(targets)
    # The matrices as the file's blocks hold them; a tensor laid out otherwise in the model (the
    # per-head q/k norms, the shared expert's gate vector) is a float tensor in the file: the folder's own.
    state = {n: t.dest.detach().clone().contiguous()
             if t.convert is None and t.offset == 0 and tuple(t.dest.shape) == tuple(t.shape) else saved[n]
             for n, t in targets.items()}
    save_file(state, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    return ref_dir


def test_greedy_tokens_match_transformers(files: dict[tuple[str, str], Path], reference: Path) -> None:
    """Served with its mixed matrices kept (the engine's fused layers, autotune on), the file gives
    transformers' greedy tokens for its dequantised weights, except that it may take the other
    branch where transformers' top two logits are a near-tie (within the activation rounding)."""
    from transformers import AutoModelForCausalLM

    path = files["qwen2moe", "k"]
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [random_tokens(n, 400, seed=n) for n in (7, 23)]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    plain = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_tokens=1024)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == want
    kept = LLM(str(path), quantization="gguf", dtype="float32", max_model_len=128, kv_cache_tokens=1024)
    assert isinstance(kept.engine.model._layers[0].qkv_weight, QuantizedParts)
    for prompt, ours, ref in zip(prompts, [o.outputs[0].token_ids for o in kept.generate(prompts, params)], want):
        if ours == ref:
            continue
        i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1]
        gap = float(logits[ref[i]] - logits[ours[i]])
        assert gap <= 0.02 * float(logits.max() - logits.min()), (prompt, i, ours, ref, gap)


def test_a_parts_weight_must_be_consistent() -> None:
    a = QuantizedWeight.quantize(torch.randn(8, 64), "q8_0")
    b = QuantizedWeight.quantize(torch.randn(8, 32), "q4_0")
    with pytest.raises(ValueError, match="parts: every part must have K = 64"):
        QuantizedParts.join([a, b])
    with pytest.raises(ValueError, match="data: 10 bytes"):
        QuantizedParts((a,), torch.zeros(10, dtype=torch.uint8), (8, 64))


def hybrid_mix(name: str) -> str:
    """A Qwen3.5 file whose fused matrices all mix: Q4_0 attn_q (queries and gates interleaved per
    head) and attn_k with a Q8_0 attn_v; Q8_0 attn_qkv / ssm_beta / ssm_alpha with a Q4_0 attn_gate
    (the DeltaNet's in_proj); Q4_0 ffn_gate with a Q8_0 ffn_up."""
    return "Q4_0" if name.endswith(("attn_q.weight", "attn_k.weight", "attn_gate.weight", "ffn_gate.weight")) else "Q8_0"


@pytest.mark.parametrize("invariant", [False, True])
def test_hybrid_layers_run_their_mixed_matrices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                invariant: bool) -> None:
    """The Gated DeltaNet hybrids move rows into the model's order as they keep a matrix: the gated
    attention's qkv becomes runs [q k | v | gate] (Q4_0, Q8_0, Q4_0) and the DeltaNet's in_proj
    [qkv | z | b a]; each dequantises to exactly the float load's matrix, and the fused hybrid
    layers (gdn_decode_layer, gated_attention_decode_layer) give exactly the Python layers' floats."""
    import server.models.qwen3_next as qn
    from tests.models.test_hybrid_decode import _count, _run, _steps
    from tests.tiny_models import make_tiny_model

    hf_dir = make_tiny_model(tmp_path / "hf", "qwen3_5", vocab_size=VOCAB)
    path = write_gguf(tmp_path / "mixed.gguf", hf_dir, "Q8_0", qtype_of=hybrid_mix)
    kept, config = load_model(path, dtype="float32", keep_gguf_blocks=True)
    plain, _ = load_model(path, dtype="float32")
    assert isinstance(kept, qn.Qwen3NextForCausalLM)
    seen = set()
    for i, (k, p) in enumerate(zip(kept._layers, plain._layers)):  # type: ignore[attr-defined]
        pairs = ([(k.gdn.in_proj, p.gdn.in_proj)] if config.layer_types[i] == "gated_deltanet"
                 else [(k.qkv_weight, p.qkv_weight)])
        for got, want in [*pairs, (k.gate_up_weight, p.gate_up_weight)]:
            assert isinstance(got, QuantizedParts), i
            seen.add(got.qtypes)
            assert torch.equal(got.dequantize(), want), i
    assert seen == {("q4_0", "q8_0", "q4_0"), ("q8_0", "q4_0", "q8_0"), ("q4_0", "q8_0")}
    steps = _steps(3)
    calls = _count(monkeypatch)
    with batch_invariant.mode(invariant):
        fused, _ = _run(kept, True, steps)
        assert calls and set(calls) == {"gdn", "attn"}
        python, _ = _run(kept, False, steps)
    for a, b in zip(fused, python):
        for sid in a:
            assert torch.equal(a[sid], b[sid]), sid
