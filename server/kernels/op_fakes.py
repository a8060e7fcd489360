"""Fake (meta) kernels of the pagewire ops: the output shapes and dtypes, without running anything,
for torch.compile and torch.library.opcheck. server.kernels.ops imports this module, so importing
the ops registers them."""
from __future__ import annotations

import torch

import server._C  # noqa: F401  (the op schemas these register against)


# Fake (meta) kernels: the in-place ops produce no new tensors, so shape propagation is trivial.
@torch.library.register_fake("pagewire::write_kv_cache")
def _write_kv_cache_fake(key, value, key_cache, value_cache, slot_mapping) -> None:
    return None


@torch.library.register_fake("pagewire::paged_attention")
def _paged_attention_fake(
    out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
    scale, sliding_window, max_query_len, max_seq_len, softcap=0.0, sinks=None,
) -> None:
    return None


@torch.library.register_fake("pagewire::copy_blocks")
def _copy_blocks_fake(key_caches, value_caches, block_mapping) -> None:
    return None


@torch.library.register_fake("pagewire::linear")
def _linear_fake(x, weight, bias):
    torch._check(x.shape[-1] == weight.shape[1], lambda: "x and weight disagree on K")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("pagewire::rms_norm")
def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.register_fake("pagewire::add_rms_norm")
def _add_rms_norm_fake(residual, delta, weight, eps):
    return residual.new_empty(residual.shape)


@torch.library.register_fake("pagewire::rotary_embedding")
def _rotary_embedding_fake(x, positions, cos, sin, norm_weight, eps) -> None:
    return None


@torch.library.register_fake("pagewire::silu_and_mul")
def _silu_and_mul_fake(x):
    torch._check(x.shape[-1] % 2 == 0, lambda: "x's last dim must be even")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.register_fake("pagewire::gelu_tanh_and_mul")
def _gelu_tanh_and_mul_fake(x):
    torch._check(x.shape[-1] % 2 == 0, lambda: "x's last dim must be even")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.register_fake("pagewire::short_conv")
