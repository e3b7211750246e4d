// The pack core under AddressSanitizer + UBSan (`make asan`): random layouts
// checked against a naive per-byte reference, slices and threads, unpack in
// shuffled chunks, every validation error, and the CUDA kernel's per-row copy
// (wire_map.h) run on the CPU lane by lane.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "geometry.h"
#include "kvbridge/pack.h"
#include "wire_map.h"
#include "xxh3.h"

namespace {

int g_failures = 0;
int g_checks = 0;
int g_vector_runs = 0;   // emulated kernel calls on the 16-byte path
int g_byte_runs = 0;     // ... on the byte path
int g_packed_cases = 0;  // ABI 2 caches with K and V side by side in each slot

#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    ++g_checks;                                                            \
    if (!(cond)) {                                                         \
      ++g_failures;                                                        \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                   \
      std::fprintf(stderr, "\n");                                          \
    }                                                                      \
  } while (0)

enum class Order { kKvFirstNHD, kPageFirstNHD, kKvFirstHND, kPageFirstHND, kMLA };

struct TestCache {
  int32_t layers, comps, heads;
  int64_t hb, pt, pages;
  Order order;
  bool stacked;
  std::vector<uint8_t> storage;
  std::vector<void*> bases;
  kvb_cache_desc desc{};

  int64_t layer_bytes() const { return comps * pages * pt * heads * hb; }
};

TestCache make_cache(int32_t layers, int32_t heads, int64_t hb, int64_t pt, int64_t pages,
                     Order order, bool stacked) {
  TestCache c{layers,
              order == Order::kMLA ? 1 : 2,
              order == Order::kMLA ? 1 : heads,
              hb,
              pt,
              pages,
              order,
              stacked,
              {},
              {},
              {}};
  const int64_t page_inner = c.pt * c.heads * c.hb;
  int64_t sc = 0, sp = 0, st = 0, sh = 0;
  const bool hnd = order == Order::kKvFirstHND || order == Order::kPageFirstHND;
  st = hnd ? c.hb : c.heads * c.hb;
  sh = hnd ? c.pt * c.hb : c.hb;
  switch (order) {
    case Order::kKvFirstNHD:
    case Order::kKvFirstHND:
      sc = c.pages * page_inner;
      sp = page_inner;
      break;
    case Order::kPageFirstNHD:
    case Order::kPageFirstHND:
      sc = page_inner;
      sp = 2 * page_inner;
      break;
    case Order::kMLA:
      sc = 0;
      sp = page_inner;
      break;
  }
  // Per-layer tensors get a gap between them (and an odd shift when not
  // stacked) so that layer bases are not one constant stride apart.
  const int64_t lb = c.layer_bytes();
  const int64_t gap = stacked ? 0 : 48;
  c.storage.resize(static_cast<size_t>(layers * (lb + gap) + 64));
  for (int32_t l = 0; l < layers; ++l) {
    c.bases.push_back(c.storage.data() + 16 + l * (lb + gap));
  }
  c.desc.abi_version = KVB_ABI_VERSION;
  c.desc.num_layers = layers;
  c.desc.num_components = c.comps;
  c.desc.num_heads = c.heads;
  c.desc.head_bytes = c.hb;
  c.desc.page_tokens = c.pt;
  c.desc.num_pages = c.pages;
  c.desc.stride_component = sc;
  c.desc.stride_page = sp;
  c.desc.stride_token = st;
  c.desc.stride_head = sh;
  c.desc.layer_base = c.bases.data();
  c.desc.device = -1;
  return c;
}

void fill_random(std::vector<uint8_t>& v, std::mt19937_64& rng) {
  for (auto& b : v) b = static_cast<uint8_t>(rng());
}

// Naive reference: address of (l, c, t, h) byte 0.
uint8_t* ref_addr(const TestCache& c, const std::vector<int32_t>& bt, int32_t l, int64_t comp,
                  int64_t tok, int64_t h) {
  const int64_t page = bt[static_cast<size_t>(tok / c.pt)];
  const int64_t slot = tok % c.pt;
  return static_cast<uint8_t*>(c.bases[static_cast<size_t>(l)]) + comp * c.desc.stride_component +
         page * c.desc.stride_page + slot * c.desc.stride_token + h * c.desc.stride_head;
}

std::vector<uint8_t> ref_pack(const TestCache& c, const std::vector<int32_t>& bt, int64_t s,
                              int64_t e, int32_t l0, int32_t l1) {
  std::vector<uint8_t> out;
  for (int32_t l = l0; l < l1; ++l)
    for (int64_t comp = 0; comp < c.comps; ++comp)
      for (int64_t t = s; t < e; ++t)
        for (int64_t h = 0; h < c.heads; ++h) {
          const uint8_t* p = ref_addr(c, bt, l, comp, t, h);
          out.insert(out.end(), p, p + c.hb);
        }
  return out;
}

struct Case {
  TestCache cache;
  std::vector<int32_t> bt;
  kvb_range range{};
};

