"""pagewire::decode_layer, one decoder layer of a small CPU batch in one C++ call: it must give
exactly the Python layer's floats (logits and every KV cache byte) for each architecture's
switches (q/k/v bias, Qwen3's q/k norm, sliding windows, llama3 RoPE scaling), every weight kind
(float kernel or F.linear, Q8_0 and 4-bit in row or interleaved layout), batches of 1 to 16
tokens, prefill chunks as well as decodes, in batch-invariant mode too (the default for CPU bf16
on AVX2), with Gemma's logit soft-capping and GELU-tanh MLP, and for every family's layer parts
(Gemma's four norms, OLMo 2's post-norms and projection q/k norm, Phi-3's partial rotary,
SmolLM3's NoPE layers, Granite's residual multiplier, Gemma 4's KV-sharing layers, values from the
keys, value norm, per-layer inputs and layer scalar); and the model must step aside to
the Python layers wherever their paths differ (above 16 tokens, a replaced `linear`, an autotune
choice decode_layer has no equivalent for)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import server.models.decoder as llama
import server.models.decoder_layer as decoder_layer
from server.kernels import autotune, batch_invariant, linear_route, ops
from server.kernels.quant import x8_here
from server.models.decoder import DecoderForCausalLM
from server.models.loader import load_model
from tests.models.paged_harness import ARCHS, VOCAB, PagedRun, random_tokens
from tests.tiny_models import LLAMA3_ROPE_SCALING, make_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny model per architecture (Mistral with a window shorter than the prompt), K = 64."""
    out = {}
    for arch in ARCHS:
        extra = {"sliding_window": 24} if arch == "mistral" else {}
        scaling = LLAMA3_ROPE_SCALING if arch == "llama" else None
        out[arch] = make_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch, vocab_size=VOCAB, hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=2, rope_scaling=scaling, **extra)
    return out


def _run(model: DecoderForCausalLM, fused: bool, steps: list[dict[int, list[int]]],
         switch: str = "fused_decode") -> tuple[list, PagedRun]:
    """The steps' logits and the run, with the model's `switch` (fused_decode, stacked_decode) set to `fused`."""
    setattr(model, switch, fused)
    run = PagedRun(model, seed=5)
    logits = [run.step(s) for s in steps]
    return logits, run


def _steps(batch: int) -> list[dict[int, list[int]]]:
    """A 12-token prefill chunk per sequence (several sequences: up to 16 rows together), then decodes."""
    toks = {s: random_tokens(40, VOCAB, seed=s) for s in range(batch)}
    steps = [{s: toks[s][:12] for s in range(min(batch, 1))}]
    steps.append({s: toks[s][:12] for s in range(1, batch)} if batch > 1 else {0: toks[0][12:13]})
    for t in range(13, 30):
        steps.append({s: [toks[s][t]] for s in range(batch)})
    return steps


def _assert_same(model: DecoderForCausalLM, batch: int, switch: str = "fused_decode") -> None:
    """Logits and every KV cache byte the same with `switch` on and off."""
    steps = _steps(batch)
    fused, run_f = _run(model, True, steps, switch)
    plain, run_p = _run(model, False, steps, switch)
    for a, b in zip(fused, plain):
        for sid in a:
            assert torch.equal(a[sid], b[sid]), sid
    for (kf, vf), (kp, vp) in zip(run_f.kv_caches, run_p.kv_caches):
        assert torch.equal(kf, kp) and torch.equal(vf, vp)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("invariant", [False, True])
