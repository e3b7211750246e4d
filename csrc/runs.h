// Internal: the token range of a plan cut into runs of tokens that sit at one
// constant token stride in the cache (one page, or physically adjacent pages).
#ifndef KVBRIDGE_RUNS_H
#define KVBRIDGE_RUNS_H

#include <cstdint>
#include <vector>

#include "geometry.h"

namespace kvb {

// Pages named by consecutive block-table entries coalesce into one run when
// the next page begins exactly one token stride after the previous run ends.
// `pages` holds the entries from g.first_block on (g.num_blocks of them).
std::vector<TokenRun> token_runs(const Geometry& g, const CompStrides& s, const int32_t* pages);

}  // namespace kvb

#endif  // KVBRIDGE_RUNS_H
