"""dots.llm1 beyond what every family is checked for (tests/families/test_family_*.py run its tiny
folder -- sigmoid router with a selection bias, 2 expert groups of which 1 is kept, renormalised,
scaled by 2.5, a dense first layer, an ungated shared expert -- and its F32 GGUF copy against
transformers): the other router settings (renormalisation off, no groups, no scaling; more
experts, top-3) give transformers' greedy tokens too; the GGUF copy's router means the same; bad
llama.cpp router keys name the key; and deterministic mode holds (a request alone and among
others gives the same tokens and logprobs)."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import pytest
import torch

from server import LLM, SamplingParams
from server.models.config import ModelLoadError, UnsupportedModelError
from server.models.loader import load_model
from server.models.registry import read_model_config
from tests.families.test_families_vs_transformers import hf_greedy
from tests.gguf_files import write_gguf
from tests.models.paged_harness import PagedRun, random_tokens

MAX_NEW = 12


def test_the_tiny_config_makes_the_router_settings_matter(family_model: Callable[[str, str], Path]) -> None:
    """Each of the selection bias, the group limit and the scaling factor changes the tiny model's
    logits (so the family tests, which pass, see them): the bias and the groups change which
    experts run, the scaling how much they add."""
    model, config = load_model(family_model("dots1", "hf"))
    tokens = random_tokens(40, config.vocab_size, seed=8)
    moes = [layer.moe for layer in model._layers if layer.moe is not None]  # type: ignore[attr-defined]
    assert len(moes) == 2 and all(m.selection_bias is not None for m in moes)

    def logits() -> torch.Tensor:
        return PagedRun(model).step({0: tokens})[0]

    def chosen() -> set[tuple[int, ...]]:
        x = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(9))
        return {tuple(sorted(r)) for r in moes[0].route(x)[0].tolist()}

    base, base_choice = logits(), chosen()
    for attr, value in (("selection_bias", None), ("n_group", 1), ("routed_scaling", 1.0)):
        saved = [getattr(m, attr) for m in moes]
        for m in moes:
            setattr(m, attr, value)
        try:
            assert not torch.allclose(logits(), base, atol=1e-3), attr
            if attr != "routed_scaling":
                assert chosen() != base_choice, attr
        finally:
            for m, v in zip(moes, saved):
                setattr(m, attr, v)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {"norm_topk_prob": False, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0},
    {"n_routed_experts": 16, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "norm_topk_prob": False},
])
def test_other_router_settings_match_transformers(tiny_model: Callable[..., Path], overrides: dict[str, object]) -> None:
    hf_dir = tiny_model("dots1", **overrides)
    rng = random.Random(11)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    llm = LLM(str(hf_dir), max_model_len=256, kv_cache_tokens=4096)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_dir, p, MAX_NEW) for p in prompts]


def test_gguf_router_keys(family_model: Callable[[str, str], Path], tmp_path: Path) -> None:
    hf_dir = family_model("dots1", "hf")
    hf, gg = read_model_config(hf_dir), read_model_config(family_model("dots1", "gguf"))
    for field in ("moe_router", "moe_selection_bias", "moe_n_group", "moe_topk_group", "moe_routed_scaling",
                  "norm_topk_prob", "num_experts", "num_experts_per_tok", "layer_mlp_kinds",
                  "shared_expert_intermediate_size", "shared_expert_gated", "moe_checkpoint"):
        assert getattr(gg, field) == getattr(hf, field), field
    assert hf.moe_router == "sigmoid_topk" and hf.moe_routed_scaling == 2.5 and hf.moe_n_group == 2
    bad = [({"dots1.expert_gating_func": 3}, UnsupportedModelError, "dots1.expert_gating_func"),
           ({"dots1.expert_weights_scale": -2.0}, ModelLoadError, "dots1.expert_weights_scale"),
           ({"dots1.expert_group_count": 3}, ModelLoadError, "dots1.expert_group_count"),
           ({"dots1.leading_dense_block_count": 9}, ModelLoadError, "dots1.leading_dense_block_count")]
    for i, (meta, error, key) in enumerate(bad):
        path = write_gguf(tmp_path / f"bad{i}.gguf", hf_dir, "F32", extra_metadata=meta)
        with pytest.raises(error, match=key):
            read_model_config(path)


@pytest.mark.parametrize("dtype,quantization", [("bfloat16", "none"), ("float32", "int8")])
def test_deterministic_mode_a_requests_tokens_do_not_depend_on_its_batch(tiny_model: Callable[..., Path],
                                                                         dtype: str, quantization: str) -> None:
    """The same prompt alone and among others (which route other tokens to the same experts, and
    through the same expert groups) gives the same tokens and logprobs."""
    hf_dir = tiny_model("dots1", dtype=dtype)
    llm = LLM(str(hf_dir), dtype=dtype, quantization=quantization, deterministic=True, max_model_len=256,
              kv_cache_tokens=4096)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [random_tokens(n, 500, seed=n) for n in (9, 40, 23, 31)]
    alone = llm.generate(prompts[:1], params)[0].outputs[0]
    together = llm.generate(prompts, params)[0].outputs[0]
    assert together.token_ids == alone.token_ids
    assert [lp for lp in together.logprobs] == [lp for lp in alone.logprobs]  # type: ignore[union-attr]


def test_plan_counts_the_float32_router_of_a_bf16_model(tiny_model: Callable[..., Path]) -> None:
    """In bf16 the router's weight and selection bias stay float32: `pagewire plan` counts them so."""
    from server.engine.config import EngineConfig
    from server.engine.plan import make_plan
    from tests.gateway.test_plan import _loaded_weight_bytes

    hf_dir = tiny_model("dots1", dtype="bfloat16")
    model, _ = load_model(hf_dir, dtype="bfloat16")
    router = model._layers[1].moe.router_weight  # type: ignore[attr-defined]
    assert router.dtype == torch.float32
    config = EngineConfig(str(hf_dir), dtype="bfloat16", kv_cache_tokens=1024)
    plan = make_plan("m", read_model_config(hf_dir), config, None, None)
    assert plan.weights.total == _loaded_weight_bytes(model)
