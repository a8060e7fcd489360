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

from dataclasses import dataclass
from typing import Optional

import torch

from server import hugepages
from server.engine.kv_cache_manager import KVCacheManager
from server.engine.kv_groups import KVGroupLayout, kv_groups
from server.engine.request import Sequence
from server.engine.scheduler import SchedulerOutput
from server.engine.state_cache import StateCache
from server.inference_mode import hot_inference_mode
from server.kernels import ops
from server.models.attention import AttentionMetadata, StateBatch
from server.models.lora import LoraSet, LoraStep
from server.models.pooling import PoolingMethod
from server.models.protocol import CausalLM
from server.models.registry import kv_specs


@dataclass(frozen=True, slots=True)
class _DecodeViews:
    """A decode step's inputs as views of the runner's persistent buffers, for n rows and tables
    `longest` blocks wide (ModelRunner._plan_decode)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    prompt_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    sample_rows: torch.Tensor

    @classmethod
    def of(cls, i64: torch.Tensor, i32: torch.Tensor, tables: torch.Tensor, n: int, longest: int) -> "_DecodeViews":
        return cls(i64[0, :n], i64[1, :n], i64[2, :n], i32[0, :n], i32[1, :n], i32[2, : n + 1], tables[0, :n, :longest],
                   torch.arange(n, dtype=torch.int64))

    def to(self, device: torch.device) -> "_DecodeViews":
        """Copies on `device` (the host views stay the runner's; sample_rows stays on the host)."""
        def on(t: torch.Tensor) -> torch.Tensor:
            return t.to(device)

        return _DecodeViews(on(self.input_ids), on(self.positions), on(self.slot_mapping), on(self.seq_lens),
                            on(self.prompt_lens), on(self.query_start_loc), on(self.block_tables), self.sample_rows)


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
        pool = self._pool_tensors(tuple(shape), kv_dtype, 2 * g.group_size)
        slots = [(pool[2 * j], pool[2 * j + 1]) for j in range(g.group_size)]
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
        # Decode steps (one token per sequence, one KV group, no recurrent states) are planned by one
        # allocator call into persistent buffers, read through views cached per (rows, table width):
        # such a step creates no tensor on the host (_plan_decode).
        self._decode_plannable = (len(self.groups.groups) == 1 and not self.groups.slot_elems
                                  and state_cache is None)
        self.decode_planned = False  # the last _plan's (see _plan)
        self._on_cpu = self.device.type == "cpu"
        self._dec64 = torch.zeros((3, 0), dtype=torch.int64)
        self._dec32 = torch.zeros((3, 1), dtype=torch.int32)
        self._dec64_np, self._dec32_np = self._dec64.numpy(), self._dec32.numpy()
        self._decode_views: dict[tuple[int, int], _DecodeViews] = {}

    def _pool_tensors(self, shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
        """The pool's K and V tensors, zeroed (every page committed). On the CPU, one mapping on 2 MB
        pages where the kernel allows (server.hugepages: on 4 KB pages a decode step's block reads
        are TLB misses)."""
        if self.device.type == "cpu":
            return hugepages.zeros([shape] * count, dtype)
        return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(count)]

    def _grow_tables(self, rows: int, width: int) -> None:
        """Make the persistent tables hold at least rows x width (doubling, so growth is rare)."""
        _, have_rows, have_cols = self._tables_np.shape  # (numpy's: a tuple read, no torch.Size built)
        if rows > have_rows or width > have_cols:
            self._tables = torch.zeros((self.kv_cache.num_groups, max(rows, 2 * have_rows), max(width, 2 * have_cols)),
                                       dtype=torch.int32)
            self._tables_np = self._tables.numpy()
            self._decode_views.clear()  # they view the old tables

    def _block_tables(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """[groups, len(seqs), longest table] view of the persistent tables, filled for `seqs`."""
        self._grow_tables(len(seqs), width)
        longest = self.kv_cache.fill_block_tables(seqs, self._tables_np)
        return self._tables[:, : len(seqs), :longest]

    def _plan(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Host-side metadata for the flat batch. Returns (input_ids, positions, meta, sample_rows).
        Sets `decode_planned`: whether the decode plan made it (every share decodes one token and
        samples it, none pools)."""
        if self._decode_plannable:
            planned = self._plan_decode(out)
            if planned is not None:
                self.decode_planned = True
                return planned
        self.decode_planned = False
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

    def _plan_decode(self, out: SchedulerOutput) -> Optional[tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                    torch.Tensor]]:
        """_plan for a step in which every sequence decodes one token and samples it (no lookahead,
        no prefill chunk, no embedding request), or None for any other step. One allocator call
        writes the tokens, positions, slots, lengths and block tables into persistent buffers, and
        the step reads them through views cached per (rows, table width): a decode step's host work
        is a share of its time on small models (issue 31), and each tensor built per step cost
        microseconds with the caches cold after the weights' stream.

        The buffers are rewritten by the next step's plan: the forward reads them synchronously on
        the CPU, and on another device the views are copied there first (below)."""
        ids: list[int] = []
        tokens: list[int] = []
        starts: list[int] = []
        prompt_lens: list[int] = []
        for share in out.scheduled:
            seq = share.seq
            c = seq.num_computed_tokens
            if share.num_new_tokens != 1 or c + 1 != len(seq.token_ids) or seq.request.pooler is not None:
                return None  # a prefill chunk, lookahead, or a share that does not sample
            ids.append(seq.seq_id)
            tokens.append(seq.token_ids[c])
            starts.append(c)
            prompt_lens.append(seq.num_prompt_tokens)
        n = len(ids)
        if n > self._dec64_np.shape[1]:  # (numpy's shape: a tuple read, no torch call on the hot path)
            cap = max(n, 2 * self._dec64_np.shape[1], 8)
            self._dec64 = torch.zeros((3, cap), dtype=torch.int64)
            self._dec32 = torch.zeros((3, cap + 1), dtype=torch.int32)
            self._dec64_np, self._dec32_np = self._dec64.numpy(), self._dec32.numpy()
            self._decode_views.clear()
        self._grow_tables(n, 1)
        longest, max_len = self.kv_cache.fill_decode_inputs(ids, tokens, starts, prompt_lens, self._dec64_np,
                                                            self._dec32_np, self._tables_np)
        if max_len < 0:  # a table wider than the persistent tables: grow them, then fill again
            self._grow_tables(n, longest)
            longest, max_len = self.kv_cache.fill_decode_inputs(ids, tokens, starts, prompt_lens, self._dec64_np,
                                                                self._dec32_np, self._tables_np)
        v = self._decode_views.get((n, longest))
        if v is None:
            v = self._decode_views[(n, longest)] = _DecodeViews.of(self._dec64, self._dec32, self._tables, n, longest)
        if not self._on_cpu:  # (a bool made once: torch.device.type cost 16 us cold a step)
            v = v.to(self.device)
        meta = AttentionMetadata(slot_mapping=v.slot_mapping, block_tables=v.block_tables, seq_lens=v.seq_lens,
                                 query_start_loc=v.query_start_loc, max_query_len=1, max_seq_len=max_len,
                                 prompt_lens=v.prompt_lens)
        return v.input_ids, v.positions, meta, v.sample_rows

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

    def execute_greedy(self, out: SchedulerOutput) -> torch.Tensor:
        """execute() for a step whose every sampled row takes its argmax (LLMEngine's plain-greedy
        steps): the logits come back in the lm_head's dtype, not widened to float32."""
        return self.execute(out, widen=False)

    @hot_inference_mode
    def execute(self, out: SchedulerOutput, widen: bool = True) -> torch.Tensor:
        """Run one step. Returns float32 logits [sum of num_logit_rows, vocab] (possibly 0 rows);
        with widen=False in the model's logits dtype (execute_greedy)."""
        copies = out.copies
        if copies:
            mapping = torch.tensor(copies, dtype=torch.int64, device=self.device)
            ops.copy_blocks(self._key_caches, self._value_caches, mapping)
        input_ids, positions, meta, sample_rows = self._plan(out)
        step = self._lora_step(out)
        # forward, not __call__: nn.Module's hook handling took 18 us a step with the caches cold
        # after the weights' stream, and pagewire's models register no hooks (models/protocol.py).
        if step is None:
            hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_caches, meta, lora=step)
        if self.decode_planned:  # every row samples, none pools: no gather, no pooling (a step's host work)
            return self.model.compute_logits(hidden, widen)
        self._pool(out, hidden)
        if sample_rows.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        if sample_rows.numel() == hidden.shape[0]:  # every row samples (decodes): no gather
            return self.model.compute_logits(hidden, widen)
        return self.model.compute_logits(hidden.index_select(0, sample_rows.to(hidden.device)), widen)
