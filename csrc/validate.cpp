// Validation of pack/unpack arguments: everything is checked before any byte moves.
#include <algorithm>
#include <cinttypes>
#include <utility>
#include <vector>

#include "error.h"
#include "geometry.h"
#include "kvbridge/pack.h"

namespace kvb {
namespace {

constexpr int64_t kMaxDim = int64_t{1} << 40;
constexpr int64_t kMaxStride = int64_t{1} << 56;
constexpr int64_t kMaxTokens = int64_t{1} << 48;  // token positions (keeps page math in range)

bool mul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// Distinct (component, page, token, head) coordinates must name disjoint
// head_bytes runs: sorted by stride, each axis must step over everything the
// smaller axes span.
int check_strides(const kvb_cache_desc& c) {
  struct Axis {
    int64_t count, stride;
    const char* name;
  };
  Axis axes[4] = {{c.num_components, c.stride_component, "component"},
                  {c.num_pages, c.stride_page, "page"},
                  {c.page_tokens, c.stride_token, "token"},
                  {c.num_heads, c.stride_head, "head"}};
  std::vector<Axis> used;
  for (const Axis& a : axes) {
    if (a.count > 1) used.push_back(a);
  }
  std::stable_sort(used.begin(), used.end(),
                   [](const Axis& x, const Axis& y) { return x.stride < y.stride; });
  int64_t span = c.head_bytes;  // bytes spanned by the axes seen so far
  for (const Axis& a : used) {
    if (a.stride < span) {
      return failf(KVB_ERR_LAYOUT,
                   "%s stride %" PRId64 " is smaller than the %" PRId64
                   " bytes the inner axes span: distinct slots would overlap",
                   a.name, a.stride, span);
    }
    int64_t s = 0;
    if (!mul(a.count - 1, a.stride, &s) || __builtin_add_overflow(s, span, &span)) {
      return fail(KVB_ERR_LAYOUT, "cache layout spans more bytes than fit in 64 bits");
    }
  }
  return KVB_OK;
}

// A page named twice would be written twice.  Linear with a bitmap of the
// cache's pages when that is small next to the table; else sort.
int check_unique(const int32_t* ids, int64_t n, int64_t num_pages, int64_t first_index) {
  int32_t dup = -1;
  if (num_pages / 64 <= 4 * n + 4096) {
    std::vector<uint64_t> seen(static_cast<size_t>(num_pages / 64 + 1), 0);
    for (int64_t i = 0; i < n && dup < 0; ++i) {
      const uint64_t bit = uint64_t{1} << (ids[i] & 63);
      uint64_t& word = seen[static_cast<size_t>(ids[i] >> 6)];
      if (word & bit) dup = ids[i];
      word |= bit;
    }
  } else {
    std::vector<int32_t> sorted(ids, ids + n);
    std::sort(sorted.begin(), sorted.end());
    auto it = std::adjacent_find(sorted.begin(), sorted.end());
    if (it != sorted.end()) dup = *it;
  }
  if (dup < 0) return KVB_OK;
  return failf(KVB_ERR_OVERLAP,
               "page %d appears twice in the block table entries [%" PRId64 ", %" PRId64
               "]: two destinations would overlap",
               dup, first_index, first_index + n - 1);
}

}  // namespace

uint64_t layer_extent(const kvb_cache_desc& c) {
  if (c.num_pages <= 0) return 0;
  // Bounded by validate(): no overflow for a descriptor that passed check_strides.
  return static_cast<uint64_t>(c.head_bytes + (c.num_components - 1) * c.stride_component +
                               (c.num_pages - 1) * c.stride_page +
                               (c.page_tokens - 1) * c.stride_token +
                               (c.num_heads - 1) * c.stride_head);
}

int validate(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset,
             uint64_t nbytes, const void* wire, bool check_wire_ptr, Access cache_access,
             Geometry* g) {
  if (cache == nullptr || range == nullptr || g == nullptr) {
    return fail(KVB_ERR_INVALID_ARG, "null cache descriptor or range");
  }
  const kvb_cache_desc& c = *cache;
  const kvb_range& r = *range;
  if (c.abi_version != KVB_ABI_VERSION) {
    return failf(KVB_ERR_INVALID_ARG, "cache descriptor abi_version %d, this library speaks %d",
                 c.abi_version, KVB_ABI_VERSION);
  }
  if (c.num_layers <= 0 || c.num_heads <= 0 || (c.num_components != 1 && c.num_components != 2)) {
    return failf(KVB_ERR_LAYOUT, "bad cache dims: num_layers=%d num_components=%d num_heads=%d",
                 c.num_layers, c.num_components, c.num_heads);
  }
  if (c.head_bytes <= 0 || c.head_bytes > kMaxDim || c.page_tokens <= 0 ||
      c.page_tokens > kMaxDim || c.num_pages < 0 || c.num_pages > kMaxDim) {
    return failf(KVB_ERR_LAYOUT,
                 "bad cache dims: head_bytes=%" PRId64 " page_tokens=%" PRId64
                 " num_pages=%" PRId64,
                 c.head_bytes, c.page_tokens, c.num_pages);
  }
  for (int64_t s : {c.stride_component, c.stride_page, c.stride_token, c.stride_head}) {
    if (s < 0 || s > kMaxStride) {
      return failf(KVB_ERR_LAYOUT, "cache stride %" PRId64 " out of range [0, 2^56]", s);
    }
  }
  if (c.layer_base == nullptr) return fail(KVB_ERR_INVALID_ARG, "layer_base is null");
  if (r.token_start < 0 || r.token_end < r.token_start || r.token_end > kMaxTokens) {
    return failf(KVB_ERR_INVALID_ARG, "bad token range [%" PRId64 ", %" PRId64 ")", r.token_start,
                 r.token_end);
  }
  if (r.layer_start < 0 || r.layer_end < r.layer_start || r.layer_end > c.num_layers) {
    return failf(KVB_ERR_INVALID_ARG, "bad layer range [%d, %d) for a cache of %d layers",
                 r.layer_start, r.layer_end, c.num_layers);
  }
  if (int rc = check_strides(c); rc != KVB_OK) return rc;

  Geometry geo;
  geo.layer_start = r.layer_start;
  geo.layer_end = r.layer_end;
  geo.num_components = c.num_components;
  geo.num_heads = c.num_heads;
  geo.head_bytes = c.head_bytes;
  geo.page_tokens = c.page_tokens;
  geo.token_start = r.token_start;
  geo.num_tokens = r.token_end - r.token_start;
  geo.stride_component = c.stride_component;
  geo.stride_page = c.stride_page;
  geo.stride_token = c.stride_token;
  geo.stride_head = c.stride_head;
  geo.heads_contiguous = c.num_heads == 1 || c.stride_head == c.head_bytes;
  int64_t blocks_wire = 0;
  int64_t total = 0;
  if (!mul(c.num_heads, c.head_bytes, &geo.token_bytes) ||
      !mul(geo.num_tokens, geo.token_bytes, &geo.block_bytes) ||
      !mul(geo.layer_end - geo.layer_start, geo.num_components, &blocks_wire) ||
      !mul(blocks_wire, geo.block_bytes, &total)) {
    return fail(KVB_ERR_INVALID_ARG, "wire size of the range overflows 64 bits");
  }
  geo.total_bytes = static_cast<uint64_t>(total);
  if (wire_offset > geo.total_bytes || nbytes > geo.total_bytes - wire_offset) {
    return failf(KVB_ERR_INVALID_ARG,
                 "slice [%" PRIu64 ", +%" PRIu64 ") is outside the %" PRIu64
                 "-byte wire buffer of the range",
                 wire_offset, nbytes, geo.total_bytes);
  }
  if (check_wire_ptr && nbytes > 0 && wire == nullptr) {
    return fail(KVB_ERR_INVALID_ARG, "wire buffer pointer is null");
  }

  if (geo.num_tokens > 0) {
    for (int64_t l = geo.layer_start; l < geo.layer_end; ++l) {
      if (c.layer_base[l] == nullptr)
        return failf(KVB_ERR_INVALID_ARG, "layer_base[%" PRId64 "] is null", l);
    }
    geo.first_block = r.token_start / c.page_tokens;
    const int64_t last_block = (r.token_end - 1) / c.page_tokens;
    geo.num_blocks = last_block - geo.first_block + 1;
    if (r.block_table == nullptr) return fail(KVB_ERR_INVALID_ARG, "block_table is null");
    if (r.block_table_len <= last_block) {
      return failf(KVB_ERR_OUT_OF_RANGE,
                   "block table has %" PRId64 " entries; tokens [%" PRId64 ", %" PRId64
                   ") with %" PRId64 "-token pages need %" PRId64,
                   r.block_table_len, r.token_start, r.token_end, c.page_tokens, last_block + 1);
    }
    for (int64_t i = geo.first_block; i <= last_block; ++i) {
      const int32_t p = r.block_table[i];
      if (p < 0 || p >= c.num_pages) {
        return failf(KVB_ERR_OUT_OF_RANGE,
                     "block_table[%" PRId64 "] = %d is outside the cache's %" PRId64 " pages", i, p,
                     c.num_pages);
      }
    }
    if (cache_access == Access::kWrite && geo.num_blocks > 1) {
      if (int rc = check_unique(r.block_table + geo.first_block, geo.num_blocks, c.num_pages,
                                geo.first_block);
          rc != KVB_OK) {
        return rc;
      }
    }
    // Layer regions (and the wire slice) must not overlap where we write.
    const uint64_t extent = layer_extent(c);
    std::vector<std::pair<uintptr_t, int64_t>> regions;
    for (int64_t l = geo.layer_start; l < geo.layer_end; ++l) {
      regions.emplace_back(reinterpret_cast<uintptr_t>(c.layer_base[l]), l);
    }
    std::sort(regions.begin(), regions.end());
    if (cache_access == Access::kWrite) {
      for (size_t i = 1; i < regions.size(); ++i) {
        if (regions[i].first - regions[i - 1].first < extent) {
          return failf(KVB_ERR_OVERLAP, "layers %" PRId64 " and %" PRId64 " overlap in memory",
                       regions[i - 1].second, regions[i].second);
        }
      }
    }
    if (check_wire_ptr && nbytes > 0) {
      const uintptr_t w0 = reinterpret_cast<uintptr_t>(wire);
      const uintptr_t w1 = w0 + nbytes;
      for (const auto& [b, l] : regions) {
        if (w0 < b + extent && b < w1) {
          return failf(KVB_ERR_OVERLAP, "the wire buffer overlaps layer %" PRId64 " of the cache",
                       l);
        }
      }
    }
  }
  *g = geo;
  return KVB_OK;
}

}  // namespace kvb

