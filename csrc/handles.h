// Internal: what the opaque kvb_cache and kvb_plan handles of pack.h hold, and
// the CUDA side of building them (pack_cuda.cu, or pack_cuda_absent.cpp).
#ifndef KVBRIDGE_HANDLES_H
#define KVBRIDGE_HANDLES_H

#include "geometry.h"
#include "kvbridge/pack.h"

struct kvb_cache {
  kvb::CacheInfo info;
  void* device_bases = nullptr;  // CUDA: info.base as a device array of uint64
  int sm_count = 0;              // CUDA: multiprocessors of info.device
};

struct kvb_plan {
  kvb::PlanInfo info;
  const kvb_cache* cache = nullptr;
  void* device_pages = nullptr;  // CUDA: info.pages as a device array
};

namespace kvb {

// For a cache with device >= 0: check its base pointers and build its device
// table (a no-op without CUDA: the CUDA entry points then say so).
int cuda_attach_cache(kvb_cache* cache);
void cuda_release_cache(kvb_cache* cache);
// For a plan of such a cache: stage its block-table entries to the device.
int cuda_attach_plan(kvb_plan* plan);
void cuda_release_plan(kvb_plan* plan);

}  // namespace kvb

#endif  // KVBRIDGE_HANDLES_H
