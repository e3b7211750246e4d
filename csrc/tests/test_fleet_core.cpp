// The fleet router's compiled core under AddressSanitizer + UBSan (`make
// asan`): random membership, decisions, prefills ended, finishes, load reports with
// prefixes, ejections and removals, with per-engine page limits small enough
// to evict and a fleet that grows past 64 and 128 engines (the bit sets
// widen) and shrinks, with no memory error, leak or undefined behaviour;
// every engine's pages stay within the limit, without repeats. Decisions
// themselves are held to the pure-Python router by tests/test_fleet_router.py.
#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <vector>

#include "fleet/fleet_core.h"

using kvb::fleet::FleetCore;
using kvb::fleet::Key;

namespace {

int g_failures = 0;
int g_checks = 0;

#define CHECK(cond, ...)                                        \
  do {                                                          \
    ++g_checks;                                                 \
    if (!(cond)) {                                              \
      ++g_failures;                                             \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                        \
      std::fprintf(stderr, "\n");                               \
    }                                                           \
  } while (0)

Key page_key(uint64_t base, uint64_t i) { return Key{base * 1000003u + i, ~(base ^ (i << 20))}; }

struct Keyless {
  bool operator()(const Key& x, const Key& y) const { return x.a != y.a ? x.a < y.a : x.b < y.b; }
};

void run(uint32_t seed, int64_t max_pages) {
  std::mt19937_64 rng(seed);
  FleetCore core(1.2, max_pages);
  std::vector<int> live;
  struct Open {
    int prefill, main, relay;
    int64_t tokens;
  };
  std::vector<Open> open;
  auto pick = [&](size_t n) { return size_t(rng() % n); };
  for (int step = 0; step < 6000; ++step) {
    uint64_t op = rng() % 100;
    if (op < 8 || live.size() < 3) {  // an engine joins
      unsigned roles = std::vector<unsigned>{1, 2, 4, 6}[pick(4)];
      if (live.size() < 3) roles = std::vector<unsigned>{1, 4, 2}[live.size()];
      live.push_back(core.add(roles, int64_t(pick(300)), int64_t(pick(3))));
    } else if (op < 11 && live.size() > 3) {  // an engine leaves
      size_t at = pick(live.size());
      int slot = live[at];
      core.remove(slot);
      live.erase(live.begin() + long(at));
      for (Open& o : open) {  // the caller forgets it (re-routing is Python's)
        if (o.prefill == slot) o.prefill = -1;
        if (o.main == slot) o.main = -1;
        if (o.relay == slot) o.relay = -1;
      }
    } else if (op < 14) {  // a load report with prefixes
      int slot = live[pick(live.size())];
      core.update(slot, std::vector<unsigned>{1, 2, 4, 6}[pick(4)], int64_t(pick(300)), 0);
      std::vector<Key> keys;
      uint64_t base = pick(12);
      for (uint64_t i = 0, n = pick(20); i < n; ++i) keys.push_back(page_key(base, i));
      core.note(slot, keys);
    } else if (op < 15) {
      core.eject(live[pick(live.size())]);
    } else if (op < 60) {  // a decision
      std::vector<Key>& keys = core.pages_buffer();
      keys.clear();
      uint64_t base = pick(12);
      for (uint64_t i = 0, n = pick(40); i < n; ++i) keys.push_back(page_key(base, i));
      for (uint64_t i = 0, n = pick(4); i < n; ++i) keys.push_back(Key{rng(), rng()});
      int out[4];
      core.choose(pick(3) == 0 ? live[pick(live.size())] : -1, 16, out);
      if (out[0] < 0 || out[2] < 0) continue;
      CHECK(out[1] >= 0 && out[1] <= int(keys.size()), "main held %d of %zu", out[1], keys.size());
      int relay = pick(2) ? core.least(1) : -1;
      int64_t tokens = int64_t(keys.size()) * 16;
      core.commit(out[2], out[0], relay, tokens, out[1], out[3]);
      open.push_back(Open{out[2], out[0], relay, tokens});
    } else if (op < 70 && !open.empty()) {  // a request's prefill ends
      Open& o = open[pick(open.size())];
      if (o.prefill >= 0 && o.tokens > 0) {
        int64_t before = core.queued(o.prefill);
        core.prefilled(o.prefill, o.tokens);
        CHECK(core.queued(o.prefill) == before - o.tokens, "prefilled: queued %lld, was %lld",
              (long long)core.queued(o.prefill), (long long)before);
        o.tokens = 0;  // finish releases no tokens after it
      }
    } else if (!open.empty()) {  // a request ends
      size_t at = pick(open.size());
      Open o = open[at];
      open.erase(open.begin() + long(at));
      core.finish(o.prefill, o.main, o.relay, o.tokens);
    }
    if (step % 500 == 499) {
      for (int slot : live) {
        std::vector<Key> pages = core.pages(slot);
        std::set<Key, Keyless> seen(pages.begin(), pages.end());
        CHECK(int64_t(pages.size()) <= max_pages, "slot %d holds %zu pages", slot, pages.size());
        CHECK(seen.size() == pages.size(), "slot %d lists a page twice", slot);
        CHECK(core.active(slot) >= 0 && core.queued(slot) >= 0, "slot %d load", slot);
      }
    }
    if (step == 2000)  // grow past 64 and 128 engines with pages in the index
      for (int i = 0; i < 140; ++i)
        live.push_back(core.add(std::vector<unsigned>{1, 4}[i % 2], 0, 0));
    if (step == 4000)  // and shrink
      while (live.size() > 20) {
        core.remove(live.back());
        int slot = live.back();
        live.pop_back();
        for (Open& o : open) {
          if (o.prefill == slot) o.prefill = -1;
          if (o.main == slot) o.main = -1;
          if (o.relay == slot) o.relay = -1;
        }
      }
  }
}

}  // namespace

int main() {
  for (uint32_t seed = 0; seed < 6; ++seed) run(seed, seed % 2 ? 30 : 65536);
  std::printf("test_fleet_core: %d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
