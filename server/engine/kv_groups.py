"""KV groups: which layers share a block table, and how many blocks a sequence holds in each.

vLLM v1's hybrid KV cache manager, in pagewire's terms. Layers with the same attention window (0:
full attention) form groups of `group_size` layers each; a physical block of the one pool holds
block_size tokens of K and V for every layer of ONE group, so a block costs the same bytes in every
group and the allocator keeps a single pool (csrc/allocator/block_allocator.h). Each group has its
own block table per sequence. A full-attention group keeps a block for every block_size tokens; a
sliding-window group gives its blocks back once no later token can see them, so it holds about
window / block_size blocks however long the sequence grows.

`group_size` is the layer count of the rarest window, as in vLLM: Gemma 3's 5 local : 1 global over
36 layers gives groups of 6 (one global group, five local ones). A window whose layer count is not a
multiple of it gets a last, partly empty group (its unused slots cost memory, never correctness).
The runner allocates `group_size` K/V tensors ("slots"); layer i reads and writes slot
`layer_slot[i]` through its group's block table.

Torch-free: `pagewire plan` sizes pools from it without loading weights. The per-layer windows come
from the model config (`ModelConfig.layer_sliding_windows`, None or 0 = full), or any other source
of a plain per-layer list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class KVGroup:
    window: int  # 0: full attention; W > 0: each token sees the W positions ending at itself
    layers: tuple[int, ...]  # the model layers in this group, len(layers) <= group_size


@dataclass(frozen=True)
class KVGroupLayout:
    """The groups of a model's layers and each layer's place in them."""

    groups: tuple[KVGroup, ...]
    group_size: int  # layers per block = K/V tensors the runner allocates
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its K/V tensor (its index within the group)

    @property
    def windows(self) -> tuple[int, ...]:
        """Per group, the window the allocator is built with (0 = full)."""
        return tuple(g.window for g in self.groups)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    def group_blocks(self, group: int, num_tokens: int, block_size: int, new_tokens: int = 1) -> int:
        """Blocks group `group` holds for a sequence of num_tokens tokens whose last new_tokens are
        being written this step (the allocator releases what the first new token cannot see)."""
        held = -(-num_tokens // block_size)
        w = self.groups[group].window
        if w <= 0:
            return held
        first_new = max(0, num_tokens - max(1, new_tokens))
        return held - max(0, first_new - w + 1) // block_size

    def blocks_for(self, num_tokens: int, block_size: int, new_tokens: int = 1) -> int:
        """Blocks a sequence of num_tokens tokens holds over every group (see group_blocks)."""
        return sum(self.group_blocks(g, num_tokens, block_size, new_tokens) for g in range(len(self.groups)))

    def describe(self) -> str:
        """E.g. "6 groups of 6 layers: 1 full, 5 sliding 512"."""
        kinds: dict[int, int] = {}
        for g in self.groups:
            kinds[g.window] = kinds.get(g.window, 0) + 1
        parts = [f"{n} full" if w == 0 else f"{n} sliding {w}" for w, n in kinds.items()]
        noun = "group" if len(self.groups) == 1 else "groups"
        return f"{len(self.groups)} {noun} of {self.group_size} layers: {', '.join(parts)}"


def kv_groups(layer_windows: Sequence[Optional[int]]) -> KVGroupLayout:
    """Group layers by window (None or 0: full attention), group_size layers per group.

    Groups are numbered in the order of their first layer; within a window, layers fill groups in
    layer order. Raises ValueError for no layers or a negative window.
    """
    windows = [0 if w is None else int(w) for w in layer_windows]
    if not windows:
        raise ValueError("layer_windows: a model has at least one layer")
    if any(w < 0 for w in windows):
        raise ValueError(f"layer_windows: windows must be >= 0 (0 or None: full attention), got {windows}")
    by_window: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        by_window.setdefault(w, []).append(i)
    size = min(len(layers) for layers in by_window.values())
    chunks = [tuple(layers[k : k + size]) for w, layers in by_window.items() for k in range(0, len(layers), size)]
    chunks.sort(key=lambda c: c[0])
    groups = tuple(KVGroup(windows[c[0]], c) for c in chunks)
    layer_group = [0] * len(windows)
    layer_slot = [0] * len(windows)
    for g, group in enumerate(groups):
        for slot, layer in enumerate(group.layers):
            layer_group[layer], layer_slot[layer] = g, slot
    return KVGroupLayout(groups, size, tuple(layer_group), tuple(layer_slot))
