// Internal: the per-row copy that the CUDA kernel runs, written once for host
// and device so the C++ test can run the kernel's exact index math on a CPU.
//
// A "row" is one token of one (layer, component) block of the wire:
// token_bytes bytes at wire position row * token_bytes.  One warp copies one
// row; lane i of n takes 16-byte units i, i + n, ... when both sides are
// 16-byte aligned and every head is one run, else single bytes.
#ifndef KVBRIDGE_WIRE_MAP_H
#define KVBRIDGE_WIRE_MAP_H

#include <stdint.h>

#include "geometry.h"

#ifdef __CUDACC__
#define KVB_HD __host__ __device__ __forceinline__
#define KVB_UNROLL _Pragma("unroll")
#else
#define KVB_UNROLL
#include <cstring>
#define KVB_HD inline
#endif

namespace kvb {

struct RowCopy {
  int64_t num_components;
  int64_t head_bytes;
  int64_t elem_bytes;
  int64_t page_tokens;
  int64_t token_start;
  int64_t num_tokens;
  int64_t token_bytes;
  int64_t first_block;
  int64_t head_start;
  int64_t stride_page[2];
  int64_t stride_token[2];
  int64_t stride_head[2];
  int64_t stride_elem[2];
  int32_t head_run[2];          // a head of the component is one run of head_bytes
  int32_t heads_contiguous[2];  // ... and the range's heads of a token are one run
  uint64_t lo;                  // wire positions [lo, hi) of the slice
  uint64_t hi;
  uint64_t row_first;     // lo / token_bytes
  uint64_t num_rows;      // rows the slice touches
  const uint64_t* bases;  // [(layer - layer_start) * num_components + component]
  const int32_t* pages;   // [block - first_block]
  uint8_t* wire;          // the byte at wire position lo
  int32_t vector_ok;      // 16-byte units are aligned on both sides
};

// Address in the cache of the first byte of row `row`, and its component.
KVB_HD uint8_t* row_token_addr(const RowCopy& d, uint64_t row, int* comp_out) {
  const uint64_t t = row % static_cast<uint64_t>(d.num_tokens);
  const uint64_t lc = row / static_cast<uint64_t>(d.num_tokens);
  const int comp = static_cast<int>(lc % static_cast<uint64_t>(d.num_components));
  const int64_t abs_t = d.token_start + static_cast<int64_t>(t);
  const int64_t blk = abs_t / d.page_tokens;
  const int64_t slot = abs_t - blk * d.page_tokens;
  const int64_t page = d.pages[blk - d.first_block];
  *comp_out = comp;
  return reinterpret_cast<uint8_t*>(d.bases[lc]) + d.head_start * d.stride_head[comp] +
         page * d.stride_page[comp] + slot * d.stride_token[comp];
}

// Cache address of row-relative byte x of the token at `tok` (heads strided).
KVB_HD uint8_t* row_byte_addr(const RowCopy& d, int comp, uint8_t* tok, uint64_t x) {
  uint64_t h;
  if (d.token_bytes <= 0xFFFFFFFFll) {  // 32-bit division is far cheaper on a GPU
    h = static_cast<uint32_t>(x) / static_cast<uint32_t>(d.head_bytes);
  } else {
    h = x / static_cast<uint64_t>(d.head_bytes);
  }
  const uint64_t xb = x - h * static_cast<uint64_t>(d.head_bytes);
  uint8_t* head = tok + static_cast<int64_t>(h) * d.stride_head[comp];
  if (d.head_run[comp]) return head + static_cast<int64_t>(xb);
  const uint64_t e = xb / static_cast<uint64_t>(d.elem_bytes);
  return head + static_cast<int64_t>(e) * d.stride_elem[comp] +
         static_cast<int64_t>(xb - e * static_cast<uint64_t>(d.elem_bytes));
}

template <bool kPack>
KVB_HD void move_bytes(uint8_t* wire, uint8_t* cache, int n) {
  for (int i = 0; i < n; ++i) {
    if (kPack) {
      wire[i] = cache[i];
    } else {
      cache[i] = wire[i];
    }
  }
}

#ifdef __CUDA_ARCH__
using Vec16 = uint4;
KVB_HD Vec16 load16(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
KVB_HD void store16(uint8_t* p, const Vec16& v) { *reinterpret_cast<uint4*>(p) = v; }
#else
struct Vec16 {
  unsigned char b[16];
};
inline Vec16 load16(const uint8_t* p) {
  Vec16 v;
  std::memcpy(v.b, p, 16);
  return v;
}
inline void store16(uint8_t* p, const Vec16& v) { std::memcpy(p, v.b, 16); }
#endif

constexpr int kUnroll = 4;  // 16-byte loads in flight per lane

// Lane `lane` of `lanes` copies its share of row `row` (clipped to the slice).
template <bool kPack>
KVB_HD void copy_row(const RowCopy& d, uint64_t row, uint32_t lane, uint32_t lanes) {
  const uint64_t tokb = static_cast<uint64_t>(d.token_bytes);
  const uint64_t row_pos = row * tokb;
  const uint64_t a = (d.lo > row_pos ? d.lo : row_pos) - row_pos;
  const uint64_t end = row_pos + tokb;
  const uint64_t b = (d.hi < end ? d.hi : end) - row_pos;
  if (a >= b) return;
  int comp = 0;
  uint8_t* tok = row_token_addr(d, row, &comp);
  const bool contiguous = d.heads_contiguous[comp] != 0;
  // Wire and cache addresses of row byte x.
#define KVB_WIRE(x) (d.wire + (row_pos + (x)-d.lo))
#define KVB_CACHE(x) (contiguous ? tok + (x) : row_byte_addr(d, comp, tok, (x)))
  if (!d.vector_ok) {
    for (uint64_t x = a + lane; x < b; x += lanes) move_bytes<kPack>(KVB_WIRE(x), KVB_CACHE(x), 1);
    return;
  }
  // Whole 16-byte units [u0, u1); the partial units at either end go byte by
  // byte (a unit never straddles heads: head_bytes % 16 == 0).
  const uint64_t u0 = (a + 15) / 16, u1 = b / 16;
  if (u0 > u1) {  // [a, b) inside one unit
    if (lane == 0) move_bytes<kPack>(KVB_WIRE(a), KVB_CACHE(a), static_cast<int>(b - a));
    return;
  }
  if (lane == 0 && a < u0 * 16) {
    move_bytes<kPack>(KVB_WIRE(a), KVB_CACHE(a), static_cast<int>(u0 * 16 - a));
  }
  if (lane == (lanes > 1 ? 1u : 0u) && u1 * 16 < b) {
    move_bytes<kPack>(KVB_WIRE(u1 * 16), KVB_CACHE(u1 * 16), static_cast<int>(b - u1 * 16));
  }
  for (uint64_t u = u0 + lane; u < u1; u += kUnroll * static_cast<uint64_t>(lanes)) {
    Vec16 v[kUnroll];
    KVB_UNROLL
    for (int k = 0; k < kUnroll; ++k) {
      const uint64_t x = (u + k * static_cast<uint64_t>(lanes)) * 16;
      if (x < u1 * 16) v[k] = load16(kPack ? KVB_CACHE(x) : KVB_WIRE(x));
    }
    KVB_UNROLL
    for (int k = 0; k < kUnroll; ++k) {
      const uint64_t x = (u + k * static_cast<uint64_t>(lanes)) * 16;
      if (x < u1 * 16) store16(kPack ? KVB_WIRE(x) : KVB_CACHE(x), v[k]);
    }
  }
#undef KVB_WIRE
#undef KVB_CACHE
}

// Host side: the kernel's arguments for wire positions [lo, lo + nbytes)
// (nbytes > 0) of a checked plan.  `bases` holds the (layer, component) base
// addresses from layer_start on; `pages` the block-table entries from first_block.
inline RowCopy make_row_copy(const PlanInfo& p, uint64_t lo, uint64_t nbytes, const uint64_t* bases,
                             const int32_t* pages, uint8_t* wire, bool aligned) {
  const Geometry& g = p.g;
  const CacheInfo& c = *p.cache;
  RowCopy d;
  d.num_components = g.num_components;
  d.head_bytes = g.head_bytes;
  d.elem_bytes = g.elem_bytes;
  d.page_tokens = g.page_tokens;
  d.token_start = g.token_start;
  d.num_tokens = g.num_tokens;
  d.token_bytes = g.token_bytes;
  d.first_block = g.first_block;
  d.head_start = g.head_start;
  for (int k = 0; k < 2; ++k) {
    const CompStrides& s = c.comp[k < g.num_components ? k : 0];
    d.stride_page[k] = s.page;
    d.stride_token[k] = s.token;
    d.stride_head[k] = s.head;
    d.stride_elem[k] = s.elem;
    const bool run = c.head_run(k < g.num_components ? k : 0);
    d.head_run[k] = run ? 1 : 0;
    d.heads_contiguous[k] = run && (g.num_heads == 1 || s.head == g.head_bytes) ? 1 : 0;
  }
  d.lo = lo;
  d.hi = lo + nbytes;
  const uint64_t tokb = static_cast<uint64_t>(g.token_bytes);
  d.row_first = d.lo / tokb;
  d.num_rows = (d.hi - 1) / tokb - d.row_first + 1;
  d.bases = bases;
  d.pages = pages;
  d.wire = wire;
  d.vector_ok = aligned ? 1 : 0;
  return d;
}

// Whether 16-byte units line up on both sides: every head is one run,
// head_bytes and every stride are multiples of 16, and so are every base of a
// layer in the range and (wire - lo).
inline bool row_copy_aligned(const PlanInfo& p, const void* wire, uint64_t lo) {
  const Geometry& g = p.g;
  const CacheInfo& c = *p.cache;
  bool ok = g.head_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(wire) - lo) % 16 == 0;
  for (int k = 0; k < g.num_components && ok; ++k) {
    const CompStrides& s = c.comp[k];
    ok = c.head_run(k) && s.page % 16 == 0 && s.token % 16 == 0 && s.head % 16 == 0;
  }
  for (int64_t l = g.layer_start; l < g.layer_end && ok; ++l) {
    for (int k = 0; k < g.num_components && ok; ++k) ok = c.at(l, k) % 16 == 0;
  }
  return ok;
}

}  // namespace kvb

#endif  // KVBRIDGE_WIRE_MAP_H
