"""Embedding models through the engine (server.models.pooling) equal transformers' pooled
`last_hidden_state`, for last-token, mean and cls pooling on tiny Qwen3 and Qwen2 models.

Tolerance: max abs difference 1e-4 per value after normalisation (float32 weights; the paged
attention kernel and fused ops round differently from torch's eager attention in the last bits,
which is about 1e-6 here, so 1e-4 is a wide margin that still catches any wrong row or position).
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from server import LLM
from server.models.pooling import DEFAULT_POOLER, Pooler, PoolingMethod, read_pooler, resolve_pooler
from tests.tiny_models import with_pooling_config

TOL = 1e-4

_HF: dict[str, object] = {}


def _hf_hidden(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' AutoModel last_hidden_state (after the final norm) for one unpadded input."""
    from transformers import AutoModel

    if str(model_dir) not in _HF:
        _HF[str(model_dir)] = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return _HF[str(model_dir)](input_ids=torch.tensor([ids])).last_hidden_state[0]  # type: ignore[operator]


def _reference(model_dir: Path, ids: list[int], method: str, normalize: bool, dims: int | None = None) -> torch.Tensor:
    h = _hf_hidden(model_dir, ids)
    vec = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[method]
    if dims is not None:
        vec = vec[:dims]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def embed_model(tiny_model, tmp_path_factory):
    cache: dict[tuple[str, str, bool, bool], Path] = {}

    def make(arch: str, method: str, normalize: bool = True, base_model: bool = True) -> Path:
        key = (arch, method, normalize, base_model)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"embed-{arch}-{method}")
            cache[key] = with_pooling_config(tiny_model(arch), out / "m", method, normalize, base_model)
        return cache[key]

    return make


# Several inputs of different lengths in one batch, across more than one 16-token block and, with
# max_num_batched_tokens=32, split into chunked prefills (mean pooling sums across chunks).
LENGTHS = [3, 17, 40, 9, 65]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_pooled_embeddings_match_transformers(embed_model, arch: str, method: str) -> None:
    model_dir = embed_model(arch, method)
    llm = LLM(str(model_dir), max_model_len=128, kv_cache_tokens=2048, max_num_batched_tokens=32)
    assert llm.engine.pooler == Pooler(PoolingMethod(method), True, source=str(model_dir / "modules.json"))
    prompts = _prompts(llm.engine.vocab_size, LENGTHS, seed=3)
    outs = llm.embed(prompts)
    for p, o in zip(prompts, outs):
        assert o.embedding is not None and len(o.embedding) == 64
        ref = _reference(model_dir, p, method, normalize=True)
        got = torch.tensor(o.embedding)
        assert (got - ref).abs().max().item() <= TOL, (method, len(p))
        assert abs(got.norm().item() - 1.0) < 1e-5
        assert o.outputs[0].token_ids == [] and o.outputs[0].finish_reason == "stop"


