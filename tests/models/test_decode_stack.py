"""The DecodeStack (csrc/cpu/decode_stack.cpp): every layer of a small CPU step in one C++ call
must give exactly the per-layer path's floats (one decode_layer / moe_decode call per layer, which
tests/models/test_decode_layer.py and test_moe_fused_layer.py hold to the Python layers), logits
and every KV cache byte, for every family the fused layer expresses, dense and sparse, float and
quantised, batches of 1 and 3, and for a model with several KV groups (a per-layer slot mapping
and block table); the stack must really run (no per-layer call) where every layer can join it,
step aside where one cannot (Gemma 4's per-layer inputs, LoRA rows), be rebuilt when the layers'
kinds change, and refuse a bad call with a message naming what is wrong."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server import SamplingParams
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.kernels.ops import decode_stack
from server.models.decoder import DecoderForCausalLM
from server.models.loader import load_model
from tests.models.paged_harness import ARCHS, VOCAB, PagedRun
from tests.models.test_decode_layer import FAMILIES, _assert_same, _count_fused_calls, _run, _steps
from tests.models.test_moe_fused_layer import MOE_FAMILIES
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def stack_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny config (tests.tiny_models: windows shorter than the prompts, NoPE and
    partial-rotary layers, Gemma 4's parts, the sparse families' routers and dense layers)."""
    return {arch: make_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch, vocab_size=VOCAB)
            for arch in ARCHS + FAMILIES + MOE_FAMILIES}


@pytest.mark.parametrize("arch", ARCHS + FAMILIES + MOE_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_stack_gives_the_per_layer_floats(stack_models: dict[str, Path], arch: str, dtype: str,
                                              quantization: str, batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = load_model(stack_models[arch], dtype=dtype)
    if quantization != "none":
        model.quantize_weights(quantization)
    calls = _count_fused_calls(monkeypatch, stacks=True)
    _assert_same(model, batch, "stacked_decode")
    fused_layers = all(layer.fusable for layer in model._layers)
    stackable = fused_layers and all(layer.stackable() for layer in model._layers)
    # gpt-oss in bf16 runs its Python layers (fp32 norm weights); Gemma 4's per-layer inputs keep
    # its layers one call each; every other family's small steps run as one stack call.
    assert stackable == (arch != "gemma4" and not (arch == "gpt_oss" and dtype != "float32"))
    small = sum(sum(map(len, step.values())) <= 16 for step in _steps(batch))
    per_layer_run = list(range(model.config.num_layers)) * small  # the unstacked pass's calls
    if stackable:
        assert calls == per_layer_run  # only the stacked_decode=False pass called layers one by one
        assert any(entry[2] is not None for entry in model._stacks.values())
    elif fused_layers:
        assert calls == per_layer_run * 2  # no stack: both passes ran layer by layer
        assert all(entry[2] is None for entry in model._stacks.values())


def test_the_stack_follows_a_change_of_the_layers_kinds(stack_models: dict[str, Path]) -> None:
    """Stacks hold each layer's arguments; quantising afterwards (new weights, new kinds) must
    not leave a stale stack behind, and neither must a layer attribute changed with the kinds
    forgotten (what tests that mutate layers do)."""
    model, _ = load_model(stack_models["qwen3"], dtype="float32")
    steps = _steps(1)
    float_logits, _ = _run(model, True, steps, "stacked_decode")
    model.quantize_weights("int8")
    quant_stacked, _ = _run(model, True, steps, "stacked_decode")
    quant_layered, _ = _run(model, False, steps, "stacked_decode")
    assert not torch.equal(float_logits[-1][0], quant_stacked[-1][0])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(quant_stacked, quant_layered))
    for layer in model._layers:
        layer.softcap = 0.5
    model._forget_kinds()
    capped, _ = _run(model, True, steps, "stacked_decode")
    capped_layered, _ = _run(model, False, steps, "stacked_decode")
    assert not torch.equal(capped[-1][0], quant_stacked[-1][0])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(capped, capped_layered))


def test_a_bad_stack_call_names_what_is_wrong(stack_models: dict[str, Path]) -> None:
    model, _ = load_model(stack_models["llama"], dtype="float32")
    run = PagedRun(model, seed=1)
    run.step({0: [1, 2, 3]})
    fused = model._fused_kinds(torch.zeros(1, model.config.hidden_size), [])
    assert fused is not None
    stack = model._decode_stack(fused, run.kv_caches, torch.zeros(1, model.config.hidden_size))
    assert stack is not None and stack.size() == model.config.num_layers
    hidden = torch.zeros(1, model.config.hidden_size)
    one = torch.zeros(1, dtype=torch.int64)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens, qsl = torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="2 slot mappings and 1 block tables"):
        stack.run(hidden, None, [one], [one, one], [tables], lens, qsl, 1, 1)
    with pytest.raises(RuntimeError, match="reads RoPE table 0 of 0"):
        stack.run(hidden, None, [], [one], [tables], lens, qsl, 1, 1)
    empty = decode_stack()
    with pytest.raises(RuntimeError, match="set_moe: add the layer first"):
        empty.set_moe(torch.zeros(4, 4), "torch", None, "softmax_topk", 2, True, torch.zeros(1), "float",
                      torch.zeros(1), "float", None, None, "silu", 1.0, 7.0, None, "", None, "", None, "", None,
                      1, 1, 1.0)


# 4 layers: sliding, full, sliding, full -> two KV groups, each with its own slots and block tables.
QWEN2_GROUPS = dict(use_sliding_window=True, sliding_window=16, num_hidden_layers=4,
                    layer_types=["sliding_attention", "full_attention"] * 2)


def test_the_stack_reads_each_kv_groups_metadata_in_the_engine(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """Through the engine (KV groups: per-layer metadata), prompts longer than the window, mixed
    lengths: stacked and per-layer steps give the same tokens and the same logprobs. One engine
    for both (its start-up autotune times kernels, so two engines may choose different paths), no
    prefix cache (the second pass computes everything again)."""
    model_dir = tiny_model("qwen2", **QWEN2_GROUPS)
    prompts = [[(7 * i + 3 * j) % 200 + 10 for j in range(n)] for i, n in enumerate((40, 23, 57))]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=256, kv_cache_tokens=4096, num_threads=2,
                                    enable_prefix_caching=False))
    model = engine.model
    assert isinstance(model, DecoderForCausalLM) and engine.kv_cache.num_groups == 2
    results = []
    for stacked in (True, False):
        model.stacked_decode = stacked
        for i, p in enumerate(prompts):
            engine.add_request(f"{stacked}{i}", p, params)
        out: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for d in engine.step():
                for smp in d.samples:
                    out.setdefault(d.request_id[-1], []).append((smp.token_ids, smp.logprobs))
        if stacked:
            assert any(entry[2] is not None for entry in model._stacks.values())
        results.append(out)
    assert results[0] == results[1]
