"""ModelRunner: turns a SchedulerOutput into one flat model forward over the paged KV cache.

It owns the model and the KV cache tensors (one key/value pair per slot of a KV group, shared by
the groups: server/engine/kv_groups.py). Each step it plans the attention metadata on the host
(token ids, positions, and per KV group a slot mapping and block tables, which the allocator
writes into a persistent tensor in one call), applies the step's copy-on-write block copies, runs
the forward and returns the logits of the sequences that are up to date (one row per ScheduledSeq
that samples, in scheduling order; 1 + k rows for a decode with k proposed tokens, see
spec_decode.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from server.engine.kv_cache_manager import KVCacheManager
from server.engine.kv_groups import KVGroupLayout, kv_groups
from server.engine.request import Sequence
from server.engine.scheduler import SchedulerOutput
from server.engine.state_cache import StateCache
from server.kernels import ops
from server.models.attention import AttentionMetadata, StateBatch
from server.models.lora import LoraSet, LoraStep
from server.models.pooling import PoolingMethod
from server.models.protocol import CausalLM
from server.models.registry import kv_specs


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        kv_cache: KVCacheManager,
        device: torch.device,
        kv_dtype: torch.dtype,
        groups: Optional[KVGroupLayout] = None,
        state_cache: Optional[StateCache] = None,
        lora: Optional[LoraSet] = None,
    ) -> None:
        """groups: the model's KV groups, those kv_cache was built with (None: one full-attention
        group of every layer). state_cache: a hybrid model's recurrent state slots (its KV layers
        are then its attention layers only). lora: the LoRA adapters requests may use (their
        Request.lora_slot)."""
        self.model = model
        self.lora = lora
        self.block_size = block_size
        self.kv_cache = kv_cache
        self.device = device
        self.state_cache = state_cache
        num_layers = len(kv_specs(model.config))  # the layers with a KV cache
        self.groups = groups if groups is not None else kv_groups([None] * num_layers)
        if len(self.groups.groups) != kv_cache.num_groups or self.groups.num_layers != num_layers:
            raise ValueError(f"groups: {self.groups.describe()} over {self.groups.num_layers} layers does not match "
                             f"the KV cache's {kv_cache.num_groups} groups and the model's {num_layers} KV layers")
        shape = model.kv_cache_shape(num_blocks, block_size)  # [blocks, kv_heads, block_size, head_dim]
        # torch.zeros, not torch.empty, so every page of the pool is committed now. Positions are
        # only ever read after they were written (the kernel's causal bound), but with lazily
        # committed pages the process's RSS crept up for as long as the block allocator kept
        # handing out blocks it had never used (freed blocks go to the back of the queue, so it
        # cycles through the whole pool): ~1 GB over 5,000 requests, which looked like a leak
        # (issue 13, bug 9). Committed up front, the server's footprint is known at start and an
        # over-sized --kv-cache-memory-gb fails there, not hours later.
        # One (key, value) pair per slot of a KV group, shared by the groups: a block id belongs to
        # one group at a time, so layer i (group g, slot j) owns its block's rows of slot j's
        # tensors. With one group there is a pair per layer, as before groups.
        g = self.groups
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
        if g.slot_elems:  # layer sizes differ (Gemma 4): a slot holds slot_elems values per token
            shape = (num_blocks, 1, block_size, g.slot_elems)
        slots = [
            (
                torch.zeros(shape, dtype=kv_dtype, device=device),
                torch.zeros(shape, dtype=kv_dtype, device=device),
            )
            for _ in range(g.group_size)
        ]
        if g.slot_elems:
            # Layer i views its slot as ratio x num_blocks blocks of its own shape (contiguous, as
            # the kernels need) and uses block b * ratio + sub for the pool's block b (_plan).
            specs = kv_specs(model.config)
            self.kv_caches = [tuple(t.view(num_blocks * g.layer_ratio[i], specs[i].num_kv_heads, block_size,
                                           specs[i].head_dim) for t in slots[g.layer_slot[i]])  # type: ignore[misc]
                              for i in range(num_layers)]
        else:
            self.kv_caches = [slots[j] for j in g.layer_slot]
        # copy_blocks copies a block in every slot: all layers of the group that holds it.
        self._key_caches = [k for k, _ in slots]
        self._value_caches = [v for _, v in slots]
        # Persistent int32 block tables [groups, rows, width], filled by the allocator in one call
        # per step (KVCacheManager.fill_block_tables), grown when a batch outgrows them.
        self._tables = torch.zeros((kv_cache.num_groups, 0, 0), dtype=torch.int32)
        self._tables_np = self._tables.numpy()

    def _block_tables(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """[groups, len(seqs), longest table] view of the persistent tables, filled for `seqs`."""
        _, rows, cols = self._tables.shape
        if len(seqs) > rows or width > cols:
            self._tables = torch.zeros((self.kv_cache.num_groups, max(len(seqs), 2 * rows), max(width, 2 * cols)),
                                       dtype=torch.int32)
            self._tables_np = self._tables.numpy()
        longest = self.kv_cache.fill_block_tables(seqs, self._tables_np)
        return self._tables[:, : len(seqs), :longest]

    def _plan(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Host-side metadata for the flat batch. Returns (input_ids, positions, meta, sample_rows)."""
        bs = self.block_size
        token_ids: list[int] = []
        starts: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        seqs: list[Sequence] = []
        prompt_lens: list[int] = []
        sample_rows: list[int] = []
        qsl = [0]
        for share in out.scheduled:
            seq = share.seq
            c = seq.num_computed_tokens
            n = share.num_new_tokens
            token_ids.extend(seq.token_ids[c : c + n])
            if share.num_spec:  # lookahead: the proposals follow the last verified token
                token_ids.extend(seq.spec_token_ids)
            starts.append(c)
            q_lens.append(n)
            seq_lens.append(c + n)
            seqs.append(seq)
            prompt_lens.append(seq.num_prompt_tokens)
            qsl.append(qsl[-1] + n)
            if share.num_logit_rows:  # the last position, and the num_spec before it (lookahead)
                sample_rows.extend(range(qsl[-1] - 1 - share.num_spec, qsl[-1]))

        num_seqs = len(q_lens)
        tables = self._block_tables(seqs, -(-max(seq_lens) // bs))
        if (qsl[-1] == num_seqs and len(self.groups.groups) == 1 and not self.groups.slot_elems
                and self.state_cache is None):  # a hybrid's steps also carry the state slots (below)
            return self._plan_decode(token_ids, starts, seq_lens, prompt_lens, qsl, tables, sample_rows)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        # positions: start_i + arange(q_len_i), vectorised over the flat batch.
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs), q_lens_t)
        qsl_t = torch.tensor(qsl, dtype=torch.int64)
        offsets = torch.arange(qsl[-1], dtype=torch.int64) - qsl_t[:-1][seq_idx]
        positions = torch.tensor(starts, dtype=torch.int64)[seq_idx] + offsets
        block_idx, offset = positions // bs, positions % bs
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        qsl_dev = qsl_t.to(torch.int32).to(self.device)
        prompt_lens_t = torch.tensor(prompt_lens, dtype=torch.int32, device=self.device)
        metas = []
        for g in range(tables.shape[0]):  # each KV group: its own slots and tables, the same lengths
            slot_mapping = tables[g][seq_idx, block_idx].to(torch.int64) * bs + offset
            metas.append(AttentionMetadata(
                slot_mapping=slot_mapping.to(self.device),
                block_tables=tables[g].to(self.device),
                seq_lens=seq_lens_t,
                query_start_loc=qsl_dev,
                max_query_len=max(q_lens),
                max_seq_len=max(seq_lens),
                prompt_lens=prompt_lens_t,
            ))
        meta = metas[0]
        lay = self.groups
        if lay.slot_elems and any(r > 1 for r in lay.layer_ratio):
            # A layer packed `ratio` to a slot reads block b * ratio + sub where the group's table says b
            # (released blocks stay -1, never read).
            packed: dict[tuple[int, int, int], AttentionMetadata] = {}
            for grp, r, sub in set(zip(lay.layer_group, lay.layer_ratio, lay.layer_sub)):
                base = metas[grp]
                t = tables[grp]
                packed[(grp, r, sub)] = AttentionMetadata(
                    slot_mapping=((t[seq_idx, block_idx].to(torch.int64) * r + sub) * bs + offset).to(self.device),
                    block_tables=torch.where(t >= 0, t * r + sub, t).to(self.device),
                    seq_lens=base.seq_lens, query_start_loc=base.query_start_loc, max_query_len=base.max_query_len,
                    max_seq_len=base.max_seq_len, prompt_lens=base.prompt_lens)
            meta = packed[(lay.layer_group[0], lay.layer_ratio[0], lay.layer_sub[0])]
            meta.per_layer = [packed[k] for k in zip(lay.layer_group, lay.layer_ratio, lay.layer_sub)]
        elif len(metas) > 1:
            meta.per_layer = [metas[grp] for grp in lay.layer_group]
        if self.state_cache is not None:  # a hybrid model: each sequence's recurrent state slot
            meta.state = StateBatch(self.state_cache.slots_tensor(seqs, self.device), self.state_cache.layers)
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        return input_ids, positions.to(self.device), meta, torch.tensor(sample_rows, dtype=torch.int64)

    def _plan_decode(self, token_ids: list[int], starts: list[int], seq_lens: list[int], prompt_lens: list[int],
                     qsl: list[int], tables: torch.Tensor,
                     sample_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """_plan for a step of one token per sequence and one KV group (every decode step without
        lookahead): the same tensors, built from host lists in a handful of calls rather than the
        vectorised index arithmetic a mixed batch needs (a decode step's host work is a share of
        its time; issue 31)."""
        bs = self.block_size
        tnp = self._tables_np[0]
        slots = [int(tnp[i, c // bs]) * bs + c % bs for i, c in enumerate(starts)]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables[0].to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=1,
            max_seq_len=max(seq_lens),
            prompt_lens=torch.tensor(prompt_lens, dtype=torch.int32, device=dev),
        )
        return (torch.tensor(token_ids, dtype=torch.int64, device=dev),
                torch.tensor(starts, dtype=torch.int64, device=dev), meta,
                torch.tensor(sample_rows, dtype=torch.int64))

    def _lora_step(self, out: SchedulerOutput) -> Optional[LoraStep]:
        """The step's LoRA terms: each row's adapter slot (every row of a share is its request's);
        None when no adapters are loaded or no scheduled request uses one."""
        if self.lora is None or not any(share.seq.request.lora_slot for share in out.scheduled):
            return None
        rows: list[int] = []
        for share in out.scheduled:
            rows += [share.seq.request.lora_slot] * share.num_new_tokens
        return self.lora.step(rows)

    @staticmethod
    def _pool(out: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Each embedding share's contribution from its rows of the final-norm hidden states, in
        float32 (`ScheduledSeq.pooled`): for mean pooling the sum of its rows, for cls the first
        prompt position's row (when this share holds it), for last-token the last row (when the
        share brings the prompt up to date). Set on the share, not folded: isolation may run a
        share again after a failed batch, and only the engine folds, once, for survivors."""
        r = 0
        for share in out.scheduled:
            n = share.num_new_tokens
            pooler = share.seq.request.pooler
            if pooler is not None:
                rows = hidden[r : r + n]
                if pooler.method is PoolingMethod.MEAN:
                    share.pooled = rows.float().sum(0)
                elif pooler.method is PoolingMethod.CLS:
                    share.pooled = rows[0].float().clone() if share.seq.num_computed_tokens == 0 else None
                else:
                    share.pooled = rows[-1].float().clone() if share.samples else None
            r += n

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step. Returns float32 logits [sum of num_logit_rows, vocab] (possibly 0 rows)."""
        copies = out.copies
        if copies:
            mapping = torch.tensor(copies, dtype=torch.int64, device=self.device)
            ops.copy_blocks(self._key_caches, self._value_caches, mapping)
        input_ids, positions, meta, sample_rows = self._plan(out)
        step = self._lora_step(out)
        if step is None:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, lora=step)
        self._pool(out, hidden)
        if sample_rows.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        if sample_rows.numel() == hidden.shape[0]:  # every row samples (decodes): no gather
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden.index_select(0, sample_rows.to(hidden.device)))