Case make_case(std::mt19937_64& rng, Order order, bool stacked, int64_t pt, bool adjacent) {
  const int32_t layers = 3;
  const int64_t pages = 12;
  Case k{make_cache(layers, 3, 32, pt, pages, order, stacked), {}, {}};
  fill_random(k.cache.storage, rng);
  k.bt.resize(static_cast<size_t>(pages));
  std::iota(k.bt.begin(), k.bt.end(), 0);
  if (!adjacent) std::shuffle(k.bt.begin(), k.bt.end(), rng);
  const int64_t max_tok = pages * pt;
  int64_t s = static_cast<int64_t>(rng() % static_cast<uint64_t>(max_tok));
  int64_t e = s + static_cast<int64_t>(rng() % static_cast<uint64_t>(max_tok - s + 1));
  k.range.token_start = s;
  k.range.token_end = e;
  k.range.layer_start = static_cast<int32_t>(rng() % 2);
  k.range.layer_end = layers - static_cast<int32_t>(rng() % 2);
  k.range.block_table = k.bt.data();
  k.range.block_table_len = static_cast<int64_t>(k.bt.size());
  return k;
}

// Runs the CUDA kernel's per-row copy on the CPU for the slice [lo, lo + n).
template <bool kPack>
void emulate_kernel_desc(const kvb_cache_desc& desc, const kvb_range& range, uint64_t lo,
                         uint8_t* wire, uint64_t n, uint32_t lanes) {
  kvb::CacheInfo c;
  kvb::PlanInfo p;
  int rc = kvb::check_cache(&desc, &c);
  if (rc == KVB_OK) {
    rc = kvb::check_range(c, &range, kPack ? kvb::Access::kRead : kvb::Access::kWrite, &p);
  }
  if (rc == KVB_OK) rc = kvb::check_slice(p, lo, n, wire, true);
  CHECK(rc == KVB_OK, "validate: %s", kvb_last_error());
  if (rc != KVB_OK || n == 0) return;
  std::vector<uint64_t> bases(c.base.begin() + p.g.layer_start * c.num_components, c.base.end());
  const bool aligned = kvb::row_copy_aligned(p, wire, lo);
  ++(aligned ? g_vector_runs : g_byte_runs);
  const kvb::RowCopy d = kvb::make_row_copy(p, lo, n, bases.data(), p.pages.data(), wire, aligned);
  for (uint64_t i = 0; i < d.num_rows; ++i)
    for (uint32_t lane = 0; lane < lanes; ++lane)
      kvb::copy_row<kPack>(d, d.row_first + i, lane, lanes);
}

template <bool kPack>
void emulate_kernel(const Case& k, uint64_t lo, uint8_t* wire, uint64_t n, uint32_t lanes) {
  emulate_kernel_desc<kPack>(k.cache.desc, k.range, lo, wire, n, lanes);
}

void test_roundtrips() {
  std::mt19937_64 rng(1234);
  const Order orders[] = {Order::kKvFirstNHD, Order::kPageFirstNHD, Order::kKvFirstHND,
                          Order::kPageFirstHND, Order::kMLA};
  for (Order order : orders)
    for (bool stacked : {false, true})
      for (int64_t pt : {1, 5, 16})
        for (bool adjacent : {false, true})
          for (int rep = 0; rep < 3; ++rep) {
            Case k = make_case(rng, order, stacked, pt, adjacent);
            const auto& r = k.range;
            const std::vector<uint8_t> ref =
                ref_pack(k.cache, k.bt, r.token_start, r.token_end, r.layer_start, r.layer_end);
            CHECK(kvb_wire_nbytes(&k.cache.desc, &k.range) == ref.size(), "wire_nbytes");
            for (int threads : {1, 3}) {
              kvb_exec ex{threads, 0};
              std::vector<uint8_t> wire(ref.size() + 1, 0xAB);
              int rc = kvb_pack_cpu(&k.cache.desc, &k.range, 0, wire.data(), ref.size(), &ex);
              CHECK(rc == KVB_OK, "pack: %s", kvb_last_error());
              CHECK(std::equal(ref.begin(), ref.end(), wire.begin()), "pack bytes differ");
              CHECK(wire.back() == 0xAB, "pack wrote past the slice");
            }
            // Slices at odd boundaries, packed separately.
            const uint64_t total = ref.size();
            std::vector<uint64_t> cuts{0, total};
            for (int i = 0; i < 5 && total > 0; ++i) cuts.push_back(rng() % (total + 1));
            std::sort(cuts.begin(), cuts.end());
            for (size_t i = 0; i + 1 < cuts.size(); ++i) {
              const uint64_t a = cuts[i], n = cuts[i + 1] - cuts[i];
              std::vector<uint8_t> part(n + 1, 0xCD);
              int rc = kvb_pack_cpu(&k.cache.desc, &k.range, a, part.data(), n, nullptr);
              CHECK(rc == KVB_OK, "slice pack: %s", kvb_last_error());
              CHECK(std::equal(part.begin(), part.begin() + static_cast<long>(n),
                               ref.begin() + static_cast<long>(a)),
                    "slice [%llu,+%llu) differs", (unsigned long long)a, (unsigned long long)n);
              // The kernel's math, on an odd-aligned buffer and an aligned one.
              for (uint32_t lanes : {1u, 4u}) {
                std::vector<uint8_t> kw(n + 32, 0);
                uint8_t* dst =
                    kw.data() + (lanes == 1 ? (a + 1) % 16 : a % 16);  // misaligned, aligned
                emulate_kernel<true>(k, a, dst, n, lanes);
                CHECK(std::equal(dst, dst + n, ref.begin() + static_cast<long>(a)),
                      "kernel emulation pack slice differs (lanes %u)", lanes);
              }
            }
            // Unpack: chunks in shuffled order into a zeroed twin cache.
            for (int mode = 0; mode < 2; ++mode) {
              Case dst = k;
              dst.cache.bases.clear();
              const int64_t lb = dst.cache.layer_bytes();
              const int64_t gap = dst.cache.stacked ? 0 : 48;
              for (int32_t l = 0; l < dst.cache.layers; ++l)
                dst.cache.bases.push_back(dst.cache.storage.data() + 16 + l * (lb + gap));
              dst.cache.desc.layer_base = dst.cache.bases.data();
              dst.range.block_table = dst.bt.data();
              std::fill(dst.cache.storage.begin(), dst.cache.storage.end(), 0);
              std::vector<size_t> order_idx(cuts.size() - 1);
              std::iota(order_idx.begin(), order_idx.end(), 0);
              std::shuffle(order_idx.begin(), order_idx.end(), rng);
              for (size_t i : order_idx) {
                const uint64_t a = cuts[i], n = cuts[i + 1] - cuts[i];
                std::vector<uint8_t> chunk(ref.begin() + static_cast<long>(a),
                                           ref.begin() + static_cast<long>(a + n));
                if (mode == 0) {
                  kvb_exec ex{2, 0};
                  int rc = kvb_unpack_cpu(&dst.cache.desc, &dst.range, a, chunk.data(), n, &ex);
                  CHECK(rc == KVB_OK, "unpack: %s", kvb_last_error());
                } else {
                  emulate_kernel<false>(dst, a, chunk.data(), n, 3);
                }
              }
              const std::vector<uint8_t> back = ref_pack(dst.cache, dst.bt, r.token_start,
                                                         r.token_end, r.layer_start, r.layer_end);
              CHECK(back == ref, "unpack round trip differs (mode %d)", mode);
              // Nothing outside the range was written.
              const uint64_t written =
                  std::count_if(dst.cache.storage.begin(), dst.cache.storage.end(),
                                [](uint8_t b) { return b != 0; });
              CHECK(written <= ref.size(), "unpack wrote outside the range (mode %d)", mode);
            }
          }
}

