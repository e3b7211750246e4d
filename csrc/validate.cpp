// Validation of caches, ranges and slices: everything is checked before any byte moves.
#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <utility>
#include <vector>

#include "error.h"
#include "geometry.h"
#include "kvbridge/pack.h"
#include "runs.h"

namespace kvb {
namespace {

constexpr int64_t kMaxDim = int64_t{1} << 40;
constexpr int64_t kMaxStride = int64_t{1} << 56;
constexpr int64_t kMaxTokens = int64_t{1} << 48;  // token positions (keeps page math in range)

bool mul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

struct Axis {
  int64_t count, stride;
  const char* name;
};

// Points k_1*s_1 + ... + k_n*s_n (0 <= k_i < count_i), each the start of
// `unit` bytes, are pairwise disjoint if, sorted by stride, each axis steps
// over everything the smaller axes span.  Returns false and the first axis that
// does not (in *bad, with the span it fails to step over), or false with
// *overflow when the span does not fit in 64 bits.
bool strides_disjoint(std::vector<Axis> axes, int64_t unit, Axis* bad, int64_t* span_out,
                      bool* overflow) {
  *overflow = false;
  std::vector<Axis> used;
  for (const Axis& a : axes) {
    if (a.count > 1) used.push_back(a);
  }
  std::stable_sort(used.begin(), used.end(),
                   [](const Axis& x, const Axis& y) { return x.stride < y.stride; });
  int64_t span = unit;
  for (const Axis& a : used) {
    if (a.stride < span) {
      *bad = a;
      *span_out = span;
      return false;
    }
    int64_t s = 0;
    if (!mul(a.count - 1, a.stride, &s) || __builtin_add_overflow(s, span, &span)) {
      *overflow = true;
      return false;
    }
  }
  *span_out = span;
  return true;
}

Axis axis(int64_t count, int64_t stride, const char* name) { return Axis{count, stride, name}; }

// The (page, token, head, element) axes of component c.
std::vector<Axis> comp_axes(const CacheInfo& c, int comp, int64_t num_heads) {
  const CompStrides& s = c.comp[comp];
  return {axis(c.num_pages, s.page, "page"), axis(c.page_tokens, s.token, "token"),
          axis(num_heads, s.head, "head"), axis(c.elems_per_head(), s.elem, "element")};
}

// Whether the blocks (layer, component) for layers [l0, l1) provably never
// share a byte: either their address spans are disjoint, or their bases form a
// lattice base + l*sL + c*sC that interleaves them without collision (vLLM's
// block-outer layouts, K and V halves of one page).
bool lattice_disjoint(const CacheInfo& c, int64_t l0, int64_t l1, int64_t* first, int64_t* second) {
  const int C = c.num_components;
  const int64_t nl = l1 - l0;
  if (nl * C <= 1) return true;
  std::vector<std::pair<uintptr_t, int64_t>> spans;  // (lo, block index)
  for (int64_t l = l0; l < l1; ++l) {
    for (int k = 0; k < C; ++k) spans.emplace_back(c.at(l, k), (l - l0) * C + k);
  }
  std::sort(spans.begin(), spans.end());
  bool apart = true;
  for (size_t i = 1; i < spans.size() && apart; ++i) {
    const int k = static_cast<int>(spans[i - 1].second % C);
    if (spans[i].first - spans[i - 1].first < c.extent(k)) {
      apart = false;
      *first = l0 + spans[i - 1].second / C;
      *second = l0 + spans[i].second / C;
    }
  }
  if (apart) return true;
  // The lattice: every base must be base(l0, 0) + (l - l0) * sL + k * sC, strides >= 0.
  const uintptr_t b0 = c.at(l0, 0);
  const int64_t sl = nl > 1 ? static_cast<int64_t>(c.at(l0 + 1, 0) - b0) : 0;
  const int64_t sc = C > 1 ? static_cast<int64_t>(c.at(l0, 1) - b0) : 0;
  if (sl < 0 || sc < 0 || sl > kMaxStride || sc > kMaxStride) return false;
  for (int64_t l = l0; l < l1; ++l) {
    for (int k = 0; k < C; ++k) {
      if (c.at(l, k) != b0 + static_cast<uintptr_t>((l - l0) * sl + k * sc)) return false;
    }
  }
  // Axes shared by every component stay outer; the others make an inner box
  // of X bytes (the largest of the components'), which outer axes must step over.
  std::vector<Axis> a0 = comp_axes(c, 0, c.num_heads);
  std::vector<bool> outer(a0.size(), true);
  for (int k = 1; k < C; ++k) {
    std::vector<Axis> ak = comp_axes(c, k, c.num_heads);
    for (size_t i = 0; i < a0.size(); ++i) {
      if (ak[i].stride != a0[i].stride || ak[i].count != a0[i].count) outer[i] = false;
    }
  }
  int64_t inner = 0;
  for (bool changed = true; changed;) {
    changed = false;
    inner = 0;
    for (int k = 0; k < C; ++k) {
      std::vector<Axis> ak = comp_axes(c, k, c.num_heads);
      int64_t x = c.elem_bytes;
      for (size_t i = 0; i < ak.size(); ++i) {
        if (!outer[i] && ak[i].count > 1) x += (ak[i].count - 1) * ak[i].stride;
      }
      inner = std::max(inner, x);
    }
    for (size_t i = 0; i < a0.size(); ++i) {
      if (outer[i] && a0[i].count > 1 && a0[i].stride < inner) {
        outer[i] = false;
        changed = true;
      }
    }
  }
  std::vector<Axis> axes = {axis(nl, sl, "layer"), axis(C, sc, "component")};
  for (size_t i = 0; i < a0.size(); ++i) {
    if (outer[i]) axes.push_back(a0[i]);
  }
  Axis bad{};
  int64_t span = 0;
  bool overflow = false;
  return strides_disjoint(axes, inner, &bad, &span, &overflow);
}

// Whether the (layer, component) blocks of layers [l0, l1) never share a byte:
// the components of each layer are apart (lattice_disjoint on the layer), and
// the layers' spans are disjoint or all blocks form one lattice.  On false,
// *first and *second name the layers that may overlap (equal: within a layer).
bool blocks_disjoint(const CacheInfo& c, int64_t l0, int64_t l1, int64_t* first, int64_t* second) {
  if (c.num_components > 1) {
    for (int64_t l = l0; l < l1; ++l) {
      if (!lattice_disjoint(c, l, l + 1, first, second)) {
        *first = *second = l;
        return false;
      }
    }
  }
  if (l1 - l0 <= 1) return true;
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // [lo, hi) of each layer
  for (int64_t l = l0; l < l1; ++l) {
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (int k = 0; k < c.num_components; ++k) {
      lo = std::min(lo, c.at(l, k));
      hi = std::max(hi, c.at(l, k) + static_cast<uintptr_t>(c.extent(k)));
    }
    spans.emplace_back(lo, hi);
  }
  std::vector<size_t> order(spans.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return spans[a] < spans[b]; });
  bool apart = true;
  for (size_t i = 1; i < order.size() && apart; ++i) {
    if (spans[order[i]].first < spans[order[i - 1]].second) {
      apart = false;
      *first = l0 + static_cast<int64_t>(order[i - 1]);
      *second = l0 + static_cast<int64_t>(order[i]);
    }
  }
  if (apart) return true;
  int64_t a = 0, b = 0;
  return lattice_disjoint(c, l0, l1, &a, &b);
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

uint64_t CacheInfo::extent(int c) const {
  if (num_pages <= 0) return 0;
  // Bounded by check_cache(): no overflow for a descriptor that passed it.
  const CompStrides& s = comp[c];
  return static_cast<uint64_t>(elem_bytes + (num_pages - 1) * s.page + (page_tokens - 1) * s.token +
                               (num_heads - 1) * s.head + (elems_per_head() - 1) * s.elem);
}

int check_cache(const kvb_cache_desc* desc, CacheInfo* out) {
  if (desc == nullptr || out == nullptr) return fail(KVB_ERR_INVALID_ARG, "null cache descriptor");
  const kvb_cache_desc& d = *desc;
  if (d.abi_version < KVB_ABI_VERSION_MIN || d.abi_version > KVB_ABI_VERSION) {
    return failf(KVB_ERR_INVALID_ARG,
                 "cache descriptor abi_version %d, this library speaks %d to %d", d.abi_version,
                 KVB_ABI_VERSION_MIN, KVB_ABI_VERSION);
  }
  const bool v2 = d.abi_version >= 2;
  if (d.num_layers <= 0 || d.num_heads <= 0 || (d.num_components != 1 && d.num_components != 2)) {
    return failf(KVB_ERR_LAYOUT, "bad cache dims: num_layers=%d num_components=%d num_heads=%d",
                 d.num_layers, d.num_components, d.num_heads);
  }
  if (d.head_bytes <= 0 || d.head_bytes > kMaxDim || d.page_tokens <= 0 ||
      d.page_tokens > kMaxDim || d.num_pages < 0 || d.num_pages > kMaxDim) {
    return failf(KVB_ERR_LAYOUT,
                 "bad cache dims: head_bytes=%" PRId64 " page_tokens=%" PRId64
                 " num_pages=%" PRId64,
                 d.head_bytes, d.page_tokens, d.num_pages);
  }
  const int64_t eb = v2 && d.elem_bytes != 0 ? d.elem_bytes : d.head_bytes;
  if (eb <= 0 || d.head_bytes % eb != 0) {
    return failf(KVB_ERR_LAYOUT, "elem_bytes %" PRId64 " does not divide head_bytes %" PRId64, eb,
                 d.head_bytes);
  }
  const bool own_bases = v2 && d.component_base != nullptr;
  const bool own_strides = v2 && d.component_strides != nullptr;
  CacheInfo c;
  c.abi_version = d.abi_version;
  c.num_layers = d.num_layers;
  c.num_components = d.num_components;
  c.num_heads = d.num_heads;
  c.head_bytes = d.head_bytes;
  c.elem_bytes = eb;
  c.page_tokens = d.page_tokens;
  c.num_pages = d.num_pages;
  c.device = d.device;
  for (int k = 0; k < c.num_components; ++k) {
    CompStrides& s = c.comp[k];
    if (own_strides) {
      const int64_t* row = d.component_strides + 4 * k;
      s = CompStrides{row[0], row[1], row[2], row[3]};
    } else {
      s = CompStrides{d.stride_page, d.stride_token, d.stride_head, eb};
    }
    for (int64_t v : {s.page, s.token, s.head, s.elem}) {
      if (v < 0 || v > kMaxStride) {
        return failf(KVB_ERR_LAYOUT, "cache stride %" PRId64 " out of range [0, 2^56]", v);
      }
    }
  }
  if (!own_bases) {
    for (int64_t v : {d.stride_component}) {
      if (v < 0 || v > kMaxStride) {
        return failf(KVB_ERR_LAYOUT, "cache stride %" PRId64 " out of range [0, 2^56]", v);
      }
    }
  }
  // Distinct (page, token, head, element) slots of each component never overlap.
  for (int k = 0; k < c.num_components; ++k) {
    Axis bad{};
    int64_t span = 0;
    bool overflow = false;
    if (!strides_disjoint(comp_axes(c, k, c.num_heads), c.elem_bytes, &bad, &span, &overflow)) {
      if (overflow) {
        return fail(KVB_ERR_LAYOUT, "cache layout spans more bytes than fit in 64 bits");
      }
      return failf(KVB_ERR_LAYOUT,
                   "%s stride %" PRId64 " is smaller than the %" PRId64
                   " bytes the inner axes span: distinct slots would overlap",
                   bad.name, bad.stride, span);
    }
  }
  if (own_bases) {
    c.base.resize(static_cast<size_t>(c.num_layers) * c.num_components);
    for (size_t i = 0; i < c.base.size(); ++i) {
      c.base[i] = reinterpret_cast<uintptr_t>(d.component_base[i]);
    }
    // The components of each layer never overlap.
    for (int32_t l = 0; l < c.num_layers && c.num_components == 2; ++l) {
      if (c.at(l, 0) == 0 || c.at(l, 1) == 0) continue;
      int64_t a = 0, b = 0;
      if (!lattice_disjoint(c, l, l + 1, &a, &b)) {
        return failf(KVB_ERR_LAYOUT, "the two components of layer %d overlap in memory", l);
      }
    }
  } else {
    if (d.layer_base == nullptr) return fail(KVB_ERR_INVALID_ARG, "layer_base is null");
    // The components of a layer, stride_component apart, never overlap.
    if (c.num_components == 2) {
      CacheInfo probe = c;
      probe.num_layers = 1;
      probe.base = {0x1000, 0x1000 + static_cast<uintptr_t>(d.stride_component)};
      int64_t a = 0, b = 0;
      if (!lattice_disjoint(probe, 0, 1, &a, &b)) {
        return failf(KVB_ERR_LAYOUT,
                     "component stride %" PRId64
                     " is smaller than the bytes a component spans: K and V would overlap",
                     d.stride_component);
      }
    }
    c.base.resize(static_cast<size_t>(c.num_layers) * c.num_components);
    for (int32_t l = 0; l < c.num_layers; ++l) {
      const uintptr_t b = reinterpret_cast<uintptr_t>(d.layer_base[l]);
      for (int k = 0; k < c.num_components; ++k) {
        c.base[static_cast<size_t>(l * c.num_components + k)] =
            b == 0 ? 0 : b + static_cast<uintptr_t>(k * d.stride_component);
      }
    }
  }
  *out = std::move(c);
  return KVB_OK;
}

int check_range(const CacheInfo& c, const kvb_range* range, Access access, PlanInfo* out) {
  if (range == nullptr || out == nullptr) return fail(KVB_ERR_INVALID_ARG, "null range");
  const kvb_range& r = *range;
  if (r.token_start < 0 || r.token_end < r.token_start || r.token_end > kMaxTokens) {
    return failf(KVB_ERR_INVALID_ARG, "bad token range [%" PRId64 ", %" PRId64 ")", r.token_start,
                 r.token_end);
  }
  if (r.layer_start < 0 || r.layer_end < r.layer_start || r.layer_end > c.num_layers) {
    return failf(KVB_ERR_INVALID_ARG, "bad layer range [%d, %d) for a cache of %d layers",
                 r.layer_start, r.layer_end, c.num_layers);
  }
  int64_t h0 = 0, h1 = c.num_heads;
  if (c.abi_version >= 2 && (r.head_start != 0 || r.head_end != 0)) {
    h0 = r.head_start;
    h1 = r.head_end;
    if (h0 < 0 || h1 <= h0 || h1 > c.num_heads) {
      return failf(KVB_ERR_INVALID_ARG,
                   "head range [%d, %d) is outside the cache's %d heads (or empty)", r.head_start,
                   r.head_end, c.num_heads);
    }
  }
  PlanInfo p;
  p.cache = &c;
  p.writable = access == Access::kWrite;
  Geometry& g = p.g;
  g.layer_start = r.layer_start;
  g.layer_end = r.layer_end;
  g.num_components = c.num_components;
  g.head_start = h0;
  g.num_heads = h1 - h0;
  g.head_bytes = c.head_bytes;
  g.elem_bytes = c.elem_bytes;
  g.page_tokens = c.page_tokens;
  g.token_start = r.token_start;
  g.num_tokens = r.token_end - r.token_start;
  int64_t blocks_wire = 0;
  int64_t total = 0;
  if (!mul(g.num_heads, c.head_bytes, &g.token_bytes) ||
      !mul(g.num_tokens, g.token_bytes, &g.block_bytes) ||
      !mul(g.layer_end - g.layer_start, g.num_components, &blocks_wire) ||
      !mul(blocks_wire, g.block_bytes, &total)) {
    return fail(KVB_ERR_INVALID_ARG, "wire size of the range overflows 64 bits");
  }
  g.total_bytes = static_cast<uint64_t>(total);
  if (g.num_tokens > 0 && g.layer_end > g.layer_start) {
    for (int64_t l = g.layer_start; l < g.layer_end; ++l) {
      for (int k = 0; k < c.num_components; ++k) {
        if (c.at(l, k) == 0) {
          return c.abi_version >= 2 && c.num_components == 2 && k == 1
                     ? failf(KVB_ERR_INVALID_ARG,
                             "the base of layer %" PRId64 " component %d is null", l, k)
                     : failf(KVB_ERR_INVALID_ARG, "layer_base[%" PRId64 "] is null", l);
        }
      }
    }
  }
  if (g.num_tokens > 0) {
    g.first_block = r.token_start / c.page_tokens;
    const int64_t last_block = (r.token_end - 1) / c.page_tokens;
    g.num_blocks = last_block - g.first_block + 1;
    if (r.block_table == nullptr) return fail(KVB_ERR_INVALID_ARG, "block_table is null");
    if (r.block_table_len <= last_block) {
      return failf(KVB_ERR_OUT_OF_RANGE,
                   "block table has %" PRId64 " entries; tokens [%" PRId64 ", %" PRId64
                   ") with %" PRId64 "-token pages need %" PRId64,
                   r.block_table_len, r.token_start, r.token_end, c.page_tokens, last_block + 1);
    }
    for (int64_t i = g.first_block; i <= last_block; ++i) {
      const int32_t pg = r.block_table[i];
      if (pg < 0 || pg >= c.num_pages) {
        return failf(KVB_ERR_OUT_OF_RANGE,
                     "block_table[%" PRId64 "] = %d is outside the cache's %" PRId64 " pages", i,
                     pg, c.num_pages);
      }
    }
    if (access == Access::kWrite && g.num_blocks > 1) {
      if (int rc =
              check_unique(r.block_table + g.first_block, g.num_blocks, c.num_pages, g.first_block);
          rc != KVB_OK) {
        return rc;
      }
    }
    if (access == Access::kWrite && g.layer_end > g.layer_start) {
      int64_t a = 0, b = 0;
      if (!blocks_disjoint(c, g.layer_start, g.layer_end, &a, &b)) {
        return a == b ? failf(KVB_ERR_OVERLAP,
                              "the components of layer %" PRId64 " overlap in memory", a)
                      : failf(KVB_ERR_OVERLAP,
                              "layers %" PRId64 " and %" PRId64 " overlap in memory", a, b);
      }
    }
    p.pages.assign(r.block_table + g.first_block, r.block_table + g.first_block + g.num_blocks);
    for (int k = 0; k < c.num_components; ++k) {
      if (k > 0 && c.comp[k].page == c.comp[0].page && c.comp[k].token == c.comp[0].token) {
        p.runs[k] = p.runs[0];
      } else {
        p.runs[k] = token_runs(g, c.comp[k], p.pages.data());
      }
    }
  }
  *out = std::move(p);
  out->cache = &c;
  return KVB_OK;
}

int check_slice(const PlanInfo& p, uint64_t wire_offset, uint64_t nbytes, const void* wire,
                bool check_ptr) {
  const Geometry& g = p.g;
  if (wire_offset > g.total_bytes || nbytes > g.total_bytes - wire_offset) {
    return failf(KVB_ERR_INVALID_ARG,
                 "slice [%" PRIu64 ", +%" PRIu64 ") is outside the %" PRIu64
                 "-byte wire buffer of the range",
                 wire_offset, nbytes, g.total_bytes);
  }
  if (!check_ptr || nbytes == 0) return KVB_OK;
  if (wire == nullptr) return fail(KVB_ERR_INVALID_ARG, "wire buffer pointer is null");
  if (g.num_tokens == 0) return KVB_OK;
  const CacheInfo& c = *p.cache;
  const uintptr_t w0 = reinterpret_cast<uintptr_t>(wire);
  const uintptr_t w1 = w0 + nbytes;
  for (int64_t l = g.layer_start; l < g.layer_end; ++l) {
    for (int k = 0; k < c.num_components; ++k) {
      const uintptr_t b = c.at(l, k);
      if (w0 < b + c.extent(k) && b < w1) {
        return failf(KVB_ERR_OVERLAP, "the wire buffer overlaps layer %" PRId64 " of the cache", l);
      }
    }
  }
  return KVB_OK;
}

}  // namespace kvb

namespace {

// The per-call entry points' check: descriptor, range, then slice.
int check_all(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset,
              uint64_t nbytes, kvb::CacheInfo* c, kvb::PlanInfo* p) {
  if (cache == nullptr || range == nullptr) {
    return kvb::fail(KVB_ERR_INVALID_ARG, "null cache descriptor or range");
  }
  if (int rc = kvb::check_cache(cache, c); rc != KVB_OK) return rc;
  if (int rc = kvb::check_range(*c, range, kvb::Access::kWrite, p); rc != KVB_OK) return rc;
  return kvb::check_slice(*p, wire_offset, nbytes, nullptr, false);
}

}  // namespace

extern "C" int kvb_validate(const kvb_cache_desc* cache, const kvb_range* range,
                            uint64_t wire_offset, uint64_t nbytes) {
  KVB_GUARD_BEGIN
  kvb::CacheInfo c;
  kvb::PlanInfo p;
  return check_all(cache, range, wire_offset, nbytes, &c, &p);
  KVB_GUARD_END
}

extern "C" uint64_t kvb_wire_nbytes(const kvb_cache_desc* cache, const kvb_range* range) {
  try {
    if (cache == nullptr || range == nullptr) return 0;
    const int64_t t = range->token_end - range->token_start;
    if (range->token_start < 0 || t < 0) return 0;
    // The size does not depend on the block table: check the shape with no tokens.
    // (An ABI 1 caller's range has no head fields: copy field by field.)
    kvb::CacheInfo c;
    kvb::PlanInfo p;
    if (kvb::check_cache(cache, &c) != KVB_OK) return 0;
    kvb_range r{};
    r.token_start = range->token_start;
    r.token_end = range->token_start;
    r.layer_start = range->layer_start;
    r.layer_end = range->layer_end;
    if (c.abi_version >= 2) {
      r.head_start = range->head_start;
      r.head_end = range->head_end;
    }
    if (kvb::check_range(c, &r, kvb::Access::kRead, &p) != KVB_OK) return 0;
    const kvb::Geometry& g = p.g;
    const uint64_t per_token = static_cast<uint64_t>(g.layer_end - g.layer_start) *
                               static_cast<uint64_t>(g.num_components * g.token_bytes);
    uint64_t out = 0;
    if (__builtin_mul_overflow(per_token, static_cast<uint64_t>(t), &out)) return 0;
    return out;
  } catch (...) {
    return 0;
  }
}
