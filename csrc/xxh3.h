// Internal: a streaming XXH3-64 (seed 0, the default secret), the wire
// protocol's chunk checksum (docs/protocol.md section 7).  Written for the pack
// core so that a chunk is hashed while it is copied; the digest of any split of
// the input into update() calls equals the one-shot XXH3_64bits of the bytes.
#ifndef KVBRIDGE_XXH3_H
#define KVBRIDGE_XXH3_H

#include <cstddef>
#include <cstdint>

namespace kvb {

class Xxh3Stream {
 public:
  Xxh3Stream();
  void update(const void* data, size_t n);
  // update() with the n bytes of `src`, also copied to `dst` (not overlapping
  // `src`) in the same pass.  `stream`: write the bulk of `dst` with streaming
  // stores (for a destination not read back soon), fenced before returning.
  void update_copy(void* dst, const void* src, size_t n, bool stream = false);
  uint64_t digest() const;

 private:
  static constexpr size_t kBufferSize = 256;  // holds every byte of an input up to 240
  alignas(64) uint64_t acc_[8];
  alignas(64) uint8_t buffer_[kBufferSize];  // bytes not yet consumed as stripes
  uint8_t last_stripe_[64];                  // the 64 bytes consumed last (for a short final tail)
  size_t buffered_ = 0;
  size_t stripes_in_block_ = 0;
  uint64_t total_ = 0;

  void consume(const uint8_t* p, size_t stripes);
};

// One-shot digest of `n` bytes.
uint64_t xxh3_64(const void* data, size_t n);

// Tests only (not thread-safe): use kernel set `which` for the stripe loop
// (0 the best this CPU runs, 1 portable, 2 SSE2, 3 AVX2, 4 AVX-512); false if
// this CPU or build lacks it.
bool xxh3_select_kernels(int which);

}  // namespace kvb

#endif  // KVBRIDGE_XXH3_H
