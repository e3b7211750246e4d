// Page pieces in memory order, merged where contiguous at both ends.
#include "runs.h"

#include "messages.h"

#include <string>

namespace kvb::ucx {

RunPlan::RunPlan(int64_t page_tokens, int64_t components, int64_t heads, int64_t head_bytes,
                 bool hnd, bool kv_first, bool stacked, int64_t num_layers, CacheShape src,
                 CacheShape dst)
    : pt_(page_tokens),
      comps_(components),
      heads_(heads),
      head_bytes_(head_bytes),
      hnd_(hnd),
      kv_first_(kv_first),
      stacked_(stacked),
      layers_(num_layers),
      src_(std::move(src)),
      dst_(std::move(dst)) {
  const size_t want = stacked_ ? 1 : static_cast<size_t>(layers_);
  if (pt_ <= 0 || comps_ <= 0 || heads_ <= 0 || head_bytes_ <= 0 || layers_ <= 0 ||
      src_.region_ids.size() != want || dst_.region_ids.size() != want)
    throw std::invalid_argument("inconsistent run plan");
}

namespace {

void check_table(const int64_t* bt, size_t n, int64_t first, int64_t last, int64_t pages,
                 const char* side) {
  if (static_cast<int64_t>(n) <= last)
    throw RangeError(std::string(side) + " block table of " + std::to_string(n) +
                     " pages does not cover the token range");
  for (int64_t i = first; i <= last; ++i)
    if (bt[i] < 0 || bt[i] >= pages)
      throw RangeError(std::string(side) + " block table names a page outside [0, " +
                       std::to_string(pages) + ")");
}

}  // namespace

uint64_t RunPlan::runs(const int64_t* src_bt, size_t src_n, const int64_t* dst_bt, size_t dst_n,
                       int64_t start, int64_t end, int64_t l0, int64_t l1,
                       std::vector<PutRun>* out) const {
  out->clear();
  if (start < 0 || end < start) throw std::invalid_argument("bad token range");
  if (l0 < 0 || l1 < l0 || l1 > layers_) throw std::invalid_argument("bad layer range");
  if (start == end || l0 == l1) return 0;
  const int64_t first = start / pt_, last = (end - 1) / pt_;
  check_table(src_bt, src_n, first, last, src_.num_pages, "local");
  check_table(dst_bt, dst_n, first, last, dst_.num_pages, "remote");
  const int64_t nheads = hnd_ ? heads_ : 1;
  const int64_t unit_src = hnd_ ? head_bytes_ : src_.s_tok;
  const int64_t unit_dst = hnd_ ? head_bytes_ : dst_.s_tok;
  const int64_t npages = last - first + 1;
  const int64_t outer = kv_first_ ? comps_ : npages;
  const int64_t inner = kv_first_ ? npages : comps_;
  uint64_t total = 0;
  for (int64_t layer = l0; layer < l1; ++layer) {
    const size_t ri = stacked_ ? 0 : static_cast<size_t>(layer);
    const uint64_t sreg = src_.region_ids[ri], dreg = dst_.region_ids[ri];
    const int64_t sbase = stacked_ ? layer * src_.layer_bytes : 0;
    const int64_t dbase = stacked_ ? layer * dst_.layer_bytes : 0;
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t i = 0; i < inner; ++i) {
        const int64_t comp = kv_first_ ? o : i;
        const int64_t p = kv_first_ ? i : o;  // index into [first, last]
        const int64_t logical = first + p;
        const int64_t t0 = start > logical * pt_ ? start - logical * pt_ : 0;
        const int64_t t1 = end - logical * pt_ < pt_ ? end - logical * pt_ : pt_;
        const int64_t sp = src_bt[logical], dp = dst_bt[logical];
        for (int64_t h = 0; h < nheads; ++h) {
          const uint64_t soff = static_cast<uint64_t>(
              sbase + comp * src_.s_comp + sp * src_.s_page + h * src_.s_head + t0 * unit_src);
          const uint64_t doff = static_cast<uint64_t>(
              dbase + comp * dst_.s_comp + dp * dst_.s_page + h * dst_.s_head + t0 * unit_dst);
          const uint64_t len = static_cast<uint64_t>((t1 - t0) * unit_src);
          total += len;
          if (!out->empty()) {
            PutRun& r = out->back();
            if (r.local_region == sreg && r.remote_region == dreg &&
                r.local_off + r.length == soff && r.remote_off + r.length == doff) {
              r.length += len;
              continue;
            }
          }
          out->push_back({sreg, soff, dreg, doff, len});
        }
      }
    }
  }
  return total;
}

PreparedPut RunPlan::prepare(const int64_t* src_bt, size_t src_n, const int64_t* dst_bt,
                             size_t dst_n, int64_t start, int64_t end, int64_t l0,
                             int64_t l1) const {
  PreparedPut p;
  p.nbytes = runs(src_bt, src_n, dst_bt, dst_n, start, end, l0, l1, &p.runs);
  p.start = static_cast<uint64_t>(start);
  p.end = static_cast<uint64_t>(end);
  p.l0 = static_cast<uint64_t>(l0);
  p.l1 = static_cast<uint64_t>(l1);
  p.pages = pages_digest(dst_bt, dst_n, p.start, p.end, static_cast<uint64_t>(pt_));
  return p;
}

}  // namespace kvb::ucx
