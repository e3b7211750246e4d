// Internal: the per-row copy that the CUDA kernel runs, written once for host
// and device so the C++ test can run the kernel's exact index math on a CPU.
//
// A "row" is one token of one (layer, component) block of the wire:
// token_bytes bytes at wire position row * token_bytes.  One warp copies one
// row; lane i of n takes 16-byte units i, i + n, ... when both sides are
// 16-byte aligned, else single bytes.
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
  int64_t layer_start;
  int64_t num_components;
  int64_t head_bytes;
  int64_t page_tokens;
  int64_t token_start;
  int64_t num_tokens;
  int64_t token_bytes;
  int64_t first_block;
  int64_t stride_component;
  int64_t stride_page;
  int64_t stride_token;
  int64_t stride_head;
  uint64_t lo;  // wire positions [lo, hi) of the slice
  uint64_t hi;
  uint64_t row_first;          // lo / token_bytes
  uint64_t num_rows;           // rows the slice touches
  const uint64_t* layer_base;  // [layer - layer_start]
  const int32_t* pages;        // [block - first_block]
  uint8_t* wire;               // the byte at wire position lo
  int32_t vector_ok;           // 16-byte units are aligned on both sides
  int32_t heads_contiguous;    // a token's heads are one run (no per-head stride)
};

// Address in the cache of the first byte of row `row`.
KVB_HD uint8_t* row_token_addr(const RowCopy& d, uint64_t row) {
  const uint64_t t = row % static_cast<uint64_t>(d.num_tokens);
  const uint64_t lc = row / static_cast<uint64_t>(d.num_tokens);
  const int64_t comp = static_cast<int64_t>(lc % static_cast<uint64_t>(d.num_components));
  const int64_t layer = static_cast<int64_t>(lc / static_cast<uint64_t>(d.num_components));
  const int64_t abs_t = d.token_start + static_cast<int64_t>(t);
  const int64_t blk = abs_t / d.page_tokens;
  const int64_t slot = abs_t - blk * d.page_tokens;
  const int64_t page = d.pages[blk - d.first_block];
  return reinterpret_cast<uint8_t*>(d.layer_base[layer]) + comp * d.stride_component +
         page * d.stride_page + slot * d.stride_token;
}

// Cache address of row-relative byte x of the token at `tok` (heads strided).
KVB_HD uint8_t* row_byte_addr(const RowCopy& d, uint8_t* tok, uint64_t x) {
  uint64_t h;
  if (d.token_bytes <= 0xFFFFFFFFll) {  // 32-bit division is far cheaper on a GPU
    h = static_cast<uint32_t>(x) / static_cast<uint32_t>(d.head_bytes);
  } else {
    h = x / static_cast<uint64_t>(d.head_bytes);
  }
  return tok + static_cast<int64_t>(h) * d.stride_head +
         static_cast<int64_t>(x - h * static_cast<uint64_t>(d.head_bytes));
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
  uint8_t* tok = row_token_addr(d, row);
  // Wire and cache addresses of row byte x.
#define KVB_WIRE(x) (d.wire + (row_pos + (x)-d.lo))
#define KVB_CACHE(x) (d.heads_contiguous ? tok + (x) : row_byte_addr(d, tok, (x)))
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
// (nbytes > 0) of a validated call.  `layer_base` holds the pointers of layers
// [layer_start, layer_end); `pages` the block-table entries from first_block.
inline RowCopy make_row_copy(const Geometry& g, uint64_t lo, uint64_t nbytes,
                             const uint64_t* layer_base, const int32_t* pages, uint8_t* wire,
                             bool aligned) {
  RowCopy d;
  d.layer_start = g.layer_start;
  d.num_components = g.num_components;
  d.head_bytes = g.head_bytes;
  d.page_tokens = g.page_tokens;
  d.token_start = g.token_start;
  d.num_tokens = g.num_tokens;
  d.token_bytes = g.token_bytes;
  d.first_block = g.first_block;
  d.stride_component = g.stride_component;
  d.stride_page = g.stride_page;
  d.stride_token = g.stride_token;
  d.stride_head = g.stride_head;
  d.lo = lo;
  d.hi = lo + nbytes;
  const uint64_t tokb = static_cast<uint64_t>(g.token_bytes);
  d.row_first = d.lo / tokb;
  d.num_rows = (d.hi - 1) / tokb - d.row_first + 1;
  d.layer_base = layer_base;
  d.pages = pages;
  d.wire = wire;
  d.vector_ok = aligned ? 1 : 0;
  d.heads_contiguous = g.heads_contiguous ? 1 : 0;
  return d;
}

// Whether 16-byte units line up on both sides: head_bytes and every stride
// are multiples of 16, and so are every layer base and (wire - lo).
inline bool row_copy_aligned(const Geometry& g, const void* const* layer_base, const void* wire,
                             uint64_t lo) {
  bool ok = g.head_bytes % 16 == 0 && g.stride_component % 16 == 0 && g.stride_page % 16 == 0 &&
            g.stride_token % 16 == 0 && g.stride_head % 16 == 0 &&
            (reinterpret_cast<uintptr_t>(wire) - lo) % 16 == 0;
  for (int64_t l = g.layer_start; l < g.layer_end && ok; ++l) {
    ok = reinterpret_cast<uintptr_t>(layer_base[l]) % 16 == 0;
  }
  return ok;
}

}  // namespace kvb

#endif  // KVBRIDGE_WIRE_MAP_H
