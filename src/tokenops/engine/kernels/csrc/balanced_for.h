// A parallel loop over items that cost the same on paper but not always in practice: on a VM a vCPU
// the host slows for a while (a busy sibling, another guest) makes a static split's other threads spin
// at the region's end barrier. Here each thread owns a contiguous share of the items, as a static split
// gives it (so what it touches stays in its own caches), takes them from the share's front, and once its
// share is done takes the others' remaining items from their backs. Items must be independent; which
// thread runs one does not change what it computes.
#pragma once

#include <ATen/Parallel.h>
#include <atomic>
#include <cstdint>
#include <memory>

namespace tokenops {

// f(share, j) for every share in [0, shares) and j in [0, len(share)), on up to `shares` threads
// (len(share) < 2^31). All of them run on the calling thread, in order, where at::parallel_for would
// not start a region (one share, one thread, or already inside a region).
template <class Len, class F>
void balanced_for(int64_t shares, Len&& len, F&& f) {
  if (shares <= 0) return;
  if (shares == 1 || at::get_num_threads() == 1 || at::in_parallel_region()) {
    for (int64_t s = 0; s < shares; ++s)
      for (int64_t j = 0, n = len(s); j < n; ++j) f(s, j);
    return;
  }
  // per share: the next item from the front (low 32 bits) and one past the last left (high 32 bits)
  // in one word, so an owner and a thief never take the same item; a cache line each, so owners taking
  // from their own shares do not pull the line back and forth
  struct alignas(64) Ends {
    std::atomic<uint64_t> v;
  };
  std::unique_ptr<Ends[]> ends(new Ends[shares]);
  for (int64_t s = 0; s < shares; ++s) ends[s].v.store(static_cast<uint64_t>(len(s)) << 32, std::memory_order_relaxed);
  auto take = [&](int64_t s, bool front, int64_t& j) {
    uint64_t v = ends[s].v.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t lo = v & 0xffffffffu, hi = v >> 32;
      if (lo >= hi) return false;
      const uint64_t next = front ? ((hi << 32) | (lo + 1)) : (((hi - 1) << 32) | lo);
      if (ends[s].v.compare_exchange_weak(v, next, std::memory_order_relaxed)) {
        j = static_cast<int64_t>(front ? lo : hi - 1);
        return true;
      }
    }
  };
  at::parallel_for(0, shares, 1, [&](int64_t s0, int64_t s1) {
    int64_t j;
    for (int64_t s = s0; s < s1; ++s)
      while (take(s, true, j)) f(s, j);
    for (int64_t k = 1; k < shares; ++k) {  // then the other shares' tails, nearest share first
      const int64_t s = (s0 + k) % shares;
      while (take(s, false, j)) f(s, j);
    }
  });
}

}  // namespace tokenops
