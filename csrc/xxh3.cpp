// XXH3-64 (seed 0, default secret) for the pack core: one-shot and streaming,
// with the long-input stripe loop in AVX-512, AVX2 or SSE2 on x86-64 (chosen
// once at run time) and portable C++ elsewhere.  The algorithm is XXH3's as
// specified by the xxHash project; tests compare every input size class and
// split with the `xxhash` Python package.
#include "xxh3.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVB_XXH3_X86 1
#endif

namespace kvb {
namespace {

constexpr uint64_t kPrime32_1 = 0x9E3779B1u;
constexpr uint64_t kPrime32_2 = 0x85EBCA77u;
constexpr uint64_t kPrime32_3 = 0xC2B2AE3Du;
constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;
constexpr uint64_t kPrimeMx1 = 0x165667919E3779F9ull;
constexpr uint64_t kPrimeMx2 = 0x9FB21C651E98DF25ull;

constexpr size_t kStripe = 64;
constexpr size_t kSecretSize = 192;
constexpr size_t kStripesPerBlock = (kSecretSize - kStripe) / 8;  // 16
constexpr size_t kMidMax = 240;

alignas(64) constexpr uint8_t kSecret[kSecretSize] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

inline uint64_t rd64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;  // x86-64 and aarch64 Linux are little-endian, like the algorithm
}
inline uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t fold128(uint64_t a, uint64_t b) {
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
}
inline uint64_t avalanche_xxh64(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  return h ^ (h >> 32);
}
inline uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= kPrimeMx1;
  return h ^ (h >> 32);
}
inline uint64_t rrmxmx(uint64_t h, uint64_t len) {
  h ^= rotl64(h, 49) ^ rotl64(h, 24);
  h *= kPrimeMx2;
  h ^= (h >> 35) + len;
  h *= kPrimeMx2;
  return h ^ (h >> 28);
}
inline uint64_t mix16(const uint8_t* in, const uint8_t* sec) {
  return fold128(rd64(in) ^ rd64(sec), rd64(in + 8) ^ rd64(sec + 8));
}

uint64_t hash_short(const uint8_t* in, size_t len) {
  const uint8_t* s = kSecret;
  if (len == 0) return avalanche_xxh64(rd64(s + 56) ^ rd64(s + 64));
  if (len <= 3) {
    const uint32_t combined =
        (static_cast<uint32_t>(in[0]) << 16) | (static_cast<uint32_t>(in[len >> 1]) << 24) |
        static_cast<uint32_t>(in[len - 1]) | (static_cast<uint32_t>(len) << 8);
    const uint64_t flip = static_cast<uint64_t>(rd32(s) ^ rd32(s + 4));
    return avalanche_xxh64(static_cast<uint64_t>(combined) ^ flip);
  }
  if (len <= 8) {
    const uint64_t in1 = rd32(in), in2 = rd32(in + len - 4);
    const uint64_t flip = rd64(s + 8) ^ rd64(s + 16);
    return rrmxmx((in2 + (in1 << 32)) ^ flip, len);
  }
  if (len <= 16) {
    const uint64_t lo = rd64(in) ^ (rd64(s + 24) ^ rd64(s + 32));
    const uint64_t hi = rd64(in + len - 8) ^ (rd64(s + 40) ^ rd64(s + 48));
    const uint64_t acc = len + __builtin_bswap64(lo) + hi + fold128(lo, hi);
    return avalanche(acc);
  }
  uint64_t acc = len * kPrime64_1;
  if (len <= 128) {
    if (len > 32) {
      if (len > 64) {
        if (len > 96) acc += mix16(in + 48, s + 96) + mix16(in + len - 64, s + 112);
        acc += mix16(in + 32, s + 64) + mix16(in + len - 48, s + 80);
      }
      acc += mix16(in + 16, s + 32) + mix16(in + len - 32, s + 48);
    }
    acc += mix16(in, s) + mix16(in + len - 16, s + 16);
    return avalanche(acc);
  }
  // 129..240 bytes
  const size_t rounds = len / 16;
  for (size_t i = 0; i < 8; ++i) acc += mix16(in + 16 * i, s + 16 * i);
  uint64_t acc_end = mix16(in + len - 16, s + 136 - 17);
  acc = avalanche(acc);
  for (size_t i = 8; i < rounds; ++i) acc_end += mix16(in + 16 * i, s + 16 * (i - 8) + 3);
  return avalanche(acc + acc_end);
}

