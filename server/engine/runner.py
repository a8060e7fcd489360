"""ModelRunner: turns a SchedulerOutput into one flat model forward over the paged KV cache.

It owns the model and the per-layer KV cache tensors. Each step it plans the attention metadata
on the host (token ids, positions, slot mapping, block tables, sequence lengths), applies the
step's copy-on-write block copies, runs the forward and returns the logits of the sequences
that are up to date (one row per ScheduledSeq that samples, in scheduling order; 1 + k rows for
a decode with k proposed tokens, see spec_decode.py).
"""
from __future__ import annotations

import torch

from server.engine.kv_cache_manager import KVCacheManager
from server.engine.scheduler import SchedulerOutput
from server.kernels import ops
from server.models.attention import AttentionMetadata
from server.models.protocol import CausalLM


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        kv_cache: KVCacheManager,
        device: torch.device,
        kv_dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_cache = kv_cache
        self.device = device
        shape = model.kv_cache_shape(num_blocks, block_size)  # [blocks, kv_heads, block_size, head_dim]
        # torch.zeros, not torch.empty, so every page of the pool is committed now. Positions are
        # only ever read after they were written (the kernel's causal bound), but with lazily
        # committed pages the process's RSS crept up for as long as the block allocator kept
        # handing out blocks it had never used (freed blocks go to the back of the queue, so it
        # cycles through the whole pool): ~1 GB over 5,000 requests, which looked like a leak
        # (issue 13, bug 9). Committed up front, the server's footprint is known at start and an
        # over-sized --kv-cache-memory-gb fails there, not hours later.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=kv_dtype, device=device),
                torch.zeros(shape, dtype=kv_dtype, device=device),
            )
            for _ in range(model.config.num_layers)
        ]
        self._key_caches = [k for k, _ in self.kv_caches]
        self._value_caches = [v for _, v in self.kv_caches]

    def _plan(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Host-side metadata for the flat batch. Returns (input_ids, positions, meta, sample_rows)."""
        bs = self.block_size
        token_ids: list[int] = []
        starts: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
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
            prompt_lens.append(seq.num_prompt_tokens)
            tables.append(self.kv_cache.block_table(seq))
            qsl.append(qsl[-1] + n)
            if share.samples:  # the last position, and the num_spec before it (lookahead)
                sample_rows.extend(range(qsl[-1] - 1 - share.num_spec, qsl[-1]))

        num_seqs = len(q_lens)
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.zeros((num_seqs, max_blocks), dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        # positions: start_i + arange(q_len_i), vectorised over the flat batch.
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs), q_lens_t)
        qsl_t = torch.tensor(qsl, dtype=torch.int64)
        offsets = torch.arange(qsl[-1], dtype=torch.int64) - qsl_t[:-1][seq_idx]
        positions = torch.tensor(starts, dtype=torch.int64)[seq_idx] + offsets
        slot_mapping = block_tables[seq_idx, positions // bs].to(torch.int64) * bs + positions % bs

        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            block_tables=block_tables.to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            query_start_loc=qsl_t.to(torch.int32).to(self.device),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            prompt_lens=torch.tensor(prompt_lens, dtype=torch.int32, device=self.device),
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        return input_ids, positions.to(self.device), meta, torch.tensor(sample_rows, dtype=torch.int64)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step. Returns float32 logits [sum of num_logit_rows, vocab] (possibly 0 rows)."""
        copies = out.copies
        if copies:
            mapping = torch.tensor(copies, dtype=torch.int64, device=self.device)
            ops.copy_blocks(self._key_caches, self._value_caches, mapping)
        input_ids, positions, meta, sample_rows = self._plan(out)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if sample_rows.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, sample_rows.to(hidden.device)))