void expect(int rc, int want, const char* what) {
  CHECK(rc == want, "%s: got %s (%s), want %s", what, kvb_status_name(rc), kvb_last_error(),
        kvb_status_name(want));
  if (want != KVB_OK) CHECK(std::strlen(kvb_last_error()) > 0, "%s: empty message", what);
}

void test_errors() {
  std::mt19937_64 rng(7);
  Case k = make_case(rng, Order::kKvFirstNHD, false, 4, false);
  k.range.token_start = 2;
  k.range.token_end = 30;
  k.range.layer_start = 0;
  k.range.layer_end = 3;
  const uint64_t total = kvb_wire_nbytes(&k.cache.desc, &k.range);
  std::vector<uint8_t> wire(total);
  auto pack = [&](const Case& c, uint64_t off, uint64_t n) {
    return kvb_pack_cpu(&c.cache.desc, &c.range, off, wire.data(), n, nullptr);
  };
  auto unpack = [&](const Case& c, uint64_t off, uint64_t n) {
    return kvb_unpack_cpu(&c.cache.desc, &c.range, off, wire.data(), n, nullptr);
  };
  expect(pack(k, 0, total), KVB_OK, "good call");
  expect(kvb_pack_cpu(nullptr, &k.range, 0, wire.data(), total, nullptr), KVB_ERR_INVALID_ARG,
         "null cache");
  expect(kvb_pack_cpu(&k.cache.desc, &k.range, 0, nullptr, total, nullptr), KVB_ERR_INVALID_ARG,
         "null dst");
  expect(pack(k, 1, total), KVB_ERR_INVALID_ARG, "slice past the end");
  expect(pack(k, UINT64_MAX, 2), KVB_ERR_INVALID_ARG, "slice offset overflow");
  {
    Case b = k;
    b.bt[3] = 12;  // pages = 12
    b.range.block_table = b.bt.data();
    expect(pack(b, 0, total), KVB_ERR_OUT_OF_RANGE, "page id too large");
    b.bt[3] = -1;
    expect(pack(b, 0, total), KVB_ERR_OUT_OF_RANGE, "negative page id");
  }
  {
    Case b = k;
    b.range.block_table = b.bt.data();
    b.range.block_table_len = 7;  // tokens up to 30 need 8 entries of 4
    expect(pack(b, 0, total), KVB_ERR_OUT_OF_RANGE, "short block table");
    b.range.block_table = nullptr;
    expect(pack(b, 0, total), KVB_ERR_INVALID_ARG, "null block table");
  }
  {
    Case b = k;
    b.bt[4] = b.bt[5];
    b.range.block_table = b.bt.data();
    expect(pack(b, 0, total), KVB_OK, "repeated page is fine to read");
    std::vector<uint8_t> before = b.cache.storage;
    expect(unpack(b, 0, total), KVB_ERR_OVERLAP, "repeated page on unpack");
    CHECK(before == b.cache.storage, "a failed unpack wrote");
    b.bt[4] = b.bt[0];  // entry 0 is outside the range (tokens 2..) only partly: still covered
    expect(unpack(b, 0, total), KVB_ERR_OVERLAP, "repeat of the first covered entry");
  }
  {
    Case b = k;
    b.range.block_table = b.bt.data();
    b.cache.desc.layer_base = b.cache.bases.data();
    b.cache.bases[1] = b.cache.bases[0];
    expect(unpack(b, 0, total), KVB_ERR_OVERLAP, "aliased layers on unpack");
    expect(kvb_unpack_cpu(&k.cache.desc, &k.range, 0, k.cache.bases[1], 64, nullptr),
           KVB_ERR_OVERLAP, "wire buffer inside the cache");
    b.cache.bases[1] = nullptr;
    expect(pack(b, 0, total), KVB_ERR_INVALID_ARG, "null layer base");
  }
  {
    Case b = k;
    b.range.block_table = b.bt.data();
    b.cache.desc.layer_base = b.cache.bases.data();
    b.cache.desc.stride_token = 16;  // < heads * head_bytes
    expect(pack(b, 0, total), KVB_ERR_LAYOUT, "overlapping strides");
    b.cache.desc.stride_token = -96;
    expect(pack(b, 0, total), KVB_ERR_LAYOUT, "negative stride");
    b.cache.desc = k.cache.desc;
    b.cache.desc.num_components = 3;
    expect(pack(b, 0, total), KVB_ERR_LAYOUT, "three components");
    b.cache.desc = k.cache.desc;
    b.cache.desc.abi_version = 99;
    expect(pack(b, 0, total), KVB_ERR_INVALID_ARG, "abi version");
    b.cache.desc = k.cache.desc;
    b.cache.desc.device = 0;
    expect(pack(b, 0, total), KVB_ERR_INVALID_ARG, "CUDA cache on the CPU path");
  }
  {
    Case b = k;
    b.range.block_table = b.bt.data();
    b.range.token_end = 1;
    expect(pack(b, 0, 0), KVB_ERR_INVALID_ARG, "end before start");
    b.range = k.range;
    b.range.token_start = 0;
    b.range.token_end = INT64_MAX;
    expect(pack(b, 0, 0), KVB_ERR_INVALID_ARG, "absurd token range");
    b.range = k.range;
    b.range.layer_end = 4;
    expect(pack(b, 0, 0), KVB_ERR_INVALID_ARG, "layer range past the cache");
  }
  {
    kvb_exec ex{-1, 0};
    expect(kvb_pack_cpu(&k.cache.desc, &k.range, 0, wire.data(), total, &ex), KVB_ERR_INVALID_ARG,
           "negative threads");
  }
  {
    Case b = k;
    b.range.block_table = b.bt.data();
    b.range.token_end = b.range.token_start;
    expect(pack(b, 0, 0), KVB_OK, "empty range");
    CHECK(kvb_wire_nbytes(&b.cache.desc, &b.range) == 0, "empty range has no bytes");
  }
  expect(kvb_validate(&k.cache.desc, &k.range, 0, total), KVB_OK, "validate");
  {
    // A cache with millions of pages: the repeated-page check sorts instead
    // of using a bitmap.  kvb_validate reads no cache memory.
    kvb_cache_desc big = k.cache.desc;
    big.num_pages = int64_t{1} << 22;
    big.stride_component = big.stride_page;
    big.stride_page = 2 * big.stride_component;
    std::vector<int32_t> ids{7, 1 << 21, 5, (1 << 22) - 1};
    kvb_range r{0, 16, 0, 1, ids.data(), 4};
    expect(kvb_validate(&big, &r, 0, 0), KVB_OK, "unique pages of a large cache");
    ids[2] = 1 << 21;
    expect(kvb_validate(&big, &r, 0, 0), KVB_ERR_OVERLAP, "repeated page of a large cache");
  }
#ifndef KVBRIDGE_HAS_CUDA
  expect(kvb_pack_cuda(&k.cache.desc, &k.range, 0, wire.data(), total, nullptr),
         KVB_ERR_UNAVAILABLE, "CUDA without CUDA");
  CHECK(kvb_built_with_cuda() == 0, "built_with_cuda");
#endif
  CHECK(kvb_cuda_device_count() >= 0, "device count");
  CHECK(std::string(kvb_status_name(KVB_ERR_OVERLAP)) == "KVB_ERR_OVERLAP", "status name");
}