// ---- the stripe loop ------------------------------------------------------------------
// accumulate: for each 64-byte stripe n, acc[i ^ 1] += d[i], acc[i] += lo32(d[i] ^ k[i]) *
// hi32(d[i] ^ k[i]) with the key at secret + 8 n; scramble: acc ^= acc >> 47, ^= key, *= P32_1.
using AccFn = void (*)(uint64_t* acc, const uint8_t* in, const uint8_t* sec, size_t stripes);
using ScrambleFn = void (*)(uint64_t* acc, const uint8_t* sec);
// accumulate the stripes of `src` while copying them to `dst` (one read of the bytes).
using AccCopyFn = void (*)(uint64_t* acc, uint8_t* dst, const uint8_t* src, const uint8_t* sec,
                           size_t stripes);

void acc_scalar(uint64_t* acc, const uint8_t* in, const uint8_t* sec, size_t stripes) {
  for (size_t n = 0; n < stripes; ++n) {
    const uint8_t* p = in + n * kStripe;
    const uint8_t* k = sec + n * 8;
    for (int i = 0; i < 8; ++i) {
      const uint64_t d = rd64(p + 8 * i);
      const uint64_t dk = d ^ rd64(k + 8 * i);
      acc[i ^ 1] += d;
      acc[i] += (dk & 0xFFFFFFFFu) * (dk >> 32);
    }
  }
}

void acc_copy_scalar(uint64_t* acc, uint8_t* dst, const uint8_t* src, const uint8_t* sec,
                     size_t stripes) {
  std::memcpy(dst, src, stripes * kStripe);
  acc_scalar(acc, dst, sec, stripes);
}

void scramble_scalar(uint64_t* acc, const uint8_t* sec) {
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= rd64(sec + 8 * i);
    acc[i] = a * kPrime32_1;
  }
}

#ifdef KVB_XXH3_X86
__attribute__((target("sse2"))) void acc_sse2(uint64_t* acc, const uint8_t* in, const uint8_t* sec,
                                              size_t stripes) {
  __m128i a[4];
  for (int i = 0; i < 4; ++i) a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc) + i);
  for (size_t n = 0; n < stripes; ++n) {
    const __m128i* p = reinterpret_cast<const __m128i*>(in + n * kStripe);
    const __m128i* k = reinterpret_cast<const __m128i*>(sec + n * 8);
    for (int i = 0; i < 4; ++i) {
      const __m128i d = _mm_loadu_si128(p + i);
      const __m128i dk = _mm_xor_si128(d, _mm_loadu_si128(k + i));
      const __m128i prod = _mm_mul_epu32(dk, _mm_srli_epi64(dk, 32));
      const __m128i swap = _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));
      a[i] = _mm_add_epi64(a[i], _mm_add_epi64(prod, swap));
    }
  }
  for (int i = 0; i < 4; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(acc) + i, a[i]);
}

__attribute__((target("sse2"))) void scramble_sse2(uint64_t* acc, const uint8_t* sec) {
  const __m128i prime = _mm_set1_epi32(static_cast<int>(kPrime32_1));
  for (int i = 0; i < 4; ++i) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc) + i);
    a = _mm_xor_si128(a, _mm_srli_epi64(a, 47));
    a = _mm_xor_si128(a, _mm_loadu_si128(reinterpret_cast<const __m128i*>(sec) + i));
    const __m128i lo = _mm_mul_epu32(a, prime);
    const __m128i hi = _mm_mul_epu32(_mm_srli_epi64(a, 32), prime);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(acc) + i,
                     _mm_add_epi64(lo, _mm_slli_epi64(hi, 32)));
  }
}

__attribute__((target("sse2"))) void acc_copy_sse2(uint64_t* acc, uint8_t* dst, const uint8_t* src,
                                                   const uint8_t* sec, size_t stripes) {
  std::memcpy(dst, src, stripes * kStripe);
  acc_sse2(acc, dst, sec, stripes);
}

