// Internal: the token range of a call cut into runs of tokens that sit at one
// constant token stride in the cache (one page, or physically adjacent pages).
#ifndef KVBRIDGE_RUNS_H
#define KVBRIDGE_RUNS_H

#include <cstdint>
#include <vector>

#include "geometry.h"

namespace kvb {

struct TokenRun {
  int64_t t0;   // first token, relative to the range start
  int64_t t1;   // one past the last token
  int64_t off;  // bytes from (layer base + component * stride) to token t0
};

// Pages named by consecutive block-table entries coalesce into one run when
// the next page begins exactly one token stride after the previous run ends.
// `block_table` is the host table indexed by absolute block number.
// Only tokens [t_lo, t_hi) (relative to the range start) are cut.
std::vector<TokenRun> token_runs(const Geometry& g, const int32_t* block_table, int64_t t_lo,
                                 int64_t t_hi);

// The tokens (relative to the range start) that wire positions [lo, hi) touch:
// a sub-range when the slice stays inside one (layer, component) block, else all.
void slice_tokens(const Geometry& g, uint64_t lo, uint64_t hi, int64_t* t_lo, int64_t* t_hi);

}  // namespace kvb

#endif  // KVBRIDGE_RUNS_H