// A large job to exercise the thread pool (and repeated pool use).
void test_threads() {
  std::mt19937_64 rng(99);
  TestCache c = make_cache(2, 8, 256, 16, 64, Order::kKvFirstNHD, true);
  fill_random(c.storage, rng);
  std::vector<int32_t> bt(64);
  std::iota(bt.begin(), bt.end(), 0);
  std::shuffle(bt.begin(), bt.end(), rng);
  kvb_range r{3, 64 * 16 - 5, 0, 2, bt.data(), 64};
  const std::vector<uint8_t> ref = ref_pack(c, bt, 3, 64 * 16 - 5, 0, 2);
  for (int threads : {0, 2, 8}) {
    std::vector<uint8_t> wire(ref.size());
    kvb_exec ex{threads, 0};
    int rc = kvb_pack_cpu(&c.desc, &r, 0, wire.data(), wire.size(), &ex);
    CHECK(rc == KVB_OK && wire == ref, "threaded pack (%d threads)", threads);
  }
}

// ---- ABI 2: random descriptors with per-component strides, strided head
// elements, separate component bases and head sub-ranges, through plans.
struct V2Cache {
  int32_t L, C, H;
  int64_t E, eb, pt, P;
  std::vector<std::vector<uint8_t>> blocks;  // one allocation per (layer, component)
  std::vector<void*> bases;
  std::vector<std::pair<size_t, int64_t>> where;  // (block, offset) of each base
  std::vector<int64_t> strides;                   // C x {page, token, head, elem}
  kvb_cache_desc desc{};

