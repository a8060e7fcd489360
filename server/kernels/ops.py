"""Typed Python entry points for the pagewire tensor ops (torch.ops.pagewire.*) and their fake kernels.

Shapes: T = tokens in the flat batch, S = sequences, H = query heads, KVH = KV heads, D = head_dim,
NB = physical KV blocks, BS = block_size. All argument checking happens in the C++ kernels, which
raise RuntimeError naming the offending argument.

`linear` and its routing rules (which path each weight kind and row count takes: `linear_kind`,
`embedding`, the autotune's paths) are server.kernels.linear_route's; `linear` is re-exported here
for its many callers.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

import server._C  # (also loads the TORCH_LIBRARY(pagewire) registrations)
from server._C import fast as _fast  # the per-step CPU ops without the dispatcher (csrc/fast_calls.cpp)
from server.kernels.linear_route import linear
from server.kernels.quant import QuantizedExperts

__all__ = [
    "write_kv_cache", "paged_attention", "copy_blocks", "linear", "rms_norm", "add_rms_norm",
    "rotary_embedding", "silu_and_mul", "gelu_tanh_and_mul", "moe_experts", "moe_decode", "moe_route", "ngram_propose",
    "rejection_sample", "argmax_rows", "argmax_list", "to_float32", "cpu_isa", "detected_cpu_isa", "lora_add", "cpu_features",
    "use_small_blocks", "release_small_blocks", "small_block_stats",
]

logger = logging.getLogger(__name__)


def cpu_features() -> dict[str, object]:
    """CPUID features of this CPU as the extension detected them (vendor, brand, avx2, avx512bf16, amx_bf16, ...)."""
    return dict(server._C.cpu_features())


def cpu_isa() -> str:
    """The CPU kernel family in use: "amx", "avx512bf16", "avx512", "avx2" or "portable" (torch fallback).

    It is the best the CPU supports, lowered by $PAGEWIRE_CPU_ISA when that names a lower family.
    """
    return str(server._C.cpu_isa())


def detected_cpu_isa() -> str:
    """The best CPU kernel family this CPU supports (as cpu_isa() names them), ignoring $PAGEWIRE_CPU_ISA."""
    return str(server._C.detected_cpu_isa())


def use_small_blocks(on: bool = True) -> None:
    """Install (or remove) the small-block cache as torch's CPU allocator for the whole process
    (cpu/small_blocks.h): a freed tensor block of up to 512 KiB is kept on its thread, by size
    class, for the next tensor of that size, instead of going back to glibc's posix_memalign. A
    decode step allocates a few hundred such tensors; the cache made SmolLM2's steps about 1.5 %
    faster (bench/RESULTS.md, session 33). At most 8 MiB stays cached per thread. The engine turns
    it on for CPU models unless $PAGEWIRE_SMALL_BLOCKS=0."""
    server._C.set_small_blocks(on)


def release_small_blocks() -> None:
    """Return the calling thread's cached small blocks to the C library (after a model load, whose
    transient sizes a decode step will not ask for again)."""
    server._C.release_small_blocks()


def small_block_stats() -> dict[str, object]:
    """The small-block cache: enabled, hits and misses (every thread, since start), cached_bytes
    (the calling thread's cache now)."""
    return dict(server._C.small_block_stats())


def _log_cpu_dispatch() -> None:
    f = cpu_features()
    flags = " ".join(k for k, v in f.items() if v is True)
    logger.info("CPU kernels: %s (detected %s) on %s %s; flags: %s", cpu_isa(), server._C.detected_cpu_isa(),
                f.get("vendor", "?"), f.get("brand", "?"), flags or "none")


_log_cpu_dispatch()


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys and values into the paged cache, in place.

    Args:
        key: [T, KVH, D], the cache dtype, contiguous in D.
        value: [T, KVH, D], like key.
        key_cache: [NB, KVH, BS, D], contiguous; written at the slots below.
        value_cache: [NB, KVH, BS, D], like key_cache.
        slot_mapping: int64 [T]; slot = block * BS + offset; -1 marks padding (skipped).
    """
    torch.ops.pagewire.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
    max_query_len: int,
    max_seq_len: int,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention of a flat mixed batch (prefill chunks and decodes) over the paged cache.

    Query token i of sequence s sits at position seq_lens[s] - q_len + i and attends to cached
    positions p <= its own (and, when sliding_window > 0, to p with position - p < sliding_window).
    The cache must already hold this step's keys and values (call write_kv_cache first).

    Args:
        out: [T, H, D], query's dtype; overwritten with the attention output.
        query: [T, H, D] float32, bfloat16 or float16, contiguous in D; H % KVH == 0.
        key_cache: [NB, KVH, BS, D], query's dtype, contiguous.
        value_cache: [NB, KVH, BS, D], like key_cache.
        block_tables: int32 [S, max_blocks], physical block ids of each sequence.
        seq_lens: int32 [S], tokens in the cache after this step (context + new).
        query_start_loc: int32 [S + 1], prefix sum of new tokens per sequence; every q_len >= 1.
        scale: the scores' scale (per layer: usually D ** -0.5, Gemma's query_pre_attn_scalar ** -0.5).
        sliding_window: window size in tokens (the token itself included); <= 0 disables it.
        max_query_len: an upper bound on q_len over the batch.
        max_seq_len: an upper bound on seq_lens over the batch.
        softcap: 0 for none; > 0 caps every scaled score s to softcap * tanh(s / softcap) before
            the mask and softmax (Gemma 2's attn_logit_softcapping).
        sinks: None, or float32 [H] on query's device: gpt-oss's attention sinks, one learned logit
            per query head that joins every row's softmax denominator and carries no value.
    """
    torch.ops.pagewire.paged_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale, sliding_window, max_query_len, max_seq_len, softcap, sinks,
    )


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole physical blocks (copy-on-write) in every layer's key and value cache, in place.

    Args:
        key_caches: one [NB, KVH, BS, D] tensor per layer, all the same shape.
        value_caches: one per layer, shaped like key_caches.
        block_mapping: int64 [N, 2] of (src, dst) block ids; destinations must be distinct and
            must not also be sources.
    """
    torch.ops.pagewire.copy_blocks(list(key_caches), list(value_caches), block_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight with transformers' rounding (CPU op).

    Args: x [T, d] contiguous in d; weight [d], x's dtype. Returns a new [T, d] tensor.
    """
    if x.is_cpu:  # (server._C.fast: a plain call, not the dispatcher's; csrc/fast_calls.cpp says why)
        return _fast.rms_norm(x, weight, eps)
    return torch.ops.pagewire.rms_norm(x, weight, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta in place (rounded to its dtype), then return RMSNorm(residual) * weight (CPU op).

    Args: residual [T, d] (mutated); delta [T, d]; weight [d]; all one dtype, contiguous in d.
    """
    if residual.is_cpu:
        return _fast.add_rms_norm(residual, delta, weight, eps)
    return torch.ops.pagewire.add_rms_norm(residual, delta, weight, eps)


def rotary_embedding(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
) -> None:
    """Rotate-half RoPE (HF Llama convention) of x in place (CPU op).

    Args:
        x: [T, heads, head_dim], any row/head strides with head_dim contiguous (e.g. the q and k
            columns of a fused qkv output); overwritten.
        positions: int64 [T], each in [0, cos.shape[0]).
        cos, sin: float32 [max_positions, head_dim // 2] tables (RotaryEmbedding.cos/.sin; any
            scaling such as llama3's is already in them).
        norm_weight: [heads, head_dim] in x's dtype, or None. When given, each head is first
            RMSNorm'ed over head_dim with its row (Qwen3's q_norm / k_norm).
        eps: the norm's epsilon.
    """
    torch.ops.pagewire.rotary_embedding(x, positions, cos, sin, norm_weight, eps)


def short_conv(bcx: torch.Tensor, weight_t: torch.Tensor, bias: Optional[torch.Tensor], state: torch.Tensor,
               slots: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """LFM2's gated short convolution: bcx [T, 3C] (in_proj's B, C, x chunks) -> [T, C] =
    C * causal_conv(B * x) per sequence (query_start_loc int32 [S + 1]), each continuing from and
    updating its state slot (state [slots, K - 1, C] of bcx's dtype, slots int64 [S]); weight_t
    fp32 [K, C], bias fp32 [C] or None. AVX-512 / AVX2 / portable bodies (csrc/cpu/short_conv*)."""
    return torch.ops.pagewire.short_conv(bcx, weight_t, bias, state, slots, query_start_loc)


def lora_add(out: torch.Tensor, x: torch.Tensor, adapter: torch.Tensor, a: torch.Tensor, spans: torch.Tensor,
             scales: torch.Tensor, bts: Sequence[torch.Tensor], parts: Sequence[int]) -> None:
    """Each row's own LoRA term for one fused projection, added to out [T, N] in place (CPU op,
    csrc/cpu/lora*.cpp: AVX2 or portable bodies, the same bits): for row t with adapter[t] = k >= 0
    (int32 [T], -1: none) and each part p (a PEFT module of the matrix), out[t, row_p : row_p +
    rows_p] += scales[k] · B_p[k] · A_p[k] · x[t], rounded as PEFT in x's dtype (float32,
    bfloat16, float16). a [R, in]: every adapter's A rows stacked; bts[p] [C_p, rows_p]: part p's
    Bᵀ over rows [c0_p, c0_p + C_p) of a; spans int32 [n, P, 2]: adapter k's (first row of a, rank)
    in part p (rank 0: none); scales float32 [n]; parts: (row_p, rows_p, c0_p) per part. A row's
    result depends on its own adapter only, not on the other rows of the call. Off CPU: the same
    sum from torch ops (lora_add_torch)."""
    if not x.is_cpu:
        lora_add_torch(out, x, adapter, a, spans, scales, bts, parts)
        return
    torch.ops.pagewire.lora_add(out, x, adapter, a, spans, scales, list(bts), list(parts))


def lora_add_torch(out: torch.Tensor, x: torch.Tensor, adapter: torch.Tensor, a: torch.Tensor, spans: torch.Tensor,
                   scales: torch.Tensor, bts: Sequence[torch.Tensor], parts: Sequence[int]) -> None:
    """lora_add from torch ops, adapter by adapter over its rows (devices without the CPU kernel;
    the rounding of torch's matmuls, not the kernel's)."""
    for k, part_spans in enumerate(spans.tolist()):
        rows = torch.nonzero(adapter == k).view(-1)
        if rows.numel() == 0:
            continue
        xr = x.index_select(0, rows)
        for p, (first, cnt) in enumerate(part_spans):
            if cnt == 0:
                continue
            row, width, c0 = parts[3 * p : 3 * p + 3]
            u = xr @ a[first : first + cnt].t()
            d = (u @ bts[p][first - c0 : first - c0 + cnt]) * float(scales[k])
            out[:, row : row + width].index_add_(0, rows, d)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Args: x float32 or bfloat16 [S, V] on the CPU, contiguous in V (a bf16 value compares as its
    exact float32 value). Returns int64 [S]: each row's first index of its largest value, a NaN
    counting as the largest (torch.argmax's choice). Each thread scans the slice of the columns
    that the lm_head kernel's split gave its core (cpu/argmax.cpp)."""
    return _fast.argmax_rows(x)  # (the op is CPU-only; server._C.fast skips the dispatcher)


