// CPU pack/unpack: memcpy over coalesced runs, the slice split across threads;
// with a checksum, one thread copies and hashes window by window.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#include "error.h"
#include "geometry.h"
#include "handles.h"
#include "kvbridge/pack.h"
#include "thread_pool.h"
#include "xxh3.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#define KVB_HAVE_SSE2 1
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVB_HAVE_AVX2_TARGET 1
#endif

namespace kvb {
namespace {

constexpr uint64_t kMinBytesPerThread = uint64_t{1} << 20;
constexpr uint64_t kPartsPerThread = 8;  // move_parallel's parts
constexpr int kMaxAutoThreads = 8;
constexpr int kMaxThreads = 64;
constexpr std::ptrdiff_t kPrefetchRuns = 4;  // runs ahead
constexpr size_t kStreamPrefetchRuns = 2;    // runs ahead, streamed packed K|V
constexpr int64_t kPrefetchBytes = 2048;     // of each run's head
constexpr uint64_t kHashWindow = uint64_t{32} << 10;
constexpr uint64_t kPairHashBytes = uint64_t{4} << 20;  // a layer's K and V, hashed from cache
// Slices this large are written with streaming stores: they outgrow the caches.
constexpr uint64_t kStreamBytes = uint64_t{8} << 20;
// A checksummed unpack this large writes the cache with streaming stores
// where it is copied by the hashing loop (move_slice_hashed).
constexpr uint64_t kStreamHashedBytes = uint64_t{1} << 20;

struct Job {
  const CacheInfo* c;
  const PlanInfo* p;
  uint8_t* wire;         // the byte at wire position `wire_offset`
  uint64_t wire_offset;  // first wire position of the call's slice
  bool paired = false;   // components_paired()
};

#ifdef KVB_HAVE_AVX2_TARGET
// 32-byte streaming stores where the CPU has AVX2 (chosen at run time: the
// core is built for baseline x86-64).  Out of line, so for long copies only.
constexpr size_t kAvx2CallBytes = 1024;

__attribute__((target("avx2"))) void copy_nt_avx2(uint8_t* dst, const uint8_t* src, size_t n) {
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  for (; i + 32 <= n; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  }
  for (; i + 16 <= n; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
  }
  if (i < n) std::memcpy(dst + i, src + i, n - i);
}
bool cpu_has_avx2() {
  __builtin_cpu_init();  // may run before the runtime's own initialisation
  return __builtin_cpu_supports("avx2") != 0;
}
const bool kHaveAvx2 = cpu_has_avx2();
#endif

// A copy whose destination is not read back soon: streaming stores (no read
// for ownership, no cache pollution) where the destination is aligned, as
// memcpy itself does for copies larger than the caches.
inline void copy_nt(uint8_t* dst, const uint8_t* src, size_t n) {
#ifdef KVB_HAVE_SSE2
#ifdef KVB_HAVE_AVX2_TARGET
  if (n >= kAvx2CallBytes && kHaveAvx2 && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    copy_nt_avx2(dst, src, n);
    return;
  }
#endif
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    for (; i + 16 <= n; i += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    }
    if (i < n) std::memcpy(dst + i, src + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// Orders this thread's streaming stores before what follows.
inline void fence_nt() {
#ifdef KVB_HAVE_SSE2
  _mm_sfence();
#endif
}

template <bool kPack, bool kNt>
inline void move(uint8_t* wire, uint8_t* cache, size_t n) {
  uint8_t* dst = kPack ? wire : cache;
  const uint8_t* src = kPack ? cache : wire;
  if (kNt) {
    copy_nt(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

// All heads of one token whose heads are not adjacent (HND): a constant-size
// memcpy per head lets the compiler emit plain vector moves.
template <bool kPack, bool kNt, int64_t kHeadBytes>
inline void move_heads_fixed(uint8_t* wire, uint8_t* tok, int64_t heads, int64_t stride_head) {
  for (int64_t h = 0; h < heads; ++h) {
    move<kPack, kNt>(wire + h * kHeadBytes, tok + h * stride_head, kHeadBytes);
  }
}

template <bool kPack, bool kNt>
inline void move_heads(uint8_t* wire, uint8_t* tok, const Geometry& g, int64_t stride_head) {
  switch (g.head_bytes) {
    case 64:
      return move_heads_fixed<kPack, kNt, 64>(wire, tok, g.num_heads, stride_head);
    case 128:
      return move_heads_fixed<kPack, kNt, 128>(wire, tok, g.num_heads, stride_head);
    case 256:
      return move_heads_fixed<kPack, kNt, 256>(wire, tok, g.num_heads, stride_head);
    case 512:
      return move_heads_fixed<kPack, kNt, 512>(wire, tok, g.num_heads, stride_head);
    default:
      for (int64_t h = 0; h < g.num_heads; ++h) {
        move<kPack, kNt>(wire + h * g.head_bytes, tok + h * stride_head,
                         static_cast<size_t>(g.head_bytes));
      }
  }
}

#ifdef KVB_HAVE_SSE2
// An 8 x 8 tile of 2-byte elements, transposed: row r of `src` (8 elements at
// src + r * src_stride) becomes column r of `dst` (rows dst_stride apart).
inline void transpose8x8_u16(uint8_t* dst, int64_t dst_stride, const uint8_t* src,
                             int64_t src_stride) {
  __m128i a[8], t[8];
  for (int r = 0; r < 8; ++r) {
    a[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + r * src_stride));
  }
  for (int r = 0; r < 4; ++r) {
    t[2 * r] = _mm_unpacklo_epi16(a[2 * r], a[2 * r + 1]);
    t[2 * r + 1] = _mm_unpackhi_epi16(a[2 * r], a[2 * r + 1]);
  }
  const __m128i u[8] = {_mm_unpacklo_epi32(t[0], t[2]), _mm_unpackhi_epi32(t[0], t[2]),
                        _mm_unpacklo_epi32(t[1], t[3]), _mm_unpackhi_epi32(t[1], t[3]),
                        _mm_unpacklo_epi32(t[4], t[6]), _mm_unpackhi_epi32(t[4], t[6]),
                        _mm_unpacklo_epi32(t[5], t[7]), _mm_unpackhi_epi32(t[5], t[7])};
  for (int c = 0; c < 4; ++c) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * c * dst_stride),
                     _mm_unpacklo_epi64(u[c], u[c + 4]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * c + 1) * dst_stride),
                     _mm_unpackhi_epi64(u[c], u[c + 4]));
  }
}

// move_elems_typed for 2-byte elements whose tokens are adjacent (vLLM's CPU
// backend stores each block's K as [head_size][block_size]): 8 x 8 tiles of
// (element, token) transposed in registers, the edges element by element.
template <bool kPack>
void move_elems_transposed_u16(uint8_t* wire, uint8_t* tok, int64_t n, const Geometry& g,
                               const CompStrides& s, int64_t elems) {
  const int64_t tokb = g.token_bytes;
  auto one = [&](uint8_t* we, uint8_t* ce) { move<kPack, false>(we, ce, 2); };
  for (int64_t h = 0; h < g.num_heads; ++h) {
    uint8_t* wh = wire + h * g.head_bytes;
    uint8_t* ch = tok + h * s.head;
    int64_t e = 0;
    for (; e + 8 <= elems; e += 8) {
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        uint8_t* w = wh + e * 2 + i * tokb;    // 8 tokens' rows of 8 elements
        uint8_t* c = ch + e * s.elem + i * 2;  // 8 elements' rows of 8 tokens
        if (kPack) {
          transpose8x8_u16(w, tokb, c, s.elem);
        } else {
          transpose8x8_u16(c, s.elem, w, tokb);
        }
      }
      for (; i < n; ++i) {
        for (int64_t r = 0; r < 8; ++r)
          one(wh + (e + r) * 2 + i * tokb, ch + (e + r) * s.elem + i * 2);
      }
    }
    for (; e < elems; ++e) {
      for (int64_t i = 0; i < n; ++i) one(wh + e * 2 + i * tokb, ch + e * s.elem + i * 2);
    }
  }
}
#endif

// Heads whose elements are strided (a K cache stored [head_dim][tokens] within
// each page): `n` whole tokens, the cache's tokens `stride_token` apart.
template <bool kPack, bool kNt, typename T>
void move_elems_typed(uint8_t* wire, uint8_t* tok, int64_t n, const Geometry& g,
                      const CompStrides& s, int64_t elems) {
#ifdef KVB_HAVE_SSE2
  if (sizeof(T) == 2 && s.token == 2)
    return move_elems_transposed_u16<kPack>(wire, tok, n, g, s, elems);
#endif
  const int64_t tokb = g.token_bytes;
  for (int64_t h = 0; h < g.num_heads; ++h) {
    uint8_t* wh = wire + h * g.head_bytes;
    uint8_t* ch = tok + h * s.head;
    for (int64_t e = 0; e < elems; ++e) {
      uint8_t* we = wh + e * static_cast<int64_t>(sizeof(T));
      uint8_t* ce = ch + e * s.elem;
      for (int64_t i = 0; i < n; ++i) {
        move<kPack, false>(we + i * tokb, ce + i * s.token, sizeof(T));  // element stores
      }
    }
  }
}

template <bool kPack, bool kNt>
void move_elems(uint8_t* wire, uint8_t* tok, int64_t n, const Geometry& g, const CompStrides& s,
                int64_t elems) {
  switch (g.elem_bytes) {
    case 1:
      return move_elems_typed<kPack, kNt, uint8_t>(wire, tok, n, g, s, elems);
    case 2:
      return move_elems_typed<kPack, kNt, uint16_t>(wire, tok, n, g, s, elems);
    case 4:
      return move_elems_typed<kPack, kNt, uint32_t>(wire, tok, n, g, s, elems);
    case 8:
      return move_elems_typed<kPack, kNt, uint64_t>(wire, tok, n, g, s, elems);
    default:
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t h = 0; h < g.num_heads; ++h) {
          for (int64_t e = 0; e < elems; ++e) {
            move<kPack, kNt>(wire + i * g.token_bytes + h * g.head_bytes + e * g.elem_bytes,
                             tok + i * s.token + h * s.head + e * s.elem,
                             static_cast<size_t>(g.elem_bytes));
          }
        }
      }
  }
}

