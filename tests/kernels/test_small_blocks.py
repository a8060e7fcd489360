"""The small-block cache in front of torch's CPU allocator (csrc/cpu/small_blocks.cpp).

Blocks come back whole and aligned at every size class's edges, a freed block is reused by the
next tensor of its class on that thread, any thread may free a block another allocated, larger
tensors bypass it, the per-thread bound holds, and turning it off leaves its blocks freeable.
The engine turns it on for a CPU model, and greedy tokens are the same with it as without.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from server import _C
from server.kernels.ops import small_block_stats, use_small_blocks

MAX_BYTES = 1 << 19
MAX_PER_CLASS = 32
MAX_CACHED = 8 << 20


def class_bytes(n: int) -> int:
    """The cache's size class for n bytes (small_blocks.cpp class_of / class_bytes)."""
    if n <= 256:
        return -(-n // 64) * 64
    e = (n - 1).bit_length() - 1
    step = 1 << (e - 2)
    return -(-n // step) * step


@pytest.fixture()
def cache_on() -> Iterator[None]:
    """The cache installed for the test, then the state before it (an engine test earlier in the
    worker may have installed it for good)."""
    was = bool(small_block_stats()["enabled"])
    use_small_blocks(True)
    _C.release_small_blocks()
    yield
    _C.release_small_blocks()
    use_small_blocks(was)


def hits() -> int:
    return int(small_block_stats()["hits"])  # type: ignore[call-overload]


def test_size_classes_cover_every_edge() -> None:
    sizes = set()
    for n in range(1, 300):
        sizes.add(class_bytes(n))
        assert n <= class_bytes(n) and class_bytes(n) % 64 == 0
    for e in range(8, 19):
        for q in range(4, 9):
            edge = q << (e - 2)
            for n in (edge - 1, edge, edge + 1):
                if n <= MAX_BYTES:
                    c = class_bytes(n)
                    assert n <= c <= max(256, n + (n - 1) // 4 + 64), (n, c)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 256, 257, 320, 321, 1000, 1152, 4095, 4096, 4097, 65536,
                               MAX_BYTES - 1, MAX_BYTES])
def test_blocks_are_whole_and_aligned(cache_on: None, n: int) -> None:
    torch.manual_seed(n)
    a = torch.randint(0, 256, (n,), dtype=torch.uint8)
    copy = a.clone()
    assert a.data_ptr() % 64 == 0 and copy.data_ptr() % 64 == 0
    # Fill a neighbour of the same class after freeing one: nothing of `a` may change.
    b = torch.empty(n, dtype=torch.uint8).fill_(0xAB)
    del b
    c = torch.full((n,), 7, dtype=torch.uint8)
    assert torch.equal(a, copy)
    assert bool((c == 7).all())


def test_freed_block_is_reused_on_its_thread(cache_on: None) -> None:
    x = torch.empty(1152, dtype=torch.uint8)
    ptr = x.data_ptr()
    del x
    before = hits()
    y = torch.empty(1100, dtype=torch.uint8)  # same class (1152 -> 1280 bytes)
    assert y.data_ptr() == ptr
    assert hits() == before + 1
    assert int(small_block_stats()["cached_bytes"]) == 0  # type: ignore[call-overload]


def test_large_tensors_bypass_the_cache(cache_on: None) -> None:
    before = dict(small_block_stats())
    x = torch.empty(MAX_BYTES + 1, dtype=torch.uint8)
    del x
    after = small_block_stats()
    assert after["hits"] == before["hits"] and after["misses"] == before["misses"]
    assert after["cached_bytes"] == before["cached_bytes"]


def test_per_class_and_per_thread_bounds(cache_on: None) -> None:
    many = [torch.empty(4096, dtype=torch.uint8) for _ in range(3 * MAX_PER_CLASS)]
    del many
    assert int(small_block_stats()["cached_bytes"]) == MAX_PER_CLASS * 4096  # type: ignore[call-overload]
    _C.release_small_blocks()
    big = [torch.empty(MAX_BYTES, dtype=torch.uint8) for _ in range(MAX_PER_CLASS)]
    del big
    assert int(small_block_stats()["cached_bytes"]) <= MAX_CACHED  # type: ignore[call-overload]
    _C.release_small_blocks()
    assert int(small_block_stats()["cached_bytes"]) == 0  # type: ignore[call-overload]


def test_a_burst_of_large_blocks_leaves_room_for_small_ones(cache_on: None) -> None:
    big = [torch.empty(MAX_BYTES, dtype=torch.uint8) for _ in range(MAX_PER_CLASS)]
    del big
    assert int(small_block_stats()["cached_bytes"]) == MAX_CACHED  # type: ignore[call-overload]
    x = torch.empty(1152, dtype=torch.uint8)
    ptr = x.data_ptr()
    del x  # cached: one large block makes room
    assert int(small_block_stats()["cached_bytes"]) == MAX_CACHED - MAX_BYTES + 1280  # type: ignore[call-overload]
    before = hits()
    y = torch.empty(1152, dtype=torch.uint8)
    assert y.data_ptr() == ptr and hits() == before + 1


def test_blocks_freed_on_other_threads(cache_on: None) -> None:
    made: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def make() -> None:
        try:
            made.extend(torch.full((n,), n % 251, dtype=torch.uint8) for n in range(100, 5000, 97))
            # Exiting with blocks cached: the thread's cache is returned to the C library.
            scratch = [torch.empty(2048, dtype=torch.uint8) for _ in range(8)]
            del scratch
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert not errors
    for x in made:
        assert bool((x == x.numel() % 251).all())
    before = int(small_block_stats()["cached_bytes"])  # type: ignore[call-overload]
    made.clear()  # freed here: onto this thread's lists
    assert int(small_block_stats()["cached_bytes"]) > before  # type: ignore[call-overload]

    def free_there(xs: list[torch.Tensor]) -> None:
        xs.clear()

    mine = [torch.ones(3000, dtype=torch.uint8) for _ in range(4)]
    t2 = threading.Thread(target=free_there, args=(mine,))
    t2.start()
    t2.join()
    assert mine == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_ops_that_allocate_raw_blocks(cache_on: None, dtype: torch.dtype) -> None:
    """torch's own kernels under the cache: oneDNN's bf16 matmul frees scratch through the
    allocator's raw deleter (a crash before every block carried its class), large and small."""
    torch.manual_seed(0)
    for m, k, n in ((1, 576, 4096), (8, 576, 1536), (64, 1024, 3072), (300, 256, 2048)):
        x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
        got = torch.nn.functional.linear(x, w)
        ref = x.double() @ w.double().T
        assert torch.allclose(got.double(), ref, rtol=2e-2, atol=2e-2 * k ** 0.5)
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: through the previous allocator
    assert float(big.sum()) == float((1 << 20) * ((1 << 20) - 1) // 2)


def test_off_keeps_its_blocks_freeable(cache_on: None) -> None:
    held = [torch.full((777,), 3, dtype=torch.uint8) for _ in range(4)]
    use_small_blocks(False)
    assert small_block_stats()["enabled"] is False
    before = hits()
    x = torch.empty(777, dtype=torch.uint8)  # from torch's own allocator now
    assert hits() == before
    assert all(bool((h == 3).all()) for h in held)
    del held, x  # the cache's blocks go through its deleter even while it is off
    use_small_blocks(True)
    use_small_blocks(True)  # installing twice keeps one (the previous allocator is not itself)
    y = torch.empty(777, dtype=torch.uint8)
    assert hits() == before + 1
    del y


def test_the_engine_installs_it_and_tokens_are_unchanged(tiny_model: Callable[..., Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from server.engine.config import EngineConfig
    from server.engine.engine import LLMEngine
    from server.engine.sampling_params import SamplingParams

    was = bool(small_block_stats()["enabled"])
    outs = []
    try:
        for on in (False, True):
            use_small_blocks(False)
            monkeypatch.setenv("PAGEWIRE_SMALL_BLOCKS", "1" if on else "0")
            engine = LLMEngine(EngineConfig(model=str(tiny_model("llama", "bfloat16")), dtype="bfloat16", num_threads=1,
                                            max_num_seqs=4, enable_prefix_caching=False))
            assert small_block_stats()["enabled"] is on
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            for r in range(3):
                engine.add_request(f"r{r}", [5 + r, 17, 29 + 3 * r, 41], params)
            tokens: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for d in engine.step():
                    tokens.setdefault(d.request_id, []).extend(d.samples[0].token_ids if d.samples else [])
            outs.append(tokens)
        assert outs[0] == outs[1] and all(len(v) == 12 for v in outs[0].values())
    finally:
        use_small_blocks(was)
