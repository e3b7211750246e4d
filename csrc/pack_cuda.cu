// CUDA pack/unpack: the same validation and slice semantics as the CPU path,
// one kernel launch per call on the caller's stream.  One warp copies one token
// row of the wire (wire_map.h); 16-byte vector loads/stores where both sides
// are aligned, single bytes at misaligned slice ends.
//
// With a plan (kvb_plan_*), the cache's base table and the range's block-table
// entries live on the device from kvb_cache_create / kvb_plan_create on: a
// launch allocates nothing and does not synchronise.  The per-call entry
// points stage both per call, in stream order.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "error.h"
#include "geometry.h"
#include "handles.h"
#include "kvbridge/pack.h"
#include "wire_map.h"

namespace kvb {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kBlocksPerSm = 16;

template <bool kPack>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) copy_rows_kernel(RowCopy d) {
  const uint32_t lane = threadIdx.x & 31u;
  const uint64_t warp = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const uint64_t warps = (static_cast<uint64_t>(gridDim.x) * blockDim.x) >> 5;
  for (uint64_t i = warp; i < d.num_rows; i += warps) {
    copy_row<kPack>(d, d.row_first + i, lane, 32u);
  }
}

int cuda_fail(cudaError_t e, const char* what) {
  return failf(KVB_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

// Makes `device` current for the scope if it is not already (no call at all
// when it is), and restores the caller's device afterwards.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      cudaGetLastError();
      error_ = cudaErrorNoDevice;
      return;
    }
    if (prev_ != device) {
      error_ = cudaSetDevice(device);
      switched_ = error_ == cudaSuccess;
    }
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int prev_ = 0;
  bool switched_ = false;
  cudaError_t error_ = cudaSuccess;
};

int device_usable(int device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return fail(KVB_ERR_UNAVAILABLE, "no usable CUDA device (driver missing or no GPU)");
  }
  if (device >= count) {
    return failf(KVB_ERR_INVALID_ARG, "CUDA device %d does not exist (%d devices)", device, count);
  }
  return KVB_OK;
}

// Pointers the kernel dereferences must be device memory of `device`, managed
// memory, or pinned (registered) host memory; never pageable host memory.
int check_pointer(const void* p, int device, bool host_ok, const char* what) {
  cudaPointerAttributes attr;
  cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cuda_fail(e, "cudaPointerGetAttributes");
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      if (attr.device != device) {
        return failf(KVB_ERR_INVALID_ARG, "%s is on CUDA device %d, the cache on %d", what,
                     attr.device, device);
      }
      return KVB_OK;
    case cudaMemoryTypeManaged:
      return KVB_OK;
    case cudaMemoryTypeHost:
      if (host_ok) return KVB_OK;
      return failf(KVB_ERR_INVALID_ARG, "%s is pinned host memory; it must be device memory", what);
    default:
      return failf(KVB_ERR_INVALID_ARG,
                   "%s is pageable host memory; the CUDA path needs device or pinned host memory",
                   what);
  }
}

int check_bases(const PlanInfo& p) {
  const CacheInfo& c = *p.cache;
  for (int64_t l = p.g.layer_start; l < p.g.layer_end; ++l) {
    for (int k = 0; k < c.num_components; ++k) {
      if (int rc =
              check_pointer(reinterpret_cast<void*>(c.at(l, k)), c.device, false, "a cache layer");
          rc != KVB_OK) {
        return rc;
      }
    }
  }
  return KVB_OK;
}