  uint8_t* addr(int32_t l, int32_t c, int64_t page, int64_t slot, int64_t h, int64_t e) const {
    const int64_t* s = &strides[static_cast<size_t>(4 * c)];
    return static_cast<uint8_t*>(bases[static_cast<size_t>(l * C + c)]) + page * s[0] +
           slot * s[1] + h * s[2] + e * s[3];
  }
};

V2Cache make_v2(std::mt19937_64& rng) {
  V2Cache v;
  v.L = 1 + static_cast<int32_t>(rng() % 3);
  v.C = 1 + static_cast<int32_t>(rng() % 2);
  v.H = 1 + static_cast<int32_t>(rng() % 4);
  v.E = 1 + static_cast<int64_t>(rng() % 5);
  const int64_t ebs[] = {1, 2, 4};
  v.eb = ebs[rng() % 3];
  v.pt = 1 + static_cast<int64_t>(rng() % 6);
  v.P = 3 + static_cast<int64_t>(rng() % 6);
  int64_t extent = 0;
  // Sometimes K and V side by side in each slot, as vLLM packs them.
  const bool packed = v.C == 2 && rng() % 3 == 0;
  g_packed_cases += packed ? 1 : 0;
  for (int32_t c = 0; c < v.C; ++c) {
    if (packed && c == 1) {
      for (int i = 0; i < 4; ++i) v.strides.push_back(v.strides[static_cast<size_t>(i)]);
      break;
    }
    // A random physical order of (page, token, head, element), dense plus padding.
    int order[4] = {0, 1, 2, 3};
    std::shuffle(order, order + 4, rng);
    const int64_t count[4] = {v.P, v.pt, v.H, v.E};
    int64_t st[4] = {0, 0, 0, 0};
    int64_t cur = v.eb;
    if (packed) {  // elements innermost, then the two components
      std::rotate(order, std::find(order, order + 4, 3), order + 4);
      std::rotate(order, order + 1, order + 4);  // element last
      st[3] = v.eb;
      cur = 2 * v.E * v.eb;
    }
    for (int i = packed ? 2 : 3; i >= 0; --i) {
      const int ax = order[i];
      st[ax] = cur + v.eb * static_cast<int64_t>(rng() % 2);  // sometimes padded
      cur = st[ax] * count[ax];
    }
    for (int64_t x : st) v.strides.push_back(x);
    extent = std::max(extent, cur);
  }
  for (int32_t l = 0; l < v.L; ++l) {
    for (int32_t c = 0; c < v.C; ++c) {
      v.blocks.emplace_back(static_cast<size_t>(extent + 64));
      for (auto& b : v.blocks.back()) b = static_cast<uint8_t>(rng());
      if (packed && c == 1) {  // V right after K in the layer's block
        v.where.emplace_back(v.where.back().first, v.where.back().second + v.E * v.eb);
      } else {
        v.where.emplace_back(v.blocks.size() - 1, static_cast<int64_t>(rng() % 7));
      }
      v.bases.push_back(v.blocks[v.where.back().first].data() + v.where.back().second);
    }
  }
  kvb_cache_desc& d = v.desc;
  d.abi_version = KVB_ABI_VERSION;
  d.num_layers = v.L;
  d.num_components = v.C;
  d.num_heads = v.H;
  d.head_bytes = v.E * v.eb;
  d.page_tokens = v.pt;
  d.num_pages = v.P;
  d.layer_base = nullptr;
  d.device = -1;
  d.elem_bytes = v.eb;
  d.component_strides = v.strides.data();
  d.component_base = v.bases.data();
  return v;
}

std::vector<uint8_t> v2_ref(const V2Cache& v, const std::vector<int32_t>& bt, const kvb_range& r) {
  const int64_t h0 = r.head_start, h1 = r.head_end == 0 ? v.H : r.head_end;
  std::vector<uint8_t> out;
  for (int32_t l = r.layer_start; l < r.layer_end; ++l)
    for (int32_t c = 0; c < v.C; ++c)
      for (int64_t t = r.token_start; t < r.token_end; ++t)
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t e = 0; e < v.E; ++e) {
            const uint8_t* p = v.addr(l, c, bt[static_cast<size_t>(t / v.pt)], t % v.pt, h, e);
            out.insert(out.end(), p, p + v.eb);
          }
  return out;
}