// How the bytes of one token of a component sit in the cache.
enum class TokenShape {
  kRun,    // the range's heads of a token are one run of token_bytes
  kHeads,  // each head is one run of head_bytes
  kElems,  // each element is a run of elem_bytes
};

TokenShape token_shape(const Job& j, int comp) {
  const Geometry& g = j.p->g;
  if (!j.c->head_run(comp)) return TokenShape::kElems;
  if (g.num_heads == 1 || j.c->comp[comp].head == g.head_bytes) return TokenShape::kRun;
  return TokenShape::kHeads;
}

// `n` whole tokens: wire rows from `wire`, cache tokens from `tok`.
template <bool kPack, bool kNt>
void move_tokens(const Job& j, int comp, TokenShape shape, uint8_t* wire, uint8_t* tok, int64_t n) {
  const Geometry& g = j.p->g;
  const CompStrides& s = j.c->comp[comp];
  switch (shape) {
    case TokenShape::kRun:
      for (int64_t i = 0; i < n; ++i) {
        move<kPack, kNt>(wire + i * g.token_bytes, tok + i * s.token,
                         static_cast<size_t>(g.token_bytes));
      }
      return;
    case TokenShape::kHeads:
      for (int64_t i = 0; i < n; ++i)
        move_heads<kPack, kNt>(wire + i * g.token_bytes, tok + i * s.token, g, s.head);
      return;
    case TokenShape::kElems:
      move_elems<kPack, kNt>(wire, tok, n, g, s, j.c->elems_per_head());
      return;
  }
}