# argmax_list(x) -> list[int]: each row's argmax over the last dim, as ints: argmax_rows where it
# applies, else torch.argmax (any device or dtype, and its error for a row of no columns). Bound
# straight to the pybind11 call, with no Python frame or checks around it: the greedy decode
# step's tokens (LLMEngine._sample_and_apply), where the checks and tolist cost 20 us cold.
argmax_list = _fast.argmax_list


def to_float32(x: torch.Tensor) -> torch.Tensor:
    """x as float32, exactly: `x.float()`, except that bf16 [S, V] CPU rows (a bf16 model's logits)
    go through pagewire::widen_rows, which widens one row on the calling thread and several in the
    lm_head kernel's column slices (cpu/widen_rows.cpp): torch's copy split one row over the team."""
    if x.is_cpu and x.dtype is torch.bfloat16 and x.dim() == 2:
        return _fast.widen_rows(x)
    return x.float()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Args: x [T, 2 * I] = cat(gate, up), contiguous in the last dim. Returns silu(gate) * up [T, I] (CPU op)."""
    return torch.ops.pagewire.silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Args: x [T, 2 * I] = cat(gate, up), contiguous in the last dim. Returns
    gelu(gate, approximate="tanh") * up [T, I] (CPU op; Gemma's gelu_pytorch_tanh MLP)."""
    return torch.ops.pagewire.gelu_tanh_and_mul(x)


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                gate_up: torch.Tensor | QuantizedExperts, down: torch.Tensor | QuantizedExperts,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The routed experts of a mixture-of-experts layer (CPU op, csrc/cpu/moe.cpp): for each token
    t, sum_j topk_weights[t, j] * down_e(act(gate_up_e(x_t))) with e = topk_ids[t, j], where act is
    silu(gate) * up or, with activation "swiglu_oai", gpt-oss's clamped SwiGLU
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

    Tokens are grouped by expert and each expert used runs its matrices once over its rows on the
    small-M kernels (float, or its GGUF blocks); experts no token chose are not read. Each token's
    k results are summed in slot order in fp32, so in batch-invariant mode a token's output does
    not depend on the other tokens of the step.

    Args:
        x: [T, H] float32, bfloat16 or float16.
        topk_ids: int64 [T, k], the chosen experts (-1: an empty slot).
        topk_weights: float32 [T, k], their weights.
        gate_up: [E, 2I, H] in x's dtype (gate rows, then up rows, per expert), or QuantizedExperts.
        down: [E, H, I] in x's dtype, or QuantizedExperts.
        gate_up_bias, down_bias: None, or [E, 2I] / [E, H] in x's dtype (gpt-oss's expert biases).
    Returns:
        [T, H] in x's dtype.
    """
    gk, gw = (gate_up.op_qtype, gate_up.data) if isinstance(gate_up, QuantizedExperts) else ("float", gate_up)
    dk, dw = (down.op_qtype, down.data) if isinstance(down, QuantizedExperts) else ("float", down)
    return torch.ops.pagewire.moe_experts(x, topk_ids, topk_weights, gw, str(gk), dw, str(dk), gate_up_bias,
                                          down_bias, activation, alpha, limit)


def moe_decode(x: torch.Tensor, router_weight: torch.Tensor, router_kind: str, router_bias: torch.Tensor | None,
               router: str, top_k: int, norm_topk_prob: bool,
               gate_up: torch.Tensor | QuantizedExperts, down: torch.Tensor | QuantizedExperts,
               gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, activation: str, alpha: float,
               limit: float, shared: tuple[torch.Tensor, str, torch.Tensor, str, torch.Tensor | None, str] | None = None,
               selection_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
               routed_scaling: float = 1.0) -> torch.Tensor:
    """A mixture-of-experts layer's whole MLP for at most Q8_KERNEL_MAX_ROWS (linear_route) CPU tokens
    in one call (csrc/cpu/moe_decode.cpp): the router (x @ router_weight^T (+ router_bias) by the path
    `router_kind` names, as linear_route.linear_kind gives it for router_weight's dtype -- x is cast to it when
    they differ (a float32 router in a bf16 model); then router "softmax_topk": fp32 softmax, top_k,
    renormalised when norm_topk_prob, "topk_softmax": gpt-oss's softmax over the top k logits, or
    "sigmoid_topk": fp32 sigmoid scores; for the fp32 scorings `selection_bias` [E] (added to the
    scores to choose, not to the weights), `n_group` / `topk_group` (group-limited choice) and
    `routed_scaling` (multiplies the weights) as server.models.moe_router.route applies them),
    the chosen experts as moe_experts runs them, and optionally a shared expert `shared` =
    (gate_up [2S, H], its kind, down [H, S], its kind, gate [1, H] or None, its kind or ""), added
    times sigmoid(x @ gate^T) (Qwen2-MoE) or as it is (no gate: dots.llm1). Quantised experts on
    AVX2 or better run in one OpenMP region, every thread streaming its share of the chosen
    experts' rows; float experts go through moe_experts.

    Returns [T, H] in x's dtype."""
    gk, gw = (gate_up.op_qtype, gate_up.data) if isinstance(gate_up, QuantizedExperts) else ("float", gate_up)
    dk, dw = (down.op_qtype, down.data) if isinstance(down, QuantizedExperts) else ("float", down)
    sgu, sgu_kind, sdn, sdn_kind, sg, sg_kind = shared if shared is not None else (None, "", None, "", None, "")
    return torch.ops.pagewire.moe_decode(x, router_weight, router_kind, router_bias, router, top_k, norm_topk_prob,
                                         gw, str(gk), dw, str(dk), gate_up_bias, down_bias, activation, alpha, limit,
                                         sgu, sgu_kind, sdn, sdn_kind, sg, sg_kind, selection_bias, n_group,
                                         topk_group, routed_scaling)