void test_v2_plans() {
  std::mt19937_64 rng(2026);
  int cases = 0;
  for (int rep = 0; rep < 300; ++rep) {
    V2Cache v = make_v2(rng);
    kvb_cache* cache = nullptr;
    int rc = kvb_cache_create(&v.desc, &cache);
    CHECK(rc == KVB_OK, "cache_create: %s", kvb_last_error());
    if (rc != KVB_OK) continue;
    std::vector<int32_t> bt(static_cast<size_t>(v.P));
    std::iota(bt.begin(), bt.end(), 0);
    std::shuffle(bt.begin(), bt.end(), rng);
    const int64_t max_tok = v.P * v.pt;
    kvb_range r{};
    r.token_start = static_cast<int64_t>(rng() % static_cast<uint64_t>(max_tok));
    r.token_end = r.token_start +
                  static_cast<int64_t>(rng() % static_cast<uint64_t>(max_tok - r.token_start + 1));
    r.layer_start = static_cast<int32_t>(rng() % static_cast<uint64_t>(v.L));
    r.layer_end = r.layer_start + 1 +
                  static_cast<int32_t>(rng() % static_cast<uint64_t>(v.L - r.layer_start));
    if (rng() % 2) {
      r.head_start = static_cast<int32_t>(rng() % static_cast<uint64_t>(v.H));
      r.head_end = r.head_start + 1 +
                   static_cast<int32_t>(rng() % static_cast<uint64_t>(v.H - r.head_start));
    }
    r.block_table = bt.data();
    r.block_table_len = static_cast<int64_t>(bt.size());
    const std::vector<uint8_t> ref = v2_ref(v, bt, r);
    kvb_plan* plan = nullptr;
    rc = kvb_plan_create(cache, &r, KVB_PLAN_WRITE, &plan);
    CHECK(rc == KVB_OK, "plan_create: %s", kvb_last_error());
    if (rc != KVB_OK) {
      kvb_cache_destroy(cache);
      continue;
    }
    ++cases;
    const uint64_t total = kvb_plan_wire_nbytes(plan);
    CHECK(total == ref.size(), "plan wire bytes %llu != %zu", (unsigned long long)total,
          ref.size());
    CHECK(kvb_wire_nbytes(&v.desc, &r) == ref.size(), "kvb_wire_nbytes with a head range");
    // Whole, sliced, with and without checksum; the kernel's math.
    std::vector<uint64_t> cuts{0, total};
    for (int i = 0; i < 4 && total > 0; ++i) cuts.push_back(rng() % (total + 1));
    std::sort(cuts.begin(), cuts.end());
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      const uint64_t a = cuts[i], n = cuts[i + 1] - cuts[i];
      std::vector<uint8_t> part(n + 1, 0xCD);
      uint64_t digest = 0;
      kvb_exec ex{static_cast<int32_t>(rng() % 3), 0};
      rc = kvb_plan_pack_cpu(plan, a, part.data(), n, &ex, (i % 2) ? &digest : nullptr);
      CHECK(rc == KVB_OK, "plan pack: %s", kvb_last_error());
      CHECK(std::equal(part.begin(), part.begin() + static_cast<long>(n),
                       ref.begin() + static_cast<long>(a)),
            "v2 slice [%llu,+%llu) differs", (unsigned long long)a, (unsigned long long)n);
      CHECK(part[n] == 0xCD, "v2 pack wrote past the slice");
      if (i % 2) CHECK(digest == kvb_xxh3_64(part.data(), n), "digest of the packed slice");
      std::vector<uint8_t> kw(n + 32, 0);
      uint8_t* dst = kw.data() + (a + rep) % 16;
      emulate_kernel_desc<true>(v.desc, r, a, dst, n, 1 + static_cast<uint32_t>(rep % 4));
      CHECK(std::equal(dst, dst + n, ref.begin() + static_cast<long>(a)), "v2 kernel emulation");
    }
    // Unpack the slices, shuffled, into a twin with its own bytes; verify with
    // checksums (one of them wrong first).
    V2Cache w = v;
    for (size_t i = 0; i < w.blocks.size(); ++i) {
      for (auto& b : w.blocks[i]) b = static_cast<uint8_t>(rng());
      w.bases[i] = w.blocks[w.where[i].first].data() + w.where[i].second;
    }
    w.desc.component_base = w.bases.data();
    w.desc.component_strides = w.strides.data();
    const std::vector<std::vector<uint8_t>> w_before = w.blocks;
    kvb_cache* wc = nullptr;
    CHECK(kvb_cache_create(&w.desc, &wc) == KVB_OK, "twin cache: %s", kvb_last_error());
    kvb_plan* wp = nullptr;
    CHECK(kvb_plan_create(wc, &r, KVB_PLAN_WRITE, &wp) == KVB_OK, "twin plan: %s",
          kvb_last_error());
    std::vector<size_t> idx(cuts.size() - 1);
    std::iota(idx.begin(), idx.end(), 0);
    std::shuffle(idx.begin(), idx.end(), rng);
    for (size_t i : idx) {
      const uint64_t a = cuts[i], n = cuts[i + 1] - cuts[i];
      const uint8_t* chunk = ref.data() + a;
      const uint64_t sum = kvb_xxh3_64(chunk, n);
      if (n > 0) {
        const uint64_t wrong = sum ^ 1;
        CHECK(kvb_plan_unpack_cpu(wp, a, chunk, n, nullptr, &wrong) == KVB_ERR_CHECKSUM,
              "a wrong checksum is refused");
      }
      CHECK(kvb_plan_unpack_cpu(wp, a, chunk, n, nullptr, &sum) == KVB_OK, "v2 unpack: %s",
            kvb_last_error());
    }
    CHECK(v2_ref(w, bt, r) == ref, "v2 unpack round trip differs");
    // Bytes outside the range's slots are untouched: rebuild the expectation.
    std::vector<std::vector<uint8_t>> expect = w_before;
    {
      V2Cache e = w;
      e.blocks = expect;
      for (size_t i = 0; i < e.blocks.size(); ++i) {
        e.bases[i] = e.blocks[e.where[i].first].data() + e.where[i].second;
      }
      const int64_t h0 = r.head_start, h1 = r.head_end == 0 ? v.H : r.head_end;
      size_t pos = 0;
      for (int32_t l = r.layer_start; l < r.layer_end; ++l)
        for (int32_t c = 0; c < v.C; ++c)
          for (int64_t t = r.token_start; t < r.token_end; ++t)
            for (int64_t h = h0; h < h1; ++h)
              for (int64_t el = 0; el < v.E; ++el, pos += static_cast<size_t>(v.eb)) {
                std::memcpy(e.addr(l, c, bt[static_cast<size_t>(t / v.pt)], t % v.pt, h, el),
                            ref.data() + pos, static_cast<size_t>(v.eb));
              }
      CHECK(e.blocks == w.blocks, "v2 unpack wrote outside the range's slots");
    }
    // A read plan cannot unpack.
    kvb_plan* ro = nullptr;
    CHECK(kvb_plan_create(cache, &r, KVB_PLAN_READ, &ro) == KVB_OK, "read plan");
    if (total > 0) {
      CHECK(kvb_plan_unpack_cpu(ro, 0, ref.data(), 1, nullptr, nullptr) == KVB_ERR_INVALID_ARG,
            "unpack with a read plan");
    }
    kvb_plan_destroy(ro);
    kvb_plan_destroy(wp);
    kvb_cache_destroy(wc);
    kvb_plan_destroy(plan);
    kvb_cache_destroy(cache);
  }
  CHECK(cases > 250, "v2 cases run: %d", cases);
  CHECK(g_packed_cases > 20, "packed K|V cases run: %d", g_packed_cases);
}

