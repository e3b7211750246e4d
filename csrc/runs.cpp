#include "runs.h"

#include <algorithm>

namespace kvb {

void slice_tokens(const Geometry& g, uint64_t lo, uint64_t hi, int64_t* t_lo, int64_t* t_hi) {
  *t_lo = 0;
  *t_hi = g.num_tokens;
  if (hi <= lo || g.block_bytes <= 0) return;
  const uint64_t blkb = static_cast<uint64_t>(g.block_bytes);
  const uint64_t tokb = static_cast<uint64_t>(g.token_bytes);
  if (lo / blkb != (hi - 1) / blkb) return;
  *t_lo = static_cast<int64_t>((lo % blkb) / tokb);
  *t_hi = static_cast<int64_t>(((hi - 1) % blkb) / tokb) + 1;
}

std::vector<TokenRun> token_runs(const Geometry& g, const int32_t* block_table, int64_t t_lo,
                                 int64_t t_hi) {
  std::vector<TokenRun> runs;
  if (t_hi <= t_lo) return runs;
  const int64_t begin = g.token_start + t_lo;
  const int64_t end = g.token_start + t_hi;
  const int64_t b0 = begin / g.page_tokens, b1 = (end - 1) / g.page_tokens;
  runs.reserve(static_cast<size_t>(b1 - b0 + 1));
  for (int64_t b = b0; b <= b1; ++b) {
    const int64_t a0 = std::max(b * g.page_tokens, begin);
    const int64_t a1 = std::min((b + 1) * g.page_tokens, end);
    const int64_t off = static_cast<int64_t>(block_table[b]) * g.stride_page +
                        (a0 - b * g.page_tokens) * g.stride_token;
    if (!runs.empty()) {
      TokenRun& last = runs.back();
      if (last.off + (last.t1 - last.t0) * g.stride_token == off) {
        last.t1 = a1 - g.token_start;
        continue;
      }
    }
    runs.push_back(TokenRun{a0 - g.token_start, a1 - g.token_start, off});
  }
  return runs;
}

}  // namespace kvb
