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
#else
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

// Cache address of row-relative byte x of the token at `tok`.
KVB_HD uint8_t* row_byte_addr(const RowCopy& d, uint8_t* tok, uint64_t x) {
  const uint64_t h = x / static_cast<uint64_t>(d.head_bytes);
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

template <bool kPack>
KVB_HD void move16(uint8_t* wire, uint8_t* cache) {
#ifdef __CUDA_ARCH__
  if (kPack) {
    *reinterpret_cast<uint4*>(wire) = *reinterpret_cast<const uint4*>(cache);
  } else {
    *reinterpret_cast<uint4*>(cache) = *reinterpret_cast<const uint4*>(wire);
  }
#else
  if (kPack) {
    std::memcpy(wire, cache, 16);
  } else {
    std::memcpy(cache, wire, 16);
  }
#endif
}

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
  if (d.vector_ok) {
    const uint64_t u_end = (b + 15) / 16;
    for (uint64_t u = a / 16 + lane; u < u_end; u += lanes) {
      const uint64_t x0 = u * 16;
      if (x0 >= a && x0 + 16 <= b) {
        move16<kPack>(d.wire + (row_pos + x0 - d.lo), row_byte_addr(d, tok, x0));
      } else {
        const uint64_t s = x0 > a ? x0 : a;
        const uint64_t e = x0 + 16 < b ? x0 + 16 : b;
        // A 16-byte unit never straddles heads (head_bytes % 16 == 0).
        move_bytes<kPack>(d.wire + (row_pos + s - d.lo), row_byte_addr(d, tok, s),
                          static_cast<int>(e - s));
      }
    }
  } else {
    for (uint64_t x = a + lane; x < b; x += lanes) {
      move_bytes<kPack>(d.wire + (row_pos + x - d.lo), row_byte_addr(d, tok, x), 1);
    }
  }
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
