// A decode step's crew: the OpenMP team of one region that lasts the whole DecodeStack call, in
// which the engine thread (the leader) runs the layers and the other threads wait, spinning, for
// the kernels' shares it hands them.
//
// Why: at one token a step, a small model's step is some 120 short kernels (four matrices a
// layer, attention) with serial work between them (norms, RoPE, the KV write, activation rows).
// Each kernel opened a region of its own: the team's wake-up and join cost 1-3 us a region here,
// and the other core idled through the leader's serial work (SmolLM2 Q4_0 on a Zen 4: the second
// thread idle 56 % of a step, bench/RESULTS.md session 32). Inside one region a handoff is a
// generation counter and a countdown, a few hundred nanoseconds.
//
// Used while the team's cores sit close (DecodeStack's probe, handoff_ns; decode_stack.cpp says
// why), or when $PAGEWIRE_DECODE_CREW=1 forces it. Only the code that asks runs on the crew:
// team_for (team_kernel.h, the x8 kernels' loops) and team_region (paged attention's units,
// linear_parts_region) pass their shares to it; any other OpenMP region opened inside runs on the
// leader alone (nested regions are teams of one), with the same results. So DecodeStack runs on a
// crew only when every layer's kernels ask (DecodeStack::crew_ready).
//
// Which thread computes a share never changes a float: the kernels' outputs are per group of rows
// or per unit, whole on one thread, as with their own regions (batch invariance).
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <limits>
#include <mutex>

#include "x86_target.h"

namespace pagewire::cpu {

class Crew;
// The crew this thread leads, while its DecodeStack call runs on one (nullptr otherwise, and while
// the leader runs its own share of a job; members never lead, so a kernel share a member runs
// opens nothing and runs where it is).
inline thread_local Crew* t_crew = nullptr;

class Crew {
 public:
  explicit Crew(int size) : size_(size < 1 ? 1 : size) {}
  Crew(const Crew&) = delete;
  Crew& operator=(const Crew&) = delete;

  int size() const { return size_; }
  void resize(int size) { size_ = size < 1 ? 1 : size; }