def _short_conv_fake(bcx, weight_t, bias, state, slots, query_start_loc):
    torch._check(bcx.shape[-1] % 3 == 0, lambda: "bcx's last dim must be 3C")
    return bcx.new_empty((bcx.shape[0], bcx.shape[1] // 3))


@torch.library.register_fake("pagewire::lora_add")
def _lora_add_fake(out, x, adapter, a, spans, scales, bts, parts) -> None:
    return None


@torch.library.register_fake("pagewire::moe_experts")
def _moe_experts_fake(x, topk_ids, topk_weights, gate_up, gate_up_kind, down, down_kind, gate_up_bias=None,
                      down_bias=None, activation="silu", alpha=1.702, limit=7.0):
    return x.new_empty(x.shape)


@torch.library.register_fake("pagewire::moe_decode")
def _moe_decode_fake(x, router_weight, router_kind, router_bias, router, top_k, norm_topk_prob, gate_up, gate_up_kind,
                     down, down_kind, gate_up_bias, down_bias, activation, alpha, limit, shared_gate_up,
                     shared_gate_up_kind, shared_down, shared_down_kind, shared_gate, shared_gate_kind,
                     selection_bias=None, n_group=1, topk_group=1, routed_scaling=1.0):
    return x.new_empty(x.shape)


@torch.library.register_fake("pagewire::moe_route")
def _moe_route_fake(logits, router, top_k, norm_topk_prob, selection_bias=None, n_group=1, topk_group=1,
                    routed_scaling=1.0):
    T = logits.shape[0]
    return (logits.new_empty((T, top_k), dtype=torch.int64), logits.new_empty((T, top_k), dtype=torch.float32))


@torch.library.register_fake("pagewire::ngram_propose")
def _ngram_propose_fake(token_ids, num_tokens, k, min_n, max_n):
    return num_tokens.new_empty((num_tokens.shape[0], k))


# rejection_sample has no fake kernel: its output width (the largest k_i) depends on cu_num_draft's
# values, and it only ever runs eagerly, on the host's control path.


@torch.library.register_fake("pagewire::quantize_q8_0")
def _quantize_q8_0_fake(weight):
    return weight.new_empty((weight.shape[0], weight.shape[1] // 32 * 34), dtype=torch.uint8)


@torch.library.register_fake("pagewire::dequantize_q8_0")
def _dequantize_q8_0_fake(weight, interleaved=False):
    return weight.new_empty((weight.shape[0], weight.shape[1] // 34 * 32), dtype=torch.float32)


@torch.library.register_fake("pagewire::quantize_q4_0")
def _quantize_q4_0_fake(weight):
    return weight.new_empty((weight.shape[0], weight.shape[1] // 32 * 18), dtype=torch.uint8)


# (values, bytes) per block of each qtype string the 4-bit and K-quant ops take ("x8": the interleaved layout).
_Q4_FORMATS = {"q4_0": (32, 18), "q4_1": (32, 20), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
               "q4_0x8": (32, 18), "q4_1x8": (32, 20), "q4_kx8": (256, 144), "q6_kx8": (256, 210),
               "mxfp4": (32, 17), "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18), "q5_0x8": (32, 22),
               "q5_1x8": (32, 24), "iq4_nlx8": (32, 18), "q5_kx8": (256, 176), "iq4_xs": (256, 136),
               "iq4_xsx8": (256, 136), "q2_k": (256, 84), "q2_kx8": (256, 84),
               "q3_k": (256, 110), "q3_kx8": (256, 110),
               **{f"{q}{x8}": (256, 136) for q in ("iq3_xxs", "iq3_s", "iq2_xxs", "iq1_s") for x8 in ("", "x8")},
               **{f"{q}{x8}": (256, 138) for q in ("iq2_xs", "iq2_s", "iq1_m") for x8 in ("", "x8")}}


@torch.library.register_fake("pagewire::interleave_bf16")
def _interleave_bf16_fake(weight):
    return weight.new_empty((weight.shape[0], 2 * weight.shape[1]), dtype=torch.uint8)


@torch.library.register_fake("pagewire::deinterleave_bf16")
def _deinterleave_bf16_fake(weight):
    return weight.new_empty((weight.shape[0], weight.shape[1] // 2), dtype=torch.bfloat16)


@torch.library.register_fake("pagewire::embedding_bf16x8")
def _embedding_bf16x8_fake(ids, weight):
    return weight.new_empty((*ids.shape, weight.shape[1] // 2), dtype=torch.bfloat16)


@torch.library.register_fake("pagewire::linear_bf16x8")
def _linear_bf16x8_fake(x, weight, bias):
    torch._check(x.shape[-1] * 2 == weight.shape[1], lambda: "x and weight disagree on K")
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("pagewire::pack_bf16z")
def _pack_bf16z_fake(weight):
    # The buffer's width depends on the values (rare raw steps): an unbacked size.
    width = torch.library.get_ctx().new_dynamic_size()
    return weight.new_empty((weight.shape[0], width), dtype=torch.uint8)


@torch.library.register_fake("pagewire::unpack_bf16z")
def _unpack_bf16z_fake(weight, k):
    return weight.new_empty((weight.shape[0], k), dtype=torch.bfloat16)


@torch.library.register_fake("pagewire::embedding_bf16z")
def _embedding_bf16z_fake(ids, weight, k):
    return weight.new_empty((*ids.shape, k), dtype=torch.bfloat16)


@torch.library.register_fake("pagewire::linear_bf16z")
def _linear_bf16z_fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("pagewire::dequantize_q4")
def _dequantize_q4_fake(weight, qtype):
    values, nbytes = _Q4_FORMATS[qtype]
    return weight.new_empty((weight.shape[0], weight.shape[1] // nbytes * values), dtype=torch.float32)


@torch.library.register_fake("pagewire::embedding_gguf")
def _embedding_gguf_fake(ids, weight, qtype, dtype):
    values, nbytes = (32, 34) if qtype in ("q8_0", "q8_0x8") else _Q4_FORMATS[qtype]
    return weight.new_empty((*ids.shape, weight.shape[1] // nbytes * values), dtype=dtype)


@torch.library.register_fake("pagewire::decode_layer")
def _decode_layer_fake(hidden, delta, attn_norm, attn_post_norm, mlp_norm, mlp_post_norm, eps, residual_multiplier,
                       qkv_weight, qkv_kind, qkv_bias, q_norm, k_norm, o_weight, o_kind, o_bias, gate_up_weight,
                       gate_up_kind, gate_up_bias, down_weight, down_kind, down_bias, positions, cos, sin, qk_norm,
                       key_cache, value_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                       sliding_window, max_query_len, max_seq_len, num_heads, num_kv_heads, head_dim, softcap=0.0,
                       activation="silu", v_norm=None, shares_kv=False, value_from_key=False, per_layer_input=None,
                       ple_gate=None, ple_gate_kind="torch", ple_proj=None, ple_proj_kind="torch", ple_norm=None,
                       layer_scalar=None, sinks=None, lora=None, lora_spec=None):
    # A layer that ends itself (Gemma 4's per-layer input block, layer scalar) has added its MLP
    # output already and returns an empty [0, H].
    finishes = ple_gate is not None or layer_scalar is not None
    return hidden.new_empty((0, hidden.shape[1]) if finishes else hidden.shape)


@torch.library.register_fake("pagewire::interleave_q8_0")
def _interleave_q8_0_fake(weight):
    return torch.empty_like(weight)


@torch.library.register_fake("pagewire::interleave_q4")
def _interleave_q4_fake(weight, qtype):
    return torch.empty_like(weight)


@torch.library.register_fake("pagewire::linear_q4")
def _linear_q4_fake(x, weight, qtype, bias):
    values, nbytes = _Q4_FORMATS[qtype]
    torch._check(x.shape[-1] // values * nbytes == weight.shape[1], lambda: "x and weight disagree on K")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("pagewire::linear_q8_0")
def _linear_q8_0_fake(x, weight, bias, interleaved=False):
    torch._check(x.shape[-1] // 32 * 34 == weight.shape[1], lambda: "x and weight disagree on K")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# Gated DeltaNet (server/kernels/gdn.py): the states are updated in place, outputs are new tensors.
@torch.library.register_fake("pagewire::gdn_causal_conv1d")
def _gdn_causal_conv1d_fake(x, weight, bias, conv_states, slots, query_start_loc, activation="silu"):
    return x.new_empty(x.shape)


@torch.library.register_fake("pagewire::gdn_gating")
def _gdn_gating_fake(a, b, A_log, dt_bias):
    return a.new_empty(a.shape, dtype=torch.float32), a.new_empty(a.shape, dtype=torch.float32)


@torch.library.register_fake("pagewire::gated_delta_rule")
def _gated_delta_rule_fake(q, k, v, g, beta, states, slots, query_start_loc, chunk_size=64):
    return v.new_empty(v.shape)


@torch.library.register_fake("pagewire::gated_rms_norm")
def _gated_rms_norm_fake(x, gate, weight, eps):
    return x.new_empty(x.shape)


# The hybrids' fused decode layers (csrc/cpu/hybrid_decode.h): hidden and the states or caches are
# updated in place; the result is the layer's MLP output, hidden's shape.
@torch.library.register_fake("pagewire::gdn_decode_layer")
def _gdn_decode_layer_fake(hidden, delta, attn_norm, mlp_norm, eps, in_proj, in_kind, conv_weight, A_log, dt_bias,
                           norm_weight, norm_eps, out_proj, out_kind, gate_up, gate_up_kind, down, down_kind,
                           conv_states, recurrent_states, slots, query_start_loc, num_key_heads, num_value_heads,
                           key_head_dim, value_head_dim, chunk_size=64, out_columns=None):
    return hidden.new_empty(hidden.shape)


@torch.library.register_fake("pagewire::gated_attention_decode_layer")
def _gated_attention_decode_layer_fake(hidden, delta, attn_norm, mlp_norm, eps, qkv_weight, qkv_kind, qk_norm,
                                       o_weight, o_kind, gate_up, gate_up_kind, down, down_kind, positions, cos, sin,
                                       key_cache, value_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                                       scale, sliding_window, max_query_len, max_seq_len, num_heads, num_kv_heads,
                                       head_dim):
    return hidden.new_empty(hidden.shape)