void test_v2_errors() {
  std::mt19937_64 rng(5);
  V2Cache v = make_v2(rng);
  v.desc.num_heads = 3;
  v = make_v2(rng);
  kvb_cache* cache = nullptr;
  expect(kvb_cache_create(nullptr, &cache), KVB_ERR_INVALID_ARG, "null desc");
  expect(kvb_cache_create(&v.desc, nullptr), KVB_ERR_INVALID_ARG, "null out");
  {
    kvb_cache_desc bad = v.desc;
    bad.elem_bytes = v.eb * v.E + 1;
    expect(kvb_cache_create(&bad, &cache), KVB_ERR_LAYOUT, "elem_bytes not dividing head_bytes");
    CHECK(cache == nullptr, "no handle on error");
    std::vector<int64_t> s = v.strides;
    s[1] = 0;  // token stride 0 with several tokens per page: slots overlap
    bad = v.desc;
    bad.component_strides = s.data();
    if (v.pt > 1) expect(kvb_cache_create(&bad, &cache), KVB_ERR_LAYOUT, "overlapping strides");
  }
  {
    // K and V of a layer on the same bytes.
    std::vector<uint8_t> mem(4096);
    void* b[2] = {mem.data(), mem.data() + 8};
    int64_t st[8] = {256, 64, 16, 2, 256, 64, 16, 2};
    kvb_cache_desc d{};
    d.abi_version = KVB_ABI_VERSION;
    d.num_layers = 1;
    d.num_components = 2;
    d.num_heads = 4;
    d.head_bytes = 16;
    d.page_tokens = 4;
    d.num_pages = 4;
    d.elem_bytes = 2;
    d.component_strides = st;
    d.component_base = b;
    d.device = -1;
    expect(kvb_cache_create(&d, &cache), KVB_ERR_LAYOUT, "aliased K and V");
    b[1] = mem.data() + 1024;
    expect(kvb_cache_create(&d, &cache), KVB_OK, "K and V apart");
    int32_t bt[4] = {0, 1, 2, 3};
    kvb_range r{};
    r.token_end = 16;
    r.layer_end = 1;
    r.block_table = bt;
    r.block_table_len = 4;
    kvb_plan* plan = nullptr;
    for (auto hr : {std::pair<int, int>{0, 5}, {2, 2}, {3, 1}, {-1, 2}}) {
      r.head_start = hr.first;
      r.head_end = hr.second;
      expect(kvb_plan_create(cache, &r, KVB_PLAN_WRITE, &plan), KVB_ERR_INVALID_ARG,
             "head range outside the cache");
      CHECK(plan == nullptr, "no plan on error");
    }
    r.head_start = 1;
    r.head_end = 3;
    expect(kvb_plan_create(cache, &r, 7, &plan), KVB_ERR_INVALID_ARG, "bad flags");
    expect(kvb_plan_create(nullptr, &r, KVB_PLAN_READ, &plan), KVB_ERR_INVALID_ARG, "null cache");
    expect(kvb_plan_create(cache, &r, KVB_PLAN_READ, &plan), KVB_OK, "head range plan");
    CHECK(kvb_plan_wire_nbytes(plan) == 2ull * 16 * 2 * 16, "head range bytes");
    std::vector<uint8_t> w(kvb_plan_wire_nbytes(plan));
    expect(kvb_plan_pack_cpu(plan, 1, w.data(), w.size(), nullptr, nullptr), KVB_ERR_INVALID_ARG,
           "plan slice past the end");
    expect(kvb_plan_pack_cpu(nullptr, 0, w.data(), w.size(), nullptr, nullptr), KVB_ERR_INVALID_ARG,
           "null plan");
    expect(kvb_plan_pack_cpu(plan, 0, mem.data() + 100, 64, nullptr, nullptr), KVB_ERR_OVERLAP,
           "wire inside the cache");
    expect(kvb_plan_pack_cuda(plan, 0, w.data(), w.size(), nullptr),
#ifdef KVBRIDGE_HAS_CUDA
           KVB_ERR_INVALID_ARG,
#else
           KVB_ERR_UNAVAILABLE,
#endif
           "CPU plan on the CUDA path");
    kvb_plan_destroy(plan);
    kvb_cache_destroy(cache);
    kvb_plan_destroy(nullptr);
    kvb_cache_destroy(nullptr);
    CHECK(kvb_plan_wire_nbytes(nullptr) == 0, "wire bytes of no plan");
  }
  {
    // An ABI 1 descriptor (the struct without the ABI 2 fields) goes through
    // kvb_cache_create unchanged, and its range's head fields are not read.
    std::mt19937_64 r2(9);
    Case k = make_case(r2, Order::kPageFirstHND, false, 4, false);
    k.cache.desc.abi_version = 1;
    k.cache.desc.elem_bytes = 999;  // garbage past the ABI 1 struct: ignored
    k.range.head_start = 7;
    k.range.head_end = 3;
    expect(kvb_cache_create(&k.cache.desc, &cache), KVB_OK, "ABI 1 descriptor");
    kvb_plan* plan = nullptr;
    expect(kvb_plan_create(cache, &k.range, KVB_PLAN_READ, &plan), KVB_OK, "ABI 1 range");
    const auto& r = k.range;
    const std::vector<uint8_t> ref =
        ref_pack(k.cache, k.bt, r.token_start, r.token_end, r.layer_start, r.layer_end);
    std::vector<uint8_t> w(ref.size());
    expect(kvb_plan_pack_cpu(plan, 0, w.data(), w.size(), nullptr, nullptr), KVB_OK, "ABI 1 pack");
    CHECK(w == ref, "ABI 1 plan bytes");
    kvb_plan_destroy(plan);
    kvb_cache_destroy(cache);
  }
}