# server._C.DecodeStack (csrc/cpu/decode_stack.cpp, a pybind11 class; its interface and what it does
# are in server/_C.pyi): every decoder layer of a small CPU step in one call.
DecodeStack = server._C.DecodeStack


def decode_stack() -> DecodeStack:
    """An empty DecodeStack (DecoderForCausalLM._decode_stack fills it, layer by layer)."""
    return server._C.DecodeStack()


def moe_route(logits: torch.Tensor, router: str, top_k: int, norm_topk_prob: bool,
              selection_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
              routed_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts router's choice for CPU logits [T, E] (float32, bfloat16 or float16) of
    any row count in one call (csrc/cpu/moe_route_op.cpp): server.models.moe_router.route's contract
    (router, selection_bias, groups and scaling as moe_decode takes them) by moe_decode's own router.

    Returns (ids int64 [T, top_k], weights float32 [T, top_k]), largest choice first."""
    ids, weights = torch.ops.pagewire.moe_route(logits, router, top_k, norm_topk_prob, selection_bias, n_group,
                                                topk_group, routed_scaling)
    return ids, weights


def ngram_propose(
    token_ids: Sequence[torch.Tensor], num_tokens: torch.Tensor, k: int, min_n: int, max_n: int
) -> torch.Tensor:
    """Prompt lookup, batched (CPU op): per sequence, find the latest earlier occurrence of its
    longest suffix n-gram (min_n <= n <= max_n) and propose the k tokens that followed it.

    Args:
        token_ids: S contiguous int64 CPU vectors, each a sequence's prompt + output tokens (a
            buffer may be longer than its used part).
        num_tokens: int64 [S], the used length of each vector.
        k: tokens to propose per sequence.
    Returns:
        int64 [S, k]; a row with no match of at least min_n tokens is all -1. A continuation that
        runs past the end of the sequence repeats itself (an overlapping copy), so periodic text
        still gets k tokens.
    """
    return torch.ops.pagewire.ngram_propose(list(token_ids), num_tokens, k, min_n, max_n)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_probs: Optional[torch.Tensor],
    target_argmax: torch.Tensor,
    is_greedy: torch.Tensor,
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact verification of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

    S sequences; sequence i has k_i = cu_num_draft[i + 1] - cu_num_draft[i] drafts and k_i + 1
    target rows, starting at row cu_num_draft[i] + i (the last one scores the bonus position).
    Greedy rows accept the longest prefix of drafts equal to the target's argmax and then emit the
    target's token. Sampled rows accept draft d with probability min(1, p(d) / q(d)); the first
    rejection emits a draw from the residual max(p - q, 0) (renormalised), and when every draft
    is accepted the bonus token is drawn from the last target row, so every emitted token is
    distributed exactly as the target's.

    Args:
        draft_token_ids: int64 [ND].
        cu_num_draft: int64 [S + 1], cumulative drafts, starting at 0.
        draft_probs: float32 [ND, V] (a draft model's distributions) or None: each draft is a
            point mass (the n-gram proposer), so q(d) = 1.
        target_probs: float32 [ND + S, V], normalised (after temperature and top-k/top-p/min-p);
            None only when every row is greedy.
        target_argmax: int64 [ND + S], each target row's greedy token.
        is_greedy: bool [S].
        uniform: float64 [ND + S] in [0, 1): draw j of a sequence decides draft j; its last draw
            picks the residual or bonus token. Taken from the request's own generator when seeded.
    Returns:
        (output_token_ids int64 [S, max k_i + 1], -1 padded; num_emitted int64 [S], each in 1..k_i + 1).
    """
    if target_probs is None and not bool(is_greedy.all()):
        raise ValueError("target_probs: required when a row is not greedy")
    out, num_emitted = torch.ops.pagewire.rejection_sample(
        draft_token_ids, cu_num_draft, draft_probs, target_probs, target_argmax, is_greedy, uniform
    )
    return out, num_emitted


# Fake (meta) kernels of every op, for torch.compile and opcheck (registered on import).
import server.kernels.op_fakes  # noqa: E402,F401
