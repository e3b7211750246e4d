// Contiguous byte runs of a page transfer between two caches with the same
// memory layout: the C++ twin of kvbridge/transport/ucx/runs.py (which stays
// the reference the tests compare against).  Pure: no UCX, no Python.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "engine.h"

namespace kvb::ucx {

// Where one cache keeps its layers: strides in bytes inside one layer.
struct CacheShape {
  int64_t num_pages = 0;
  int64_t layer_bytes = 0;  // stacked caches: layer l starts at l * layer_bytes
  int64_t s_comp = 0, s_page = 0, s_tok = 0, s_head = 0;
  std::vector<uint64_t> region_ids;  // per layer (one entry for a stacked cache)
};

// A bad block table or range (Python raises PageIndexError / LayoutError).
class RangeError : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// The runs of one range made once (RunPlan::prepare), posted as many times
// as asked, each post with its own request id in its DONE (Engine::put).
struct PreparedPut {
  std::vector<PutRun> runs;
  uint64_t start = 0, end = 0, l0 = 0, l1 = 0;
  uint64_t nbytes = 0;
  uint64_t pages = 0;  // the DONE's pages digest (of the destination block table)
};

class RunPlan {
 public:
  // Shared by both sides (same exact_hash): page_tokens, components (2, or 1
  // for MLA), heads, head bytes, head order HND (and not MLA), KV-first
  // order, stacked, layer count.
  RunPlan(int64_t page_tokens, int64_t components, int64_t heads, int64_t head_bytes, bool hnd,
          bool kv_first, bool stacked, int64_t num_layers, CacheShape src, CacheShape dst);

  // The coalesced runs of tokens [start, end) of layers [l0, l1), into `out`
  // (cleared first).  Returns the byte count.  Throws RangeError.
  uint64_t runs(const int64_t* src_bt, size_t src_n, const int64_t* dst_bt, size_t dst_n,
                int64_t start, int64_t end, int64_t l0, int64_t l1, std::vector<PutRun>* out) const;

  // The runs of tokens [start, end) of layers [l0, l1), kept for posting.
  // Throws RangeError.
  PreparedPut prepare(const int64_t* src_bt, size_t src_n, const int64_t* dst_bt, size_t dst_n,
                      int64_t start, int64_t end, int64_t l0, int64_t l1) const;

  int64_t page_tokens() const { return pt_; }

 private:
  int64_t pt_, comps_, heads_, head_bytes_;
  bool hnd_, kv_first_, stacked_;
  int64_t layers_;
  CacheShape src_, dst_;
};

}  // namespace kvb::ucx
