"""Type stub for `server._C`, the pagewire native extension (built from csrc/).

Importing the module also registers the tensor ops `torch.ops.pagewire.*` (write_kv_cache,
paged_attention (with logit soft-capping and attention sinks), copy_blocks, linear, the fused layer ops (silu_and_mul,
gelu_tanh_and_mul, decode_layer), the mixture-of-experts layer's moe_experts, the Q8_0 and 4-bit (Q4_0/Q4_1/Q4_K) quantised-weight
ops, and speculative
decoding's ngram_propose and rejection_sample); their typed wrappers are in `server.kernels.ops`. The only
Python-visible classes are the KV block allocator, which the engine reaches solely through
`server.engine.kv_cache_manager.KVCacheManager`, and DecodeStack (server.kernels.ops.decode_stack).
`fast` holds the per-step CPU ops as plain calls (csrc/fast_calls.cpp).

Errors: C++ std::invalid_argument surfaces as ValueError, std::runtime_error as RuntimeError.
"""
from typing import Any, Optional, Sequence, TypedDict

import torch

class AllocatorStats(TypedDict):
    num_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    prefix_hit_tokens: int
    prefix_miss_tokens: int
    evictions: int

class BlockAllocator:
    """Paged KV block allocator with refcounted sharing, copy-on-write and prefix caching."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, hash_bits: int = 64,
        group_windows: Sequence[int] = (0,),
    ) -> None:
        """group_windows: one entry per KV group, 0 = full attention, W > 0 = a sliding window of W
        tokens whose blocks go back to the pool once they leave it."""
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def group_windows(self) -> list[int]: ...
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: truly free + evictable cached."""
    def has_sequence(self, seq_id: int) -> bool: ...
    def match_prefix(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Attach the longest cached chain of full blocks matching token_ids; returns tokens covered."""
    def allocate_slots(
        self, seq_id: int, num_computed_tokens: int, num_new_tokens: int
    ) -> list[tuple[int, int]] | None:
        """Grow the block table; returns copy-on-write (src, dst) copies, or None if out of blocks."""
    def blocks_needed(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Net blocks allocate_slots would take now (new + copy-on-write, less what windows give back; may be < 0)."""
    def cache_full_blocks(self, seq_id: int, token_ids: Sequence[int], start: int = 0) -> None:
        """Register newly full blocks; token_ids are the sequence's tokens at [start, start + len)."""
    def registered_tokens(self, seq_id: int) -> int: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep ceil(num_tokens / block_size) blocks per group; ValueError below a released window."""
    def free(self, seq_id: int) -> None: ...
    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        """Group `group`'s table; -1 where a sliding window released the block."""
    def fill_block_tables(self, seq_ids: Sequence[int], out: Any) -> int:
        """Every group's tables into a writable int32 buffer out[g, row, :]; returns the longest table."""
    def fill_decode_inputs(self, seq_ids: Sequence[int], tokens: Sequence[int], starts: Sequence[int],
                           prompt_lens: Sequence[int], i64: Any, i32: Any, tables: Any) -> tuple[int, int]:
        """One decode step's inputs into persistent buffers; returns (longest table, max seq_len or -1)."""
    def refcount(self, block_id: int) -> int: ...
    def chain_link(self, seq_id: int, index: int) -> tuple[int, int]:
        """Group 0's registered chain link `index`: (representative block, generation)."""
    def link_valid(self, block: int, gen: int) -> bool:
        """Whether `block` is still registered with generation `gen`."""
    def stats(self) -> AllocatorStats: ...
    def reset_prefix_cache(self) -> None: ...
    def check_invariants(self) -> None: ...

def cpu_features() -> dict[str, bool | str | int]:
    """CPUID features as detected at load (vendor, brand, family, avx2, fma, avx512bf16, amx_bf16, ...)."""
    ...

def set_batch_invariant(on: bool) -> None:
    """Batch-invariant kernel choices on the calling thread (server.kernels.batch_invariant.mode)."""
    ...

def set_amx_allowed(on: bool) -> None:
    """Whether the linear ops may use the AMX kernels on the calling thread (the autotune's choice)."""
    ...

def amx_allowed() -> bool:
    """Whether the linear ops may use the AMX kernels on the calling thread."""
    ...

def batch_invariant() -> bool:
    """Whether the C++ ops make batch-invariant kernel choices on the calling thread."""
    ...

def cpu_isa() -> str:
    """The CPU kernel family in use: "amx", "avx512bf16", "avx512", "avx2" or "portable" ($PAGEWIRE_CPU_ISA may lower it)."""
    ...

def detected_cpu_isa() -> str:
    """The best CPU kernel family this CPU supports, ignoring $PAGEWIRE_CPU_ISA."""
    ...

def core_handoff_ns(threads: int = 0, tries: int = 5) -> int:
    """How far apart a team's cores sit: the shortest empty handoff to every other thread and back, in ns (-1: one thread)."""
    ...

def set_small_blocks(on: bool) -> None:
    """Install (True) or remove (False) the small-block cache as torch's CPU allocator (cpu/small_blocks.h)."""
    ...

def small_block_stats() -> dict[str, Any]:
    """The small-block cache: enabled, hits and misses (all threads), cached_bytes (this thread)."""
    ...

def release_small_blocks() -> None:
    """Return the calling thread's cached small blocks to the C library."""
    ...

class DecodeStack:
    """Every decoder layer of a small CPU step in one call (csrc/cpu/decode_stack.cpp; made by
    server.kernels.ops.decode_stack). add_layer takes decode_layer's static arguments in its order
    (the RoPE table index, -1 for none, where decode_layer takes positions), set_moe makes the last
    layer sparse with moe_decode's arguments after x, and run(hidden, delta, rows per RoPE table,
    slot mappings, block tables (one pair, or one per layer), seq_lens, query_start_loc,
    max_query_len, max_seq_len) returns (hidden, the last layer's output or None). A one-token
    step runs on a crew (csrc/cpu/crew.h: one region for the whole stack, the kernels' shares
    handed to the waiting threads, which read the next weights ahead meanwhile) where every layer's
    kernels take one, while a probe at each crew step finds the threads' cores close (a handoff
    under 400 ns; far apart, the next 64 steps open regions: the crew lost there, bench/RESULTS.md
    session 33); $PAGEWIRE_DECODE_CREW=1 forces it and 0 turns it off. After set_final_norm(weight,
    eps), run() also applies the model's final RMSNorm (add_rms_norm with the last layer's output)
    and returns (the normed rows, None). crew_runs() counts those
    calls, crew_handoff_ns() gives the last probe. A pybind11 class, not a TorchScript one: a
    TorchScript method call cost 30 us right after a step's weight stream (session 34)."""

    def __init__(self) -> None: ...
    def add_layer(self, *args: Any) -> int: ...
    def set_moe(self, *args: Any) -> None: ...
    def set_final_norm(self, weight: torch.Tensor, eps: float) -> None: ...
    def size(self) -> int: ...
    def crew_runs(self) -> int: ...
    def crew_handoff_ns(self) -> int: ...
    def run(self, hidden: torch.Tensor, delta: Optional[torch.Tensor], rows: list[torch.Tensor],
            slot_mappings: list[torch.Tensor], block_tables: list[torch.Tensor], seq_lens: torch.Tensor,
            query_start_loc: torch.Tensor, max_query_len: int,
            max_seq_len: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]: ...

class _Fast:
    """server._C.fast: torch.ops.pagewire ops' CPU implementations as plain pybind11 calls (the
    same code and checks, without the dispatcher), for CPU tensors on a decode step's path."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...
    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor: ...
    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor: ...
    def argmax_list(self, x: torch.Tensor) -> list[int]: ...
    def widen_rows(self, x: torch.Tensor) -> torch.Tensor: ...
    def embedding_gguf(self, ids: torch.Tensor, weight: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor: ...
    def linear_q4(self, x: torch.Tensor, weight: torch.Tensor, qtype: str, bias: Optional[torch.Tensor]) -> torch.Tensor: ...
    def linear_q4_rows(self, x: torch.Tensor, weight: torch.Tensor, qtype: str,
                       bias: Optional[torch.Tensor]) -> torch.Tensor: ...
    def linear_q8_0_rows(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         interleaved: bool) -> torch.Tensor: ...
    def linear_q8_0(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    interleaved: bool) -> torch.Tensor: ...
    def linear_bf16x8(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor: ...
    def linear_bf16z(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor: ...

fast: _Fast
