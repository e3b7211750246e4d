// The validated-once handles: kvb_cache (a checked descriptor) and kvb_plan (a
// checked range), and the one-shot XXH3-64.
#include <memory>
#include <new>

#include "error.h"
#include "handles.h"
#include "xxh3.h"

extern "C" int kvb_cache_create(const kvb_cache_desc* desc, kvb_cache** out) {
  KVB_GUARD_BEGIN
  if (out == nullptr) return kvb::fail(KVB_ERR_INVALID_ARG, "out is null");
  *out = nullptr;
  auto cache = std::make_unique<kvb_cache>();
  if (int rc = kvb::check_cache(desc, &cache->info); rc != KVB_OK) return rc;
  if (cache->info.device >= 0) {
    if (int rc = kvb::cuda_attach_cache(cache.get()); rc != KVB_OK) return rc;
  }
  *out = cache.release();
  return KVB_OK;
  KVB_GUARD_END
}

extern "C" void kvb_cache_destroy(kvb_cache* cache) {
  if (cache == nullptr) return;
  kvb::cuda_release_cache(cache);
  delete cache;
}

extern "C" int kvb_plan_create(const kvb_cache* cache, const kvb_range* range, int32_t flags,
                               kvb_plan** out) {
  KVB_GUARD_BEGIN
  if (out == nullptr) return kvb::fail(KVB_ERR_INVALID_ARG, "out is null");
  *out = nullptr;
  if (cache == nullptr) return kvb::fail(KVB_ERR_INVALID_ARG, "cache is null");
  if (flags != KVB_PLAN_READ && flags != KVB_PLAN_WRITE) {
    return kvb::failf(KVB_ERR_INVALID_ARG, "unknown plan flags %d", flags);
  }
  auto plan = std::make_unique<kvb_plan>();
  plan->cache = cache;
  const kvb::Access access = flags == KVB_PLAN_WRITE ? kvb::Access::kWrite : kvb::Access::kRead;
  if (int rc = kvb::check_range(cache->info, range, access, &plan->info); rc != KVB_OK) return rc;
  if (cache->info.device >= 0) {
    if (int rc = kvb::cuda_attach_plan(plan.get()); rc != KVB_OK) return rc;
  }
  *out = plan.release();
  return KVB_OK;
  KVB_GUARD_END
}

extern "C" void kvb_plan_destroy(kvb_plan* plan) {
  if (plan == nullptr) return;
  kvb::cuda_release_plan(plan);
  delete plan;
}

extern "C" uint64_t kvb_plan_wire_nbytes(const kvb_plan* plan) {
  return plan == nullptr ? 0 : plan->info.g.total_bytes;
}

extern "C" uint64_t kvb_xxh3_64(const void* data, uint64_t n) {
  return kvb::xxh3_64(n == 0 ? "" : data, static_cast<size_t>(n));
}
