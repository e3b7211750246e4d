// CPU pack/unpack: memcpy over coalesced runs, the slice split across threads.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

#include "error.h"
#include "geometry.h"
#include "kvbridge/pack.h"
#include "runs.h"
#include "thread_pool.h"

namespace kvb {
namespace {

constexpr uint64_t kMinBytesPerThread = uint64_t{1} << 20;
constexpr int kMaxAutoThreads = 8;
constexpr int kMaxThreads = 64;
constexpr std::ptrdiff_t kPrefetchRuns = 4;  // runs ahead
constexpr int64_t kPrefetchBytes = 2048;     // of each run's head

struct Job {
  Geometry g;
  std::vector<TokenRun> runs;
  void* const* layer_base;
  uint8_t* wire;         // the byte at wire position `wire_offset`
  uint64_t wire_offset;  // first wire position of the call's slice
};

template <bool kPack>
inline void move(uint8_t* wire, uint8_t* cache, size_t n) {
  if (kPack) {
    std::memcpy(wire, cache, n);
  } else {
    std::memcpy(cache, wire, n);
  }
}

// All heads of one token whose heads are not adjacent (HND): a constant-size
// memcpy per head lets the compiler emit plain vector moves.
template <bool kPack, int64_t kHeadBytes>
inline void move_heads_fixed(uint8_t* wire, uint8_t* tok, int64_t heads, int64_t stride_head) {
  for (int64_t h = 0; h < heads; ++h) {
    move<kPack>(wire + h * kHeadBytes, tok + h * stride_head, kHeadBytes);
  }
}

template <bool kPack>
inline void move_heads(uint8_t* wire, uint8_t* tok, const Geometry& g) {
  switch (g.head_bytes) {
    case 64:
      return move_heads_fixed<kPack, 64>(wire, tok, g.num_heads, g.stride_head);
    case 128:
      return move_heads_fixed<kPack, 128>(wire, tok, g.num_heads, g.stride_head);
    case 256:
      return move_heads_fixed<kPack, 256>(wire, tok, g.num_heads, g.stride_head);
    case 512:
      return move_heads_fixed<kPack, 512>(wire, tok, g.num_heads, g.stride_head);
    default:
      for (int64_t h = 0; h < g.num_heads; ++h) {
        move<kPack>(wire + h * g.head_bytes, tok + h * g.stride_head,
                    static_cast<size_t>(g.head_bytes));
      }
  }
}

// Part of one token: block-relative wire bytes [a, b) of the token at x0.
template <bool kPack>
void move_token_part(const Job& j, uint64_t blk_pos, uint8_t* tok, uint64_t x0, uint64_t a,
                     uint64_t b) {
  const Geometry& g = j.g;
  auto wp = [&](uint64_t x) { return j.wire + (blk_pos + x - j.wire_offset); };
  if (g.heads_contiguous) {
    move<kPack>(wp(a), tok + (a - x0), b - a);
    return;
  }
  const uint64_t hb = static_cast<uint64_t>(g.head_bytes);
  for (uint64_t h = (a - x0) / hb; h < static_cast<uint64_t>(g.num_heads); ++h) {
    const uint64_t h0 = x0 + h * hb;
    if (h0 >= b) break;
    const uint64_t s = std::max(h0, a), e = std::min(h0 + hb, b);
    move<kPack>(wp(s), tok + h * g.stride_head + (s - h0), e - s);
  }
}

// One token run of (layer, component) block at wire position blk_pos,
// clipped to the block-relative wire bytes [blo, bhi).
template <bool kPack>
void move_run(const Job& j, const TokenRun& run, uint8_t* comp_base, uint64_t blk_pos, uint64_t blo,
              uint64_t bhi) {
  const Geometry& g = j.g;
  const uint64_t tokb = static_cast<uint64_t>(g.token_bytes);
  const uint64_t w0 = std::max(static_cast<uint64_t>(run.t0) * tokb, blo);
  const uint64_t w1 = std::min(static_cast<uint64_t>(run.t1) * tokb, bhi);
  if (w0 >= w1) return;
  uint8_t* first = comp_base + run.off;  // token run.t0
  auto wp = [&](uint64_t x) { return j.wire + (blk_pos + x - j.wire_offset); };
  if (g.heads_contiguous && g.stride_token == g.token_bytes) {
    move<kPack>(wp(w0), first + (w0 - static_cast<uint64_t>(run.t0) * tokb), w1 - w0);
    return;
  }
  const uint64_t t_begin = w0 / tokb, t_end = (w1 + tokb - 1) / tokb;
  for (uint64_t t = t_begin; t < t_end; ++t) {
    const uint64_t x0 = t * tokb;
    uint8_t* tok = first + static_cast<int64_t>(t - run.t0) * g.stride_token;
    if (x0 >= w0 && x0 + tokb <= w1) {
      if (g.heads_contiguous) {
        move<kPack>(wp(x0), tok, tokb);
      } else {
        move_heads<kPack>(wp(x0), tok, g);
      }
    } else {
      move_token_part<kPack>(j, blk_pos, tok, x0, std::max(x0, w0), std::min(x0 + tokb, w1));
    }
  }
}

// Runs start at random pages, where the hardware prefetcher cannot follow:
// touch the head of a run a few runs ahead (read for pack, write for unpack).
template <bool kPack>
inline void prefetch_run(const Job& j, const TokenRun& run, const uint8_t* comp_base) {
  const uint8_t* p = comp_base + run.off;
  const int64_t n = std::min<int64_t>((run.t1 - run.t0) * j.g.stride_token, kPrefetchBytes);
  for (int64_t x = 0; x < n; x += 64) __builtin_prefetch(p + x, kPack ? 0 : 1, 3);
}

// Wire positions [lo, hi) (absolute, inside the call's slice).
template <bool kPack>
void move_slice(const Job& j, uint64_t lo, uint64_t hi) {
  const Geometry& g = j.g;
  const uint64_t blkb = static_cast<uint64_t>(g.block_bytes);
  const uint64_t tokb = static_cast<uint64_t>(g.token_bytes);
  uint64_t blk = lo / blkb;
  while (lo < hi) {
    const uint64_t blk_pos = blk * blkb;
    const int64_t layer = g.layer_start + static_cast<int64_t>(blk) / g.num_components;
    const int64_t comp = static_cast<int64_t>(blk) % g.num_components;
    uint8_t* comp_base = static_cast<uint8_t*>(j.layer_base[layer]) + comp * g.stride_component;
    const uint64_t blo = lo - blk_pos;
    const uint64_t bhi = std::min(hi - blk_pos, blkb);
    const int64_t t_first = static_cast<int64_t>(blo / tokb);
    auto it = std::upper_bound(j.runs.begin(), j.runs.end(), t_first,
                               [](int64_t t, const TokenRun& r) { return t < r.t1; });
    for (; it != j.runs.end() && static_cast<uint64_t>(it->t0) * tokb < bhi; ++it) {
      if (j.runs.end() - it > kPrefetchRuns) prefetch_run<kPack>(j, it[kPrefetchRuns], comp_base);
      move_run<kPack>(j, *it, comp_base, blk_pos, blo, bhi);
    }
    lo = blk_pos + bhi;
    ++blk;
  }
}

int thread_count(const kvb_exec* exec, uint64_t nbytes) {
  int want = exec != nullptr ? exec->num_threads : 0;
  if (want == 0) {
    const unsigned hw = std::thread::hardware_concurrency();
    want = std::min<int>(hw == 0 ? 1 : static_cast<int>(hw), kMaxAutoThreads);
  }
  want = std::min(want, kMaxThreads);
  const uint64_t by_size = std::max<uint64_t>(1, nbytes / kMinBytesPerThread);
  return static_cast<int>(std::min<uint64_t>(static_cast<uint64_t>(want), by_size));
}

template <bool kPack>
int run_cpu(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset, void* wire,
            uint64_t nbytes, const kvb_exec* exec) {
  if (exec != nullptr && exec->num_threads < 0) {
    return failf(KVB_ERR_INVALID_ARG, "num_threads must be >= 0, got %d", exec->num_threads);
  }
  Job j;
  int rc = validate(cache, range, wire_offset, nbytes, wire, true,
                    kPack ? Access::kRead : Access::kWrite, &j.g);
  if (rc != KVB_OK) return rc;
  if (cache->device != -1) {
    return failf(KVB_ERR_INVALID_ARG,
                 "the CPU path needs a host-memory cache; this one is on CUDA device %d",
                 cache->device);
  }
  if (nbytes == 0) return KVB_OK;
  int64_t t_lo = 0, t_hi = 0;
  slice_tokens(j.g, wire_offset, wire_offset + nbytes, &t_lo, &t_hi);
  j.runs = token_runs(j.g, range->block_table, t_lo, t_hi);
  j.layer_base = cache->layer_base;
  j.wire = static_cast<uint8_t*>(wire);
  j.wire_offset = wire_offset;
  const int n = thread_count(exec, nbytes);
  const uint64_t lo = wire_offset, hi = wire_offset + nbytes;
  if (n <= 1) {
    move_slice<kPack>(j, lo, hi);
    return KVB_OK;
  }
  // Equal parts, cut on 64-byte wire positions so no two threads share a line.
  const uint64_t step = (nbytes / static_cast<uint64_t>(n) + 63) & ~uint64_t{63};
  parallel_for(n, [&](int i) {
    const uint64_t a = std::min(hi, lo + static_cast<uint64_t>(i) * step);
    const uint64_t b = i == n - 1 ? hi : std::min(hi, a + step);
    if (a < b) move_slice<kPack>(j, a, b);
  });
  return KVB_OK;
}

}  // namespace
}  // namespace kvb

extern "C" int kvb_pack_cpu(const kvb_cache_desc* cache, const kvb_range* range,
                            uint64_t wire_offset, void* dst, uint64_t nbytes,
                            const kvb_exec* exec) {
  KVB_GUARD_BEGIN
  return kvb::run_cpu<true>(cache, range, wire_offset, dst, nbytes, exec);
  KVB_GUARD_END
}

extern "C" int kvb_unpack_cpu(const kvb_cache_desc* cache, const kvb_range* range,
                              uint64_t wire_offset, const void* src, uint64_t nbytes,
                              const kvb_exec* exec) {
  KVB_GUARD_BEGIN
  return kvb::run_cpu<false>(cache, range, wire_offset, const_cast<void*>(src), nbytes, exec);
  KVB_GUARD_END
}
