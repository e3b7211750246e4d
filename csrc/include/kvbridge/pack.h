/* Pack: gather a request's token/layer range from a paged cache into wire bytes.
 * Unpack: scatter wire bytes into a paged cache (of any page size and order).
 *
 * Both work on any byte slice [wire_offset, wire_offset + nbytes) of the wire
 * buffer of the range, so a receiver may unpack chunks in any arrival order.
 * Everything is validated before any byte moves: on an error nothing is written.
 * Entry points catch every exception and return a status; kvb_last_error()
 * says why.
 */
#ifndef KVBRIDGE_PACK_H
#define KVBRIDGE_PACK_H

#include <stdint.h>

#include "kvbridge/layout.h"
#include "kvbridge/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Check a cache descriptor and range as an unpack would (the stricter
 * checks: page ids in range, no page repeated, table covers the range, slice
 * inside the wire buffer).  Pack alone also accepts repeated page ids, so a
 * table this refuses with KVB_ERR_OVERLAP may still be packed. */
int kvb_validate(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset,
                 uint64_t nbytes);

/* Host memory caches. */
int kvb_pack_cpu(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset,
                 void* dst, uint64_t nbytes, const kvb_exec* exec);
int kvb_unpack_cpu(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset,
                   const void* src, uint64_t nbytes, const kvb_exec* exec);

/* CUDA caches: one kernel launch on exec->cuda_stream, asynchronous like any
 * launch.  dst/src may be device memory of cache->device or pinned host memory
 * (pageable memory is refused with KVB_ERR_INVALID_ARG).  range->block_table is
 * host memory: it is validated here and the covered entries are staged to the
 * device in stream order.  Returns KVB_ERR_UNAVAILABLE when built without CUDA
 * or when no device is present. */
int kvb_pack_cuda(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset,
                  void* dst, uint64_t nbytes, const kvb_exec* exec);
int kvb_unpack_cuda(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset,
                    const void* src, uint64_t nbytes, const kvb_exec* exec);

/* 1 when compiled with CUDA; 0 otherwise. */
int kvb_built_with_cuda(void);
/* Number of usable CUDA devices now (0 without a driver or without CUDA). */
int kvb_cuda_device_count(void);

#ifdef __cplusplus
}
#endif
#endif /* KVBRIDGE_PACK_H */