extern "C" int kvb_validate(const kvb_cache_desc* cache, const kvb_range* range,
                            uint64_t wire_offset, uint64_t nbytes) {
  KVB_GUARD_BEGIN
  kvb::Geometry g;
  return kvb::validate(cache, range, wire_offset, nbytes, nullptr, false, kvb::Access::kWrite, &g);
  KVB_GUARD_END
}

extern "C" uint64_t kvb_wire_nbytes(const kvb_cache_desc* cache, const kvb_range* range) {
  try {
    if (cache == nullptr || range == nullptr) return 0;
    const int64_t t = range->token_end - range->token_start;
    if (range->token_start < 0 || t < 0) return 0;
    // The size does not depend on the block table: check the shape with no tokens.
    kvb_range r = *range;
    r.token_end = r.token_start;
    r.block_table = nullptr;
    r.block_table_len = 0;
    kvb::Geometry g;
    if (kvb::validate(cache, &r, 0, 0, nullptr, false, kvb::Access::kRead, &g) != KVB_OK) return 0;
    const uint64_t per_token = static_cast<uint64_t>(g.layer_end - g.layer_start) *
                               static_cast<uint64_t>(g.num_components * g.token_bytes);
    uint64_t out = 0;
    if (__builtin_mul_overflow(per_token, static_cast<uint64_t>(t), &out)) return 0;
    return out;
  } catch (...) {
    return 0;
  }
}
