/* Pack: gather a request's token/layer/head range from a paged cache into wire bytes.
 * Unpack: scatter wire bytes into a paged cache (of any page size and order).
 *
 * Both work on any byte slice [wire_offset, wire_offset + nbytes) of the wire
 * buffer of the range, so a receiver may unpack chunks in any arrival order.
 * Everything is validated before any byte moves: on an error nothing is written
 * (the one exception, a checksum mismatch on unpack, is documented below).
 * Entry points catch every exception and return a status; kvb_last_error()
 * says why.
 *
 * Two ways to call the core:
 *  - per call (ABI 1): kvb_pack_cpu(desc, range, ...) validates the descriptor
 *    and the range on every call;
 *  - validated once (ABI 2): kvb_cache_create() checks a descriptor once (and
 *    for a CUDA cache builds its device-side pointer table), kvb_plan_create()
 *    checks a range once (and for a CUDA cache stages its block-table entries to
 *    the device); kvb_plan_pack_*() / kvb_plan_unpack_*() then check only the
 *    slice and the buffer.  A plan borrows its cache: destroy plans first.
 */
#ifndef KVBRIDGE_PACK_H
#define KVBRIDGE_PACK_H

#include <stdint.h>

#include "kvbridge/layout.h"
#include "kvbridge/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- per call ------------------------------------------------------------------ */

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
 * device in stream order (an allocation per call: a plan avoids it).  Returns
 * KVB_ERR_UNAVAILABLE when built without CUDA or when no device is present. */
int kvb_pack_cuda(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset,
                  void* dst, uint64_t nbytes, const kvb_exec* exec);
int kvb_unpack_cuda(const kvb_cache_desc* cache, const kvb_range* range, uint64_t wire_offset,
                    const void* src, uint64_t nbytes, const kvb_exec* exec);

/* ---- validated once (ABI 2) -------------------------------------------------------- */

typedef struct kvb_cache kvb_cache; /* a checked copy of a descriptor */
typedef struct kvb_plan kvb_plan;   /* a checked range of one cache */

/* Check `desc` (everything that does not depend on a range) and copy it.  For
 * a CUDA cache built with CUDA, the base pointers are checked to be device or
 * managed memory of desc->device and copied to a device table (synchronously,
 * once).  The memory the descriptor names must stay valid while the handle
 * lives.  *out is NULL on an error. */
int kvb_cache_create(const kvb_cache_desc* desc, kvb_cache** out);
void kvb_cache_destroy(kvb_cache* cache); /* NULL is ignored */

#define KVB_PLAN_READ 0  /* the plan packs */
#define KVB_PLAN_WRITE 1 /* the plan packs and unpacks: kvb_validate's stricter checks */

/* Check `range` against the cache and copy the block-table entries it covers
 * (range->block_table is not read afterwards); for a CUDA cache also stage
 * them to the device (synchronously, once).  The cache must outlive the plan. */
int kvb_plan_create(const kvb_cache* cache, const kvb_range* range, int32_t flags, kvb_plan** out);
void kvb_plan_destroy(kvb_plan* plan); /* NULL is ignored */
/* Bytes of the plan's wire buffer (0 for NULL). */
uint64_t kvb_plan_wire_nbytes(const kvb_plan* plan);

/* Host memory caches.  With xxh3_out non-NULL, pack also stores in *xxh3_out
 * the XXH3-64 (seed 0) of the nbytes it wrote, computed in the same pass
 * (the slice is then copied by the calling thread alone; the digest is
 * sequential).  With xxh3_expect non-NULL, unpack hashes its input in the same
 * pass as it scatters it, window by window, and returns KVB_ERR_CHECKSUM when
 * the digest differs from *xxh3_expect: then the cache slots of exactly this
 * slice hold unspecified bytes (every other byte of the cache is untouched),
 * and unpacking the right bytes into the same slice again repairs them. */
int kvb_plan_pack_cpu(const kvb_plan* plan, uint64_t wire_offset, void* dst, uint64_t nbytes,
                      const kvb_exec* exec, uint64_t* xxh3_out);
int kvb_plan_unpack_cpu(const kvb_plan* plan, uint64_t wire_offset, const void* src,
                        uint64_t nbytes, const kvb_exec* exec, const uint64_t* xxh3_expect);

/* CUDA caches: one kernel launch on exec->cuda_stream that allocates nothing
 * and does not synchronise; the one runtime query per call checks that the
 * wire buffer is device memory of the cache's device or pinned host memory.
 * The call runs on the cache's device (it switches the current device only if
 * the caller's is another one, and switches back). */
int kvb_plan_pack_cuda(const kvb_plan* plan, uint64_t wire_offset, void* dst, uint64_t nbytes,
                       const kvb_exec* exec);
int kvb_plan_unpack_cuda(const kvb_plan* plan, uint64_t wire_offset, const void* src,
                         uint64_t nbytes, const kvb_exec* exec);

/* ---- misc -------------------------------------------------------------------------- */

/* XXH3-64 with seed 0 of n bytes (the wire protocol's chunk checksum). */
uint64_t kvb_xxh3_64(const void* data, uint64_t n);

/* 1 when compiled with CUDA; 0 otherwise. */
int kvb_built_with_cuda(void);
/* Number of usable CUDA devices now (0 without a driver or without CUDA). */
int kvb_cuda_device_count(void);

#ifdef __cplusplus
}
#endif
#endif /* KVBRIDGE_PACK_H */
