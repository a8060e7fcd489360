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

Layers whose K/V differ in size (Gemma 4: a global layer's kv_heads x head_dim is twice a local
one's) still share the slots: a slot holds `slot_elems` values per token (the lcm of the layers'
sizes), and a layer r times smaller packs r of itself into it (`layer_ratio`, `layer_sub`): it views
the slot as r x num_blocks blocks of its own shape and uses block b * r + sub for the pool's block
b. So every block still costs the same bytes in every group, and the allocator and its invariants
are unchanged. A layer that reads another layer's KV (Gemma 4's shared-KV layers) is in no group of
its own: it has its source layer's group, slot and place, and costs nothing.

Torch-free: `pagewire plan` sizes pools from it without loading weights. The per-layer windows come
from the model config (`ModelConfig.layer_sliding_windows`, None or 0 = full), or any other source
of a plain per-layer list.
"""
from __future__ import annotations

import math
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
    group_size: int  # K/V tensors ("slots") per block = what the runner allocates
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its K/V tensor
    # Per-layer sizes (empty: every layer's K/V fills a slot, the layout before sizes differed).
    slot_elems: int = 0  # values per token of one slot's K (and of its V): lcm of the layers' sizes
    layer_ratio: tuple[int, ...] = ()  # per layer: slot_elems / its kv_heads x head_dim
    layer_sub: tuple[int, ...] = ()  # per layer: its place among the `ratio` it shares a slot with
    layer_source: tuple[int, ...] = ()  # per layer: the layer whose K/V it reads (itself, or earlier)

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
        """E.g. "6 groups of 6 layers: 1 full, 5 sliding 512"; with sizes that differ, "... of 2
        slots ..." plus the layers that read another's KV."""
        kinds: dict[int, int] = {}
        for g in self.groups:
            kinds[g.window] = kinds.get(g.window, 0) + 1
        parts = [f"{n} full" if w == 0 else f"{n} sliding {w}" for w, n in kinds.items()]
        noun = "group" if len(self.groups) == 1 else "groups"
        unit = "slots" if any(r > 1 for r in self.layer_ratio) else "layers"
        shared = sum(s != i for i, s in enumerate(self.layer_source))
        tail = f"; {shared} layers read another layer's KV" if shared else ""
        return f"{len(self.groups)} {noun} of {self.group_size} {unit}: {', '.join(parts)}{tail}"


def kv_layer_groups(layer_windows: Sequence[Optional[int]], layer_elems: Sequence[int],
                    layer_sources: Sequence[Optional[int]]) -> KVGroupLayout:
    """kv_groups for layers whose K/V sizes differ (`layer_elems`: kv_heads x head_dim per layer)
    or that read an earlier layer's KV (`layer_sources`: that layer, None for its own).

    Writing layers of one (window, size) kind fill groups in layer order, `ratio` of them per slot;
    group_size is the fewest slots any kind needs, as with one size. Raises ValueError for sizes
    whose lcm is more than 8 times the largest (no supported model has them), or a source that
    is not an earlier writing layer.
    """
    n = len(layer_windows)
    windows = [0 if w is None else int(w) for w in layer_windows]
    if len(layer_elems) != n or len(layer_sources) != n:
        raise ValueError("layer_elems, layer_sources: one entry per layer")
    if any(w < 0 for w in windows) or any(e <= 0 for e in layer_elems):
        raise ValueError(f"windows must be >= 0 and sizes > 0, got {windows}, {list(layer_elems)}")
    sources = [i if s is None else int(s) for i, s in enumerate(layer_sources)]
    writers = [i for i in range(n) if sources[i] == i]
    if not writers or any(not (0 <= s <= i and sources[s] == s) for i, s in enumerate(sources)):
        raise ValueError(f"layer_sources: each must be an earlier layer that writes its own KV, got {sources}")
    slot = 1
    for i in writers:
        slot = slot * layer_elems[i] // math.gcd(slot, layer_elems[i])
    if slot > 8 * max(layer_elems):
        raise ValueError(f"layer K/V sizes {sorted(set(layer_elems))} do not pack into a common slot")
    by_kind: dict[tuple[int, int], list[int]] = {}
    for i in writers:
        by_kind.setdefault((windows[i], layer_elems[i]), []).append(i)
    ratio = {kind: slot // kind[1] for kind in by_kind}
    size = min(-(-len(layers) // ratio[kind]) for kind, layers in by_kind.items())
    chunks = [(kind, tuple(layers[k : k + size * ratio[kind]])) for kind, layers in by_kind.items()
              for k in range(0, len(layers), size * ratio[kind])]
    chunks.sort(key=lambda c: c[1][0])
    groups = tuple(KVGroup(kind[0], layers) for kind, layers in chunks)
    layer_group, layer_slot, layer_sub, layer_ratio = [0] * n, [0] * n, [0] * n, [1] * n
    for g, (kind, layers) in enumerate(chunks):
        for j, layer in enumerate(layers):
            r = ratio[kind]
            layer_group[layer], layer_slot[layer], layer_sub[layer], layer_ratio[layer] = g, j // r, j % r, r
    for i in range(n):  # readers take their source's place
        s = sources[i]
        layer_group[i], layer_slot[i], layer_sub[i], layer_ratio[i] = (
            layer_group[s], layer_slot[s], layer_sub[s], layer_ratio[s])
    return KVGroupLayout(groups, size, tuple(layer_group), tuple(layer_slot), slot, tuple(layer_ratio),
                         tuple(layer_sub), tuple(sources))


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
