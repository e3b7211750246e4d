// The fleet router's state and choices (kvbridge/fleet/core.py is its Python
// face; docs/fleet.md).  Sans-IO, single-threaded (the caller holds the GIL).
//
// Engines live in slots (the lowest free slot is reused).  The prefix index
// maps a 128-bit page hash to a row: the bit set of the engines holding the
// page and, in slot order, each holder's node in its LRU list (an engine's
// pages, oldest first, at most `max_pages`).  One hash lookup per page of a
// request serves the choice, the LRU refresh and the insertion.  The least
// loaded prefill and relay come from lazily checked heaps whose ties go to
// the entry pushed first; main decodes are chosen from their loads.
// Storage grows in fixed chunks, so no decision pays for copying the index.
#ifndef KVBRIDGE_FLEET_CORE_H
#define KVBRIDGE_FLEET_CORE_H

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <utility>
#include <vector>

namespace kvb::fleet {

struct Key {
  uint64_t a = 0, b = 0;
  bool operator==(const Key& o) const { return a == o.a && b == o.b; }
};

constexpr uint32_t kNil = 0xffffffffu;

// Open addressing, linear probing, backward-shift deletion; keys are page
// hashes, mixed with a per-process seed so that chosen hashes cannot pile up.
class KeyMap {
 public:
  KeyMap(uint64_t seed, size_t capacity);
  size_t size() const { return size_; }
  uint32_t find(const Key& k) const;  // kNil: absent
  void prefetch(const Key& k) const { __builtin_prefetch(&slots_[ideal(k)]); }
  void insert(const Key& k, uint32_t v);  // k must be absent
  void erase(const Key& k);

 private:
  struct Slot {
    Key key;
    uint32_t val;
    uint32_t used;
  };
  size_t ideal(const Key& k) const;
  void grow();
  std::vector<Slot> slots_;
  size_t mask_ = 0, size_ = 0;
  uint64_t seed_;
};

// Zeroed memory, written once when allocated: the index grows in a few big
// steps (the kernel's page faults paid together, a few times per million
// pages) instead of a little in many decisions.
void* zeroed(size_t bytes);

// A growable array of zero-initialised plain values in fixed chunks of
// 2^Shift elements (elements never move), with a free list.
template <class T, uint32_t Shift>
class Pool {
 public:
  static constexpr uint32_t kMask = (1u << Shift) - 1;
  Pool() = default;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() {
    for (T* c : chunks_) std::free(c);
  }
  T& operator[](uint32_t i) { return chunks_[i >> Shift][i & kMask]; }
  const T& operator[](uint32_t i) const { return chunks_[i >> Shift][i & kMask]; }
  uint32_t alloc() {
    if (!free_.empty()) {
      uint32_t i = free_.back();
      free_.pop_back();
      return i;
    }
    if ((n_ >> Shift) == chunks_.size())
      chunks_.push_back(static_cast<T*>(zeroed(sizeof(T) << Shift)));
    return n_++;
  }
  void release(uint32_t i) { free_.push_back(i); }
  uint32_t size() const { return n_; }

 private:
  std::vector<T*> chunks_;
  std::vector<uint32_t> free_;
  uint32_t n_ = 0;
};

// Arrays of 2^k uint32 (k >= 2) carved from zeroed 2 MiB chunks, reused by
// size; no decision waits on the heap growing.
class Slabs {
 public:
  Slabs() = default;
  Slabs(const Slabs&) = delete;
  Slabs& operator=(const Slabs&) = delete;
  ~Slabs() {
    for (void* c : chunks_) std::free(c);
  }
  uint32_t* alloc(uint32_t cap);
  void release(uint32_t* p, uint32_t cap);

 private:
  std::vector<uint32_t*> free_[32];
  std::vector<void*> chunks_;
  char* cur_ = nullptr;
  size_t left_ = 0;
};

constexpr uint32_t kRowShift = 15;   // 32768 rows of 40 bytes a chunk
constexpr uint32_t kNodeShift = 17;  // 131072 nodes of 16 bytes (2 MiB) a chunk

enum RoleIdx { kPrefill = 0, kRelay = 1, kMain = 2 };

class FleetCore {
 public:
  FleetCore(double load_factor, int64_t max_pages);
  ~FleetCore();
  FleetCore(const FleetCore&) = delete;
  FleetCore& operator=(const FleetCore&) = delete;

  // membership (roles: bit 0 prefill, bit 1 relay, bit 2 main)
  int add(unsigned roles, int64_t queued_tokens, int64_t active_transfers);
  void update(int slot, unsigned roles, int64_t queued_tokens, int64_t active_transfers);
  void remove(int slot);
  void eject(int slot);
  void note(int slot, const std::vector<Key>& keys);

