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

namespace {

int g_failures = 0;
int g_checks = 0;
int g_vector_runs = 0;  // emulated kernel calls on the 16-byte path
int g_byte_runs = 0;    // ... on the byte path

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
void emulate_kernel(const Case& k, uint64_t lo, uint8_t* wire, uint64_t n, uint32_t lanes) {
  kvb::Geometry g;
  int rc = kvb::validate(&k.cache.desc, &k.range, lo, n, wire, true,
                         kPack ? kvb::Access::kRead : kvb::Access::kWrite, &g);
  CHECK(rc == KVB_OK, "validate: %s", kvb_last_error());
  if (rc != KVB_OK || n == 0) return;
  std::vector<uint64_t> ptrs;
  for (int64_t l = g.layer_start; l < g.layer_end; ++l) {
    ptrs.push_back(reinterpret_cast<uintptr_t>(k.cache.bases[static_cast<size_t>(l)]));
  }
  const bool aligned = kvb::row_copy_aligned(g, k.cache.desc.layer_base, wire, lo);
  ++(aligned ? g_vector_runs : g_byte_runs);
  const kvb::RowCopy d =
      kvb::make_row_copy(g, lo, n, ptrs.data(), k.bt.data() + g.first_block, wire, aligned);
  for (uint64_t i = 0; i < d.num_rows; ++i)
    for (uint32_t lane = 0; lane < lanes; ++lane)
      kvb::copy_row<kPack>(d, d.row_first + i, lane, lanes);
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

}  // namespace

int main() {
  test_roundtrips();
  CHECK(g_vector_runs > 100 && g_byte_runs > 100, "kernel paths: %d vector, %d byte", g_vector_runs,
        g_byte_runs);
  test_errors();
  test_threads();
  std::printf("test_pack_core: %d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