// Bytes [a, b) of one token (token-relative), the wire byte a at `wire`.
template <bool kPack, bool kNt>
void move_token_part(const Job& j, int comp, uint8_t* wire, uint8_t* tok, uint64_t a, uint64_t b) {
  const Geometry& g = j.p->g;
  const CompStrides& s = j.c->comp[comp];
  const bool head_run = j.c->head_run(comp);
  const uint64_t hb = static_cast<uint64_t>(g.head_bytes);
  const uint64_t eb = static_cast<uint64_t>(g.elem_bytes);
  for (uint64_t x = a; x < b;) {
    const uint64_t h = x / hb, xb = x - h * hb;
    uint8_t* addr = tok + static_cast<int64_t>(h) * s.head;
    uint64_t n;
    if (head_run) {
      n = std::min(b, (h + 1) * hb) - x;
      addr += xb;
    } else {
      const uint64_t e = xb / eb, xe = xb - e * eb;
      n = std::min(b - x, eb - xe);
      addr += static_cast<int64_t>(e) * s.elem + static_cast<int64_t>(xe);
    }
    move<kPack, kNt>(wire + (x - a), addr, n);
    x += n;
  }
}

// One token run of the (layer, component) block at wire position blk_pos,
// clipped to the block-relative wire bytes [blo, bhi).
template <bool kPack, bool kNt>
void move_run(const Job& j, int comp, TokenShape shape, const TokenRun& run, uint8_t* comp_base,
              uint64_t blk_pos, uint64_t blo, uint64_t bhi) {
  const Geometry& g = j.p->g;
  const CompStrides& s = j.c->comp[comp];
  const uint64_t tokb = static_cast<uint64_t>(g.token_bytes);
  const uint64_t r0 = static_cast<uint64_t>(run.t0) * tokb;
  const uint64_t w0 = std::max(r0, blo);
  const uint64_t w1 = std::min(static_cast<uint64_t>(run.t1) * tokb, bhi);
  if (w0 >= w1) return;
  uint8_t* first = comp_base + run.off;  // token run.t0
  auto wp = [&](uint64_t x) { return j.wire + (blk_pos + x - j.wire_offset); };
  auto tp = [&](uint64_t t) { return first + static_cast<int64_t>(t - run.t0) * s.token; };
  if (shape == TokenShape::kRun && s.token == g.token_bytes) {
    move<kPack, kNt>(wp(w0), first + (w0 - r0), w1 - w0);
    return;
  }
  const uint64_t ta = (w0 + tokb - 1) / tokb, tb = w1 / tokb;  // whole tokens [ta, tb)
  if (ta > tb) {                                               // inside one token
    const uint64_t t = w0 / tokb;
    move_token_part<kPack, kNt>(j, comp, wp(w0), tp(t), w0 - t * tokb, w1 - t * tokb);
    return;
  }
  if (w0 < ta * tokb) {
    const uint64_t t = ta - 1;
    move_token_part<kPack, kNt>(j, comp, wp(w0), tp(t), w0 - t * tokb, tokb);
  }
  if (ta < tb) {
    move_tokens<kPack, kNt>(j, comp, shape, wp(ta * tokb), tp(ta), static_cast<int64_t>(tb - ta));
  }
  if (tb * tokb < w1)
    move_token_part<kPack, kNt>(j, comp, wp(tb * tokb), tp(tb), 0, w1 - tb * tokb);
}