// Every stripe-loop kernel set gives the same digests, one-shot and streamed.
void test_xxh3_kernels() {
  std::mt19937_64 rng(77);
  std::vector<uint8_t> data(70016);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  CHECK(kvb_xxh3_64(nullptr, 0) == 0x2D06800538D394C2ull, "XXH3-64 of nothing");
  std::vector<uint64_t> want;
  std::vector<size_t> sizes;
  for (size_t n = 0; n < 2100; ++n) sizes.push_back(n);
  for (size_t n : {4095, 4096, 4097, 16384, 16449, 65536, 69999}) sizes.push_back(n);
  for (size_t n : sizes) want.push_back(kvb::xxh3_64(data.data() + (n % 7), n));
  int sets = 0;
  for (int which = 1; which <= 4; ++which) {
    if (!kvb::xxh3_select_kernels(which)) continue;
    ++sets;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const size_t n = sizes[i];
      const uint8_t* p = data.data() + (n % 7);
      CHECK(kvb::xxh3_64(p, n) == want[i], "kernel set %d, %zu bytes", which, n);
      kvb::Xxh3Stream s;
      size_t done = 0;
      while (done < n) {
        const size_t step = std::min<size_t>(n - done, 1 + rng() % 700);
        s.update(p + done, step);
        done += step;
      }
      CHECK(s.digest() == want[i], "kernel set %d streamed, %zu bytes", which, n);
      // The same bytes hashed while copied, in other pieces: same digest, same copy.
      std::vector<uint8_t> buf(n + 65, 0xEE);  // `copy` starts 64-byte aligned
      uint8_t* copy = buf.data() + (-reinterpret_cast<uintptr_t>(buf.data()) & 63);
      kvb::Xxh3Stream c;
      const bool stream = (n & 1) != 0;  // streaming stores where the destination allows
      for (done = 0; done < n;) {
        const size_t step = std::min<size_t>(n - done, 1 + rng() % 5000);
        c.update_copy(copy + done, p + done, step, stream);
        done += step;
      }
      CHECK(c.digest() == want[i], "kernel set %d copied, %zu bytes", which, n);
      CHECK(std::equal(p, p + n, copy) && copy[n] == 0xEE, "kernel set %d copy, %zu bytes", which,
            n);
    }
  }
  kvb::xxh3_select_kernels(0);
  CHECK(sets >= 2, "kernel sets tried: %d", sets);
}

}  // namespace

int main() {
  test_roundtrips();
  test_v2_plans();
  test_v2_errors();
  test_xxh3_kernels();
  CHECK(g_vector_runs > 100 && g_byte_runs > 100, "kernel paths: %d vector, %d byte", g_vector_runs,
        g_byte_runs);
  test_errors();
  test_threads();
  std::printf("test_pack_core: %d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