template <bool kPack>
int launch(const PlanInfo& p, uint64_t wire_offset, void* wire, uint64_t nbytes,
           const uint64_t* dev_bases, const int32_t* dev_pages, int sm_count, cudaStream_t stream) {
  const bool aligned = row_copy_aligned(p, wire, wire_offset);
  const RowCopy d = make_row_copy(p, wire_offset, nbytes, dev_bases, dev_pages,
                                  static_cast<uint8_t*>(wire), aligned);
  const uint64_t want = (d.num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const uint64_t cap = static_cast<uint64_t>(std::max(sm_count, 1)) * kBlocksPerSm;
  const unsigned blocks = static_cast<unsigned>(std::min(want, cap));
  if (kPack) {
    copy_rows_kernel<true><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(d);
  } else {
    copy_rows_kernel<false><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(d);
  }
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? KVB_OK : cuda_fail(e, "launching the copy kernel");
}

cudaStream_t stream_of(const kvb_exec* exec) {
  return reinterpret_cast<cudaStream_t>(exec != nullptr ? exec->cuda_stream : 0);
}

template <bool kPack>
int run_plan(const kvb_plan* plan, uint64_t wire_offset, void* wire, uint64_t nbytes,
             const kvb_exec* exec) {
  if (plan == nullptr) return fail(KVB_ERR_INVALID_ARG, "plan is null");
  const PlanInfo& p = plan->info;
  if (!kPack && !p.writable) {
    return fail(KVB_ERR_INVALID_ARG, "unpack needs a plan created with KVB_PLAN_WRITE");
  }
  if (int rc = check_slice(p, wire_offset, nbytes, wire, true); rc != KVB_OK) return rc;
  if (p.cache->device < 0) {
    return fail(KVB_ERR_INVALID_ARG, "the CUDA path needs a cache on a CUDA device (device >= 0)");
  }
  if (nbytes == 0) return KVB_OK;
  if (plan->cache->device_bases == nullptr ||
      (p.g.num_tokens > 0 && plan->device_pages == nullptr)) {
    return fail(KVB_ERR_INTERNAL, "the plan has no device tables");
  }
  DeviceScope scope(p.cache->device);
  if (scope.error() != cudaSuccess) return cuda_fail(scope.error(), "cudaSetDevice");
  if (int rc = check_pointer(wire, p.cache->device, true, "the wire buffer"); rc != KVB_OK) {
    return rc;
  }
  const uint64_t* bases = static_cast<const uint64_t*>(plan->cache->device_bases) +
                          p.g.layer_start * p.g.num_components;
  return launch<kPack>(p, wire_offset, wire, nbytes, bases,
                       static_cast<const int32_t*>(plan->device_pages), plan->cache->sm_count,
                       stream_of(exec));
}

// The per-call entry points: check, stage the tables in stream order, launch, free.
template <bool kPack>
int run_once(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset, void* wire,
             uint64_t nbytes, const kvb_exec* exec) {
  if (cache == nullptr || range == nullptr) {
    return fail(KVB_ERR_INVALID_ARG, "null cache descriptor or range");
  }
  CacheInfo c;
  if (int rc = check_cache(cache, &c); rc != KVB_OK) return rc;
  PlanInfo p;
  if (int rc = check_range(c, range, kPack ? Access::kRead : Access::kWrite, &p); rc != KVB_OK) {
    return rc;
  }
  if (int rc = check_slice(p, wire_offset, nbytes, wire, true); rc != KVB_OK) return rc;
  if (c.device < 0) {
    return fail(KVB_ERR_INVALID_ARG, "the CUDA path needs a cache on a CUDA device (device >= 0)");
  }
  if (nbytes == 0) return KVB_OK;
  if (int rc = device_usable(c.device); rc != KVB_OK) return rc;
  DeviceScope scope(c.device);
  if (scope.error() != cudaSuccess) return cuda_fail(scope.error(), "cudaSetDevice");
  if (int rc = check_bases(p); rc != KVB_OK) return rc;
  if (int rc = check_pointer(wire, c.device, true, "the wire buffer"); rc != KVB_OK) return rc;

  // Stage the (layer, component) bases and the covered block-table entries in one buffer.
  const size_t nb = static_cast<size_t>((p.g.layer_end - p.g.layer_start) * c.num_components);
  const size_t base_bytes = nb * sizeof(uint64_t);
  const size_t page_bytes = p.pages.size() * sizeof(int32_t);
  std::vector<uint8_t> host(base_bytes + page_bytes);
  for (size_t i = 0; i < nb; ++i) {
    const uint64_t b = c.base[static_cast<size_t>(p.g.layer_start * c.num_components) + i];
    std::memcpy(host.data() + i * sizeof(uint64_t), &b, sizeof b);
  }
  std::memcpy(host.data() + base_bytes, p.pages.data(), page_bytes);

  cudaStream_t stream = stream_of(exec);
  int pools = 0;
  cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, c.device);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c.device);
  void* staged = nullptr;
  cudaError_t e =
      pools ? cudaMallocAsync(&staged, host.size(), stream) : cudaMalloc(&staged, host.size());
  if (e != cudaSuccess) return cuda_fail(e, "allocating the staged block table");
  // From pageable memory: the copy has consumed `host` when the call returns.
  e = cudaMemcpyAsync(staged, host.data(), host.size(), cudaMemcpyHostToDevice, stream);
  int rc = e == cudaSuccess ? KVB_OK : cuda_fail(e, "staging the block table");
  if (rc == KVB_OK) {
    rc = launch<kPack>(p, wire_offset, wire, nbytes, static_cast<const uint64_t*>(staged),
                       reinterpret_cast<const int32_t*>(static_cast<uint8_t*>(staged) + base_bytes),
                       sms, stream);
  }
  cudaError_t ef = cudaSuccess;
  if (pools) {
    ef = cudaFreeAsync(staged, stream);
  } else {
    cudaError_t es = cudaStreamSynchronize(stream);
    ef = cudaFree(staged);
    if (rc == KVB_OK && es != cudaSuccess) rc = cuda_fail(es, "cudaStreamSynchronize");
  }
  if (rc != KVB_OK) return rc;
  if (ef != cudaSuccess) return cuda_fail(ef, "freeing the staged block table");
  return KVB_OK;
}

}  // namespace

