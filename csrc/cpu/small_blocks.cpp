// small_blocks: the small-block cache in front of torch's CPU allocator (see small_blocks.h).
#include "small_blocks.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

namespace pagewire::cpu {

namespace {

// Size classes: multiples of 64 bytes up to 256, then four per power of two (a block is at most
// 25 % larger than asked for) up to kMaxBytes. Every class is a multiple of 64, torch's alignment.
constexpr size_t kMaxBytes = size_t{1} << 19;  // 512 KiB: a batch-16 row block of a 1B model's MLP
constexpr int kClasses = 4 + 4 * 11;           // 64..256, then (256, 512] ... (256 KiB, 512 KiB]
constexpr int kMaxPerClass = 32;
constexpr int64_t kMaxCachedBytes = int64_t{8} << 20;

constexpr size_t class_bytes(int c) {
  if (c < 4) return size_t{64} * (c + 1);
  const int e = 8 + (c - 4) / 4, q = 5 + (c - 4) % 4;
  return size_t(q) << (e - 2);
}

// The smallest class holding n (0 < n <= kMaxBytes) bytes.
inline int class_of(size_t n) {
  if (n <= 256) return static_cast<int>((n - 1) / 64);
  const int e = 63 - __builtin_clzll(static_cast<unsigned long long>(n - 1));  // 2^e < n <= 2^(e+1)
  const size_t step = size_t{1} << (e - 2);
  const int q = static_cast<int>((n + step - 1) / step);  // 5..8
  return 4 + (e - 8) * 4 + (q - 5);
}

static_assert(class_bytes(kClasses - 1) == kMaxBytes, "the last class is kMaxBytes");

// A block is kHeader bytes that hold its class, then the tensor's bytes (what the DataPtr points
// at, 64-byte aligned). The class must travel with the block: torch frees raw allocations
// (raw_allocate, e.g. oneDNN's scratch in a bf16 matmul) through one raw_deleter(), which is given
// the data pointer alone. So a block over kMaxBytes carries a header too (kLarge), and comes
// from the previous allocator's raw_allocate (its zero/junk fill and memory reporting kept).
constexpr size_t kHeader = 64;
constexpr int kLarge = -1;  // the class of a block over kMaxBytes: `previous` made it and frees it

struct Cache {
  void* slots[kClasses][kMaxPerClass];
  int count[kClasses] = {};
  int64_t bytes = 0;

  // Frees blocks, the largest classes first, until at most `keep` bytes stay cached. A burst of
  // other sizes (a model load, a long prefill) would otherwise fill the bound for good and leave
  // no room for the classes a decode step uses.
  void evict(int64_t keep) {
    for (int c = kClasses - 1; c >= 0 && bytes > keep; --c) {
      while (count[c] > 0 && bytes > keep) {
        std::free(static_cast<char*>(slots[c][--count[c]]) - kHeader);
        bytes -= static_cast<int64_t>(class_bytes(c));
      }
    }
  }

  void release_all() { evict(0); }
};

// The thread's cache, made on first use. `dead` (trivially destructible, so still readable while
// the thread exits) says the cache is gone: a block freed after that goes to the C library.
thread_local bool dead = false;
struct Holder {
  Cache* cache = nullptr;
  ~Holder() {
    if (cache != nullptr) {
      cache->release_all();
      delete cache;
    }
    dead = true;
  }
};
thread_local Holder holder;

inline Cache* thread_cache() {
  if (dead) return nullptr;
  if (holder.cache == nullptr) holder.cache = new Cache();
  return holder.cache;
}

std::atomic<int64_t> hits{0}, misses{0};

inline int class_of_block(void* p) { return *reinterpret_cast<const int*>(static_cast<char*>(p) - kHeader); }

c10::Allocator* previous = nullptr;  // torch's allocator before this one: larger blocks come from it

void release(void* p) {
  if (p == nullptr) return;
  const int c = class_of_block(p);
  if (c == kLarge) {
    previous->raw_deallocate(static_cast<char*>(p) - kHeader);
    return;
  }
  const int64_t size = static_cast<int64_t>(class_bytes(c));
  Cache* cache = thread_cache();
  if (cache == nullptr || cache->count[c] == kMaxPerClass) {
    std::free(static_cast<char*>(p) - kHeader);
    return;
  }
  if (cache->bytes + size > kMaxCachedBytes) cache->evict(kMaxCachedBytes - size);
  cache->slots[c][cache->count[c]++] = p;
  cache->bytes += size;
}

struct SmallBlockAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
    if (n > kMaxBytes) {
      char* base = static_cast<char*>(previous->raw_allocate(kHeader + n));
      *reinterpret_cast<int*>(base) = kLarge;
      return {base + kHeader, base + kHeader, &release, c10::Device(c10::DeviceType::CPU)};
    }
    const int c = class_of(n);
    Cache* cache = thread_cache();
    void* p = nullptr;
    if (cache != nullptr && cache->count[c] > 0) {
      p = cache->slots[c][--cache->count[c]];
      cache->bytes -= static_cast<int64_t>(class_bytes(c));
      hits.fetch_add(1, std::memory_order_relaxed);
    } else {
      char* base = static_cast<char*>(std::aligned_alloc(64, kHeader + class_bytes(c)));
      TORCH_CHECK(base != nullptr, "small_blocks: out of memory allocating ", class_bytes(c), " bytes");
      *reinterpret_cast<int*>(base) = c;
      p = base + kHeader;
      misses.fetch_add(1, std::memory_order_relaxed);
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  // What torch frees raw_allocate's blocks through: every block of this allocator has its header.
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

SmallBlockAllocator& the_allocator() {
  static SmallBlockAllocator* a = new SmallBlockAllocator();  // never destroyed: blocks may outlive exit
  return *a;
}

}  // namespace

void set_small_blocks(bool on) {
  SmallBlockAllocator& a = the_allocator();
  c10::Allocator* current = c10::GetCPUAllocator();
  if (on && current != &a) {
    TORCH_CHECK(current->raw_deleter() != nullptr,
                "small_blocks: torch's CPU allocator has no raw deleter to free large blocks through");
    previous = current;
    c10::SetCPUAllocator(&a, /*priority=*/0);
    TORCH_CHECK(c10::GetCPUAllocator() == &a,
                "small_blocks: torch kept its CPU allocator (another was installed with a higher priority)");
  } else if (!on && current == &a) {
    c10::SetCPUAllocator(previous, /*priority=*/0);
  }
}

SmallBlockStats small_block_stats() {
  SmallBlockStats s;
  s.enabled = c10::GetCPUAllocator() == &the_allocator();
  s.hits = hits.load(std::memory_order_relaxed);
  s.misses = misses.load(std::memory_order_relaxed);
  const Cache* cache = dead ? nullptr : holder.cache;
  s.cached_bytes = cache != nullptr ? cache->bytes : 0;
  return s;
}

void release_small_blocks() {
  if (!dead && holder.cache != nullptr) holder.cache->release_all();
}

}  // namespace pagewire::cpu
