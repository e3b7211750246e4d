/* How one engine's paged KV cache sits in memory, as the pack core sees it.
 *
 * A cache has num_layers layers of num_components components (K and V, or one
 * MLA latent).  Component c of layer l starts at a base address:
 *
 *   ABI 1 (and ABI 2 with component_base == NULL):  layer_base[l] + c * stride_component
 *   ABI 2 with component_base:                      component_base[l * num_components + c]
 *
 * and inside it the bytes of (page p, slot s, head h) start at
 *
 *   base + p*stride_page + s*stride_token + h*stride_head
 *
 * and run head_bytes contiguous bytes.  ABI 2 may also describe heads whose
 * elements are not adjacent (a K cache stored transposed within each page):
 * with elem_bytes > 0, element e (head_bytes / elem_bytes of them) of a head
 * starts at  e * stride_elem  after the head's address and runs elem_bytes
 * contiguous bytes, and component_strides may give each component its own
 * page, token, head and element strides.  All strides are in bytes.  vLLM
 * (every layout of 0.32), SGLang, FlashInfer, NHD, HND and MLA caches are all
 * expressible this way (docs/layouts.md).
 *
 * The wire layout of tokens [token_start, token_end), layers [layer_start,
 * layer_end) and heads [head_start, head_end) of the cache is the C-order array
 *   wire[layer][component][token][head][head_bytes]
 * (the elements of a head in order), independent of page size and memory order.
 */
#ifndef KVBRIDGE_LAYOUT_H
#define KVBRIDGE_LAYOUT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI this header describes.  A descriptor with abi_version 1 is read as
 * the ABI 1 struct (the fields up to `device`) and keeps working unchanged. */
#define KVB_ABI_VERSION 2
#define KVB_ABI_VERSION_MIN 1

typedef struct kvb_cache_desc {
  int32_t abi_version; /* KVB_ABI_VERSION, or 1 for the ABI 1 struct */
  int32_t num_layers;
  int32_t num_components;   /* 2 (K, V) or 1 (MLA latent) */
  int32_t num_heads;        /* KV heads that the cache holds (1 for MLA) */
  int64_t head_bytes;       /* head_dim * element size */
  int64_t page_tokens;      /* tokens per page */
  int64_t num_pages;        /* pages in each layer */
  int64_t stride_component; /* bytes */
  int64_t stride_page;      /* bytes */
  int64_t stride_token;     /* bytes */
  int64_t stride_head;      /* bytes */
  void* const* layer_base;  /* num_layers host-readable pointers */
  int32_t device;           /* -1: host memory; >= 0: CUDA device ordinal */
  /* ---- ABI 2: read only when abi_version >= 2; all-zero means "as in ABI 1" ---- */
  int64_t elem_bytes;               /* bytes of one element of a head (a divisor of head_bytes);
                                       0: each head is one contiguous run of head_bytes */
  const int64_t* component_strides; /* NULL: every component uses stride_page,
                         stride_token, stride_head (and stride_elem = elem_bytes).
                         Else num_components rows of four byte strides
                         {page, token, head, elem}, host memory, read during the
                         call that takes the descriptor. */
  void* const* component_base;      /* NULL: bases from layer_base and stride_component.
                              Else num_layers * num_components host-readable pointers,
                              component_base[l * num_components + c]; layer_base and
                              stride_component are then not read. */
} kvb_cache_desc;

/* A token range, layer range and head range of one request, and where its
 * pages are. */
typedef struct kvb_range {
  int64_t token_start; /* first token (absolute position in the request) */
  int64_t token_end;   /* one past the last token */
  int32_t layer_start;
  int32_t layer_end;
  const int32_t* block_table; /* block_table[i]: page holding tokens [i*pt, (i+1)*pt).
                                 Always host memory, also for CUDA caches: the core
                                 validates it on the host and stages the entries
                                 the range covers to the device itself. */
  int64_t block_table_len;
  /* ---- ABI 2: read only when the cache descriptor's abi_version >= 2 ---- */
  int32_t head_start; /* heads [head_start, head_end) of the cache's num_heads; */
  int32_t head_end;   /* both 0 (the zero-initialised default): all of them */
} kvb_range;

/* Execution knobs. */
typedef struct kvb_exec {
  int32_t num_threads;  /* CPU: 0 = automatic */
  uint64_t cuda_stream; /* CUDA: cudaStream_t as an integer (0 = default) */
} kvb_exec;

/* Bytes of the wire layout of a range (0 on a malformed range). */
uint64_t kvb_wire_nbytes(const kvb_cache_desc* cache, const kvb_range* range);

#ifdef __cplusplus
}
#endif
#endif /* KVBRIDGE_LAYOUT_H */