int cuda_attach_cache(kvb_cache* cache) {
  const CacheInfo& c = cache->info;
  if (int rc = device_usable(c.device); rc != KVB_OK) return rc;
  DeviceScope scope(c.device);
  if (scope.error() != cudaSuccess) return cuda_fail(scope.error(), "cudaSetDevice");
  for (uintptr_t b : c.base) {
    if (b == 0) continue;  // a layer no range may use
    if (int rc = check_pointer(reinterpret_cast<void*>(b), c.device, false, "a cache layer");
        rc != KVB_OK) {
      return rc;
    }
  }
  cudaDeviceGetAttribute(&cache->sm_count, cudaDevAttrMultiProcessorCount, c.device);
  std::vector<uint64_t> table(c.base.begin(), c.base.end());
  void* dev = nullptr;
  cudaError_t e = cudaMalloc(&dev, table.size() * sizeof(uint64_t));
  if (e != cudaSuccess) return cuda_fail(e, "allocating the cache's base table");
  e = cudaMemcpy(dev, table.data(), table.size() * sizeof(uint64_t), cudaMemcpyHostToDevice);
  if (e != cudaSuccess) {
    cudaFree(dev);
    return cuda_fail(e, "copying the cache's base table");
  }
  cache->device_bases = dev;
  return KVB_OK;
}

void cuda_release_cache(kvb_cache* cache) {
  if (cache->device_bases == nullptr) return;
  DeviceScope scope(cache->info.device);
  cudaFree(cache->device_bases);
  cudaGetLastError();
  cache->device_bases = nullptr;
}

int cuda_attach_plan(kvb_plan* plan) {
  const PlanInfo& p = plan->info;
  if (p.pages.empty()) return KVB_OK;
  DeviceScope scope(p.cache->device);
  if (scope.error() != cudaSuccess) return cuda_fail(scope.error(), "cudaSetDevice");
  void* dev = nullptr;
  const size_t n = p.pages.size() * sizeof(int32_t);
  cudaError_t e = cudaMalloc(&dev, n);
  if (e != cudaSuccess) return cuda_fail(e, "allocating the plan's block table");
  e = cudaMemcpy(dev, p.pages.data(), n, cudaMemcpyHostToDevice);
  if (e != cudaSuccess) {
    cudaFree(dev);
    return cuda_fail(e, "copying the plan's block table");
  }
  plan->device_pages = dev;
  return KVB_OK;
}

void cuda_release_plan(kvb_plan* plan) {
  if (plan->device_pages == nullptr) return;
  DeviceScope scope(plan->info.cache->device);
  cudaFree(plan->device_pages);
  cudaGetLastError();
  plan->device_pages = nullptr;
}

}  // namespace kvb

extern "C" int kvb_pack_cuda(const kvb_cache_desc* cache, const kvb_range* range,
                             uint64_t wire_offset, void* dst, uint64_t nbytes,
                             const kvb_exec* exec) {
  KVB_GUARD_BEGIN
  return kvb::run_once<true>(cache, range, wire_offset, dst, nbytes, exec);
  KVB_GUARD_END
}

extern "C" int kvb_unpack_cuda(const kvb_cache_desc* cache, const kvb_range* range,
                               uint64_t wire_offset, const void* src, uint64_t nbytes,
                               const kvb_exec* exec) {
  KVB_GUARD_BEGIN
  return kvb::run_once<false>(cache, range, wire_offset, const_cast<void*>(src), nbytes, exec);
  KVB_GUARD_END
}

extern "C" int kvb_plan_pack_cuda(const kvb_plan* plan, uint64_t wire_offset, void* dst,
                                  uint64_t nbytes, const kvb_exec* exec) {
  KVB_GUARD_BEGIN
  return kvb::run_plan<true>(plan, wire_offset, dst, nbytes, exec);
  KVB_GUARD_END
}

extern "C" int kvb_plan_unpack_cuda(const kvb_plan* plan, uint64_t wire_offset, const void* src,
                                    uint64_t nbytes, const kvb_exec* exec) {
  KVB_GUARD_BEGIN
  return kvb::run_plan<false>(plan, wire_offset, const_cast<void*>(src), nbytes, exec);
  KVB_GUARD_END
}

extern "C" int kvb_built_with_cuda(void) { return 1; }

extern "C" int kvb_cuda_device_count(void) {
  try {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  } catch (...) {
    return 0;
  }
}