// Runs start at random pages, where the hardware prefetcher cannot follow:
// touch the head of a run a few runs ahead (read for pack, write for unpack).
template <bool kPack>
inline void prefetch_run(const TokenRun& run, const CompStrides& s, const uint8_t* comp_base) {
  const uint8_t* p = comp_base + run.off;
  const int64_t n = std::min<int64_t>((run.t1 - run.t0) * s.token, kPrefetchBytes);
  for (int64_t x = 0; x < n; x += 64) __builtin_prefetch(p + x, kPack ? 0 : 1, 3);
}

// Whether the two components sit side by side in each token slot (vLLM's
// packed K|V): same strides, heads in runs.  Then a layer whose K and V blocks
// a slice covers whole is copied in one pass over its pages (move_pair), which
// reads each slot once instead of once per component.
bool components_paired(const Job& j) {
  const CacheInfo& c = *j.c;
  if (c.num_components != 2 || !c.head_run(0) || !c.head_run(1)) return false;
  const CompStrides& a = c.comp[0];
  const CompStrides& b = c.comp[1];
  return a.page == b.page && a.token == b.token && a.head == b.head && a.elem == b.elem;
}

// One token of a paired layer whose heads are not adjacent (vLLM's LBHNC and
// the like): each head's K row, then its V row `v_off` after it, both
// kHeadBytes long.  The size is a constant, so each row is a few vector moves.
template <bool kPack, bool kNt, int64_t kHeadBytes>
inline void move_pair_token(uint8_t* wire_k, uint8_t* wire_v, uint8_t* tok, int64_t heads,
                            int64_t stride_head, int64_t v_off) {
  for (int64_t h = 0; h < heads; ++h) {
    uint8_t* c = tok + h * stride_head;
    move<kPack, kNt>(wire_k + h * kHeadBytes, c, kHeadBytes);
    move<kPack, kNt>(wire_v + h * kHeadBytes, c + v_off, kHeadBytes);
  }
}

// The tokens of a paired layer's runs, each token's rows moved by `tok_fn`
// (wire K row, wire V row, the token in the cache).  Runs start at random
// pages, where the hardware prefetcher cannot follow: with `prefetch_heads`
// > 0 the head of each head's part of a run a few runs ahead is touched first
// (read for pack, write for unpack).  Streaming stores need none (measured:
// touching runs ahead slowed the streamed copy).
template <bool kPack, typename TokenFn>
inline void for_pair_tokens(const std::vector<TokenRun>& runs, uint8_t* k_base,
                            int64_t stride_token, int64_t tokb, uint8_t* wire_k, uint8_t* wire_v,
                            int64_t prefetch_heads, int64_t stride_head, TokenFn tok_fn) {
  const size_t n = runs.size();
  for (size_t r = 0; r < n; ++r) {
    if (prefetch_heads > 0 && r + kPrefetchRuns < n) {
      const TokenRun& ahead = runs[r + kPrefetchRuns];
      const int64_t span = std::min<int64_t>((ahead.t1 - ahead.t0) * stride_token, kPrefetchBytes);
      for (int64_t h = 0; h < prefetch_heads; ++h) {
        const uint8_t* p = k_base + ahead.off + h * stride_head;
        for (int64_t x = 0; x < span; x += 64) __builtin_prefetch(p + x, kPack ? 0 : 1, 3);
      }
    }
    const TokenRun& run = runs[r];
    uint8_t* tok = k_base + run.off;
    for (int64_t t = run.t0; t < run.t1; ++t, tok += stride_token) {
      tok_fn(wire_k + t * tokb, wire_v + t * tokb, tok);
    }
  }
}

#ifdef KVB_HAVE_AVX2_TARGET
// kB bytes (a multiple of 32) with streaming stores: 32-byte moves where
// `dst` is 32-byte aligned (kWide), else 16-byte ones (`dst` 16-byte aligned).
template <int64_t kB, bool kWide>
__attribute__((target("avx2"), always_inline)) inline void row_nt_avx2(uint8_t* dst,
                                                                       const uint8_t* src) {
  if (kWide) {
    for (int64_t i = 0; i < kB; i += 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    }
  } else {
    for (int64_t i = 0; i < kB; i += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    }
  }
}

