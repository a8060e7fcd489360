"""gpt-oss test files: an MXFP4 copy of a tiny gpt-oss folder (experts as `*_blocks` / `*_scales`,
as openai/gpt-oss-* ship them) and the GGUF layout of its MoE tensors (as llama.cpp's converter
writes them), both written independently of server.models.mxfp4 / gguf_loader.

MXFP4 here follows the OCP MX spec directly: per 32 values one shared power-of-two scale
2 ** (s - 127) with the largest magnitude mapped into E2M1's range (max 6), each value rounded to
the nearest E2M1 code; HF packs element 2j in the low nibble of byte j and 2j + 1 in the high one,
GGML packs element j low and j + 16 high, with the scale byte first in each 17-byte block.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def encode_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [..., K], scales uint8 [..., K / 32]) of float w [..., K]: nearest E2M1 code per value."""
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127)  # amax / 2**exp < 8
    exp = np.clip(exp, -127, 127)
    scaled = blocks / np.exp2(exp)[..., None]
    codes = np.abs(scaled[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)
    return codes.reshape(w.shape), (exp + 127).astype(np.uint8)


def decode_reference(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 values of E2M1 codes [..., K] with their block scales [..., K / 32]."""
    vals = E2M1[codes].reshape(*codes.shape[:-1], codes.shape[-1] // 32, 32)
    return (vals * np.exp2(scales.astype(np.float64) - 127)[..., None]).reshape(codes.shape)


def hf_pack(codes: np.ndarray) -> np.ndarray:
    """[..., K] codes -> HF blocks [..., K / 32, 16]: byte j of a block = code 2j | code 2j+1 << 4."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 32, 16, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)


def hf_unpack(blocks: np.ndarray) -> np.ndarray:
    """HF blocks [..., G, 16] -> codes [..., G * 32]."""
    codes = np.stack((blocks & 0x0F, blocks >> 4), axis=-1)
    return codes.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def ggml_pack(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes [..., K] + scales [..., K / 32] -> GGML MXFP4 bytes [..., K / 32 * 17]."""
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 32, 32)
    qs = (c[..., :16] | (c[..., 16:] << 4)).astype(np.uint8)
    out = np.concatenate([scales[..., None], qs], axis=-1)
    return out.reshape(*codes.shape[:-1], -1)


def write_mxfp4_folder(float_dir: Path, out: Path) -> Path:
    """A copy of a float gpt-oss folder whose experts' matrices are MXFP4 blocks and scales
    (quantization_config.quant_method "mxfp4"); every other tensor as it was."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(float_dir, out)
    state = load_file(str(out / "model.safetensors"))
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = state.pop(name).float().transpose(1, 2).numpy()  # [E, out, in]: blocks run along the inputs
        codes, scales = encode_mxfp4(w)
        state[name + "_blocks"] = torch.from_numpy(np.ascontiguousarray(hf_pack(codes)))
        state[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def gpt_oss_moe(state: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Pops gpt-oss's router and experts from `state`: (float tensors by GGUF name, MXFP4 tensors
    by GGUF name as GGML bytes). llama.cpp's converter splits the interleaved gate/up columns into
    ffn_gate_exps / ffn_up_exps and transposes the float experts to [E, out, in]."""
    floats: dict[str, np.ndarray] = {}
    raw: dict[str, np.ndarray] = {}
    for name in [n for n in state if ".mlp." in n and not n.endswith("_scales")]:  # scales go with their blocks
        layer, rest = name.split(".")[2], name.split(".mlp.")[1]
        b = f"blk.{layer}."
        t = state.pop(name)
        if rest in ("router.weight", "router.bias"):
            floats[b + "ffn_gate_inp." + rest.split(".")[1]] = t.float().numpy()
        elif rest == "experts.gate_up_proj_bias":
            floats[b + "ffn_gate_exps.bias"] = t[:, 0::2].float().numpy()
            floats[b + "ffn_up_exps.bias"] = t[:, 1::2].float().numpy()
        elif rest == "experts.down_proj_bias":
            floats[b + "ffn_down_exps.bias"] = t.float().numpy()
        elif rest == "experts.gate_up_proj":
            w = t.float().transpose(1, 2).numpy()  # [E, 2I, H]
            floats[b + "ffn_gate_exps.weight"], floats[b + "ffn_up_exps.weight"] = w[:, 0::2], w[:, 1::2]
        elif rest == "experts.down_proj":
            floats[b + "ffn_down_exps.weight"] = t.float().transpose(1, 2).numpy()
        elif rest.endswith("_blocks"):
            codes = hf_unpack(t.numpy())
            scales = state.pop(name.replace("_blocks", "_scales")).numpy()
            if "gate_up" in rest:
                raw[b + "ffn_gate_exps.weight"] = ggml_pack(codes[:, 0::2], scales[:, 0::2])
                raw[b + "ffn_up_exps.weight"] = ggml_pack(codes[:, 1::2], scales[:, 1::2])
            else:
                raw[b + "ffn_down_exps.weight"] = ggml_pack(codes, scales)
    return floats, raw
