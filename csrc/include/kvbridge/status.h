/* kvbridge status codes: every C entry point returns one of these.
 * No Python or torch headers here; this header is part of the public C ABI. */
#ifndef KVBRIDGE_STATUS_H
#define KVBRIDGE_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvb_status {
  KVB_OK = 0,
  KVB_IN_PROGRESS = 1,           /* posted, not complete: poll again */
  KVB_ERR_INVALID_ARG = -1,      /* malformed argument (null pointer, bad range) */
  KVB_ERR_OUT_OF_RANGE = -2,     /* page id outside the cache, block table too short */
  KVB_ERR_BUFFER_TOO_SMALL = -3, /* wire buffer/slice smaller than asked */
  KVB_ERR_DTYPE = -4,
  KVB_ERR_SHAPE = -5,
  KVB_ERR_OVERLAP = -6,     /* two destinations of one write overlap */
  KVB_ERR_LAYOUT = -7,      /* inconsistent or incompatible layout */
  KVB_ERR_UNAVAILABLE = -8, /* not compiled in (CUDA, UCX) or no device */
  KVB_ERR_CUDA = -9,        /* a CUDA runtime call failed */
  KVB_ERR_INTERNAL = -10,   /* an exception escaped the core: a bug */
  KVB_ERR_TIMEOUT = -11,
  KVB_ERR_CANCELLED = -12,
  KVB_ERR_PEER = -13,         /* the peer is gone */
  KVB_ERR_INCOMPATIBLE = -14, /* peer metadata does not fit ours */
  KVB_ERR_CHECKSUM = -15      /* data does not match its expected XXH3-64 (ABI 2) */
} kvb_status;

/* Human-readable name of a status code ("KVB_ERR_OUT_OF_RANGE"). */
const char* kvb_status_name(int status);

/* The message of the last error raised on this thread (never NULL). */
const char* kvb_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* KVBRIDGE_STATUS_H */
