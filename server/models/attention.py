"""AttentionMetadata: the per-step plan of where each token's K/V lives, built once by the runner.

It is passed explicitly into every model forward (no module-global context). All tensors live on
the model's device; they are computed on the host once per step ("plan") and the kernels only
read them ("run").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class StateBatch:
    """Hybrid models: where each sequence's recurrent state lives (server/engine/state_cache.py).

    slots:  int64 [S]  each sequence's slot in the state pool, in batch order (a fresh sequence's
                       slot is zeroed before its first token; a prefix hit's holds the snapshot)
    layers: per model layer, {StateSpec name: [num_slots, *shape]} ({} for attention layers); a
            recurrent layer reads its sequences' rows and writes them back updated
    """

    slots: torch.Tensor
    layers: list[dict[str, torch.Tensor]]


@dataclass
class AttentionMetadata:
    """Shapes: T = tokens in the flat batch, S = sequences in the batch.

    slot_mapping:    int64 [T]      cache slot (block * block_size + offset) for each new token; -1 = skip
    block_tables:    int32 [S, B]   physical block ids of each sequence (padded with 0; -1 where a
                                    sliding-window KV group released a block, never read)
    seq_lens:        int32 [S]      tokens in cache for each sequence after this step (context + new)
    query_start_loc: int32 [S + 1]  prefix sum of new tokens per sequence; q_len = diff
    max_query_len / max_seq_len:    host ints, for kernels that size launches by them
    prompt_lens:     int32 [S]      each sequence's prompt length, or None (= seq_lens); read only
                                    by longrope, whose table choice depends on it (rope.long_rows)
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    prompt_lens: Optional[torch.Tensor] = None
    # With several KV groups (server/engine/kv_groups.py), per layer the metadata of its group: its
    # own slot_mapping and block_tables, the same lengths. None: every layer uses this one.
    per_layer: Optional[list[AttentionMetadata]] = None
    # Hybrid models: the recurrent layers' state slots (None for a model without recurrent layers).
    state: Optional[StateBatch] = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer` reads and writes its K/V through."""
        return self if self.per_layer is None else self.per_layer[layer]