// The AVX2 stripe loop; with kCopy the stripes are also stored to `dst`
// (kStream: with streaming stores) as they are read.
template <bool kCopy, bool kStream>
__attribute__((target("avx2"))) void acc_avx2_loop(uint64_t* acc, uint8_t* dst, const uint8_t* in,
                                                   const uint8_t* sec, size_t stripes) {
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc) + 1);
  for (size_t n = 0; n < stripes; ++n) {
    const __m256i* p = reinterpret_cast<const __m256i*>(in + n * kStripe);
    const __m256i* k = reinterpret_cast<const __m256i*>(sec + n * 8);
    const __m256i d0 = _mm256_loadu_si256(p), d1 = _mm256_loadu_si256(p + 1);
    if (kCopy) {
      __m256i* q = reinterpret_cast<__m256i*>(dst + n * kStripe);
      if (kStream) {
        _mm256_stream_si256(q, d0);
        _mm256_stream_si256(q + 1, d1);
      } else {
        _mm256_storeu_si256(q, d0);
        _mm256_storeu_si256(q + 1, d1);
      }
    }
    const __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256(k));
    const __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256(k + 1));
    const __m256i p0 = _mm256_mul_epu32(k0, _mm256_srli_epi64(k0, 32));
    const __m256i p1 = _mm256_mul_epu32(k1, _mm256_srli_epi64(k1, 32));
    a0 = _mm256_add_epi64(a0,
                          _mm256_add_epi64(p0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2))));
    a1 = _mm256_add_epi64(a1,
                          _mm256_add_epi64(p1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2))));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc) + 1, a1);
}

void acc_avx2(uint64_t* acc, const uint8_t* in, const uint8_t* sec, size_t stripes) {
  acc_avx2_loop<false, false>(acc, nullptr, in, sec, stripes);
}

template <bool kStream>
void acc_copy_avx2(uint64_t* acc, uint8_t* dst, const uint8_t* src, const uint8_t* sec,
                   size_t stripes) {
  acc_avx2_loop<true, kStream>(acc, dst, src, sec, stripes);
}

__attribute__((target("avx2"))) void scramble_avx2(uint64_t* acc, const uint8_t* sec) {
  const __m256i prime = _mm256_set1_epi32(static_cast<int>(kPrime32_1));
  for (int i = 0; i < 2; ++i) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc) + i);
    a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
    a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sec) + i));
    const __m256i lo = _mm256_mul_epu32(a, prime);
    const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc) + i,
                        _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32)));
  }
}

// GCC 12 warns about its own _mm512_undefined_epi32() inside the intrinsics.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <bool kCopy, bool kStream>
__attribute__((target("avx512f"))) void acc_avx512_loop(uint64_t* acc, uint8_t* dst,
                                                        const uint8_t* in, const uint8_t* sec,
                                                        size_t stripes) {
  __m512i a = _mm512_loadu_si512(acc);
  for (size_t n = 0; n < stripes; ++n) {
    const __m512i d = _mm512_loadu_si512(in + n * kStripe);
    if (kCopy) {
      if (kStream) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + n * kStripe), d);
      } else {
        _mm512_storeu_si512(dst + n * kStripe, d);
      }
    }
    const __m512i dk = _mm512_xor_si512(d, _mm512_loadu_si512(sec + n * 8));
    const __m512i prod = _mm512_mul_epu32(dk, _mm512_srli_epi64(dk, 32));
    const __m512i swap =
        _mm512_shuffle_epi32(d, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(1, 0, 3, 2)));
    a = _mm512_add_epi64(a, _mm512_add_epi64(prod, swap));
  }
  _mm512_storeu_si512(acc, a);
}

void acc_avx512(uint64_t* acc, const uint8_t* in, const uint8_t* sec, size_t stripes) {
  acc_avx512_loop<false, false>(acc, nullptr, in, sec, stripes);
}

template <bool kStream>
void acc_copy_avx512(uint64_t* acc, uint8_t* dst, const uint8_t* src, const uint8_t* sec,
                     size_t stripes) {
  acc_avx512_loop<true, kStream>(acc, dst, src, sec, stripes);
}

