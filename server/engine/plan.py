"""`pagewire plan`: capacity planning from a model's config, without loading its weights.

It owns the napkin math of serving a model in a memory budget: weight bytes, KV bytes per token and
per sequence (counted per KV group: a sliding-window group holds only its window),
the KV budget left after weights and activations, how many sequences of each length fit, and the
decode roofline (tokens/s = bandwidth / bytes read per step). The KV pool itself is sized by
`server.engine.kv_budget.kv_layout`, the function the engine uses at start-up, so the `KV cache:`
line printed here is the line `pagewire serve` logs for the same settings.

Torch-free: it reads config.json or GGUF metadata only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from server.engine.config import ConfigError, EngineConfig
from server.engine.kv_budget import DTYPE_BYTES, KVLayout, kv_layout
from server.models.config import ModelConfig

if TYPE_CHECKING:
    from server.models.gguf_file import GGUFTensor

# Q8_0 (--quantization int8): 32 int8 values and one fp16 scale per block.
Q8_0_BYTES_PER_VALUE = 34 / 32
# Bytes per matrix value of the formats quantising at load (int4: Q4_0, 16 bytes + an fp16 scale per 32).
QUANTIZED_BYTES_PER_VALUE = {"int8": Q8_0_BYTES_PER_VALUE, "int4": 18 / 32}
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'24GiB', '24 GB', '512MiB', '1e9' → bytes. Raises ValueError naming the accepted units."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"expected a size such as 24GiB, 16GB or 512MiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def read_model_config(path: Path) -> ModelConfig:
    """The config of a Hugging Face folder (config.json) or a GGUF file (its metadata only), by
    its architecture's translation (server.models.registry)."""
    from server.models.registry import read_model_config as read

    return read(path)


