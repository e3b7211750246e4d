#include "runs.h"

#include <algorithm>

namespace kvb {

std::vector<TokenRun> token_runs(const Geometry& g, const CompStrides& s, const int32_t* pages) {
  std::vector<TokenRun> runs;
  if (g.num_tokens <= 0) return runs;
  const int64_t begin = g.token_start;
  const int64_t end = g.token_start + g.num_tokens;
  runs.reserve(static_cast<size_t>(g.num_blocks));
  for (int64_t i = 0; i < g.num_blocks; ++i) {
    const int64_t b = g.first_block + i;
    const int64_t a0 = std::max(b * g.page_tokens, begin);
    const int64_t a1 = std::min((b + 1) * g.page_tokens, end);
    const int64_t off =
        static_cast<int64_t>(pages[i]) * s.page + (a0 - b * g.page_tokens) * s.token;
    if (!runs.empty()) {
      TokenRun& last = runs.back();
      if (last.off + (last.t1 - last.t0) * s.token == off) {
        last.t1 = a1 - g.token_start;
        continue;
      }
    }
    runs.push_back(TokenRun{a0 - g.token_start, a1 - g.token_start, off});
  }
  return runs;
}

}  // namespace kvb