__attribute__((target("avx512f"))) void scramble_avx512(uint64_t* acc, const uint8_t* sec) {
  const __m512i prime = _mm512_set1_epi32(static_cast<int>(kPrime32_1));
  __m512i a = _mm512_loadu_si512(acc);
  a = _mm512_xor_si512(a, _mm512_srli_epi64(a, 47));
  a = _mm512_xor_si512(a, _mm512_loadu_si512(sec));
  const __m512i lo = _mm512_mul_epu32(a, prime);
  const __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
  _mm512_storeu_si512(acc, _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32)));
}
#pragma GCC diagnostic pop
#endif

struct Kernels {
  AccFn acc;
  ScrambleFn scramble;
  AccCopyFn acc_copy;
  AccCopyFn acc_copy_stream;  // streaming stores; dst 64-byte aligned
};

// Kernel sets by number: 1 portable, 2 SSE2, 3 AVX2, 4 AVX-512 (0: the best
// this CPU runs).  Returns false for a set the CPU or the build lacks.
bool kernels_for(int which, Kernels* out) {
#ifdef KVB_XXH3_X86
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2");
  if (which == 0) which = avx512 ? 4 : avx2 ? 3 : 2;
  switch (which) {
    case 1:
      *out = {acc_scalar, scramble_scalar, acc_copy_scalar, acc_copy_scalar};
      return true;
    case 2:
      *out = {acc_sse2, scramble_sse2, acc_copy_sse2, acc_copy_sse2};
      return true;
    case 3:
      if (!avx2) return false;
      *out = {acc_avx2, scramble_avx2, acc_copy_avx2<false>, acc_copy_avx2<true>};
      return true;
    case 4:
      if (!avx512) return false;
      *out = {acc_avx512, scramble_avx512, acc_copy_avx512<false>, acc_copy_avx512<true>};
      return true;
    default:
      return false;
  }
#else
  if (which != 0 && which != 1) return false;
  *out = {acc_scalar, scramble_scalar, acc_copy_scalar, acc_copy_scalar};
  return true;
#endif
}

Kernels g_kernels = [] {
  Kernels k{};
  kernels_for(0, &k);
  return k;
}();

const Kernels& kernels() { return g_kernels; }

constexpr uint64_t kAccInit[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                                  kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};

uint64_t merge(const uint64_t* acc, uint64_t len) {
  uint64_t r = len * kPrime64_1;
  for (int i = 0; i < 4; ++i) {
    r += fold128(acc[2 * i] ^ rd64(kSecret + 11 + 16 * i),
                 acc[2 * i + 1] ^ rd64(kSecret + 19 + 16 * i));
  }
  return avalanche(r);
}

// Stripes [0, stripes) of `in`, the first one being stripe *in_block of its block.
void consume_stripes(uint64_t* acc, size_t* in_block, const uint8_t* in, size_t stripes) {
  const Kernels& k = kernels();
  while (stripes > 0) {
    const size_t take = std::min(stripes, kStripesPerBlock - *in_block);
    k.acc(acc, in, kSecret + *in_block * 8, take);
    in += take * kStripe;
    stripes -= take;
    *in_block += take;
    if (*in_block == kStripesPerBlock) {
      k.scramble(acc, kSecret + kSecretSize - kStripe);
      *in_block = 0;
    }
  }
}

// consume_stripes, copying the stripes from `src` to `dst` as they are read.
// With `stream`, streaming stores where `dst` is 64-byte aligned.
void consume_copy_stripes(uint64_t* acc, size_t* in_block, uint8_t* dst, const uint8_t* src,
                          size_t stripes, bool stream) {
  const Kernels& k = kernels();
  const AccCopyFn copy =
      stream && (reinterpret_cast<uintptr_t>(dst) & 63) == 0 ? k.acc_copy_stream : k.acc_copy;
  while (stripes > 0) {
    const size_t take = std::min(stripes, kStripesPerBlock - *in_block);
    copy(acc, dst, src, kSecret + *in_block * 8, take);
    src += take * kStripe;
    dst += take * kStripe;
    stripes -= take;
    *in_block += take;
    if (*in_block == kStripesPerBlock) {
      k.scramble(acc, kSecret + kSecretSize - kStripe);
      *in_block = 0;
    }
  }
#ifdef KVB_XXH3_X86
  if (copy == k.acc_copy_stream && copy != k.acc_copy) _mm_sfence();  // order the streamed stores
#endif
}

}  // namespace

bool xxh3_select_kernels(int which) {
  Kernels k{};
  if (!kernels_for(which, &k)) return false;
  g_kernels = k;
  return true;
}