def test_fused_layer_gives_the_python_layers_floats(
    models: dict[str, Path], arch: str, dtype: str, quantization: str, batch: int, invariant: bool
) -> None:
    model, _ = load_model(models[arch], dtype=dtype)
    if quantization != "none":
        model.quantize_weights(quantization)
    with batch_invariant.mode(invariant):
        kinds = model._layers[0].linear_kinds(model.dtype, batch)
        if quantization != "none":
            want = "q8_0" if quantization == "int8" else "q4_0"
            assert kinds is not None and set(kinds) == {want + "x8" if x8_here() else want}
        elif invariant:  # pagewire::linear (bf16 and fp32 alike) wherever the CPU has AVX2
            assert kinds == (("kernel",) * 4 if ops.cpu_isa() != "portable" else None)
        else:  # bf16: the kernel wherever linear's fixed rule takes it; fp32: F.linear
            qkv = model._layers[0].qkv_weight
            assert kinds is not None and set(kinds) == {"kernel" if linear_route.fixed_rule_takes_kernel(qkv, batch) else "torch"}
        _assert_same(model, batch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_fused_layer_with_softcap_and_gelu_tanh(models: dict[str, Path], dtype: str, quantization: str) -> None:
    """decode_layer's soft-capping and GELU-tanh switches (Gemma's) give the Python layer's floats,
    and they are really applied: the logits differ from the plain layers'."""
    model, _ = load_model(models["mistral"], dtype=dtype)
    if quantization != "none":
        model.quantize_weights(quantization)
    steps = _steps(3)
    plain, _ = _run(model, True, steps)
    for layer in model._layers:
        layer.softcap, layer.activation = 0.5, "gelu_tanh"
    model._forget_kinds()  # the step plans (DecodeStack) hold each layer's arguments
    _assert_same(model, 3)
    capped, _ = _run(model, True, steps)
    assert not torch.equal(plain[-1][0], capped[-1][0])


FAMILIES = ("gemma2", "gemma3", "gemma4", "phi3", "olmo2", "olmo3", "smollm3", "granite")


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny config (tests.tiny_models: windows shorter than the prompts, Phi-3's
    partial rotary and longrope, SmolLM3's NoPE layer, Granite's multipliers, Gemma 4 with every
    part on), vocabulary VOCAB."""
    return {arch: make_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch, vocab_size=VOCAB) for arch in FAMILIES}


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("batch", [1, 3])
def test_every_family_runs_fused_with_the_python_layers_floats(
    family_models: dict[str, Path], arch: str, dtype: str, quantization: str, batch: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every layer of every family runs as one decode_layer call, with exactly the Python layers'
    logits and KV bytes: norms before, after and on both sides of each sub-block, q/k norm over the
    projection, partial and no RoPE, residual multipliers; Gemma 4's global layers (their own head
    size and KV heads, values from the keys), KV-sharing layers, value norm, per-layer inputs and
    layer scalar."""
    model, _ = load_model(family_models[arch], dtype=dtype)
    if quantization != "none":
        model.quantize_weights(quantization)
    assert all(layer.fusable for layer in model._layers)
    calls = _count_fused_calls(monkeypatch)
    _assert_same(model, batch)
    # Every layer of every step of at most 16 rows ran fused (batch 3's second step has 24).
    small = sum(sum(map(len, step.values())) <= 16 for step in _steps(batch))
    assert calls == list(range(model.config.num_layers)) * small


@pytest.mark.parametrize("rotary", ["partial", "none"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_per_head_qk_norm_without_full_rope_runs_fused(tmp_path: Path, rotary: str, dtype: str, batch: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A per-head q/k norm on a partial-rotary layer (GLM-4.5 with use_qk_norm) or a NoPE one: the
    Python layer norms each head with torch ops, then turns the leading dims; decode_layer does the
    same ops (torch_rms_norm, then RoPE without its norm), so the fused layer gives its floats."""
    folder = make_tiny_model(tmp_path / "q3", "qwen3", vocab_size=VOCAB)
    model, _ = load_model(folder, dtype=dtype)
    for layer in model._layers:
        if rotary == "none":
            layer.rope_index, layer.rotary_dim = None, 0
        else:
            layer.rotary_dim = layer.head_dim // 2
    if rotary == "partial":  # a table of half the head's width, as ModelConfig builds one for partial rotary
        from server.models.rope import RotaryEmbedding

        r = model.ropes[0]
        model.ropes[0] = RotaryEmbedding(model._layers[0].head_dim // 2, r.cos.shape[0], 10000.0, None, model.device)
    assert all(layer.fusable and layer.qk_norm is not None for layer in model._layers)
    calls = _count_fused_calls(monkeypatch)
    _assert_same(model, batch)
    small = sum(sum(map(len, step.values())) <= 16 for step in _steps(batch))
    assert calls == list(range(model.config.num_layers)) * small
    one_sided = list(_decode_layer_args_of(model, dtype))
    one_sided[24] = None
    with pytest.raises(RuntimeError, match="decode_layer: cos and sin come together"):
        torch.ops.pagewire.decode_layer(*one_sided)


def _decode_layer_args_of(model: DecoderForCausalLM, dtype: str) -> tuple:
    layer = model._layers[0]
    run = PagedRun(model)
    run.step({0: random_tokens(3, VOCAB, seed=1)})
    kinds = layer.linear_kinds(model.dtype, 1)
    assert kinds is not None
    key_cache, value_cache = run.kv_caches[0]
    return _op_args(model, layer, run, kinds, torch.randn(1, 64).to(getattr(torch, dtype)), key_cache, value_cache)


def test_decode_layer_rejects_an_unknown_activation(models: dict[str, Path]) -> None:
    model, _ = load_model(models["llama"], dtype="float32")
    model._layers[0].activation = "relu"
    with pytest.raises(RuntimeError, match="decode_layer: activation must be 'silu' or 'gelu_tanh', got 'relu'"):
        _run(model, True, _steps(1)[:1])


def test_sixteen_rows_fused_seventeen_not(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = load_model(models["qwen3"], dtype="bfloat16")
    model.quantize_weights("int8")
    calls = _count_fused_calls(monkeypatch)
    toks = random_tokens(17, VOCAB, seed=1)
    fused, _ = _run(model, True, [{0: toks[:16]}])
    assert calls == [0, 1]  # both layers, one call each
    plain, _ = _run(model, False, [{0: toks[:16]}])
    assert calls == [0, 1] and torch.equal(fused[0][0], plain[0][0])
    _run(model, True, [{0: toks}])
    assert calls == [0, 1]  # 17 rows: the Python layers


def test_python_layers_where_paths_differ(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = load_model(models["llama"], dtype="bfloat16")
    rope_batch = model.ropes[0].prepare(torch.zeros(1, dtype=torch.int64), model.dtype)
    hidden = torch.zeros(1, 64, dtype=model.dtype)
    assert model._fused_kinds(hidden, [rope_batch]) is not None
    model.fused_decode = False
    assert model._fused_kinds(hidden, [rope_batch]) is None
    model.fused_decode = True
    # Something watching every linear call (a test, bench/decode_step.py) sees them all.
    monkeypatch.setattr(llama, "linear", lambda x, w, b=None: ops.linear(x, w, b))
    assert model._fused_kinds(hidden, [rope_batch]) is None
    monkeypatch.undo()
    monkeypatch.setattr(decoder_layer, "linear", lambda x, w, b=None: ops.linear(x, w, b))  # the layers' own
    assert model._fused_kinds(hidden, [rope_batch]) is None
    monkeypatch.undo()
    # An autotune choice with no decode_layer equivalent (dequantise + GEMM) keeps that layer in
    # Python; the other layers' matrices were tuned the same way here, so every layer steps aside.
    model.quantize_weights("int8")
    qkv = model._layers[0].qkv_weight
    plan = {("q8_0", model.dtype, qkv.shape): (False,) * (autotune.LARGE + 1)}
    table = autotune.LinearTable(plans=plan)
    with autotune.active(table):
        kinds = model._fused_kinds(hidden, [rope_batch])
        assert kinds is not None and all(k is None for k in kinds)
    with autotune.active(None):
        kinds = model._fused_kinds(hidden, [rope_batch])
        assert kinds is not None and all(k is not None for k in kinds)


def test_opcheck_decode_layer(models: dict[str, Path]) -> None:
    """The schema's aliasing (hidden and both caches mutated, a fresh output) and the fake's shape."""
    model, _ = load_model(models["qwen2"], dtype="float32")
    layer = model._layers[0]
    run = PagedRun(model)
    run.step({0: random_tokens(5, VOCAB, seed=2)})  # some context in the cache
    hidden = torch.randn(1, 64)
    kinds = layer.linear_kinds(model.dtype, 1)
    assert kinds is not None
    key_cache, value_cache = run.kv_caches[0]
    args = _op_args(model, layer, run, kinds, hidden, key_cache.clone(), value_cache.clone())
    torch.library.opcheck(torch.ops.pagewire.decode_layer.default, args)
    with pytest.raises(RuntimeError, match="decode_layer: unknown linear kind 'fp8'"):
        torch.ops.pagewire.decode_layer(*args[:9], "fp8", *args[10:])


@pytest.mark.parametrize("arch, index", [("gemma3", 0), ("olmo2", 0), ("granite", 0), ("gemma4", 0), ("gemma4", 2),
                                         ("gemma4", 4)])
def test_opcheck_decode_layer_with_the_families_parts(family_models: dict[str, Path], arch: str, index: int) -> None:
    """The same with Gemma's four norms, OLMo 2's post-norms and projection q/k norm, Granite's
    multiplier, and Gemma 4's layers: a local one (value norm, per-layer input, layer scalar: the
    op returns [0, H]), a global one (values from the keys) and one reading layer 3's KV."""
    model, _ = load_model(family_models[arch], dtype="float32")
    layer = model._layers[index]
    if arch == "gemma4":
        assert (layer.value_from_key, layer.shares_kv) == ((False, False), (True, False), (False, True))[index // 2]
    run = PagedRun(model)
    run.step({0: random_tokens(5, VOCAB, seed=2)})
    kinds = layer.linear_kinds(model.dtype, 1)
    assert kinds is not None
    key_cache, value_cache = run.kv_caches[index]
    args = _op_args(model, layer, run, kinds, torch.randn(1, 64), key_cache.clone(), value_cache.clone())
    torch.library.opcheck(torch.ops.pagewire.decode_layer.default, args)
    out = torch.ops.pagewire.decode_layer(*args)
    assert out.shape == ((0, 64) if layer.finishes else (1, 64))


def test_decode_layer_refuses_gemma4_parts_that_do_not_go_together(family_models: dict[str, Path]) -> None:
    """A layer reading another's KV has no keys to take values from; the per-layer input block's
    tensors come together. Refused before anything is written."""
    model, _ = load_model(family_models["gemma4"], dtype="float32")
    layer = model._layers[4]
    run = PagedRun(model)
    run.step({0: random_tokens(5, VOCAB, seed=2)})
    kinds = layer.linear_kinds(model.dtype, 1)
    assert kinds is not None and layer.shares_kv
    key_cache, value_cache = run.kv_caches[4]
    hidden = torch.randn(1, 64)
    args = list(_op_args(model, layer, run, kinds, hidden.clone(), key_cache, value_cache))
    both = list(args)
    both[43] = True  # value_from_key on a sharing layer
    with pytest.raises(RuntimeError, match="decode_layer: a layer reading another layer's KV has no keys"):
        torch.ops.pagewire.decode_layer(*both)
    no_input = list(args)
    no_input[44] = None  # per_layer_input
    with pytest.raises(RuntimeError, match="decode_layer: per_layer_input, ple_gate, ple_proj and ple_norm come together"):
        torch.ops.pagewire.decode_layer(*no_input)
    assert torch.equal(args[0], hidden)


def _count_fused_calls(monkeypatch: pytest.MonkeyPatch, stacks: bool = False) -> list[int]:
    """A list that collects the layer index of every forward_fused call from now on; unless
    `stacks`, with the whole-step DecodeStack off so that each layer's call is seen
    (tests/models/test_decode_stack.py checks the stack against these calls)."""
    calls: list[int] = []
    real = decoder_layer.DecoderLayer.forward_fused
    if not stacks:
        monkeypatch.setattr(DecoderForCausalLM, "_decode_stack", lambda *args: None)

    def counting(self: decoder_layer.DecoderLayer, *args: object) -> object:
        calls.append(self.layer_idx)
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(decoder_layer.DecoderLayer, "forward_fused", counting)
    return calls


def _op_args(model: DecoderForCausalLM, layer: decoder_layer.DecoderLayer, run: PagedRun, kinds: tuple[str, ...],
             hidden: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple:
    """decode_layer's arguments for one new token at position 5 of sequence 0 (5 tokens cached);
    with Gemma 4's parts when the layer has them (a random per-layer input row)."""
    from server.models.attention import AttentionMetadata

    meta = AttentionMetadata(
        slot_mapping=torch.tensor([int(run.tables[0][0]) * run.block_size + 5], dtype=torch.int64),
        block_tables=torch.tensor([run.tables[0]], dtype=torch.int32),
        seq_lens=torch.tensor([6], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=6,
    )
    rope = model.ropes[layer.rope_index if layer.rope_index is not None else 0]
    args = (hidden, torch.randn(1, 64), layer.attn_norm, layer.attn_post_norm, layer.mlp_norm, layer.mlp_post_norm,
            layer.eps, layer.residual_multiplier, layer.qkv_weight, kinds[0], layer.qkv_bias, layer.q_norm,
            layer.k_norm, layer.o_weight, kinds[1], layer.o_bias, layer.gate_up_weight, kinds[2], layer.gate_up_bias,
            layer.down_weight, kinds[3], layer.down_bias, torch.tensor([5]), rope.cos, rope.sin,
            layer.qk_norm, key_cache, value_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, layer.scale, layer.sliding_window, 1, 6, layer.num_heads, layer.num_kv_heads,
            layer.head_dim)
    if layer.v_norm is None and not layer.shares_kv and not layer.finishes:
        return args
    ple = layer.ple_gate is not None
    per_layer_input = torch.randn(1, layer.ple_gate.shape[0]) if layer.ple_gate is not None else None
    return (*args, layer.softcap, layer.activation, layer.v_norm, layer.shares_kv, layer.value_from_key,
            per_layer_input, layer.ple_gate, kinds[4] if ple else "torch", layer.ple_proj, kinds[5] if ple else "torch",
            layer.ple_norm, layer.layer_scalar)