  // One decision: the request's page hashes into `pages_buffer()`, then
  // `choose`; `commit` applies what was chosen for those same pages.
  std::vector<Key>& pages_buffer() { return keys_; }
  // out: main slot (-1: none), its pages held, prefill slot (-1: none), its pages held
  void choose(int kept, int64_t page_tokens, int out[4]);
  void commit(int prefill, int main, int relay, int64_t tokens, int main_held, int prefill_held);
  // a request's prefill ended: its prompt's `tokens` leave the prefill's
  // queued work (its request stays in flight until `finish`, which then
  // releases no tokens)
  void prefilled(int prefill, int64_t tokens);
  void finish(int prefill, int main, int relay, int64_t tokens);
  void load(int slot, int64_t active, int64_t routed_tokens);
  int least(int role);  // -1: none

  // inspection
  std::vector<int> members(int role) const;
  int64_t active(int slot) const { return engine(slot).active; }
  int64_t queued(int slot) const { return engine(slot).queued; }
  std::vector<Key> pages(int slot) const;  // oldest first
  size_t index_size() const { return index_.size(); }

 private:
  struct Engine {
    bool live = false, ejected = false;
    uint64_t inc = 0;
    unsigned roles = 0;
    bool member[3] = {false, false, false};
    uint64_t join_seq[3] = {0, 0, 0};
    int64_t active = 0, routed = 0, rep_queued = 0, rep_transfers = 0, queued = 0;
    uint32_t head = kNil, tail = kNil;  // its LRU list of nodes
    int64_t npages = 0;
  };
  struct Row {  // one page of the index (plain data: zero is empty)
    Key key;
    uint32_t n;         // holders
    uint32_t cap;       // room in `more`
    uint32_t first[2];  // the first two holders' nodes (slot order)
    uint32_t* more;     // the others' (from slabs_)
  };
  struct Node {  // one page in one engine's LRU list
    uint32_t row, prev, next;
    int slot;
  };
  struct HeapEntry {
    int64_t k0, k1;
    uint64_t seq;
    int slot;
    uint64_t inc;
  };
  static bool after(const HeapEntry& x, const HeapEntry& y);
  struct Heap {
    std::vector<HeapEntry> v;
    uint64_t seq = 0;
  };

  const Engine& engine(int slot) const;
  Engine& live(int slot);
  std::pair<int64_t, int64_t> key(const Engine& e, int role) const;
  void heap_push(int role, int slot);
  int heap_top(int role);
  void join_roles(int slot);
  void leave_roles(int slot);
  void ensure_width(size_t slots);

  // the index
  uint64_t* bits(uint32_t row) {
    return &bit_chunks_[row >> kRowShift][size_t(row & Pool<Row, kRowShift>::kMask) * width_];
  }
  bool holds(uint32_t row, int slot) { return bits(row)[slot / 64] >> (slot % 64) & 1; }
  uint32_t rank(uint32_t row, int slot);  // holders of row below slot
  uint32_t& holder(Row& r, uint32_t i) { return i < 2 ? r.first[i] : r.more[i - 2]; }
  uint32_t new_row(const Key& k);
  void append(int slot, uint32_t row);  // the page becomes the engine's newest
  void touch(int slot, uint32_t row);   // a page it holds becomes its newest
  void drop_oldest(int slot);
  void unlink(Engine& e, uint32_t node);
  void link_back(Engine& e, uint32_t node);
  void evict(int slot);
  void hold(int slot, int held);

  int depth(int slot) const;
  int least_of(const uint64_t* mask);  // the bits of mask with the least requests in flight
  int next_of(const uint64_t* tied);   // one bit of tied, in turn
  int pick_main(int kept, int* pages);
  int pick_prefill(int64_t page_tokens, int* pages);

  double load_factor_;
  int64_t max_pages_;
  uint64_t seed_;
  std::vector<Engine> engines_;
  std::vector<int> free_slots_;  // a min-heap
  uint64_t inc_ = 0, join_ = 0;
  size_t width_ = 1;  // 64-bit words per bit set
  KeyMap index_;
  Pool<Row, kRowShift> rows_;
  Pool<Node, kNodeShift> nodes_;
  Slabs slabs_;
  std::vector<uint64_t*> bit_chunks_;  // 2^kRowShift rows of width_ words each
  std::vector<uint64_t> mask_[3];
  size_t count_[3] = {0, 0, 0};
  Heap heaps_[2];
  int64_t active_total_ = 0;
  int turn_ = 0;
  // the current decision: its pages, their rows, the holders of its leading pages
  std::vector<Key> keys_;
  std::vector<uint32_t> key_rows_;
  std::vector<uint32_t> held_nodes_;
  std::vector<uint64_t> levels_;
  int nlevels_ = 0;
  std::vector<uint64_t> scratch_, scratch2_, scratch3_;
};

}  // namespace kvb::fleet

#endif  // KVBRIDGE_FLEET_CORE_H