// move_pair's streaming copy of heads of kB bytes, with AVX2: the rows are
// inlined vector moves (an out-of-line copy per row costs a tenth of the
// bandwidth on rows this short).  The caller checked that every destination
// row is 16-byte aligned, and 32-byte aligned for kWide.
template <bool kPack, int64_t kB, bool kWide>
__attribute__((target("avx2"))) void move_pair_nt_avx2(const TokenRun* runs, size_t num_runs,
                                                       uint8_t* k_base, int64_t stride_token,
                                                       int64_t tokb, uint8_t* wire_k,
                                                       uint8_t* wire_v, int64_t heads,
                                                       int64_t stride_head, int64_t v_off) {
  for (size_t r = 0; r < num_runs; ++r) {
    if (kPack && r + kStreamPrefetchRuns < num_runs) {
      // Start each head of a run a little ahead: the hardware prefetcher
      // follows a head's rows once they begin, but not into a random block.
      const uint8_t* ahead = k_base + runs[r + kStreamPrefetchRuns].off;
      for (int64_t h = 0; h < heads; ++h) {
        __builtin_prefetch(ahead + h * stride_head, 0, 3);
        __builtin_prefetch(ahead + h * stride_head + 64, 0, 3);
      }
    }
    uint8_t* tok = k_base + runs[r].off;
    for (int64_t t = runs[r].t0; t < runs[r].t1; ++t, tok += stride_token) {
      uint8_t* wk = wire_k + t * tokb;
      uint8_t* wv = wire_v + t * tokb;
      // The token's K rows, then its V rows: each wire stream is written in
      // order, so a line that a row ends inside is finished by the next store.
      for (int64_t h = 0; h < heads; ++h) {
        uint8_t* c = tok + h * stride_head;
        if (kPack) {
          row_nt_avx2<kB, kWide>(wk + h * kB, c);
        } else {
          row_nt_avx2<kB, kWide>(c, wk + h * kB);
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        uint8_t* c = tok + h * stride_head + v_off;
        if (kPack) {
          row_nt_avx2<kB, kWide>(wv + h * kB, c);
        } else {
          row_nt_avx2<kB, kWide>(c, wv + h * kB);
        }
      }
    }
  }
}

// Runs move_pair_nt_avx2 when the CPU has AVX2 and every destination row is
// 16-byte aligned; false when it did not.
template <bool kPack>
bool move_pair_heads_avx2(const std::vector<TokenRun>& runs, uint8_t* k_base, const CompStrides& s,
                          const Geometry& g, uint8_t* wire_k, uint8_t* wire_v, int64_t v_off) {
  if (!kHaveAvx2) return false;
  // The low bits that any destination row's address may have.
  uintptr_t bits = 0;
  if (kPack) {
    bits = reinterpret_cast<uintptr_t>(wire_k) | reinterpret_cast<uintptr_t>(wire_v) |
           static_cast<uintptr_t>(g.token_bytes);
  } else {
    bits = reinterpret_cast<uintptr_t>(k_base) | static_cast<uintptr_t>(s.token) |
           static_cast<uintptr_t>(s.head) | static_cast<uintptr_t>(v_off);
    for (const TokenRun& r : runs) bits |= static_cast<uintptr_t>(r.off);
  }
  if (bits & 15) return false;
  const bool wide = (bits & 31) == 0;
  auto go = [&](auto size) {
    constexpr int64_t kB = decltype(size)::value;
    auto kernel = wide ? move_pair_nt_avx2<kPack, kB, true> : move_pair_nt_avx2<kPack, kB, false>;
    kernel(runs.data(), runs.size(), k_base, s.token, g.token_bytes, wire_k, wire_v, g.num_heads,
           s.head, v_off);
    return true;
  };
  switch (g.head_bytes) {
    case 64:
      return go(std::integral_constant<int64_t, 64>{});
    case 128:
      return go(std::integral_constant<int64_t, 128>{});
    case 256:
      return go(std::integral_constant<int64_t, 256>{});
    case 512:
      return go(std::integral_constant<int64_t, 512>{});
    default:
      return false;
  }
}
#endif

// The whole K and V blocks of one layer: V's bytes sit `v_off` after K's.
// Each cache slot is read once, K's bytes and V's together.
template <bool kPack, bool kNt>
void move_pair(const Job& j, TokenShape shape, uint8_t* k_base, int64_t v_off, uint8_t* wire_k,
               uint8_t* wire_v) {
  const Geometry& g = j.p->g;
  const CompStrides& s = j.c->comp[0];
  const int64_t tokb = g.token_bytes;
  const std::vector<TokenRun>& runs = j.p->runs[0];
  if (shape == TokenShape::kRun) {
    for_pair_tokens<kPack>(runs, k_base, s.token, tokb, wire_k, wire_v, kNt ? 0 : 1, 0,
                           [&](uint8_t* wk, uint8_t* wv, uint8_t* tok) {
                             move<kPack, kNt>(wk, tok, static_cast<size_t>(tokb));
                             move<kPack, kNt>(wv, tok + v_off, static_cast<size_t>(tokb));
                           });
    return;
  }
#ifdef KVB_HAVE_AVX2_TARGET
  if (kNt && move_pair_heads_avx2<kPack>(runs, k_base, s, g, wire_k, wire_v, v_off)) return;
#endif
  const int64_t heads = g.num_heads, sh = s.head;
  auto fixed = [&](auto size) {
    constexpr int64_t kB = decltype(size)::value;
    for_pair_tokens<kPack>(runs, k_base, s.token, tokb, wire_k, wire_v, kNt ? 0 : heads, sh,
                           [&](uint8_t* wk, uint8_t* wv, uint8_t* tok) {
                             move_pair_token<kPack, kNt, kB>(wk, wv, tok, heads, sh, v_off);
                           });
  };
  switch (g.head_bytes) {
    case 64:
      return fixed(std::integral_constant<int64_t, 64>{});
    case 128:
      return fixed(std::integral_constant<int64_t, 128>{});
    case 256:
      return fixed(std::integral_constant<int64_t, 256>{});
    case 512:
      return fixed(std::integral_constant<int64_t, 512>{});
    default:
      for_pair_tokens<kPack>(runs, k_base, s.token, tokb, wire_k, wire_v, kNt ? 0 : heads, sh,
                             [&](uint8_t* wk, uint8_t* wv, uint8_t* tok) {
                               move_heads<kPack, kNt>(wk, tok, g, sh);
                               move_heads<kPack, kNt>(wv, tok + v_off, g, sh);
                             });
  }
}

// Wire positions [lo, hi) (absolute, inside the call's slice).
template <bool kPack, bool kNt>
void move_slice(const Job& j, uint64_t lo, uint64_t hi) {
  const Geometry& g = j.p->g;
  const uint64_t blkb = static_cast<uint64_t>(g.block_bytes);
  const uint64_t tokb = static_cast<uint64_t>(g.token_bytes);
  uint64_t blk = lo / blkb;
  while (lo < hi) {
    const uint64_t blk_pos = blk * blkb;
    const int64_t layer = g.layer_start + static_cast<int64_t>(blk) / g.num_components;
    const int comp = static_cast<int>(static_cast<int64_t>(blk) % g.num_components);
    const CompStrides& s = j.c->comp[comp];
    uint8_t* comp_base = reinterpret_cast<uint8_t*>(j.c->at(layer, comp)) + g.head_start * s.head;
    const TokenShape shape = token_shape(j, comp);
    if (j.paired && comp == 0 && lo == blk_pos && hi - blk_pos >= 2 * blkb) {
      const int64_t v_off = static_cast<int64_t>(j.c->at(layer, 1) - j.c->at(layer, 0));
      if (v_off > 0 && v_off < s.token) {
        uint8_t* wire_k = j.wire + (blk_pos - j.wire_offset);
        move_pair<kPack, kNt>(j, shape, comp_base, v_off, wire_k, wire_k + blkb);
        lo = blk_pos + 2 * blkb;
        blk += 2;
        continue;
      }
    }
    const std::vector<TokenRun>& runs = j.p->runs[comp];
    const uint64_t blo = lo - blk_pos;
    const uint64_t bhi = std::min(hi - blk_pos, blkb);
    const int64_t t_first = static_cast<int64_t>(blo / tokb);
    auto it = std::upper_bound(runs.begin(), runs.end(), t_first,
                               [](int64_t t, const TokenRun& r) { return t < r.t1; });
    for (; it != runs.end() && static_cast<uint64_t>(it->t0) * tokb < bhi; ++it) {
      if ((kPack || !kNt) && runs.end() - it > kPrefetchRuns) {  // streamed stores need none
        prefetch_run<kPack>(it[kPrefetchRuns], s, comp_base);
      }
      move_run<kPack, kNt>(j, comp, shape, *it, comp_base, blk_pos, blo, bhi);
    }
    lo = blk_pos + bhi;
    ++blk;
  }
}

// Whether every run of the plan is one span of the cache (tokens and heads
// adjacent, as in kvbridge's own layouts): a checksummed slice is then copied
// span by span in wire order, each span hashed by the loop that copies it.
bool runs_contiguous(const Job& j) {
  const Geometry& g = j.p->g;
  for (int c = 0; c < g.num_components; ++c) {
    if (token_shape(j, c) != TokenShape::kRun || j.c->comp[c].token != g.token_bytes) return false;
  }
  return true;
}

// Wire positions [lo, hi) of such a plan, through `h`: one read of each byte.
// An unpack of kStreamHashedBytes or more writes the cache with streaming
// stores (its pages are not read back soon; a pack's wire bytes are).
template <bool kPack>
void move_slice_hashed(const Job& j, uint64_t lo, uint64_t hi, Xxh3Stream& h) {
  const bool stream = !kPack && hi - lo >= kStreamHashedBytes;
  const Geometry& g = j.p->g;
  const uint64_t blkb = static_cast<uint64_t>(g.block_bytes);
  const uint64_t tokb = static_cast<uint64_t>(g.token_bytes);
  for (uint64_t blk = lo / blkb; lo < hi; ++blk) {
    const uint64_t blk_pos = blk * blkb;
    const int64_t layer = g.layer_start + static_cast<int64_t>(blk) / g.num_components;
    const int comp = static_cast<int>(static_cast<int64_t>(blk) % g.num_components);
    const CompStrides& s = j.c->comp[comp];
    uint8_t* comp_base = reinterpret_cast<uint8_t*>(j.c->at(layer, comp)) + g.head_start * s.head;
    const std::vector<TokenRun>& runs = j.p->runs[comp];
    const uint64_t blo = lo - blk_pos, bhi = std::min(hi - blk_pos, blkb);
    auto it = std::upper_bound(runs.begin(), runs.end(), static_cast<int64_t>(blo / tokb),
                               [](int64_t t, const TokenRun& r) { return t < r.t1; });
    for (; it != runs.end() && static_cast<uint64_t>(it->t0) * tokb < bhi; ++it) {
      const uint64_t r0 = static_cast<uint64_t>(it->t0) * tokb;
      const uint64_t w0 = std::max(r0, blo);
      const uint64_t w1 = std::min(static_cast<uint64_t>(it->t1) * tokb, bhi);
      if (w0 >= w1) continue;
      uint8_t* cache = comp_base + it->off + (w0 - r0);
      uint8_t* wire = j.wire + (blk_pos + w0 - j.wire_offset);
      if (kPack) {
        h.update_copy(wire, cache, w1 - w0);
      } else {
        h.update_copy(cache, wire, w1 - w0, stream);
      }
    }
    lo = blk_pos + bhi;
  }
}

// Wire positions [lo, hi) of any other plan through `h`, in windows, each
// copied and then hashed while in cache.  A layer whose K and V are copied in
// one pass (move_pair) goes whole when its two blocks fit in cache.
template <bool kPack>
void move_slice_windowed(const Job& j, uint64_t lo, uint64_t hi, Xxh3Stream& h) {
  const uint64_t pair = 2 * static_cast<uint64_t>(j.p->g.block_bytes);
  const bool pairs = j.paired && pair > 0 && pair <= kPairHashBytes;
  for (uint64_t w = lo; w < hi;) {
    uint64_t e = std::min(hi, w + kHashWindow);
    if (pairs) {
      const uint64_t next = (w / pair + 1) * pair;
      if (w % pair == 0 && w + pair <= hi) {
        e = w + pair;
      } else if (next < e) {
        e = next;  // stop at the next layer, which may then go whole
      }
    }
    const uint8_t* bytes = j.wire + (w - lo);
    if (kPack) {
      move_slice<kPack, false>(j, w, e);
      h.update(bytes, e - w);
    } else {
      h.update(bytes, e - w);
      move_slice<kPack, false>(j, w, e);
    }
    w = e;
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

// Wire positions [lo, hi) over `n` threads, as kPartsPerThread parts per
// thread that the threads take in turn: a pool thread that wakes late (a
// sleeping vCPU can take a large share of a job to wake) takes what is left
// instead of leaving its whole half to the caller.  Parts are cut on 64-byte
// wire positions, so no two threads share a line, and, for packed K|V, on a
// layer's K and V blocks, so each part copies them in one pass (move_pair).
template <bool kPack, bool kNt>
void move_parallel(const Job& j, uint64_t lo, uint64_t hi, int n) {
  if (n <= 1) {
    move_slice<kPack, kNt>(j, lo, hi);
    if (kNt) fence_nt();
    return;
  }
  const uint64_t total = hi - lo;
  const uint64_t pair = 2 * static_cast<uint64_t>(j.p->g.block_bytes);
  const uint64_t want = total / (static_cast<uint64_t>(n) * kPartsPerThread);
  const uint64_t unit = j.paired && pair > 0 && pair <= want ? pair : 64;
  const uint64_t step = std::max<uint64_t>(unit, want / unit * unit);
  auto cut = [&](uint64_t k) {  // boundary k, on a multiple of `unit` (absolute)
    if (k == 0) return lo;
    const uint64_t x = lo + k * step;
    return x >= hi ? hi : std::min(hi, (x + unit - 1) / unit * unit);
  };
  const uint64_t parts = (total + step - 1) / step;
  std::atomic<uint64_t> next{0};
  parallel_for(n, [&](int) {
    for (uint64_t k = next.fetch_add(1); k < parts; k = next.fetch_add(1)) {
      const uint64_t a = cut(k), b = cut(k + 1);
      if (a < b) move_slice<kPack, kNt>(j, a, b);
    }
    if (kNt) fence_nt();
  });
}

// A checked plan's slice.  `digest` (pack) receives the XXH3-64 of the bytes
// written; `expect` (unpack) is checked against the XXH3-64 of the bytes read.
template <bool kPack>
int run_plan(const PlanInfo& p, uint64_t wire_offset, void* wire, uint64_t nbytes,
             const kvb_exec* exec, uint64_t* digest, const uint64_t* expect) {
  if (exec != nullptr && exec->num_threads < 0) {
    return failf(KVB_ERR_INVALID_ARG, "num_threads must be >= 0, got %d", exec->num_threads);
  }
  if (!kPack && !p.writable) {
    return fail(KVB_ERR_INVALID_ARG, "unpack needs a plan created with KVB_PLAN_WRITE");
  }
  if (int rc = check_slice(p, wire_offset, nbytes, wire, true); rc != KVB_OK) return rc;
  if (p.cache->device != -1) {
    return failf(KVB_ERR_INVALID_ARG,
                 "the CPU path needs a host-memory cache; this one is on CUDA device %d",
                 p.cache->device);
  }
  Job j{p.cache, &p, static_cast<uint8_t*>(wire), wire_offset};
  j.paired = components_paired(j);
  const uint64_t lo = wire_offset, hi = wire_offset + nbytes;
  if (digest != nullptr || expect != nullptr) {
    Xxh3Stream h;
    if (runs_contiguous(j)) {
      move_slice_hashed<kPack>(j, lo, hi, h);
    } else {
      move_slice_windowed<kPack>(j, lo, hi, h);
    }
    const uint64_t d = h.digest();
    if (digest != nullptr) *digest = d;
    if (expect != nullptr && d != *expect) {
      return failf(KVB_ERR_CHECKSUM,
                   "the %llu bytes at wire offset %llu have XXH3-64 %016llx, expected %016llx; "
                   "their slots now hold unspecified bytes",
                   static_cast<unsigned long long>(nbytes),
                   static_cast<unsigned long long>(wire_offset), static_cast<unsigned long long>(d),
                   static_cast<unsigned long long>(*expect));
    }
    return KVB_OK;
  }
  if (nbytes == 0) return KVB_OK;
  const int n = thread_count(exec, nbytes);
  if (nbytes >= kStreamBytes) {
    move_parallel<kPack, true>(j, lo, hi, n);
  } else {
    move_parallel<kPack, false>(j, lo, hi, n);
  }
  return KVB_OK;
}

// The per-call entry points: check the descriptor and the range, then copy.
template <bool kPack>
int run_once(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset, void* wire,
             uint64_t nbytes, const kvb_exec* exec) {
  if (exec != nullptr && exec->num_threads < 0) {
    return failf(KVB_ERR_INVALID_ARG, "num_threads must be >= 0, got %d", exec->num_threads);
  }
  if (cache == nullptr || range == nullptr) {
    return fail(KVB_ERR_INVALID_ARG, "null cache descriptor or range");
  }
  CacheInfo c;
  if (int rc = check_cache(cache, &c); rc != KVB_OK) return rc;
  PlanInfo p;
  if (int rc = check_range(c, range, kPack ? Access::kRead : Access::kWrite, &p); rc != KVB_OK) {
    return rc;
  }
  return run_plan<kPack>(p, wire_offset, wire, nbytes, exec, nullptr, nullptr);
}

}  // namespace
}  // namespace kvb

extern "C" int kvb_pack_cpu(const kvb_cache_desc* cache, const kvb_range* range,
                            uint64_t wire_offset, void* dst, uint64_t nbytes,
                            const kvb_exec* exec) {
  KVB_GUARD_BEGIN
  return kvb::run_once<true>(cache, range, wire_offset, dst, nbytes, exec);
  KVB_GUARD_END
}

extern "C" int kvb_unpack_cpu(const kvb_cache_desc* cache, const kvb_range* range,
                              uint64_t wire_offset, const void* src, uint64_t nbytes,
                              const kvb_exec* exec) {
  KVB_GUARD_BEGIN
  return kvb::run_once<false>(cache, range, wire_offset, const_cast<void*>(src), nbytes, exec);
  KVB_GUARD_END
}

extern "C" int kvb_plan_pack_cpu(const kvb_plan* plan, uint64_t wire_offset, void* dst,
                                 uint64_t nbytes, const kvb_exec* exec, uint64_t* xxh3_out) {
  KVB_GUARD_BEGIN
  if (plan == nullptr) return kvb::fail(KVB_ERR_INVALID_ARG, "plan is null");
  return kvb::run_plan<true>(plan->info, wire_offset, dst, nbytes, exec, xxh3_out, nullptr);
  KVB_GUARD_END
}

extern "C" int kvb_plan_unpack_cpu(const kvb_plan* plan, uint64_t wire_offset, const void* src,
                                   uint64_t nbytes, const kvb_exec* exec,
                                   const uint64_t* xxh3_expect) {
  KVB_GUARD_BEGIN
  if (plan == nullptr) return kvb::fail(KVB_ERR_INVALID_ARG, "plan is null");
  return kvb::run_plan<false>(plan->info, wire_offset, const_cast<void*>(src), nbytes, exec,
                              nullptr, xxh3_expect);
  KVB_GUARD_END
}
