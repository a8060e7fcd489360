"""The paged Llama-family model reproduces transformers' logits: prefill, decode, chunked prefill, mixed batches."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.models.loader import load_model
from tests.models.paged_harness import ARCHS, VOCAB, PagedRun, hf_logits, random_tokens
from tests.tiny_models import LLAMA3_ROPE_SCALING, make_tiny_model

PROMPT_LEN = 50
DECODE_STEPS = 8
FP32_ATOL = 1e-4


def _prefill_then_decode(model_dir: Path, dtype: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """Our logits for a 50-token prompt in one step then 8 single-token decodes, and HF's for the same tokens."""
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, VOCAB, seed=1)
    model, _ = load_model(model_dir, dtype=dtype)
    run = PagedRun(model)
    rows = [run.step({0: tokens[:PROMPT_LEN]})[0]]
    for t in tokens[PROMPT_LEN:]:
        rows.append(run.step({0: [t]})[0])
    ours = torch.cat(rows)
    ref = hf_logits(model_dir, tokens, model.dtype)
    return ours, ref, model.dtype


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_match_transformers_fp32(arch: str, tiny_model_dirs: dict[str, Path]) -> None:
    ours, ref, _ = _prefill_then_decode(tiny_model_dirs[arch])
    # Well-separated logits: the comparison is meaningful, not decided by near-ties.
    assert ref.std() > 0.5
    torch.testing.assert_close(ours[:PROMPT_LEN], ref[:PROMPT_LEN], atol=FP32_ATOL, rtol=0)
    torch.testing.assert_close(ours[PROMPT_LEN:], ref[PROMPT_LEN:], atol=FP32_ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_over_cached_context_matches_transformers(arch: str, tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs[arch]
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, VOCAB, seed=2)
    model, _ = load_model(model_dir)
    run = PagedRun(model)
    # Chunks of 16 over the prompt (the last chunk is short), then decode one token at a time.
    rows = [run.step({0: tokens[i : min(i + 16, PROMPT_LEN)]})[0] for i in range(0, PROMPT_LEN, 16)]
    rows += [run.step({0: [t]})[0] for t in tokens[PROMPT_LEN:]]
    ours = torch.cat(rows)
    torch.testing.assert_close(ours, hf_logits(model_dir, tokens), atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_mixed_batch_of_prefills_and_decodes_matches_per_sequence_reference(
    arch: str, tiny_model_dirs: dict[str, Path]
) -> None:
    model_dir = tiny_model_dirs[arch]
    seqs = {sid: random_tokens(n, VOCAB, seed=10 + sid) for sid, n in ((0, 40), (1, 33), (2, 45))}
    model, _ = load_model(model_dir)
    run = PagedRun(model, num_blocks=64)
    got: dict[int, list[torch.Tensor]] = {sid: [] for sid in seqs}
    done = {sid: 0 for sid in seqs}
    # Step plans: seq 0 prefills whole then decodes; seq 1 chunks of 10; seq 2 joins late with chunks of 20.
    plans = {0: [38, 1, 1], 1: [10, 10, 10, 1, 1, 1], 2: [0, 0, 20, 20, 3, 1, 1]}
    for step in range(max(len(p) for p in plans.values())):
        batch = {}
        for sid, plan in plans.items():
            n = plan[step] if step < len(plan) else 0
            if n:
                batch[sid] = seqs[sid][done[sid] : done[sid] + n]
                done[sid] += n
        for sid, logits in run.step(batch).items():
            got[sid].append(logits)
    for sid, toks in seqs.items():
        assert done[sid] == len(toks)
        torch.testing.assert_close(torch.cat(got[sid]), hf_logits(model_dir, toks), atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("arch, dtype", [("llama", "bfloat16"), ("qwen3", "bfloat16"), ("mistral", "float16")])
def test_half_precision_tracks_transformers_at_the_same_dtype(arch: str, dtype: str, tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / arch, arch, dtype, vocab_size=VOCAB)
    ours, ref, loaded_dtype = _prefill_then_decode(model_dir)
    assert loaded_dtype == getattr(torch, dtype)  # "auto" follows the checkpoint
    scale = ref.abs().max().item()
    # bf16 keeps ~3 significant digits and both sides round differently (our kernels accumulate
    # attention in fp32, HF eager in bf16); measured max error is ~2.5% of the largest logit,
    # about the same distance each side is from the float32 result.
    assert (ours - ref).abs().max().item() < 0.05 * scale
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    model_dir = make_tiny_model(
        tmp_path / "l3", "llama", vocab_size=VOCAB, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_SCALING
    )
    ours, ref, _ = _prefill_then_decode(model_dir)
    torch.testing.assert_close(ours, ref, atol=FP32_ATOL, rtol=0)


def test_qwen2_sliding_window_on_upper_layers_matches_transformers(tmp_path: Path) -> None:
    model_dir = make_tiny_model(
        tmp_path / "q2sw", "qwen2", vocab_size=VOCAB, use_sliding_window=True, sliding_window=16, max_window_layers=1
    )
    model, config = load_model(model_dir)
    assert config.layer_sliding_windows == (None, 16)
    ours, ref, _ = _prefill_then_decode(model_dir)
    torch.testing.assert_close(ours, ref, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("llama", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE_SCALING}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
        ("mistral", {}),
    ],
)
def test_v4_and_v5_config_formats_give_identical_models(arch: str, extra: dict, tmp_path: Path) -> None:
    v5 = make_tiny_model(tmp_path / "v5", arch, vocab_size=VOCAB, config_format="v5", **extra)
    v4 = make_tiny_model(tmp_path / "v4", arch, vocab_size=VOCAB, config_format="v4", **extra)
    assert "rope_parameters" not in (v4 / "config.json").read_text()
    (m5, c5), (m4, c4) = load_model(v5), load_model(v4)
    assert c5 == c4
    tokens = random_tokens(30, VOCAB, seed=3)
    assert torch.equal(PagedRun(m5).step({0: tokens})[0], PagedRun(m4).step({0: tokens})[0])


def test_tied_embeddings_share_the_embedding_and_match_transformers(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "tied", "qwen2", vocab_size=VOCAB, tie_word_embeddings=True)
    model, config = load_model(model_dir)
    assert config.tie_word_embeddings and model.lm_head is model.embed_tokens
    ours, ref, _ = _prefill_then_decode(model_dir)
    torch.testing.assert_close(ours, ref, atol=FP32_ATOL, rtol=0)


def test_two_shard_checkpoint_with_index_loads_like_transformers(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "sharded", "llama", vocab_size=VOCAB, num_shards=2)
    assert len(list(model_dir.glob("model-0000?-of-00002.safetensors"))) == 2
    assert (model_dir / "model.safetensors.index.json").is_file()
    ours, ref, _ = _prefill_then_decode(model_dir)
    torch.testing.assert_close(ours, ref, atol=FP32_ATOL, rtol=0)
