"""What a hybrid model's recurrent layers keep per sequence: their state specs. Torch-free.

A hybrid model (LFM2, Qwen3.5, Qwen3-Next) mixes attention layers, which keep K/V in the paged
KV cache, with recurrent ("linear") layers, which keep a fixed-size state per sequence instead.
Each layer kind that keeps state declares it here as a tuple of `StateSpec`s (a name, a shape
per sequence, a dtype), computed from the ModelConfig; the engine's state cache
(server/engine/state_cache.py) gives every running sequence one slot holding every such layer's
tensors, and `pagewire plan` sizes that pool from the same specs without loading weights.

A new recurrent layer kind plugs in with `register_state_kind(kind, specs_fn)`; its layer then
reads and writes its tensors through `StateBatch` (server/models/attention.py).
`ModelConfig.layer_types[i]` names layer i's kind ("attention" for a KV layer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from server.models.config import ModelConfig

ATTENTION = "attention"
SHORT_CONV = "short_conv"  # LFM2's gated short convolution (server/models/lfm2.py)

# "model": the serving dtype (float32 / bfloat16 / float16); else an explicit torch dtype name.
STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class StateSpec:
    """One tensor a recurrent layer keeps per sequence: `shape` excludes the slot dimension."""

    name: str  # e.g. "conv", "recurrent"; unique within a layer
    shape: tuple[int, ...]
    dtype: str = "model"  # "model" (the serving dtype) or a key of STATE_DTYPE_BYTES

    def nbytes(self, model_dtype: str) -> int:
        dt = model_dtype if self.dtype == "model" else self.dtype
        return math.prod(self.shape) * STATE_DTYPE_BYTES[dt]


SpecsFn = Callable[[ModelConfig, int], tuple[StateSpec, ...]]
_KINDS: dict[str, SpecsFn] = {}


def register_state_kind(kind: str, specs: SpecsFn) -> None:
    """Declare recurrent layer kind `kind`: specs(config, layer) gives its state tensors."""
    _KINDS[kind] = specs


def _short_conv_specs(c: ModelConfig, layer: int) -> tuple[StateSpec, ...]:
    # The last kernel - 1 inputs of the convolution, channels last (the kernel vectorises over them).
    return (StateSpec("conv", (c.conv_kernel - 1, c.hidden_size)),)


register_state_kind(SHORT_CONV, _short_conv_specs)

GATED_DELTANET = "gated_deltanet"  # Qwen3-Next / Qwen3.5's linear attention (server/models/gated_deltanet.py)


def _gated_deltanet_specs(c: ModelConfig, layer: int) -> tuple[StateSpec, ...]:
    # The conv's last K - 1 inputs (q, k and v channels, time-major) and the delta rule's state,
    # kept in float32 as transformers keeps it.
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    return (StateSpec("conv", (c.conv_kernel - 1, conv_dim)),
            StateSpec("recurrent", (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                      "float32"))


register_state_kind(GATED_DELTANET, _gated_deltanet_specs)


def layer_type(config: ModelConfig, layer: int) -> str:
    return config.layer_types[layer] if config.layer_types else ATTENTION


def is_hybrid(config: ModelConfig) -> bool:
    """Whether any layer keeps recurrent state (a hybrid model: state cache, no speculation)."""
    return any(t != ATTENTION for t in config.layer_types)


def attention_layers(config: ModelConfig) -> tuple[int, ...]:
    """The layers with a KV cache, in order (every layer for a model without recurrent layers)."""
    return tuple(i for i in range(config.num_layers) if layer_type(config, i) == ATTENTION)


def state_specs(config: ModelConfig) -> tuple[tuple[StateSpec, ...], ...]:
    """Per layer, its state tensors (() for an attention layer). Raises KeyError naming an
    unregistered kind (a family entry's bug, not user input)."""
    out: list[tuple[StateSpec, ...]] = []
    for i in range(config.num_layers):
        kind = layer_type(config, i)
        if kind == ATTENTION:
            out.append(())
            continue
        if kind not in _KINDS:
            raise KeyError(f"layer {i}: no state specs registered for layer kind {kind!r}")
        out.append(_KINDS[kind](config, i))
    return tuple(out)


def state_slot_bytes(config: ModelConfig, model_dtype: str) -> int:
    """Bytes of one sequence's slot: every recurrent layer's state tensors (0: no recurrent layer)."""
    return sum(s.nbytes(model_dtype) for layer in state_specs(config) for s in layer)