def resolved_dtype(config: EngineConfig, mc: ModelConfig) -> str:
    """The dtype the engine serves (and stores KV) in: "auto" is the checkpoint's (GGUF: its float
    type, or float32 for quantised files), as `server.models.loader.resolve_dtype` decides."""
    return mc.torch_dtype if config.dtype == "auto" else config.dtype


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of the served weights, and how many of them one decode step reads."""

    total: int
    read_per_step: int  # all but the embedding table when it is not also the output projection
    parameters: int
    # A mixture of experts: the parameters one token reads (its top-k experts); None: all of them.
    active_parameters: Optional[int] = None


def weight_bytes(mc: ModelConfig, dtype: str, quantization: str, model_path: Optional[str] = None) -> WeightBytes:
    """Counted from the shapes `DecoderForCausalLM` allocates (fused qkv, gate_up); with
    quantization "gguf", from the sizes of the blocks the GGUF file at `model_path` keeps."""
    e = DTYPE_BYTES[dtype]
    H, V = mc.hidden_size, mc.vocab_size
    shapes = [_layer_sizes(mc, i) for i in range(mc.num_layers)]
    matrices, small = sum(m for m, _ in shapes), sum(s for _, s in shapes)
    per_value = QUANTIZED_BYTES_PER_VALUE.get(quantization, e)
    layer_matrices = matrices * per_value
    # A tied output projection is the embedding table itself, unless quantisation gives it its own copy.
    separate_head = (not mc.tie_word_embeddings) or quantization != "none"
    head = V * H * per_value if separate_head else 0
    embed = V * H * e
    # Per-layer input embeddings (Gemma 4): a table (only rows are read) and a projection with its norm.
    P, L = mc.per_layer_input_size, mc.num_layers
    ple_table, ple_rest = mc.per_layer_vocab_size * L * P, L * P * H + P
    ple_bytes = ple_table * e
    if quantization == "gguf" and model_path is not None:
        layer_matrices, kept_head, kept_embed, kept_ple = _gguf_matrix_bytes(model_path, mc, e)
        # An output projection the file does not let us keep stays what it was (tied: the table).
        separate_head = kept_head is not None or not mc.tie_word_embeddings
        head = kept_head if kept_head is not None else (V * H * e if separate_head else 0)
        embed = embed if kept_embed is None else kept_embed  # 0: the lm_head's blocks serve it
        ple_bytes = ple_bytes if kept_ple is None else kept_ple
    sinks = L * mc.num_heads if mc.attention_sinks else 0  # gpt-oss's, kept in float32
    total = int(layer_matrices + (small + ple_rest) * e + ple_bytes + sinks * 4 + embed + H * e + head)
    read = total - (embed if separate_head else 0) - ple_bytes  # a separate embedding table: only rows are read
    params = (matrices + small + ple_table + ple_rest + sinks + V * H + H
              + (V * H if not mc.tie_word_embeddings else 0))
    if mc.is_moe:  # experts in place of the sparse layers' dense MLP; a token reads only its top-k
        return _expert_bytes(mc, e, quantization, model_path, total, read, params)
    return WeightBytes(total, read, params)


def _layer_sizes(mc: ModelConfig, i: int) -> tuple[int, int]:
    """(values in layer i's four matrices, values in its other parameters), as DecoderLayer
    allocates them: per-layer head size, KV heads and MLP width, no K/V rows for a layer that
    reads another's KV, no V rows when values are the keys (Gemma 4)."""
    H, I, d = mc.hidden_size, mc.intermediate_of(i), mc.head_dim_of(i)
    if mc.layer_types and mc.layer_types[i] == "short_conv":
        # LFM2's convolution layer (models/lfm2.py): in_proj [3H, H], out_proj [H, H], the MLP; the
        # depthwise kernel [K, H], two norms, and with conv_bias the three biases (3H, H, H).
        return 3 * H * H + H * H + 3 * I * H, mc.conv_kernel * H + (5 * H if mc.conv_bias else 0) + 2 * H
    if mc.layer_types and mc.layer_types[i] == "gated_deltanet":
        # A Gated DeltaNet layer (models/gated_deltanet.py): in_proj [q, k, v, z, b, a] and out_proj,
        # the MLP; the conv kernel [conv_dim, K], A_log and dt_bias [Hv], the gated norm [Dv], two norms.
        hv, kd = mc.linear_num_value_heads, mc.linear_num_key_heads * mc.linear_key_head_dim
        vd = hv * mc.linear_value_head_dim
        conv = 2 * kd + vd
        return ((conv + vd + 2 * hv) * H + H * vd + 3 * I * H,
                conv * mc.conv_kernel + 2 * hv + mc.linear_value_head_dim + 2 * H)
    q, kv = mc.num_heads * d, mc.kv_heads_of(i) * d
    shares = mc.kv_source(i) != i
    qkv = q + (0 if shares else (1 if mc.value_from_key(i) else 2) * kv)
    qkv += q if mc.attn_output_gate else 0  # the output gate's rows (models/qwen3_next.py)
    matrices = qkv * H + H * q + 2 * I * H + H * I
    small = H * {"pre": 2, "post": 2, "both": 4}[mc.norm_placement]  # the layer's norms
    small += qkv if mc.qkv_bias else 0
    small += H if mc.o_bias else 0
    small += (2 * I + H) if mc.mlp_bias else 0
    if mc.qk_norm and mc.qk_norm_over == "head":  # stored per head, q's then k's
        small += (mc.num_heads + (0 if shares else mc.kv_heads_of(i))) * d
    elif mc.qk_norm:
        small += q + kv
    small += 1 if mc.layer_scalar else 0
    small += 2 * mc.per_layer_input_size * H + H if mc.per_layer_input_size else 0  # the per-layer input block
    return matrices, small


def _held_bytes(t: GGUFTensor) -> int:
    """A kept GGUF tensor's bytes in memory: the file's, or a rewritten type's (gguf_transcode)."""
    from server.models.gguf_transcode import TRANSCODED, held_nbytes

    nbytes = int(t.data.nbytes)
    return held_nbytes(t.type_name, nbytes) if t.type_name in TRANSCODED else nbytes


def _gguf_matrix_bytes(path: str, mc: ModelConfig,
                       e: int) -> tuple[float, Optional[float], Optional[int], Optional[int]]:
    """(decoder matrices, lm_head, embedding table, Gemma 4's per-layer table) bytes under
    --quantization gguf, each of the last three None when not kept: kept blocks at their size, the
    rest dequantised to `e` bytes per value (server.models.gguf_blocks decides which are kept). A
    kept embedding table that is also the kept lm_head's blocks counts 0 (the loader holds one copy)."""
    from server.models.gguf_blocks import EMBEDDING, PER_LAYER_EMBEDDING, plan_kept_matrices
    from server.models.gguf_file import GGUFFile

    f = GGUFFile.open(path)
    kept = plan_kept_matrices(f, mc, mc.tie_word_embeddings)
    kept_bytes = {(m.layer, m.name): sum(_held_bytes(f.tensors[p]) for p in m.parts) for m in kept}
    H = mc.hidden_size
    layers = 0
    for i in range(mc.num_layers):
        I, d = mc.intermediate_of(i), mc.head_dim_of(i)
        q = mc.num_heads * d
        qkv = _layer_sizes(mc, i)[0] - H * q - 3 * I * H
        sizes = {"qkv_weight": qkv, "o_weight": H * q, "gate_up_weight": 2 * I * H, "down_weight": H * I}
        if mc.layer_types and mc.layer_types[i] == "gated_deltanet":  # in_proj and out_proj instead
            out = H * mc.linear_num_value_heads * mc.linear_value_head_dim
            sizes = {"gdn.in_proj": qkv + H * q - out, "gdn.out_proj": out, "gate_up_weight": 2 * I * H,
                     "down_weight": H * I}
        layers += sum(kept_bytes.get((i, n), v * e) for n, v in sizes.items())
    head = kept_bytes.get((None, "lm_head"))
    parts = {m.name: m.parts for m in kept if m.layer is None}
    embed = kept_bytes.get((None, EMBEDDING))
    if embed is not None and parts.get("lm_head") == parts[EMBEDDING]:
        embed = 0
    return float(layers), (float(head) if head is not None else None), embed, kept_bytes.get((None, PER_LAYER_EMBEDDING))


def _expert_bytes(mc: ModelConfig, e: int, quantization: str, model_path: Optional[str], total: int, read: int,
                  params: int) -> WeightBytes:
    """`weight_bytes` of a mixture-of-experts model: each sparse layer holds its router, experts and
    shared expert (server.models.moe) in place of the dense MLP counted above, and one token reads
    only its top-k experts (read_per_step and active_parameters count those, as a batch-1 step does).
    The router and the shared expert's gate stay float; the experts are quantised like the other
    matrices (with --quantization gguf: the blocks the file keeps, gguf_blocks)."""
    H, E, k, Ie = mc.hidden_size, mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size
    S, I = mc.shared_expert_intermediate_size, mc.intermediate_size
    per_value = QUANTIZED_BYTES_PER_VALUE.get(quantization, e)
    kept: dict[tuple[Optional[int], str], int] = {}
    if quantization == "gguf" and model_path is not None:
        from server.models.gguf_blocks import plan_kept_matrices
        from server.models.gguf_file import GGUFFile

        f = GGUFFile.open(model_path)
        kept = {(m.layer, m.name): sum(_held_bytes(f.tensors[p]) for p in m.parts)
                for m in plan_kept_matrices(f, mc, mc.tie_word_embeddings)}
        per_value = e  # what is not kept is dequantised
    inactive_params = 0
    for i in range(mc.num_layers):
        if mc.mlp_kind(i) != "sparse":
            continue
        sizes = {"moe.experts_gate_up": 2 * E * Ie * H, "moe.experts_down": E * H * Ie,
                 "moe.shared_gate_up_weight": 2 * S * H, "moe.shared_down_weight": S * H}
        got = {n: kept.get((i, n), v * per_value) for n, v in sizes.items()}
        small = E * H + (H if S and mc.shared_expert_gated else 0)  # the router and the shared expert's gate, float
        small += E + E * (2 * Ie + H) if mc.moe_bias else 0  # gpt-oss: the router's and the experts' biases
        bias32 = E if mc.moe_selection_bias else 0  # a sigmoid router's selection bias: float32 in every dtype
        if mc.moe_router_fp32:  # ... and its weight
            small, bias32 = small - E * H, bias32 + E * H
        total += int(sum(got.values()) + small * e + 4 * bias32 - 3 * I * H * per_value)
        params += sum(sizes.values()) + small + bias32 - 3 * I * H
        read -= int((got["moe.experts_gate_up"] + got["moe.experts_down"]) * (E - k) / E)
        inactive_params += 3 * (E - k) * Ie * H
        read += int(sum(got.values()) + small * e + 4 * bias32 - 3 * I * H * per_value)
    return WeightBytes(total, read, params, params - inactive_params)


def _parameter_text(w: WeightBytes) -> str:
    """"135.0M parameters", or for a mixture of experts "3.3B parameters, 0.8B active per token"."""
    def n(x: int) -> str:
        return f"{x / 1e9:.1f}B" if x >= 1e9 else f"{x / 1e6:.1f}M"

    active = w.active_parameters
    return f"{n(w.parameters)} parameters" + (f", {n(active)} active per token" if active is not None else "")


def activation_bytes(mc: ModelConfig, dtype: str, config: EngineConfig) -> int:
    """An upper estimate of one step's working tensors: a layer's largest intermediates for the
    step's token budget (residual, hidden, qkv, attention output, gate_up and its SiLU product),
    plus float32 logits for max_num_seqs sampled rows and the sampler's working copy."""
    e = DTYPE_BYTES[dtype]
    T = config.max_num_batched_tokens
    per_token = 2 * mc.hidden_size + mc.q_size + 2 * mc.kv_size + mc.q_size + 3 * mc.intermediate_size
    logits = 2 * config.max_num_seqs * mc.vocab_size * 4
    return T * per_token * e + logits


@dataclass(frozen=True)
class LengthRow:
    seq_len: int
    fits: int
    batch: int  # min(fits, max_num_seqs): the batch the roofline assumes
    roofline_b1: Optional[float]  # tokens/s at batch 1
    roofline_bn: Optional[float]  # tokens/s at `batch`
    kv_bytes: int = 0  # KV one decoding sequence of seq_len holds, every KV group counted
    vs_all_global: float = 1.0  # kv_bytes / the same shape's with every layer full attention


@dataclass(frozen=True)
class Plan:
    model: str
    dtype: str
    quantization: str
    memory_bytes: Optional[int]
    weights: WeightBytes
    activations: int
    kv_budget_bytes: Optional[int]  # memory - weights - activations
    layout: KVLayout
    max_num_seqs: int
    bandwidth_gbs: Optional[float]
    rows: list[LengthRow] = field(default_factory=list)
    # A hybrid model: what one sequence holds besides its KV (hybrid_line), "" otherwise.
    state_note: str = ""

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "model": self.model, "dtype": self.dtype, "quantization": self.quantization,
            "memory_bytes": self.memory_bytes, "weight_bytes": self.weights.total,
            "weight_bytes_read_per_step": self.weights.read_per_step, "parameters": self.weights.parameters,
            "active_parameters": self.weights.active_parameters,
            "activation_bytes": self.activations, "kv_budget_bytes": self.kv_budget_bytes,
            "kv_bytes_per_token": lay.bytes_per_token, "block_size": lay.block_size,
            "kv_groups": [{"window": g.window, "layers": list(g.layers)} for g in lay.groups.groups],
            "kv_bytes_per_block": lay.bytes_per_block,
            "num_blocks": lay.num_blocks, "kv_tokens": lay.total_tokens, "kv_bytes": lay.total_bytes,
            "max_model_len": lay.max_model_len, "kv_log_line": lay.log_line(),
            "serve_flags": self.serve_flags(), "bandwidth_gbs": self.bandwidth_gbs,
            "lengths": [r.__dict__ for r in self.rows], "state_slot_bytes": lay.state_slot_bytes,
            "state_note": self.state_note,
        }

    def serve_flags(self) -> str:
        """The `pagewire serve` options that give the engine exactly this pool."""
        flags = f"--kv-cache-tokens {self.layout.total_tokens} --block-size {self.layout.block_size}"
        flags += f" --max-model-len {self.layout.max_model_len}"
        if self.dtype:
            flags += f" --dtype {self.dtype}"
        if self.quantization != "none":
            flags += f" --quantization {self.quantization}"
        return flags


