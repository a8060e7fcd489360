// small_blocks: a cache of small CPU tensor blocks in front of torch's CPU allocator.
//
// A decode step allocates the same few hundred small tensors every time (a layer's norm output,
// qkv, attention output, gate/up, ... of a few KiB each), and frees them again. torch's default
// CPU allocator takes each from glibc's posix_memalign(64), which skips malloc's per-thread cache
// and goes through its bins (unlink, consolidate): about 3.6 % of the engine thread's time in a
// SmolLM2 batch-1 step (bench/RESULTS.md, session 33). Here a freed block of up to kMaxBytes goes
// onto its size class's list on the freeing thread, and the next allocation of that class on
// that thread takes it back without entering malloc.
//
// Bounded: at most kMaxPerClass blocks per class and kMaxCachedBytes per thread stay cached; a
// block freed past the first goes back to the C library, and past the second makes room by
// returning the largest classes' blocks first. Larger blocks come from the allocator that was
// installed before (torch's default), behind the same 64-byte header that names every block's
// class (torch frees raw allocations through a single deleter). Any thread may free a block
// another allocated (a block is only its class's size), and a block freed after its thread's
// cache is gone is returned to the C library.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pagewire::cpu {

struct SmallBlockStats {
  bool enabled = false;
  int64_t hits = 0;          // allocations served from a thread's cache (every thread, since start)
  int64_t misses = 0;        // small allocations that went to the C library
  int64_t cached_bytes = 0;  // bytes cached on the calling thread now
};

// Installs (on) or removes (off) the cache as torch's CPU allocator. Blocks handed out while it was
// on are still freed through it after it is turned off. Not thread-safe against itself: call from
// one thread (engine start-up).
void set_small_blocks(bool on);
SmallBlockStats small_block_stats();
// The calling thread's cached blocks back to the C library (tests; a thread about to idle).
void release_small_blocks();

}  // namespace pagewire::cpu