uint64_t xxh3_64(const void* data, size_t n) {
  const uint8_t* in = static_cast<const uint8_t*>(data);
  if (n <= kMidMax) return hash_short(in, n);
  alignas(64) uint64_t acc[8];
  std::memcpy(acc, kAccInit, sizeof acc);
  size_t in_block = 0;
  consume_stripes(acc, &in_block, in, (n - 1) / kStripe);
  kernels().acc(acc, in + n - kStripe, kSecret + kSecretSize - kStripe - 7, 1);
  return merge(acc, n);
}

Xxh3Stream::Xxh3Stream() { std::memcpy(acc_, kAccInit, sizeof acc_); }

void Xxh3Stream::consume(const uint8_t* p, size_t stripes) {
  consume_stripes(acc_, &stripes_in_block_, p, stripes);
  std::memcpy(last_stripe_, p + (stripes - 1) * kStripe, kStripe);
}

// A stripe is consumed only once at least one byte follows it: the last stripe
// of the input is hashed differently, at digest time.
void Xxh3Stream::update(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_ += n;
  if (buffered_ + n <= kBufferSize) {
    if (n > 0) std::memcpy(buffer_ + buffered_, p, n);
    buffered_ += n;
    return;
  }
  if (buffered_ > 0) {  // fill the buffer and consume it whole: more bytes follow
    const size_t fill = kBufferSize - buffered_;
    std::memcpy(buffer_ + buffered_, p, fill);
    p += fill;
    n -= fill;
    consume(buffer_, kBufferSize / kStripe);
    buffered_ = 0;
  }
  if (n > kBufferSize) {  // straight from the input, leaving 1..64 bytes
    const size_t stripes = (n - 1) / kStripe;
    consume(p, stripes);
    p += stripes * kStripe;
    n -= stripes * kStripe;
  }
  std::memcpy(buffer_, p, n);
  buffered_ = n;
}

// update(), with the bytes also copied to `dst`: the stripes hashed straight
// from the input are copied by the same loop that hashes them.
void Xxh3Stream::update_copy(void* dst, const void* src, size_t n, bool stream) {
  uint8_t* d = static_cast<uint8_t*>(dst);
  const uint8_t* p = static_cast<const uint8_t*>(src);
  if (buffered_ + n <= kBufferSize) {
    if (n > 0) std::memcpy(d, p, n);
    update(d, n);
    return;
  }
  total_ += n;
  if (buffered_ > 0) {
    const size_t fill = kBufferSize - buffered_;
    std::memcpy(d, p, fill);
    std::memcpy(buffer_ + buffered_, p, fill);
    p += fill;
    d += fill;
    n -= fill;
    consume(buffer_, kBufferSize / kStripe);
    buffered_ = 0;
  }
  if (n > kBufferSize) {
    const size_t stripes = (n - 1) / kStripe;
    consume_copy_stripes(acc_, &stripes_in_block_, d, p, stripes, stream);
    std::memcpy(last_stripe_, d + (stripes - 1) * kStripe, kStripe);
    p += stripes * kStripe;
    d += stripes * kStripe;
    n -= stripes * kStripe;
  }
  std::memcpy(d, p, n);
  std::memcpy(buffer_, p, n);
  buffered_ = n;
}

uint64_t Xxh3Stream::digest() const {
  if (total_ <= kMidMax) return hash_short(buffer_, static_cast<size_t>(total_));
  alignas(64) uint64_t acc[8];
  std::memcpy(acc, acc_, sizeof acc);
  size_t in_block = stripes_in_block_;
  const uint8_t* last;
  uint8_t tail[kStripe];
  if (buffered_ >= kStripe) {
    consume_stripes(acc, &in_block, buffer_, (buffered_ - 1) / kStripe);
    last = buffer_ + buffered_ - kStripe;
  } else {  // the final 64 bytes start in the stripe consumed last
    const size_t from_prev = kStripe - buffered_;
    std::memcpy(tail, last_stripe_ + kStripe - from_prev, from_prev);
    std::memcpy(tail + from_prev, buffer_, buffered_);
    last = tail;
  }
  kernels().acc(acc, last, kSecret + kSecretSize - kStripe - 7, 1);
  return merge(acc, total_);
}

}  // namespace kvb
