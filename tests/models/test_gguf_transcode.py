"""Q3_K blocks rewritten at load into Q6_K blocks (server.models.gguf_transcode): every value the new
blocks hold is the old block's, bit for bit, by the `gguf` package's dequantisers and by
transformers' own (an independent implementation). With --quantization gguf such a file's matrices
are kept in the new blocks, dequantise to exactly what the float loader builds, their logits track
the file loaded dequantised, and `pagewire plan` counts the bytes they take. Mixed files: llama.cpp's
fallback types (Q5_0 in an odd-width Q4_K_M, Q3_K beside Q4_K) fuse by the types they are kept in,
and stacked experts of Q5_0 / IQ4_NL (kept in their own blocks since these have kernels) are kept."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from server.kernels.quant import QuantizedExperts, QuantizedWeight, x8_here
from server.models.gguf_file import GGUFFile
from server.models.gguf_transcode import TRANSCODES, kept_nbytes, transcode
from server.models.loader import load_model
from tests.gguf_files import write_gguf
from tests.models.paged_harness import VOCAB, random_tokens
from tests.models.test_gguf_quantized import DECODE_STEPS, PROMPT_LEN, _assert_tracks, _logits
from tests.tiny_models import make_tiny_model

# (values, bytes) per block, and where each block's fp16 scale is.
_SOURCE = {"Q3_K": (256, 110, 108)}


def _blocks(src: str, n: int, seed: int) -> np.ndarray:
    """n random `src` blocks: random codes and sub-scales, and fp16 scales of either sign spanning
    zero, subnormals and large values; the first two blocks have every code byte 0x00 and 0xFF (the
    extreme codes and sub-scales)."""
    rng = np.random.default_rng(seed)
    _, nbytes, d_at = _SOURCE[src]
    b = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    b[0], b[1] = 0x00, 0xFF
    d = rng.choice([0.0, -0.0, 6e-8, -3e-5, 0.004, -0.02, 1.5, -900.0], size=n).astype(np.float16)
    b[:, d_at:d_at + 2] = d.view(np.uint8).reshape(n, 2)
    return b


def _dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return np.asarray(quants.dequantize(raw, GGMLQuantizationType[type_name]), dtype=np.float32)


@pytest.mark.parametrize("src", list(TRANSCODES))
@pytest.mark.parametrize("lead", [(6,), (3, 4)])  # a matrix's rows; an expert stack's [E, rows]
def test_transcoded_blocks_hold_the_same_values(src: str, lead: tuple[int, ...]) -> None:
    per_row = 512 // _SOURCE[src][0]  # 512 values a row
    rows = int(np.prod(lead))
    raw = _blocks(src, rows * per_row, seed=rows).reshape(*lead, -1)
    out = transcode(src, raw)
    dst = TRANSCODES[src]
    assert out.dtype == np.uint8 and out.shape[:-1] == raw.shape[:-1]
    want, got = _dequantize(raw, src), _dequantize(out, dst)
    assert want.shape == got.shape == (*lead, 512)
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))  # bit for bit, signed zeros too


@pytest.mark.parametrize("src", ["Q3_K"])
def test_transcoded_blocks_match_transformers_dequantiser(src: str) -> None:
    """transformers' torch dequantisers (not the `gguf` package's) read the same values from both."""
    from gguf import GGMLQuantizationType
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    raw = _blocks(src, 64, seed=7).reshape(-1)
    out = transcode(src, raw.reshape(1, -1)).reshape(-1)
    want = hf_dequantize(torch.from_numpy(raw), int(GGMLQuantizationType[src])).reshape(-1)
    got = hf_dequantize(torch.from_numpy(out), int(GGMLQuantizationType[TRANSCODES[src]])).reshape(-1)
    assert torch.equal(want, got)


def test_transcode_refuses_a_partial_block() -> None:
    with pytest.raises(ValueError, match="Q3_K rows of 100 bytes are not whole 110-byte blocks"):
        transcode("Q3_K", np.zeros((2, 100), dtype=np.uint8))


@pytest.fixture(scope="module")
def k_sized_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows of 256 values (Q3_K's super-block) and grouped-query heads (the Q/K row permutation is
    undone on the transcoded rows); 2 layers keep it quick."""
    return make_tiny_model(tmp_path_factory.mktemp("k_sized") / "llama", "llama", vocab_size=VOCAB,
                           hidden_size=256, intermediate_size=512, num_hidden_layers=2)