def make_plan(model: str, mc: ModelConfig, config: EngineConfig, memory_bytes: Optional[int],
              bandwidth_gbs: Optional[float]) -> Plan:
    """The plan for `config` (the same EngineConfig `serve` would build). With `memory_bytes`, the
    KV pool is what is left after weights and activations; without, the config's own KV setting."""
    dtype = resolved_dtype(config, mc)
    if dtype not in DTYPE_BYTES:
        raise ConfigError("dtype", f"must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    weights = weight_bytes(mc, dtype, config.quantization, config.model)
    acts = activation_bytes(mc, dtype, config)
    budget: Optional[int] = None
    kv_tokens: Optional[int] = None
    if memory_bytes is not None:
        budget = memory_bytes - weights.total - acts
        if budget <= 0:
            raise ConfigError(
                "memory", f"{_gib(memory_bytes)} does not hold the weights ({_gib(weights.total)}) and "
                f"activations ({_gib(acts)}); nothing is left for the KV cache")
        from server.models.registry import kv_specs

        # K and V of one token over the layers that keep their own (Gemma 4's shared ones keep none).
        bpt = 2 * sum(s.num_kv_heads * s.head_dim for s in kv_specs(mc) if s.kv_source is None) * DTYPE_BYTES[dtype]
        kv_tokens = _kv_bytes_beside_states(mc, dtype, config, budget) // bpt
        if kv_tokens < config.block_size:
            raise ConfigError("memory", f"leaves {budget} bytes for KV, less than one block")
    from server.models.registry import kv_shape
    from server.models.state_specs import attention_layers, state_slot_bytes

    # A hybrid model's state slots (one per running sequence, plus snapshots) share the budget.
    layout = kv_layout(config, dtype=dtype, max_position_embeddings=mc.max_position_embeddings,
                       kv_cache_tokens=kv_tokens, state_slot_bytes=state_slot_bytes(mc, dtype), **kv_shape(mc))
    rows = []
    for n in _lengths(layout.max_model_len):
        fits = layout.sequences_fitting(n)
        batch = max(1, min(fits, config.max_num_seqs))
        # A sequence's memory: its KV blocks, plus its state slot in a hybrid model.
        seq_bytes = layout.seq_bytes(n) + layout.state_slot_bytes
        b1 = bn = None
        if bandwidth_gbs:
            # A step reads every block a sequence holds (a sliding group's are its window's).
            bw = bandwidth_gbs * 1e9
            b1 = bw / (weights.read_per_step + seq_bytes)
            bn = batch * bw / (weights.read_per_step + batch * seq_bytes)
        # Every layer full attention: a hybrid's recurrent layers too, with its attention layers' KV shape.
        all_global = (-(-n // layout.block_size) * layout.block_size * layout.bytes_per_token
                      * mc.num_layers // max(1, len(attention_layers(mc))))
        rows.append(LengthRow(n, fits, batch, b1, bn, seq_bytes, seq_bytes / all_global))
    return Plan(model, dtype, config.quantization, memory_bytes, weights, acts, budget, layout,
                config.max_num_seqs, bandwidth_gbs, rows, hybrid_line(mc, dtype))


def hybrid_line(mc: ModelConfig, dtype: str) -> str:
    """For a hybrid model, what one sequence holds: the KV of its attention layers only, and one
    state slot whose size does not grow with the context (each recurrent layer's tensors); "" for
    a model without recurrent layers."""
    from server.models.state_specs import attention_layers, layer_type, state_specs

    specs = state_specs(mc)
    recurrent = [i for i, layer in enumerate(specs) if layer]
    if not recurrent:
        return ""
    kinds = sorted({layer_type(mc, i) for i in recurrent})
    first = specs[recurrent[0]]
    parts = " + ".join(f"{s.name} {'x'.join(map(str, s.shape))} {s.dtype if s.dtype != 'model' else dtype}"
                       for s in first)
    per_layer = sum(s.nbytes(dtype) for s in first)
    return (f"a sequence holds the KV of its {len(attention_layers(mc))} attention layers (of {mc.num_layers}) "
            f"and one state slot of {sum(sum(s.nbytes(dtype) for s in layer) for layer in specs)} bytes whatever "
            f"its length: {len(recurrent)} {'/'.join(kinds)} layers x ({parts}: {per_layer} bytes)")


def _kv_bytes_beside_states(mc: ModelConfig, dtype: str, config: EngineConfig, budget: int) -> int:
    """What the KV blocks may take of `budget` once a hybrid model's state slots have theirs:
    kv_layout sizes a pool given in tokens without them and puts the slots on top, so the memory
    plan takes out max_num_seqs running slots and, with prefix caching, the snapshot slots (an
    eighth of what is left, as kv_layout's budget path does) first."""
    from server.models.state_specs import state_slot_bytes

    slot = state_slot_bytes(mc, dtype)
    if not slot:
        return budget
    left = budget - config.max_num_seqs * slot
    if left <= 0:
        raise ConfigError("memory", f"leaves {budget} bytes for KV and states, less than {config.max_num_seqs} "
                          f"state slots (max_num_seqs) of {slot} bytes")
    return left - (left // 8 // slot) * slot if config.enable_prefix_caching else left


def _lengths(max_len: int) -> list[int]:
    out, n = [], 256
    while n < max_len:
        out.append(n)
        n *= 2
    return out + [max_len]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def render(plan: Plan) -> str:
    lay = plan.layout
    lines = [f"model: {plan.model}  (dtype {plan.dtype}, quantization {plan.quantization})"]
    if plan.memory_bytes is not None:
        lines.append(f"memory:           {_gib(plan.memory_bytes)} ({plan.memory_bytes} bytes)")
    lines += [
        f"weights:          {_gib(plan.weights.total)} ({plan.weights.total} bytes, "
        f"{_parameter_text(plan.weights)}); read per decode step "
        f"{_gib(plan.weights.read_per_step)}",
        f"activations:      {_gib(plan.activations)} (estimate: one step's largest tensors + logits)",
    ]
    if plan.kv_budget_bytes is not None:
        lines.append(f"KV budget:        {_gib(plan.kv_budget_bytes)} (memory - weights - activations)")
    if plan.state_note:
        lines.append(f"hybrid:           {plan.state_note}")
    lines += [
        f"KV per token:     {lay.bytes_per_token} bytes (2 x kv_heads x head_dim x "
        f"{DTYPE_BYTES[plan.dtype]} bytes over the layers that keep KV)",
        f"KV groups:        {lay.groups.describe()}; {lay.bytes_per_block} bytes/block of {lay.block_size} "
        "tokens (a sliding group holds only its window's blocks)",
        lay.log_line(),
        f"serve with:       pagewire serve MODEL {plan.serve_flags()}",
        "",
        f"{'seq len':>8} {'fit':>7} {'batch':>6} {'KV/seq':>10} {'x global':>8} {'tok/s b=1':>10} {'tok/s b=N':>10}",
    ]
    for r in plan.rows:
        b1 = f"{r.roofline_b1:.1f}" if r.roofline_b1 is not None else "-"
        bn = f"{r.roofline_bn:.1f}" if r.roofline_bn is not None else "-"
        lines.append(f"{r.seq_len:>8} {r.fits:>7} {r.batch:>6} {_gib(r.kv_bytes):>10} {r.vs_all_global:>8.3f} "
                     f"{b1:>10} {bn:>10}")
    lines.append("KV/seq: KV bytes one decoding sequence holds (a hybrid's: with its state slot); x global: that "
                 "over the same shape with every layer full attention.")
    lines.append("")
    if plan.bandwidth_gbs:
        lines.append(f"roofline: tokens/s = batch x {plan.bandwidth_gbs:g} GB/s / (weights read per step + "
                     "batch x KV/seq); batch N = min(fit, max_num_seqs "
                     f"{plan.max_num_seqs}). Compute and overheads only lower it.")
    else:
        lines.append("roofline: pass --bandwidth-gbs B (memory read bandwidth). Measure it on this machine "
                     "with `python -m bench.bandwidth` from a pagewire checkout, or take the device's "
                     "datasheet figure.")
    return "\n".join(lines)
