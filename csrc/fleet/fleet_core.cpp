// The fleet router's state and choices; see fleet_core.h and
// kvbridge/fleet/core.py, whose rules this follows choice for choice.
#include "fleet/fleet_core.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>

namespace kvb::fleet {

namespace {

inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

inline int ctz(uint64_t w) { return __builtin_ctzll(w); }

uint64_t random_seed() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

uint64_t* zeroed_words(size_t n) { return static_cast<uint64_t*>(zeroed(n * sizeof(uint64_t))); }

}  // namespace

void* zeroed(size_t bytes) {
  void* p = std::calloc(1, bytes);
  if (p == nullptr) throw std::bad_alloc();
  // every page faulted in now (calloc's fresh pages are mapped lazily)
  volatile char* c = static_cast<volatile char*>(p);
  for (size_t i = 0; i < bytes; i += 4096) c[i] = 0;
  return p;
}

// ---- KeyMap -------------------------------------------------------------------------

KeyMap::KeyMap(uint64_t seed, size_t capacity) : seed_(seed) {
  size_t n = 16;
  while (n < capacity) n *= 2;
  slots_.assign(n, Slot{Key{}, 0, 0});
  mask_ = n - 1;
}

size_t KeyMap::ideal(const Key& k) const { return size_t(mix(k.a ^ seed_ ^ mix(k.b))) & mask_; }

uint32_t KeyMap::find(const Key& k) const {
  for (size_t i = ideal(k);; i = (i + 1) & mask_) {
    const Slot& s = slots_[i];
    if (!s.used) return kNil;
    if (s.key == k) return s.val;
  }
}

void KeyMap::insert(const Key& k, uint32_t v) {
  if ((size_ + 1) * 2 > slots_.size()) grow();
  size_t i = ideal(k);
  while (slots_[i].used) i = (i + 1) & mask_;
  slots_[i] = Slot{k, v, 1};
  ++size_;
}

void KeyMap::erase(const Key& k) {
  size_t i = ideal(k);
  for (;; i = (i + 1) & mask_) {
    if (!slots_[i].used) return;
    if (slots_[i].key == k) break;
  }
  // backward shift: an entry later in the run moves into the hole unless its
  // ideal slot lies cyclically in (hole, its slot]
  size_t j = i;
  for (;;) {
    j = (j + 1) & mask_;
    if (!slots_[j].used) break;
    size_t home = ideal(slots_[j].key);
    bool stays = (j > i) ? (home > i && home <= j) : (home > i || home <= j);
    if (!stays) {
      slots_[i] = slots_[j];
      i = j;
    }
  }
  slots_[i].used = 0;
  --size_;
}

void KeyMap::grow() {
  std::vector<Slot> old;
  old.swap(slots_);
  slots_.assign(old.size() * 2, Slot{Key{}, 0, 0});
  mask_ = slots_.size() - 1;
  for (const Slot& s : old) {
    if (!s.used) continue;
    size_t i = ideal(s.key);
    while (slots_[i].used) i = (i + 1) & mask_;
    slots_[i] = s;
  }
}

// ---- Slabs ---------------------------------------------------------------------------

uint32_t* Slabs::alloc(uint32_t cap) {
  int k = __builtin_ctz(cap);
  if (!free_[k].empty()) {
    uint32_t* p = free_[k].back();
    free_[k].pop_back();
    return p;
  }
  size_t bytes = size_t(cap) * sizeof(uint32_t);
  if (bytes > left_) {
    size_t size = std::max<size_t>(size_t(2) << 20, bytes);
    void* c = zeroed(size);
    chunks_.push_back(c);
    cur_ = static_cast<char*>(c);
    left_ = size;
  }
  uint32_t* p = reinterpret_cast<uint32_t*>(cur_);
  cur_ += bytes;
  left_ -= bytes;
  return p;
}

void Slabs::release(uint32_t* p, uint32_t cap) { free_[__builtin_ctz(cap)].push_back(p); }

// ---- FleetCore: membership ------------------------------------------------------------

FleetCore::FleetCore(double load_factor, int64_t max_pages)
    : load_factor_(load_factor),
      max_pages_(max_pages),
      seed_(random_seed()),
      index_(seed_, size_t(1) << 17) {
  for (auto& m : mask_) m.assign(width_, 0);
}

FleetCore::~FleetCore() {
  for (uint64_t* c : bit_chunks_) std::free(c);
}

const FleetCore::Engine& FleetCore::engine(int slot) const {
  if (slot < 0 || size_t(slot) >= engines_.size() || !engines_[slot].live)
    throw std::out_of_range("no engine in that slot");
  return engines_[slot];
}

FleetCore::Engine& FleetCore::live(int slot) { return const_cast<Engine&>(engine(slot)); }

void FleetCore::ensure_width(size_t slots) {
  size_t need = (slots + 63) / 64;
  if (need <= width_) return;
  size_t w = std::max(need, width_ * 2);
  for (uint64_t*& chunk : bit_chunks_) {
    constexpr size_t rows = size_t(1) << kRowShift;
    uint64_t* wide = zeroed_words(rows * w);
    for (size_t r = 0; r < rows; ++r) std::copy_n(&chunk[r * width_], width_, &wide[r * w]);
    std::free(chunk);
    chunk = wide;
  }
  for (auto& m : mask_) m.resize(w, 0);
  width_ = w;
}

int FleetCore::add(unsigned roles, int64_t queued_tokens, int64_t active_transfers) {
  int slot;
  if (!free_slots_.empty()) {
    std::pop_heap(free_slots_.begin(), free_slots_.end(), std::greater<int>());
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = int(engines_.size());
    engines_.emplace_back();
    ensure_width(engines_.size());
  }
  Engine& e = engines_[slot];
  e = Engine{};
  e.live = true;
  e.inc = ++inc_;
  e.roles = roles;
  e.rep_queued = queued_tokens;
  e.rep_transfers = active_transfers;
  e.queued = queued_tokens;
  join_roles(slot);
  return slot;
}

void FleetCore::update(int slot, unsigned roles, int64_t queued_tokens, int64_t active_transfers) {
  Engine& e = live(slot);
  leave_roles(slot);
  e.roles = roles;
  e.rep_queued = queued_tokens;
  e.rep_transfers = active_transfers;
  e.queued = queued_tokens + e.routed;
  join_roles(slot);
}

void FleetCore::remove(int slot) {
  Engine& e = live(slot);
  leave_roles(slot);
  while (e.head != kNil) drop_oldest(slot);
  e.live = false;
  free_slots_.push_back(slot);
  std::push_heap(free_slots_.begin(), free_slots_.end(), std::greater<int>());
}

void FleetCore::eject(int slot) {
  Engine& e = live(slot);
  if (e.ejected) return;
  leave_roles(slot);
  e.ejected = true;
}

void FleetCore::join_roles(int slot) {
  Engine& e = engines_[slot];
  if (e.ejected) return;
  for (int r = 0; r < 3; ++r) {
    if (!(e.roles & (1u << r))) continue;
    e.member[r] = true;
    e.join_seq[r] = ++join_;
    mask_[r][slot / 64] |= uint64_t(1) << (slot % 64);
    ++count_[r];
    if (r != kMain) heap_push(r, slot);
  }
  if (e.roles & (1u << kMain)) active_total_ += e.active;
}

void FleetCore::leave_roles(int slot) {
  Engine& e = engines_[slot];
  if (e.ejected) return;
  for (int r = 0; r < 3; ++r) {
    if (!(e.roles & (1u << r)) || !e.member[r]) continue;
    e.member[r] = false;
    mask_[r][slot / 64] &= ~(uint64_t(1) << (slot % 64));
    --count_[r];
  }
  if (e.roles & (1u << kMain)) active_total_ = std::max<int64_t>(active_total_ - e.active, 0);
}

std::vector<int> FleetCore::members(int role) const {
  std::vector<std::pair<uint64_t, int>> by_join;
  for (size_t s = 0; s < engines_.size(); ++s)
    if (engines_[s].live && engines_[s].member[role])
      by_join.emplace_back(engines_[s].join_seq[role], int(s));
  std::sort(by_join.begin(), by_join.end());
  std::vector<int> out;
  out.reserve(by_join.size());
  for (auto& p : by_join) out.push_back(p.second);
  return out;
}

// ---- loads and heaps ------------------------------------------------------------------

std::pair<int64_t, int64_t> FleetCore::key(const Engine& e, int role) const {
  if (role == kPrefill) return {e.queued, 0};
  if (role == kRelay) return {e.active + e.rep_transfers, e.rep_queued};
  return {e.active, 0};
}

bool FleetCore::after(const HeapEntry& x, const HeapEntry& y) {  // a min-heap on (k0, k1, seq)
  if (x.k0 != y.k0) return x.k0 > y.k0;
  if (x.k1 != y.k1) return x.k1 > y.k1;
  return x.seq > y.seq;
}

void FleetCore::heap_push(int role, int slot) {
  Heap& h = heaps_[role];
  if (h.v.size() > 4 * count_[role] + 64) {  // mostly stale entries: start afresh
    h.v.clear();
    for (int s : members(role)) {
      auto k = key(engines_[s], role);
      h.v.push_back(HeapEntry{k.first, k.second, h.seq++, s, engines_[s].inc});
    }
    std::make_heap(h.v.begin(), h.v.end(), &FleetCore::after);
  }
  const Engine& e = engines_[slot];
  auto k = key(e, role);
  h.v.push_back(HeapEntry{k.first, k.second, h.seq++, slot, e.inc});
  std::push_heap(h.v.begin(), h.v.end(), &FleetCore::after);
}

int FleetCore::heap_top(int role) {
  Heap& h = heaps_[role];
  while (!h.v.empty()) {
    const HeapEntry& t = h.v.front();
    const Engine& e = engines_[t.slot];
    if (e.live && e.inc == t.inc && e.member[role] && key(e, role) == std::make_pair(t.k0, t.k1))
      return t.slot;
    std::pop_heap(h.v.begin(), h.v.end(), &FleetCore::after);
    h.v.pop_back();
  }
  return -1;
}

void FleetCore::load(int slot, int64_t active, int64_t routed_tokens) {
  Engine& e = live(slot);
  e.active = std::max<int64_t>(e.active + active, 0);
  if (routed_tokens != 0) {
    e.routed = std::max<int64_t>(e.routed + routed_tokens, 0);
    e.queued = e.rep_queued + e.routed;
  }
  if (e.ejected) return;
  for (int r = 0; r < 3; ++r) {
    if (!(e.roles & (1u << r))) continue;
    if (r == kMain)
      active_total_ = std::max<int64_t>(active_total_ + active, 0);
    else
      heap_push(r, slot);
  }
}

int FleetCore::least(int role) {
  if (role != kMain) return heap_top(role);
  int best = -1;
  const auto& m = mask_[kMain];
  for (size_t w = 0; w < width_; ++w)
    for (uint64_t b = m[w]; b; b &= b - 1) {
      int s = int(w * 64) + ctz(b);
      if (best < 0 || engines_[s].active < engines_[best].active) best = s;
    }
  return best;
}

// ---- the prefix index -----------------------------------------------------------------

uint32_t FleetCore::rank(uint32_t row, int slot) {
  const uint64_t* b = bits(row);
  uint32_t n = 0;
  size_t w = size_t(slot) / 64;
  for (size_t i = 0; i < w; ++i) n += uint32_t(__builtin_popcountll(b[i]));
  return n + uint32_t(__builtin_popcountll(b[w] & ((uint64_t(1) << (slot % 64)) - 1)));
}

uint32_t FleetCore::new_row(const Key& k) {
  uint32_t r = rows_.alloc();
  if ((r >> kRowShift) == bit_chunks_.size())
    bit_chunks_.push_back(zeroed_words((size_t(1) << kRowShift) * width_));
  Row& row = rows_[r];
  row.key = k;
  row.n = 0;
  index_.insert(k, r);
  return r;
}

void FleetCore::unlink(Engine& e, uint32_t i) {
  Node& n = nodes_[i];
  if (n.prev != kNil)
    nodes_[n.prev].next = n.next;
  else
    e.head = n.next;
  if (n.next != kNil)
    nodes_[n.next].prev = n.prev;
  else
    e.tail = n.prev;
}

void FleetCore::link_back(Engine& e, uint32_t i) {
  Node& n = nodes_[i];
  n.prev = e.tail;
  n.next = kNil;
  if (e.tail != kNil)
    nodes_[e.tail].next = i;
  else
    e.head = i;
  e.tail = i;
}

void FleetCore::append(int slot, uint32_t r) {
  Engine& e = engines_[slot];
  uint32_t i = nodes_.alloc();
  nodes_[i] = Node{r, kNil, kNil, slot};
  link_back(e, i);
  ++e.npages;
  Row& row = rows_[r];
  uint32_t at = rank(r, slot);
  if (row.n >= 2 && row.n - 2 == row.cap) {
    uint32_t cap = row.cap ? row.cap * 2 : 4;
    uint32_t* more = slabs_.alloc(cap);
    if (row.cap) {
      std::copy_n(row.more, row.cap, more);
      slabs_.release(row.more, row.cap);
    }
    row.more = more;
    row.cap = cap;
  }
  for (uint32_t j = row.n; j > at; --j) holder(row, j) = holder(row, j - 1);
  holder(row, at) = i;
  ++row.n;
  bits(r)[slot / 64] |= uint64_t(1) << (slot % 64);
}

void FleetCore::touch(int slot, uint32_t r) {
  Engine& e = engines_[slot];
  uint32_t i = holder(rows_[r], rank(r, slot));
  if (i == e.tail) return;
  unlink(e, i);
  link_back(e, i);
}

void FleetCore::drop_oldest(int slot) {
  Engine& e = engines_[slot];
  uint32_t i = e.head;
  uint32_t r = nodes_[i].row;
  unlink(e, i);
  nodes_.release(i);
  --e.npages;
  Row& row = rows_[r];
  uint32_t at = rank(r, slot);
  for (uint32_t j = at; j + 1 < row.n; ++j) holder(row, j) = holder(row, j + 1);
  --row.n;
  uint64_t* b = bits(r);
  b[slot / 64] &= ~(uint64_t(1) << (slot % 64));
  if (row.n == 0) {
    index_.erase(row.key);
    rows_.release(r);  // keeps its `more` for the next page in the row
  }
}

void FleetCore::evict(int slot) {
  Engine& e = engines_[slot];
  while (e.npages > 0 && e.npages > max_pages_) drop_oldest(slot);
}

void FleetCore::note(int slot, const std::vector<Key>& keys) {
  live(slot);
  for (const Key& k : keys) {
    uint32_t r = index_.find(k);
    if (r != kNil && holds(r, slot)) {
      touch(slot, r);
      continue;
    }
    append(slot, r != kNil ? r : new_row(k));
    evict(slot);
  }
}

std::vector<Key> FleetCore::pages(int slot) const {
  std::vector<Key> out;
  for (uint32_t i = engine(slot).head; i != kNil; i = nodes_[i].next)
    out.push_back(rows_[nodes_[i].row].key);
  return out;
}

// ---- choices --------------------------------------------------------------------------

int FleetCore::depth(int slot) const {
  size_t w = size_t(slot) / 64;
  uint64_t bit = uint64_t(1) << (slot % 64);
  int lo = 0, hi = nlevels_;  // levels are nested: the last one holding the bit
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (levels_[size_t(mid) * width_ + w] & bit)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

int FleetCore::least_of(const uint64_t* mask) {
  int64_t best = 0;
  bool any = false;
  for (size_t w = 0; w < width_; ++w)
    for (uint64_t b = mask[w]; b; b &= b - 1) {
      int64_t a = engines_[w * 64 + ctz(b)].active;
      if (!any || a < best) best = a, any = true;
    }
  uint64_t* tied = scratch2_.data();
  for (size_t w = 0; w < width_; ++w) {
    uint64_t keep = 0;
    for (uint64_t b = mask[w]; b; b &= b - 1) {
      int i = ctz(b);
      if (engines_[w * 64 + i].active == best) keep |= uint64_t(1) << i;
    }
    tied[w] = keep;
  }
  return next_of(tied);
}

int FleetCore::next_of(const uint64_t* tied) {
  // the first bit at or above slot turn_, else the first bit
  int first = -1, later = -1;
  for (size_t w = 0; w < width_ && later < 0; ++w) {
    uint64_t b = tied[w];
    if (!b) continue;
    int base = int(w * 64);
    if (first < 0) first = base + ctz(b);
    if (base + 63 < turn_) continue;
    uint64_t at = turn_ <= base ? b : b & (~uint64_t(0) << (turn_ - base));
    if (at) later = base + ctz(at);
  }
  int slot = later >= 0 ? later : first;
  turn_ = slot + 1;
  return slot;
}

int FleetCore::pick_main(int kept, int* pages) {
  size_t n = count_[kMain];
  if (n == 0) return -1;
  double cap = load_factor_ * double(active_total_ + 1) / double(n);
  const auto& m = mask_[kMain];
  uint64_t* fit = scratch_.data();
  bool any = false;
  for (size_t w = 0; w < width_; ++w) {
    uint64_t keep = 0;
    for (uint64_t b = m[w]; b; b &= b - 1) {
      int i = ctz(b);
      if (double(engines_[w * 64 + i].active + 1) <= cap) keep |= uint64_t(1) << i;
    }
    fit[w] = keep;
    any |= keep != 0;
  }
  if (!any) std::copy_n(m.data(), width_, fit);  // none fits: all
  if (kept >= 0 && size_t(kept) < engines_.size() && (fit[size_t(kept) / 64] >> (kept % 64) & 1)) {
    *pages = depth(kept);
    return kept;
  }
  uint64_t* held = scratch3_.data();
  for (int i = nlevels_ - 1; i >= 0; --i) {
    const uint64_t* lv = &levels_[size_t(i) * width_];
    bool hit = false;
    for (size_t w = 0; w < width_; ++w) hit |= (held[w] = lv[w] & fit[w]) != 0;
    if (hit) {  // the deepest level held by one that fits: its least loaded
      *pages = i + 1;
      return least_of(held);
    }
  }
  *pages = 0;
  return least_of(fit);
}

int FleetCore::pick_prefill(int64_t page_tokens, int* pages) {
  // least queued work less what its prefix index holds: the deepest levels
  // first, stopping when no shallower engine can do better than the best so
  // far (the least loaded engine bounds them)
  int best = heap_top(kPrefill);
  if (best < 0) return -1;
  int64_t floor = engines_[best].queued;
  int best_pages = depth(best);
  int64_t best_w = floor - best_pages * page_tokens;
  const auto& mask = mask_[kPrefill];
  uint64_t* seen = scratch3_.data();
  std::fill_n(seen, width_, 0);
  for (int i = nlevels_ - 1; i >= 0; --i) {
    int64_t saved = int64_t(i + 1) * page_tokens;
    if (best_w <= floor - saved) break;
    const uint64_t* lv = &levels_[size_t(i) * width_];
    for (size_t w = 0; w < width_; ++w) {
      for (uint64_t b = lv[w] & mask[w] & ~seen[w]; b; b &= b - 1) {
        int s = int(w * 64) + ctz(b);
        int64_t v = engines_[s].queued - saved;
        if (v < best_w) best = s, best_pages = i + 1, best_w = v;
      }
      seen[w] |= lv[w];
    }
  }
  *pages = best_pages;
  return best;
}

void FleetCore::choose(int kept, int64_t page_tokens, int out[4]) {
  // every page's row (kNil: no engine holds it), and levels[i]: the engines
  // holding the request's first i + 1 pages
  size_t n = keys_.size();
  key_rows_.resize(n);
  if (levels_.size() < n * width_) levels_.resize(n * width_);
  scratch_.resize(width_);
  scratch2_.resize(width_);
  scratch3_.resize(width_);
  nlevels_ = 0;
  // the lookups' cache misses overlap: every slot fetched, then every row
  for (size_t i = 0; i < n; ++i) index_.prefetch(keys_[i]);
  for (size_t i = 0; i < n; ++i) {
    uint32_t r = key_rows_[i] = index_.find(keys_[i]);
    if (r != kNil) __builtin_prefetch(bits(r));
  }
  bool open = true;
  for (size_t i = 0; i < n; ++i) {
    uint32_t r = key_rows_[i];
    if (!open) break;
    if (r == kNil) {
      open = false;
      continue;
    }
    const uint64_t* b = bits(r);
    uint64_t* lv = &levels_[i * width_];
    bool any = false;
    if (i == 0) {
      for (size_t w = 0; w < width_; ++w) any |= (lv[w] = b[w]) != 0;
    } else {
      const uint64_t* prev = lv - width_;
      for (size_t w = 0; w < width_; ++w) any |= (lv[w] = prev[w] & b[w]) != 0;
    }
    if (any)
      ++nlevels_;
    else
      open = false;
  }
  out[0] = pick_main(kept, &out[1]);
  if (out[0] < 0) {
    out[1] = out[2] = out[3] = -1;
    return;
  }
  out[2] = pick_prefill(page_tokens, &out[3]);
}

void FleetCore::hold(int slot, int held) {
  // the first `held` pages it holds: refreshed in order; the rest are added
  // (a page it holds past a gap keeps its place)
  int n = int(keys_.size());
  held = std::min(std::max(held, 0), n);
  // its nodes for those pages, their rows, nodes and neighbours fetched ahead
  // of the moves so that the cache misses overlap
  for (int i = 0; i < held; ++i) __builtin_prefetch(&rows_[key_rows_[i]]);
  held_nodes_.resize(size_t(held));
  for (int i = 0; i < held; ++i) {
    uint32_t r = key_rows_[i];
    uint32_t at = rank(r, slot);
    Row& row = rows_[r];
    if (at >= 2) __builtin_prefetch(&row.more[at - 2]);
    held_nodes_[i] = at;
  }
  for (int i = 0; i < held; ++i) {
    uint32_t node = holder(rows_[key_rows_[i]], held_nodes_[i]);
    held_nodes_[i] = node;
    __builtin_prefetch(&nodes_[node]);
  }
  for (int i = 0; i < held; ++i) {
    const Node& nd = nodes_[held_nodes_[i]];
    if (nd.prev != kNil) __builtin_prefetch(&nodes_[nd.prev]);
    if (nd.next != kNil) __builtin_prefetch(&nodes_[nd.next]);
  }
  // each to the newest end, in order; a run of them already adjacent in the
  // list (a prefix touched together before) moves as one block, which leaves
  // the order moving them one by one would
  Engine& e = engines_[slot];
  for (int i = 0; i < held;) {
    uint32_t first = held_nodes_[i], last = first;
    int j = i + 1;
    while (j < held && nodes_[last].next == held_nodes_[j]) last = held_nodes_[j++];
    i = j;
    if (last == e.tail) continue;  // already the newest, in order
    Node& f = nodes_[first];
    Node& l = nodes_[last];
    if (f.prev != kNil)
      nodes_[f.prev].next = l.next;
    else
      e.head = l.next;
    nodes_[l.next].prev = f.prev;
    nodes_[e.tail].next = first;
    f.prev = e.tail;
    l.next = kNil;
    e.tail = last;
  }
  for (int i = held; i < n; ++i) {
    uint32_t& r = key_rows_[i];
    if (r == kNil) {  // new to the index (unless the request repeats a page)
      r = index_.find(keys_[i]);
      if (r == kNil) r = new_row(keys_[i]);
    }
    if (holds(r, slot)) continue;
    append(slot, r);
  }
}

void FleetCore::commit(int prefill, int main, int relay, int64_t tokens, int main_held,
                       int prefill_held) {
  live(prefill);
  live(main);
  if (relay >= 0) live(relay);
  load(prefill, 1, tokens);
  if (main != prefill) load(main, 1, 0);
  if (relay >= 0 && relay != prefill && relay != main) load(relay, 1, 0);
  // both hold every page now; evictions after both (they only drop an
  // engine's own oldest pages, so the order is the sequential one's)
  hold(main, main_held);
  if (prefill != main) hold(prefill, prefill_held);
  evict(main);
  if (prefill != main) evict(prefill);
}

void FleetCore::prefilled(int prefill, int64_t tokens) {
  if (prefill >= 0 && tokens != 0) load(prefill, 0, -tokens);
}

void FleetCore::finish(int prefill, int main, int relay, int64_t tokens) {
  if (prefill >= 0) load(prefill, -1, -tokens);
  if (main >= 0 && main != prefill) load(main, -1, 0);
  if (relay >= 0 && relay != prefill && relay != main) load(relay, -1, 0);
}

}  // namespace kvb::fleet
