// Internal: the validated shape of one pack/unpack call, shared by the CPU and
// CUDA paths.  validate() checks everything before any byte moves.
#ifndef KVBRIDGE_GEOMETRY_H
#define KVBRIDGE_GEOMETRY_H

#include <cstdint>

#include "kvbridge/layout.h"

namespace kvb {

struct Geometry {
  int64_t layer_start = 0;
  int64_t layer_end = 0;
  int64_t num_components = 0;
  int64_t num_heads = 0;
  int64_t head_bytes = 0;
  int64_t page_tokens = 0;
  int64_t token_start = 0;
  int64_t num_tokens = 0;
  int64_t token_bytes = 0;   // num_heads * head_bytes: one token of one (layer, component)
  int64_t block_bytes = 0;   // num_tokens * token_bytes: one (layer, component) of the wire
  uint64_t total_bytes = 0;  // the whole wire buffer of the range
  int64_t first_block = 0;   // block-table entries [first_block, first_block + num_blocks)
  int64_t num_blocks = 0;    //   cover the range
  int64_t stride_component = 0;
  int64_t stride_page = 0;
  int64_t stride_token = 0;
  int64_t stride_head = 0;
  bool heads_contiguous = false;  // a token's heads form one run of token_bytes
};

enum class Access { kRead, kWrite };

// Checks the descriptor, the range, the block table and the slice
// [wire_offset, wire_offset + nbytes) of the wire buffer at `wire` (which may be
// null when only the range is checked).  `cache_access` is kWrite for unpack:
// then a repeated page id or overlapping layers are KVB_ERR_OVERLAP.
// Returns KVB_OK and fills `g`, or a status with kvb_last_error() set.
int validate(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset,
             uint64_t nbytes, const void* wire, bool check_wire_ptr, Access cache_access,
             Geometry* g);

// Bytes that one layer of the cache spans from its base (0 without pages).
uint64_t layer_extent(const kvb_cache_desc& cache);

}  // namespace kvb

#endif  // KVBRIDGE_GEOMETRY_H
