"""A minimal stand-in for the engine's KV manager and runner, for model tests.

It owns per-layer cache tensors, hands out blocks from a shuffled free list (so a model that
assumed contiguous blocks would fail), builds AttentionMetadata by hand for a flat batch of
sequences, and returns the logits of every new token. It also loads the transformers reference.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from server.models.attention import AttentionMetadata
from server.models.decoder import DecoderForCausalLM

VOCAB = 384  # token ids only: these tests need no tokenizer
ARCHS = ("llama", "mistral", "qwen2", "qwen3")


class PagedRun:
    """Drives `model` step by step over several sequences sharing one paged cache."""

    def __init__(self, model: DecoderForCausalLM, num_blocks: int = 48, block_size: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        c = model.config
        # Finite garbage, not zeros: a kernel that read a slot it never wrote would show it. Each
        # layer's own shape; a layer that reads another's KV (Gemma 4) gets that layer's tensors.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(c.num_layers):
            if c.kv_source(i) != i:
                self.kv_caches.append(self.kv_caches[c.kv_source(i)])
                continue
            shape = (num_blocks, c.kv_heads_of(i), block_size, c.head_dim_of(i))
            self.kv_caches.append(((torch.randn(shape, generator=g) * 50).to(model.dtype),
                                   (torch.randn(shape, generator=g) * 50).to(model.dtype)))
        self.model = model
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new_tokens: dict[int, list[int]], lora: Any = None) -> dict[int, torch.Tensor]:
        """Run one forward where sequence `sid` gets `new_tokens[sid]` on top of its cached context.

        lora: the step's LoRA terms (server.models.lora.LoraStep), rows in new_tokens' order.
        Returns: per sequence, float32 logits [len(new tokens), vocab] for every new token.
        """
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        for sid, toks in new_tokens.items():
            ctx = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            total = ctx + len(toks)
            while len(table) * bs < total:
                table.append(self.free.pop())
            for i, tok in enumerate(toks):
                pos = ctx + i
                ids.append(tok)
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            self.lens[sid] = total
            seq_lens.append(total)
            starts.append(starts[-1] + len(toks))
        width = max(len(self.tables[sid]) for sid in new_tokens)
        block_tables = torch.zeros((len(new_tokens), width), dtype=torch.int32)
        for row, sid in enumerate(new_tokens):
            block_tables[row, : len(self.tables[sid])] = torch.tensor(self.tables[sid], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=block_tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(len(t) for t in new_tokens.values()),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), self.kv_caches, meta,
            **({"lora": lora} if lora is not None else {}),
        )
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), self.model.config.vocab_size)
        return {sid: logits[starts[i] : starts[i + 1]] for i, sid in enumerate(new_tokens)}


def hf_logits(model_dir: Path, tokens: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' float32 logits [len(tokens), vocab] for one sequence (eager attention)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()
    with torch.inference_mode():
        return ref(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, vocab_size: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=g).tolist()
