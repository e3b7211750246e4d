// Internal: the validated shape of a cache and of a range, shared by the CPU
// and CUDA paths.  check_cache() and check_range() check everything before any
// byte moves; a checked range (PlanInfo) is what every copy runs from.
#ifndef KVBRIDGE_GEOMETRY_H
#define KVBRIDGE_GEOMETRY_H

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvbridge/layout.h"

namespace kvb {

// Byte strides of one component inside a layer.
struct CompStrides {
  int64_t page = 0;
  int64_t token = 0;
  int64_t head = 0;
  int64_t elem = 0;  // between the elements of a head (== elem_bytes when they are adjacent)
};

// A checked, normalised copy of a kvb_cache_desc (ABI 1 or 2).
struct CacheInfo {
  int32_t abi_version = 0;
  int32_t num_layers = 0;
  int32_t num_components = 0;
  int32_t num_heads = 0;
  int64_t head_bytes = 0;
  int64_t elem_bytes = 0;  // > 0; == head_bytes when a head is one run (ABI 1)
  int64_t page_tokens = 0;
  int64_t num_pages = 0;
  CompStrides comp[2];
  std::vector<uintptr_t> base;  // [layer * num_components + comp]; 0 where the descriptor had null
  int32_t device = -1;

  uintptr_t at(int64_t layer, int64_t c) const {
    return base[static_cast<size_t>(layer * num_components + c)];
  }
  int64_t elems_per_head() const { return head_bytes / elem_bytes; }
  // A head of component c is one contiguous run of head_bytes.
  bool head_run(int c) const { return elem_bytes == head_bytes || comp[c].elem == elem_bytes; }
  // Bytes a component spans from its base (0 without pages).
  uint64_t extent(int c) const;
};

// The validated shape of one range.
struct Geometry {
  int64_t layer_start = 0;
  int64_t layer_end = 0;
  int64_t num_components = 0;
  int64_t head_start = 0;  // first head of the range, in the cache's heads
  int64_t num_heads = 0;   // heads in the range
  int64_t head_bytes = 0;
  int64_t elem_bytes = 0;
  int64_t page_tokens = 0;
  int64_t token_start = 0;
  int64_t num_tokens = 0;
  int64_t token_bytes = 0;   // num_heads * head_bytes: one token of one (layer, component)
  int64_t block_bytes = 0;   // num_tokens * token_bytes: one (layer, component) of the wire
  uint64_t total_bytes = 0;  // the whole wire buffer of the range
  int64_t first_block = 0;   // block-table entries [first_block, first_block + num_blocks)
  int64_t num_blocks = 0;    //   cover the range
};

// Tokens [t0, t1) (relative to the range start) of one component that sit at
// one constant token stride: one page, or physically adjacent pages.
struct TokenRun {
  int64_t t0;
  int64_t t1;
  int64_t off;  // bytes from the component's base to token t0 (head 0 of the cache)
};

// A checked range: everything a copy needs, built once.
struct PlanInfo {
  const CacheInfo* cache = nullptr;
  Geometry g;
  std::vector<int32_t> pages;  // block-table entries first_block .. first_block + num_blocks - 1
  std::vector<TokenRun> runs[2];
  bool writable = false;
};

enum class Access { kRead, kWrite };

// Checks a descriptor (dims, strides, that distinct slots of a layer never
// overlap) and copies it.  Base pointers may be null (a range must not use them).
int check_cache(const kvb_cache_desc* desc, CacheInfo* out);

// Checks a range against a checked cache (token, layer and head range, the
// block table, and for kWrite that no two destinations overlap) and fills
// out->g, out->pages and out->runs.
int check_range(const CacheInfo& cache, const kvb_range* range, Access access, PlanInfo* out);

// Checks a slice [wire_offset, wire_offset + nbytes) of a plan's wire buffer
// at `wire` (which may be null when nbytes == 0 or check_ptr is false).
int check_slice(const PlanInfo& plan, uint64_t wire_offset, uint64_t nbytes, const void* wire,
                bool check_ptr);

}  // namespace kvb

#endif  // KVBRIDGE_GEOMETRY_H
