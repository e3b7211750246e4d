// Built when no CUDA compiler was found: the CUDA entry points say so.
#include "error.h"
#include "kvbridge/pack.h"

extern "C" int kvb_pack_cuda(const kvb_cache_desc*, const kvb_range*, uint64_t, void*, uint64_t,
                             const kvb_exec*) {
  return kvb::fail(KVB_ERR_UNAVAILABLE, "kvbridge was built without CUDA");
}

extern "C" int kvb_unpack_cuda(const kvb_cache_desc*, const kvb_range*, uint64_t, const void*,
                               uint64_t, const kvb_exec*) {
  return kvb::fail(KVB_ERR_UNAVAILABLE, "kvbridge was built without CUDA");
}

extern "C" int kvb_built_with_cuda(void) { return 0; }

extern "C" int kvb_cuda_device_count(void) { return 0; }