@pytest.mark.parametrize("src", list(TRANSCODES))
def test_a_file_of_the_type_is_kept_in_the_new_blocks(src: str, k_sized_model: Path, tmp_path: Path) -> None:
    from server.engine.config import EngineConfig
    from server.engine.plan import make_plan, read_model_config
    from tests.gateway.test_plan import _loaded_weight_bytes

    path = write_gguf(tmp_path / f"{src}.gguf", k_sized_model, src)
    kept, _ = load_model(path, dtype="float32", keep_gguf_blocks=True)
    ref, _ = load_model(path, dtype="float32")
    dst = TRANSCODES[src].lower()
    matrices = [getattr(layer, n) for layer in kept._layers for n in layer.MATRICES] + [kept.lm_head]
    assert all(isinstance(w, QuantizedWeight) and w.qtype == dst for w in matrices)
    assert all(w.interleaved == x8_here() for w in matrices)  # Q8_0 and Q6_K both have x8 kernels
    for lk, lr in zip(kept._layers, ref._layers):
        for n in lk.MATRICES:
            assert torch.equal(getattr(lk, n).dequantize(), getattr(lr, n)), n
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, VOCAB, seed=11)
    _assert_tracks(_logits(kept, tokens), _logits(ref, tokens))
    # `pagewire plan` counts the transcoded blocks' bytes, which is what the loaded model holds.
    f = GGUFFile.open(path)
    t = f.tensors["blk.0.ffn_down.weight"]
    assert kept_nbytes(t) == t.data.nbytes // _SOURCE[src][1] * {"q8_0": 34, "q6_k": 210}[dst]
    config = EngineConfig(str(path), dtype="float32", quantization="gguf", kv_cache_tokens=1024)
    assert make_plan("m", read_model_config(path), config, None, None).weights.total == _loaded_weight_bytes(kept)


def odd_width_q4_k_m(name: str) -> str:
    """What llama.cpp's Q4_K_M gives a model whose rows are not whole super-blocks (SmolLM2's):
    Q5_0 for Q4_K, Q8_0 for Q6_K (attn_v, ffn_down, the table)."""
    return "Q8_0" if name.endswith(("attn_v.weight", "ffn_down.weight", "token_embd.weight", "output.weight")) else "Q5_0"


def q3_k_m(name: str) -> str:
    """Q3_K_M's mix: Q3_K, with a Q4_K attn_v."""
    return "Q4_K" if name.endswith("attn_v.weight") else "Q3_K"


@pytest.mark.parametrize("mix,qkv", [(odd_width_q4_k_m, ("q5_0", "q8_0")), (q3_k_m, ("q6_k", "q4_k"))])
def test_mixed_files_fuse_by_the_kept_types(mix: Callable[[str], str], qkv: tuple[str, ...],
                                             k_sized_model: Path, tmp_path: Path) -> None:
    """A fused qkv of Q5_0 q/k and a Q8_0 v stays two runs (each type in its own blocks), as do
    Q3_K q/k beside a Q4_K v (Q6_K and Q4_K blocks)."""
    path = write_gguf(tmp_path / "mix.gguf", k_sized_model, "Q8_0", qtype_of=mix)
    kept, _ = load_model(path, dtype="float32", keep_gguf_blocks=True)
    ref, _ = load_model(path, dtype="float32")
    w: Any = kept._layers[0].qkv_weight
    assert (w.qtype,) == qkv if isinstance(w, QuantizedWeight) else w.qtypes == qkv
    for lk, lr in zip(kept._layers, ref._layers):
        for n in lk.MATRICES:
            assert torch.equal(getattr(lk, n).dequantize(), getattr(lr, n)), n
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, VOCAB, seed=12)
    _assert_tracks(_logits(kept, tokens), _logits(ref, tokens))


def test_expert_stacks_keep_q5_0_and_iq4_nl_blocks(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """A Qwen2-MoE whose experts are Q5_0 (and shared expert IQ4_NL): its stacks are QuantizedExperts
    of Q5_0 blocks, each expert exactly the float loader's, and the logits track the float file's
    within the 8-bit activation rounding."""
    hf = tiny_model("qwen2moe", hidden_size=256, intermediate_size=256, head_dim=64, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=2, moe_intermediate_size=256,
                    shared_expert_intermediate_size=256)
    path = write_gguf(tmp_path / "moe.gguf", hf, "Q5_0",
                      qtype_of=lambda name: "IQ4_NL" if "shexp" in name else "Q5_0")
    kept, _ = load_model(path, dtype="float32", keep_gguf_blocks=True)
    ref, _ = load_model(path, dtype="float32")
    sparse = [(lk.moe, lr.moe) for lk, lr in zip(kept._layers, ref._layers) if lk.moe is not None]
    assert sparse
    for mk, mr in sparse:
        for n in ("experts_gate_up", "experts_down"):
            stack = getattr(mk, n)
            assert isinstance(stack, QuantizedExperts) and stack.qtype == "q5_0"
            assert torch.equal(stack.dequantize(), getattr(mr, n)), n
        assert isinstance(mk.shared_gate_up_weight, QuantizedWeight) and mk.shared_gate_up_weight.qtype == "iq4_nl"
        assert torch.equal(mk.shared_gate_up_weight.dequantize(), mr.shared_gate_up_weight)
    # The experts run on the quantised kernels in prefill too (8-bit activations: no exact prefill).
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, VOCAB, seed=13)
    ours, want = _logits(kept, tokens), _logits(ref, tokens)
    assert ((ours - want).abs().max() / want.abs().max()).item() < 8e-2
