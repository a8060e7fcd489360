"""The Gated DeltaNet layer (server/models/gated_deltanet.py) against transformers' own module with
the same weights: Qwen3-Next's (in_proj_qkvz / in_proj_ba grouped per key head) and Qwen3.5's
(split in-projections). Two prompts are prefilled in chunks of different sizes in mixed batches
(boundaries inside the K = 4 conv window), carrying their states through slot pools, then decoded
token by token together; every output row must equal transformers' full-sequence output (float32)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from server.models.gated_deltanet import GatedDeltaNet, GdnShape

SIZES = dict(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=24, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_hidden_layers=1, layer_types=["linear_attention"])


def _make(family: str, dtype: torch.dtype) -> tuple[nn.Module, GatedDeltaNet]:
    torch.manual_seed(0)
    if family == "qwen3_next":
        ref: nn.Module = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**SIZES), 0)
    else:
        ref = Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**SIZES), 0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name == "A_log":
                p.copy_(torch.log(torch.rand(p.shape) * 4 + 0.01))
            elif name in ("dt_bias", "norm.weight"):
                p.copy_(torch.randn(p.shape) * 0.5 + (1.0 if name == "norm.weight" else 0.0))
            else:
                p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    ref = ref.to(dtype).eval()
    shape = GdnShape(48, 2, 4, 16, 24, 4, 1e-6, "qkvz" if family == "qwen3_next" else "split")
    ours = GatedDeltaNet(shape, dtype, torch.device("cpu"))
    targets = ours.checkpoint_tensors("")
    state = ref.state_dict()
    assert set(state) == set(targets), f"{set(state) ^ set(targets)}"
    with torch.no_grad():
        for name, tensor in state.items():
            t = targets[name]
            assert tuple(tensor.shape) == t.shape, name
            t.dest.copy_(t.convert(tensor) if t.convert is not None else tensor)
    return ref, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_chunked_prefill_and_decode_match_transformers(family: str, dtype: torch.dtype) -> None:
    ref, ours = _make(family, dtype)
    gen = torch.Generator().manual_seed(1)
    decode = 4
    prompts = [13, 9]
    xs = [torch.randn(n + decode, 48, generator=gen).to(dtype) for n in prompts]
    with torch.no_grad():
        want = [ref(x[None])[0] for x in xs]
    s = ours.shape
    N = 5
    conv = torch.zeros(N, s.conv_kernel - 1, s.conv_dim, dtype=dtype)
    rec = torch.zeros(N, s.num_value_heads, s.key_head_dim, s.value_head_dim)
    slots = [3, 1]
    # (tokens of prompt 0, tokens of prompt 1) per step; 0 = that sequence is not in the step
    steps = [(2, 3), (1, 0), (7, 6), (3, 0)] + [(1, 1)] * decode
    got: list[list[torch.Tensor]] = [[], []]
    pos = [0, 0]
    for step in steps:
        seqs = [i for i in range(2) if step[i]]
        x = torch.cat([xs[i][pos[i] : pos[i] + step[i]] for i in seqs])
        qsl = torch.tensor([0] + list(torch.tensor([step[i] for i in seqs]).cumsum(0)), dtype=torch.int32)
        out = ours(x, conv, rec, torch.tensor([slots[i] for i in seqs]), qsl)
        for j, i in enumerate(seqs):
            got[i].append(out[int(qsl[j]) : int(qsl[j + 1])])
            pos[i] += step[i]
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for i in range(2):
        g = torch.cat(got[i]).double()
        err = float((g - want[i].double()).abs().max() / want[i].double().abs().max())
        assert err <= tol, f"sequence {i}: relative error {err:.3g}"
