// CUDA pack/unpack: the same validation and slice semantics as the CPU path,
// one kernel launch per call on the caller's stream.  One warp copies one token
// row of the wire (wire_map.h); 16-byte vector loads/stores where both sides
// are aligned, single bytes at misaligned slice ends.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "error.h"
#include "geometry.h"
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

// Restores the caller's current device on scope exit.
class DeviceGuard {
 public:
  DeviceGuard() { ok_ = cudaGetDevice(&prev_) == cudaSuccess; }
  ~DeviceGuard() {
    if (ok_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool ok_ = false;
};

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

template <bool kPack>
int run_cuda(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset, void* wire,
             uint64_t nbytes, const kvb_exec* exec) {
  Geometry g;
  int rc = validate(cache, range, wire_offset, nbytes, wire, true,
                    kPack ? Access::kRead : Access::kWrite, &g);
  if (rc != KVB_OK) return rc;
  if (cache->device < 0) {
    return fail(KVB_ERR_INVALID_ARG, "the CUDA path needs a cache on a CUDA device (device >= 0)");
  }
  if (nbytes == 0) return KVB_OK;
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return fail(KVB_ERR_UNAVAILABLE, "no usable CUDA device (driver missing or no GPU)");
  }
  if (cache->device >= count) {
    return failf(KVB_ERR_INVALID_ARG, "CUDA device %d does not exist (%d devices)", cache->device,
                 count);
  }
  DeviceGuard guard;
  if ((e = cudaSetDevice(cache->device)) != cudaSuccess) return cuda_fail(e, "cudaSetDevice");

  const int64_t nlayers = g.layer_end - g.layer_start;
  for (int64_t l = g.layer_start; l < g.layer_end; ++l) {
    if ((rc = check_pointer(cache->layer_base[l], cache->device, false, "a cache layer")) !=
        KVB_OK) {
      return rc;
    }
  }
  if ((rc = check_pointer(wire, cache->device, true, "the wire buffer")) != KVB_OK) return rc;
  const bool aligned = row_copy_aligned(g, cache->layer_base, wire, wire_offset);

  // Stage the layer pointers and the covered block-table entries in one buffer.
  const size_t ptr_bytes = static_cast<size_t>(nlayers) * sizeof(uint64_t);
  const size_t page_bytes = static_cast<size_t>(g.num_blocks) * sizeof(int32_t);
  std::vector<uint8_t> host(ptr_bytes + page_bytes);
  for (int64_t l = 0; l < nlayers; ++l) {
    const uint64_t p = reinterpret_cast<uintptr_t>(cache->layer_base[g.layer_start + l]);
    std::memcpy(host.data() + l * sizeof(uint64_t), &p, sizeof p);
  }
  std::memcpy(host.data() + ptr_bytes, range->block_table + g.first_block, page_bytes);

  cudaStream_t stream = reinterpret_cast<cudaStream_t>(exec != nullptr ? exec->cuda_stream : 0);
  int pools = 0;
  cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, cache->device);
  void* staged = nullptr;
  e = pools ? cudaMallocAsync(&staged, host.size(), stream) : cudaMalloc(&staged, host.size());
  if (e != cudaSuccess) return cuda_fail(e, "allocating the staged block table");
  // From pageable memory: the copy has consumed `host` when the call returns.
  e = cudaMemcpyAsync(staged, host.data(), host.size(), cudaMemcpyHostToDevice, stream);

  const RowCopy d =
      make_row_copy(g, wire_offset, nbytes, static_cast<const uint64_t*>(staged),
                    reinterpret_cast<const int32_t*>(static_cast<uint8_t*>(staged) + ptr_bytes),
                    static_cast<uint8_t*>(wire), aligned);

  if (e == cudaSuccess) {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, cache->device);
    const uint64_t want = (d.num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    const uint64_t cap = static_cast<uint64_t>(std::max(sms, 1)) * kBlocksPerSm;
    const unsigned blocks = static_cast<unsigned>(std::min(want, cap));
    if (kPack) {
      copy_rows_kernel<true><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(d);
    } else {
      copy_rows_kernel<false><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(d);
    }
    e = cudaGetLastError();
  }
  const char* what = e == cudaSuccess ? "" : "launching the copy kernel";
  cudaError_t ef = cudaSuccess;
  if (pools) {
    ef = cudaFreeAsync(staged, stream);
  } else {
    cudaError_t es = cudaStreamSynchronize(stream);
    ef = cudaFree(staged);
    if (e == cudaSuccess && es != cudaSuccess) {
      e = es;
      what = "cudaStreamSynchronize";
    }
  }
  if (e != cudaSuccess) return cuda_fail(e, what);
  if (ef != cudaSuccess) return cuda_fail(ef, "freeing the staged block table");
  return KVB_OK;
}

}  // namespace
}  // namespace kvb

extern "C" int kvb_pack_cuda(const kvb_cache_desc* cache, const kvb_range* range,
                             uint64_t wire_offset, void* dst, uint64_t nbytes,
                             const kvb_exec* exec) {
  KVB_GUARD_BEGIN
  return kvb::run_cuda<true>(cache, range, wire_offset, dst, nbytes, exec);
  KVB_GUARD_END
}

extern "C" int kvb_unpack_cuda(const kvb_cache_desc* cache, const kvb_range* range,
                               uint64_t wire_offset, const void* src, uint64_t nbytes,
                               const kvb_exec* exec) {
  KVB_GUARD_BEGIN
  return kvb::run_cuda<false>(cache, range, wire_offset, const_cast<void*>(src), nbytes, exec);
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