  // Leader: fn(thread, size()) on every thread of the crew (thread 0 here); returns when every share
  // is done, rethrowing the first exception a member's share raised.
  template <class F>
  void run(const F& fn) {
    if (size_ <= 1) {
      fn(0, 1);
      return;
    }
    ctx_ = &fn;
    call_ = [](const void* c, int t, int n) { (*static_cast<const F*>(c))(t, n); };
    pending_.store(size_ - 1, std::memory_order_relaxed);
    job_.fetch_add(1, std::memory_order_release);  // publishes ctx_ and call_ to the members
    std::exception_ptr mine;
    // The leader's own share opens nothing: a kernel it calls runs whole here (as a nested region
    // would, a team of one), for the crew is busy with this job's other shares.
    t_crew = nullptr;
    try {
      fn(0, size_);
    } catch (...) {
      mine = std::current_exception();
    }
    t_crew = this;
    // The members may still read ctx_ (fn lives in this frame): wait for all, even after a throw.
    while (pending_.load(std::memory_order_acquire) != 0) spin_pause();
    if (mine) std::rethrow_exception(mine);
    if (error_) {
      std::exception_ptr e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

  // Leader: the shortest of `tries` empty jobs, from the post until every member has finished,
  // in nanoseconds: how far apart the crew's cores sit. Two vCPUs of one core complex hand a job
  // over and back in about 0.1-0.3 us; across complexes (another CCD) it took over 1 us, and there
  // a line one core read ahead costs the other more than memory does (bench/RESULTS.md, session 33).
  int64_t handoff_ns(int tries = 3) {
    int64_t best = std::numeric_limits<int64_t>::max();
    for (int i = 0; i < tries; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      run([](int, int) {});
      const auto dt = std::chrono::steady_clock::now() - t0;
      best = std::min<int64_t>(best, std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count());
    }
    return best;
  }

  // What the members read ahead while they wait: byte ranges in the order the leader's kernels
  // will stream them (a step's weight matrices), as (start, bytes); set before the region opens,
  // kept unchanged through it. Only the window the leader opens is read (window()).
  struct Range {
    const char* p;
    int64_t n;
  };
  // offsets: each range's first byte in the ranges laid end to end, then their total (count + 1).
  // The members may read up to `budget` bytes past the start of the range after the one a kernel
  // is streaming (range_started()).
  void set_read_ahead(const Range* ranges, const int64_t* offsets, size_t count, int64_t budget) {
    ranges_ = ranges;
    offsets_ = offsets;
    num_ranges_ = count;
    budget_ = budget;
    started_ = 0;
    window(0, std::min(budget, offsets[count]));
  }
  // Leader: a kernel starts streaming the next range of the plan (the stack's next matrix): the
  // members' window moves to the range after it.
  void range_started() {
    if (num_ranges_ == 0 || started_ >= num_ranges_) return;
    const int64_t from = offsets_[++started_];
    window(from, std::min(from + budget_, offsets_[num_ranges_]));
  }

  // Member `thread` (1 .. size() - 1): runs the leader's jobs until close(); between jobs it reads
  // ahead its share of the window (every (size() - 1)-th chunk) into its L2, from where the
  // lines go to the shared L3 when evicted: the kernels that follow find them in cache, and the
  // memory streams through the leader's serial work instead of idling.
  void serve(int thread) {
    uint64_t seen = 0;
    ReadAhead ahead{*this, thread};
    for (;;) {
      uint64_t job;
      while ((job = job_.load(std::memory_order_acquire)) == seen) {
        if (!ahead.step()) spin_pause();
      }
      seen = job;
      if (closed_.load(std::memory_order_acquire)) return;
      try {
        call_(ctx_, thread, size_);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  // Leader: lets the members leave serve() (call once, after the last run()).
  void close() {
    closed_.store(true, std::memory_order_release);
    job_.fetch_add(1, std::memory_order_release);
  }

 private:
  // A member's read-ahead cursor: chunks of kChunk bytes through the ranges, its own every
  // (members)-th one, never past the window's end and skipping what is before its start.
  static constexpr int64_t kChunk = 4096;
  struct ReadAhead {
    Crew& c;
    int thread;
    size_t r = 0;     // current range
    int64_t pos = 0;  // plan offset of the next chunk this member reads
    bool step() {
      if (c.num_ranges_ == 0) return false;
      const int64_t to = c.ahead_to_.load(std::memory_order_relaxed);
      const int64_t from = c.ahead_from_.load(std::memory_order_relaxed);
      const int members = c.size_ - 1;
      if (pos < from) pos = from / kChunk * kChunk;
      // This member's chunks: index % members == thread - 1.
      const int64_t idx = pos / kChunk;
      pos = (idx + ((thread - 1 - idx) % members + members) % members) * kChunk;
      if (pos >= to) return false;
      while (r + 1 < c.num_ranges_ && c.offsets_[r + 1] <= pos) ++r;
      while (r > 0 && c.offsets_[r] > pos) --r;
      const Range& range = c.ranges_[r];
      const int64_t at = pos - c.offsets_[r];
      const int64_t end = std::min<int64_t>(range.n, at + kChunk);
      for (int64_t o = at; o < end; o += 64) prefetch_line(range.p + o);
      pos += kChunk;
      return true;
    }
  };

  static void prefetch_line(const char* p) {
#ifdef PAGEWIRE_X86_EMULATE
    (void)p;
#else
    _mm_prefetch(p, _MM_HINT_T1);
#endif
  }

  // Members may read ahead the plan's bytes [from, to); what is before `from` is being or has been
  // read by the kernels already.
  void window(int64_t from, int64_t to) {
    ahead_from_.store(from, std::memory_order_relaxed);
    ahead_to_.store(to, std::memory_order_relaxed);
  }

  static void spin_pause() {
#ifdef PAGEWIRE_X86_EMULATE
    std::atomic_signal_fence(std::memory_order_seq_cst);
#else
    _mm_pause();
#endif
  }

  int size_;  // the team's: set by lead_or_serve before the first job
  const void* ctx_ = nullptr;
  void (*call_)(const void*, int, int) = nullptr;
  std::exception_ptr error_;
  std::mutex error_mutex_;
  const Range* ranges_ = nullptr;
  const int64_t* offsets_ = nullptr;
  size_t num_ranges_ = 0;
  size_t started_ = 0;  // ranges the leader's kernels have started (range_started)
  int64_t budget_ = 0;
  alignas(64) std::atomic<int64_t> ahead_from_{0};
  std::atomic<int64_t> ahead_to_{0};
  alignas(64) std::atomic<uint64_t> job_{0};
  alignas(64) std::atomic<int> pending_{0};
  std::atomic<bool> closed_{false};
};

// Runs `body` as the leader of a crew of the calling region's threads: thread 0 leads (body()),
// the others serve until it returns. Call from inside `#pragma omp parallel`, on every thread.
template <class Body>
void lead_or_serve(Crew& crew, const Body& body) {
  if (omp_get_thread_num() != 0) {
    crew.serve(omp_get_thread_num());
    return;
  }
  struct Closer {  // the members are released however body() leaves
    Crew& c;
    ~Closer() {
      t_crew = nullptr;
      c.close();
    }
  } closer{crew};
  // The region's team may be smaller than asked for: the crew is the team there is (set before any
  // job is posted, so the members read it after the job's release).
  crew.resize(omp_get_num_threads());
  t_crew = &crew;
  body();
}

// How far apart a team of `threads` (0: omp_get_max_threads()) sits: a crew's handoff_ns over
// `tries` empty jobs, in its own region (-1 with fewer than two threads, or inside a region). For
// the benches' machine lines: on a KVM guest the vCPUs can move between core complexes, and the
// memory bandwidth and the crew's verdict move with them (bench/RESULTS.md, session 33).
inline int64_t team_handoff_ns(int threads = 0, int tries = 5) {
  const int n = threads > 0 ? threads : omp_get_max_threads();
  if (n < 2 || omp_in_parallel()) return -1;
  Crew crew(n);
  int64_t ns = -1;
#pragma omp parallel num_threads(n)
  lead_or_serve(crew, [&] { ns = crew.size() > 1 ? crew.handoff_ns(tries) : -1; });
  return ns;
}

// A linear kernel of the leader's stack starts on its matrix: the crew's read-ahead moves past it.
inline void crew_range_started() {
  if (Crew* crew = t_crew) crew->range_started();
}

// The threads a kernel can split over: its crew's on a crew's leader, else a region's.
inline int team_size() { return t_crew != nullptr ? t_crew->size() : omp_get_max_threads(); }

// Whether this thread leads a crew now: a share handed to it costs a few hundred nanoseconds, not
// a region's 1-3 us, so work too small for a region of its own can still split (paged attention).
inline bool leading_crew() { return t_crew != nullptr; }

// fn(thread, threads) for every thread of a team: the crew's when this thread leads one, else a
// region of `threads` (1: here, with no team of one to set up).
template <class F>
void team_region(int threads, const F& fn) {
  if (threads <= 1) {
    fn(0, 1);
    return;
  }
  if (Crew* crew = t_crew; crew != nullptr && threads >= crew->size()) {
    crew->run(fn);
    return;
  }
#pragma omp parallel num_threads(threads)
  fn(omp_get_thread_num(), omp_get_num_threads());
}

}  // namespace pagewire::cpu