def test_without_normalize_and_with_dimensions(embed_model) -> None:
    model_dir = embed_model("qwen3", "mean", normalize=False)
    llm = LLM(str(model_dir), max_model_len=128, kv_cache_tokens=2048)
    prompts = _prompts(llm.engine.vocab_size, [5, 30], seed=4)
    for p, o in zip(prompts, llm.embed(prompts)):
        ref = _reference(model_dir, p, "mean", normalize=False)
        assert (torch.tensor(o.embedding) - ref).abs().max().item() <= TOL
    # Matryoshka: the leading 16 values; normalised again only when the model normalises.
    for p, o in zip(prompts, llm.embed(prompts, dimensions=16)):
        ref = _reference(model_dir, p, "mean", normalize=False, dims=16)
        assert len(o.embedding or []) == 16 and (torch.tensor(o.embedding) - ref).abs().max().item() <= TOL
    normed = LLM(str(embed_model("qwen3", "last")), max_model_len=128, kv_cache_tokens=2048)
    o = normed.embed(prompts[1], dimensions=16)[0]
    ref = _reference(embed_model("qwen3", "last"), prompts[1], "last", normalize=True, dims=16)
    assert (torch.tensor(o.embedding) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_prefix_cache_hit_gives_the_same_vector(embed_model, method: str) -> None:
    """Last-token pooling takes a prefix-cache hit (all but the last prompt token served from the
    cache, the last recomputed); mean and cls pooling never do (they need hidden states the cache
    does not hold) and recompute. Either way the second vector equals the first."""
    model_dir = embed_model("qwen3", method)
    # Deterministic (batch-invariant) mode: a row's floats do not depend on whether its prefix
    # came from the cache, so the vectors are equal bit for bit; without it they agree to
    # rounding (one row's forward takes other kernel paths than fifty rows').
    llm = LLM(str(model_dir), max_model_len=128, kv_cache_tokens=2048, deterministic=True)
    prompt = _prompts(llm.engine.vocab_size, [50], seed=5)[0]
    first = llm.embed(prompt)[0]
    again = llm.embed(prompt)[0]
    longer = llm.embed(prompt + [7, 8, 9])[0]  # shares the first three blocks
    if method == "last":
        assert again.num_cached_tokens == 48 and longer.num_cached_tokens == 48
    else:
        assert again.num_cached_tokens == 0 and longer.num_cached_tokens == 0
    assert first.embedding == again.embedding
    ref = _reference(model_dir, prompt + [7, 8, 9], method, normalize=True)
    assert (torch.tensor(longer.embedding) - ref).abs().max().item() <= TOL


def test_preempted_mean_pooling_recomputes_once(embed_model) -> None:
    """A mean-pooled request preempted mid-prefill (a better-priority one needs its blocks)
    recomputes its whole prompt: the sum restarts rather than counting the first chunk twice."""
    from server.engine.sampling_params import EmbeddingParams, SamplingParams

    model_dir = embed_model("qwen2", "mean")
    llm = LLM(str(model_dir), max_model_len=112, kv_cache_tokens=16 * 8, max_num_batched_tokens=64, block_size=16)
    eng = llm.engine
    a, b = _prompts(eng.vocab_size, [100, 100], seed=6)
    sp = SamplingParams(max_tokens=1, embedding=EmbeddingParams())
    eng.add_request("a", a, sp, priority=5)
    got: dict[str, list[float]] = {}
    for d in eng.step():  # a's first 64 tokens
        assert d.embedding is None
    eng.add_request("b", b, sp, priority=0)
    while eng.has_unfinished_requests():
        for d in eng.step():
            if d.embedding is not None:
                got[d.request_id] = d.embedding
    assert eng.scheduler.num_preemptions > 0
    for rid, p in (("a", a), ("b", b)):
        assert (torch.tensor(got[rid]) - _reference(model_dir, p, "mean", True)).abs().max().item() <= TOL


def test_task_detection_and_refusals(tiny_model, embed_model, tmp_path) -> None:
    gen = tiny_model("qwen3")
    assert read_pooler(gen) is None and resolve_pooler("auto", gen) is None
    assert resolve_pooler("embed", gen) == DEFAULT_POOLER  # last-token, normalised
    assert resolve_pooler("generate", embed_model("qwen3", "cls")) is None
    # A causal LM checkpoint served with --task embed pools its last token.
    llm = LLM(str(gen), task="embed", max_model_len=64, kv_cache_tokens=512)
    p = _prompts(llm.engine.vocab_size, [12], seed=7)[0]
    ref = _reference(gen, p, "last", True)
    assert (torch.tensor(llm.embed(p)[0].embedding) - ref).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="model: .* embedding model"):
        llm.generate([p])
    with pytest.raises(ValueError, match="dimensions: must be between 1 and 64"):
        llm.embed(p, dimensions=65)
    plain = LLM(str(gen), max_model_len=64, kv_cache_tokens=512)
    with pytest.raises(ValueError, match="model: .* generation, not embeddings"):
        plain.embed(p)
    # A base-model checkpoint (no LM head) cannot generate, and says how to serve it.
    from server.models.config import ModelLoadError

    with pytest.raises(ModelLoadError, match="base model without an LM head.*--task embed"):
        LLM(str(embed_model("qwen3", "cls")), task="generate", max_model_len=64, kv_cache_tokens=512)


def test_unsupported_pooling_configs_are_named(tiny_model, tmp_path) -> None:
    import json

    from server.models.config import ModelLoadError, UnsupportedModelError

    d = with_pooling_config(tiny_model("qwen3"), tmp_path / "x", "last")
    cfg = json.loads((d / "1_Pooling" / "config.json").read_text())
    cfg["pooling_mode_max_tokens"] = True
    (d / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="1_Pooling/config.json: pooling mode"):
        read_pooler(d)
    cfg["pooling_mode_max_tokens"] = False
    (d / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    mods = json.loads((d / "modules.json").read_text())
    (d / "modules.json").write_text(json.dumps(mods + [{"path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(UnsupportedModelError, match="Dense"):
        read_pooler(d)
    (d / "modules.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="modules.json"):
        read_pooler(d)
