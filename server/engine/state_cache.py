"""StateCache: the second pool beside the KV blocks, for hybrid models' recurrent layers.

A hybrid model's recurrent layers (LFM2's short convolutions, Gated DeltaNet) keep a fixed-size
state per sequence instead of K/V per token. This pool holds it: for every recurrent layer and
every `StateSpec` of it (server/models/state_specs.py) one tensor [num_slots, *spec.shape]. A
slot index names the same row in every tensor, so one slot is one sequence's whole state.

Slots [0, running_slots) belong to running sequences, one each (`acquire` at admission, zeroed;
`release` through the KV cache's free listener on finish, abort and preemption; `fork` copies the
parent's for n > 1, since a recurrent state cannot be shared copy-on-write). Slots
[running_slots, running_slots + snapshot_slots) hold prefix-cache snapshots: a sequence's state
at a block boundary, keyed by the allocator's chain link of the block that ends there ((block,
generation), KVCacheManager.chain_key). A snapshot is reachable only while that block is still
registered with that generation (evicting or rewriting the block drops it from the same LRU the
KV uses: `link_valid` fails and the snapshot is the first to be reused); among valid ones the
least recently used goes first. The pool's bytes are fixed at start (kv_budget sizes it).

Bookkeeping is plain Python; copies are tensor row copies on the model's device.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch

from server.engine.request import Sequence as Seq
from server.models.state_specs import StateSpec

SnapshotKey = tuple[int, int]  # (block, generation) of the chain link that ends the prefix


class StateCache:
    """Running slots for sequences and snapshot slots for the prefix cache, in one set of tensors."""

    def __init__(self, specs: Sequence[Sequence[StateSpec]], model_dtype: torch.dtype, running_slots: int,
                 snapshot_slots: int, device: torch.device | str = "cpu") -> None:
        if running_slots < 1 or snapshot_slots < 0:
            raise ValueError(f"running_slots must be >= 1 and snapshot_slots >= 0, got {running_slots}, {snapshot_slots}")
        self.running_slots = running_slots
        self.snapshot_slots = snapshot_slots
        total = running_slots + snapshot_slots
        # Per model layer: {spec name: [slots, *shape]} ({} for attention layers).
        self.layers: list[dict[str, torch.Tensor]] = [
            {s.name: torch.zeros((total, *s.shape), dtype=model_dtype if s.dtype == "model" else getattr(torch, s.dtype),
                                 device=device) for s in layer}
            for layer in specs]
        self._tensors = [t for layer in self.layers for t in layer.values()]
        self.slot_bytes = sum(t[0].numel() * t.element_size() for t in self._tensors)
        self._slot_of: dict[int, int] = {}  # seq_id -> running slot
        self._free = list(range(running_slots - 1, -1, -1))  # stack: slot 0 first
        self._snaps: OrderedDict[SnapshotKey, int] = OrderedDict()  # key -> slot, least recent first
        self._snap_tokens: dict[SnapshotKey, int] = {}  # key -> tokens the state covers
        self._free_snaps = list(range(total - 1, running_slots - 1, -1))
        self.snapshot_hits = 0
        self.snapshots_saved = 0

    # -- running slots ----------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def has_slot(self, seq: Seq) -> bool:
        return seq.seq_id in self._slot_of

    def slot(self, seq: Seq) -> int:
        return self._slot_of[seq.seq_id]

    def acquire(self, seq: Seq) -> int:
        """Give `seq` a zeroed slot (its state before any token). Raises RuntimeError when none is
        free: admission reserves a slot before it admits (Scheduler._admit)."""
        if seq.seq_id in self._slot_of:
            raise RuntimeError(f"{seq} already holds state slot {self._slot_of[seq.seq_id]}")
        if not self._free:
            raise RuntimeError(f"no free state slot for {seq}: all {self.running_slots} are held")
        slot = self._free.pop()
        self._slot_of[seq.seq_id] = slot
        self._zero(slot)
        return slot

    def release(self, seq: Seq) -> None:
        """Return `seq`'s slot (no-op without one): finish, abort, preemption (rebuilt by recompute)."""
        slot = self._slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def fork(self, parent: Seq, child: Seq) -> None:
        """n > 1: the child gets a slot holding a copy of the parent's state."""
        slot = self.acquire(child)
        self._copy(self._slot_of[parent.seq_id], slot)

    def slots_tensor(self, seqs: Sequence[Seq], device: torch.device) -> torch.Tensor:
        """int64 [S]: each sequence's slot, in batch order (StateBatch.slots)."""
        return torch.tensor([self._slot_of[s.seq_id] for s in seqs], dtype=torch.int64, device=device)

    # -- snapshots (prefix caching) ---------------------------------------------------------------
    @property
    def num_snapshots(self) -> int:
        return len(self._snaps)

    def has_snapshot(self, key: SnapshotKey) -> bool:
        return key in self._snaps

    def save_snapshot(self, key: SnapshotKey, seq: Seq, tokens: int, valid: Callable[[SnapshotKey], bool]) -> bool:
        """Copy `seq`'s state (covering its first `tokens` tokens) under `key`. A slot comes from the
        free ones, else from a snapshot whose block is gone (`valid` false), else from the least
        recently used. Returns False when there are no snapshot slots at all."""
        if self.snapshot_slots == 0:
            return False
        if key in self._snaps:
            self._snaps.move_to_end(key)
            return True
        if not self._free_snaps:
            stale = next((k for k in self._snaps if not valid(k)), None)
            victim = stale if stale is not None else next(iter(self._snaps))
            self._free_snaps.append(self._snaps.pop(victim))
            del self._snap_tokens[victim]
        slot = self._free_snaps.pop()
        self._copy(self._slot_of[seq.seq_id], slot)
        self._snaps[key] = slot
        self._snap_tokens[key] = tokens
        self.snapshots_saved += 1
        return True

    def restore(self, key: SnapshotKey, seq: Seq) -> int:
        """Copy snapshot `key` into `seq`'s slot; returns the tokens it covers (marks it recently used)."""
        slot = self._snaps[key]
        self._snaps.move_to_end(key)
        self._copy(slot, self._slot_of[seq.seq_id])
        self.snapshot_hits += 1
        return self._snap_tokens[key]

    def drop_invalid(self, valid: Callable[[SnapshotKey], bool]) -> None:
        """Forget every snapshot whose block is gone (after reset_prefix_cache, for instance)."""
        for key in [k for k in self._snaps if not valid(k)]:
            self._free_snaps.append(self._snaps.pop(key))
            del self._snap_tokens[key]

    # -- introspection ----------------------------------------------------------------------------
    def check_invariants(self, live_seq_ids: Optional[set[int]] = None) -> None:
        """Raise RuntimeError on the first broken invariant: every running slot is free xor held by
        one sequence, every snapshot slot free xor holding one snapshot; with live_seq_ids, the
        holders are exactly those sequences."""
        held = list(self._slot_of.values())
        if len(set(held)) != len(held):
            raise RuntimeError(f"a state slot is held twice: {sorted(held)}")
        if sorted(held + self._free) != list(range(self.running_slots)):
            raise RuntimeError(f"running slots leak or overlap: held {sorted(held)}, free {sorted(self._free)}")
        snaps = list(self._snaps.values())
        expect = list(range(self.running_slots, self.running_slots + self.snapshot_slots))
        if sorted(snaps + self._free_snaps) != expect:
            raise RuntimeError(f"snapshot slots leak or overlap: used {sorted(snaps)}, free {sorted(self._free_snaps)}")
        if set(self._snap_tokens) != set(self._snaps):
            raise RuntimeError("snapshot token counts out of step with the snapshots")
        if live_seq_ids is not None and set(self._slot_of) != live_seq_ids:
            raise RuntimeError(f"state slots held by {sorted(self._slot_of)}, expected {sorted(live_seq_ids)}")

    # -- copies -----------------------------------------------------------------------------------
    def _zero(self, slot: int) -> None:
        for t in self._tensors:
            t[slot].zero_()

    def _copy(self, src: int, dst: int) -> None:
        for t in self._tensors:
            t[dst].copy_(t[src])
