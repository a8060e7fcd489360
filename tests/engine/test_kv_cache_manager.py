"""KVCacheManager: the engine's only door to the allocator; registration costs O(new blocks)."""
from __future__ import annotations

from typing import Any
from typing import Sequence as Seq

from server.engine.kv_cache_manager import KVCacheManager
from server.engine.request import Request, Sequence
from server.engine.sampling_params import SamplingParams


class _Spy:
    """Wraps the allocator and records how many tokens each cache_full_blocks call carried."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[int, int]] = []  # (len(token_ids), start)

    def cache_full_blocks(self, seq_id: int, token_ids: Seq[int], start: int = 0) -> None:
        self.calls.append((len(token_ids), start))
        self.inner.cache_full_blocks(seq_id, token_ids, start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _seq(prompt: list[int], rid: str = "r") -> Sequence:
    req = Request(rid, list(prompt), SamplingParams(max_tokens=100), priority=0, arrival_time=0.0,
                  max_total_tokens=len(prompt) + 100)
    seq = Sequence(req, 0, list(prompt))
    req.sequences.append(seq)
    return seq


def _step(kv: KVCacheManager, seq: Sequence, num_new: int) -> None:
    """What the scheduler and engine do for one scheduled share."""
    assert kv.allocate(seq, num_new) is not None
    kv.register_full_blocks(seq, num_new)
    seq.num_computed_tokens += num_new


def test_decode_steps_pass_only_the_tokens_of_the_block_they_fill() -> None:
    bs = 4
    kv = KVCacheManager(400, bs)
    spy = _Spy(kv._alloc)
    kv._alloc = spy  # type: ignore[assignment]
    prompt = [10 + i % 50 for i in range(1001)]
    seq = _seq(prompt)
    assert kv.match_prefix(seq) == 0
    _step(kv, seq, 600)  # a prefill chunk: registers 150 blocks
    _step(kv, seq, 401)
    assert spy.calls == [(600, 0), (400, 600)]  # the second chunk from its first block, 600
    assert kv.registered_tokens(seq) == 1000
    spy.calls.clear()
    for t in range(40):  # decodes: one sampled token each
        seq.token_ids.append(7 + t)
        _step(kv, seq, 1)
        assert kv.registered_tokens(seq) == seq.num_computed_tokens // bs * bs
    # A call only when a block fills (every 4th decode), carrying just that block's 4 tokens.
    assert spy.calls and all(n == bs for n, _ in spy.calls)
    assert len(spy.calls) == 1040 // bs - 1000 // bs
    # The chain registered piece by piece serves a later identical prompt.
    other = _seq(seq.token_ids[:1040] + [1], rid="o")
    assert kv.match_prefix(other) == 1040
    kv.free(seq)
    kv.free(other)
    assert kv.stats().used_blocks == 0
    kv.check_invariants()


def test_without_prefix_caching_nothing_is_registered() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    spy = _Spy(kv._alloc)
    kv._alloc = spy  # type: ignore[assignment]
    seq = _seq(list(range(5, 30)))
    assert kv.match_prefix(seq) == 0
    _step(kv, seq, 25)
    assert spy.calls == [] and kv.registered_tokens(seq) == 0
    assert kv.blocks_for_tokens(25) == 7 and len(kv.block_table(seq)) == 7


def test_default_pool_is_sized_from_max_num_seqs_and_max_model_len_capped_by_the_budget() -> None:
    """Issue 29: the demo model's server committed a 2 GiB pool for a model that needs megabytes.
    The default pool is max_num_seqs x max_model_len (plus the watermark), capped by the budget."""
    from server.engine.config import EngineConfig
    from server.engine.kv_budget import kv_bytes_per_token, kv_layout

    demo = dict(num_layers=4, num_kv_heads=4, head_dim=32, dtype="float32", max_position_embeddings=2048)
    bpt = kv_bytes_per_token(4, 4, 32, 4)
    lay = kv_layout(EngineConfig(model="m"), **demo)  # type: ignore[arg-type]
    need = 64 * 2048  # max_num_seqs x max_model_len, the defaults
    assert need <= lay.total_tokens <= need * 1.02 + 32
    assert lay.max_model_len == 2048 and lay.sequences_fitting(2048) >= 64
    assert lay.total_bytes < 2**30  # 0.5 GiB (float32, 64 x 2048 tokens), not the 2 GiB budget
    small = kv_layout(EngineConfig(model="m", max_num_seqs=4, max_model_len=512), **demo)  # type: ignore[arg-type]
    assert 4 * 512 <= small.total_tokens <= 4 * 512 + 64 and small.sequences_fitting(512) >= 4
    # A model whose sequences need more than the budget: the budget caps it, as before.
    big = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", max_position_embeddings=8192)
    capped = kv_layout(EngineConfig(model="m"), **big)  # type: ignore[arg-type]
    assert capped.total_bytes <= 2 * 2**30 and capped.total_bytes > 1.9 * 2**30
    # An explicit size is honoured whatever max_num_seqs needs.
    exact = kv_layout(EngineConfig(model="m", kv_cache_tokens=1 << 20), **demo)  # type: ignore[arg-type]
    assert exact.total_tokens == 1 << 20 and exact.total_bytes == (1 << 20) * bpt
