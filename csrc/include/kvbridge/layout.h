/* How one engine's paged KV cache sits in memory, as the pack core sees it.
 *
 * A cache has num_layers layers; each layer has its own base pointer (for a
 * stacked tensor, base + l * layer_stride).  Inside a layer, the bytes of
 * (component c, page p, slot s, head h) start at
 *
 *   layer_base[l] + c*stride_component + p*stride_page + s*stride_token + h*stride_head
 *
 * and run head_bytes contiguous bytes.  All strides are in bytes.  vLLM, FlashInfer,
 * NHD, HND and MLA caches are all expressible this way (kvbridge/layout.py).
 *
 * The wire layout of tokens [token_start, token_end) and layers
 * [layer_start, layer_end) is the C-order array
 *   wire[layer][component][token][head][head_bytes]
 * independent of page size and memory order.
 */
#ifndef KVBRIDGE_LAYOUT_H
#define KVBRIDGE_LAYOUT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVB_ABI_VERSION 1

typedef struct kvb_cache_desc {
  int32_t abi_version; /* KVB_ABI_VERSION */
  int32_t num_layers;
  int32_t num_components;   /* 2 (K, V) or 1 (MLA latent) */
  int32_t num_heads;        /* KV heads (1 for MLA) */
  int64_t head_bytes;       /* head_dim * element size */
  int64_t page_tokens;      /* tokens per page */
  int64_t num_pages;        /* pages in each layer */
  int64_t stride_component; /* bytes */
  int64_t stride_page;      /* bytes */
  int64_t stride_token;     /* bytes */
  int64_t stride_head;      /* bytes */
  void* const* layer_base;  /* num_layers host-readable pointers */
  int32_t device;           /* -1: host memory; >= 0: CUDA device ordinal */
} kvb_cache_desc;

/* A token range and layer range of one request, and where its pages are. */
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
