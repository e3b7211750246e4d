// Built when no CUDA compiler was found: the CUDA entry points say so.  CUDA
// caches can still be described (kvb_cache_create), only not copied.
#include "error.h"
#include "handles.h"
#include "kvbridge/pack.h"

namespace kvb {

int cuda_attach_cache(kvb_cache*) { return KVB_OK; }
void cuda_release_cache(kvb_cache*) {}
int cuda_attach_plan(kvb_plan*) { return KVB_OK; }
void cuda_release_plan(kvb_plan*) {}

}  // namespace kvb

extern "C" int kvb_pack_cuda(const kvb_cache_desc*, const kvb_range*, uint64_t, void*, uint64_t,
                             const kvb_exec*) {
  return kvb::fail(KVB_ERR_UNAVAILABLE, "kvbridge was built without CUDA");
}

extern "C" int kvb_unpack_cuda(const kvb_cache_desc*, const kvb_range*, uint64_t, const void*,
                               uint64_t, const kvb_exec*) {
  return kvb::fail(KVB_ERR_UNAVAILABLE, "kvbridge was built without CUDA");
}

extern "C" int kvb_plan_pack_cuda(const kvb_plan*, uint64_t, void*, uint64_t, const kvb_exec*) {
  return kvb::fail(KVB_ERR_UNAVAILABLE, "kvbridge was built without CUDA");
}

extern "C" int kvb_plan_unpack_cuda(const kvb_plan*, uint64_t, const void*, uint64_t,
                                    const kvb_exec*) {
  return kvb::fail(KVB_ERR_UNAVAILABLE, "kvbridge was built without CUDA");
}

extern "C" int kvb_built_with_cuda(void) { return 0; }

extern "C" int kvb_cuda_device_count(void) { return 0; }
