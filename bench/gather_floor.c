// What a plain gather of random pages costs against a sequential copy of the
// same bytes on this machine: the floor under `kvbridge-bench pack`'s "x mcpy"
// column, which compares a gather of random cache pages with a memcpy.
//
//   cc -O2 -pthread -o /tmp/gather_floor bench/gather_floor.c
//   /tmp/gather_floor [page KiB = 12] [threads = 2] [rounds = 15]
//
// Copies 64 MiB into one buffer from 64 MiB / page random pages of a 128 MiB
// pool (the bench's cache has twice the request's pages too), both on huge
// pages where the kernel has them, and the same 64 MiB from the pool's start
// in order; each with glibc's memcpy and with 32-byte streaming stores (AVX2,
// as the pack core writes a large wire buffer).  The modes are interleaved
// round by round; prints the median and the best of the rounds, and the
// gather's median over the sequential copy's.
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { kGatherMemcpy, kGatherStream, kSeqMemcpy, kSeqStream, kModes };
static const char* kNames[kModes] = {"gather memcpy", "gather stream", "sequential memcpy",
                                     "sequential stream"};
static const size_t kWire = (size_t)64 << 20;
static size_t page, pages;
static uint8_t *pool, *wire;
static uint32_t* table;
static int mode, threads;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

__attribute__((target("avx2"))) static void copy_stream(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m256i a = _mm256_loadu_si256((const __m256i*)(s + i));
    __m256i b = _mm256_loadu_si256((const __m256i*)(s + i + 32));
    _mm256_stream_si256((__m256i*)(d + i), a);
    _mm256_stream_si256((__m256i*)(d + i + 32), b);
  }
}

static void* work(void* arg) {
  const size_t t = (size_t)arg, a = pages * t / threads, b = pages * (t + 1) / threads;
  const int gather = mode == kGatherMemcpy || mode == kGatherStream;
  const int stream = mode == kGatherStream || mode == kSeqStream;
  for (size_t i = a; i < b; i++) {
    const uint8_t* s = pool + (gather ? (size_t)table[i] : i) * page;
    if (stream) {
      copy_stream(wire + i * page, s, page);
    } else {
      memcpy(wire + i * page, s, page);
    }
  }
  if (stream) _mm_sfence();
  return NULL;
}

static int by_value(const void* x, const void* y) {
  const double a = *(const double*)x, b = *(const double*)y;
  return (a > b) - (a < b);
}

int main(int argc, char** argv) {
  page = (size_t)(argc > 1 ? atol(argv[1]) : 12) << 10;
  threads = argc > 2 ? atoi(argv[2]) : 2;
  const int rounds = argc > 3 ? atoi(argv[3]) : 15;
  if (page == 0 || page % 64 || threads < 1 || threads > 64 || rounds < 1) {
    fprintf(stderr, "page KiB > 0, threads 1..64, rounds >= 1\n");
    return 2;
  }
  pages = kWire / page;
  const size_t pool_bytes = 2 * pages * page;
  pool = aligned_alloc(2 << 20, (pool_bytes + (2 << 20) - 1) & ~(size_t)((2 << 20) - 1));
  wire = aligned_alloc(2 << 20, kWire);
  table = malloc(2 * pages * sizeof *table);
  if (!pool || !wire || !table) return 1;
  madvise(pool, pool_bytes, MADV_HUGEPAGE);
  madvise(wire, kWire, MADV_HUGEPAGE);
  memset(pool, 1, pool_bytes);
  memset(wire, 2, kWire);
  // a random half of the pool's pages, in random order
  uint64_t x = 88172645463325252ull;
  for (size_t i = 0; i < 2 * pages; i++) table[i] = (uint32_t)i;
  for (size_t i = 2 * pages - 1; i > 0; i--) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const size_t j = x % (i + 1);
    const uint32_t v = table[i];
    table[i] = table[j], table[j] = v;
  }
  double* secs = malloc(sizeof(double) * kModes * rounds);
  for (int r = 0; r < rounds; r++) {
    for (mode = 0; mode < kModes; mode++) {
      pthread_t th[64];
      const double t0 = now();
      for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, work, (void*)(size_t)t);
      for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
      secs[mode * rounds + r] = now() - t0;
    }
  }
  double median[kModes];
  printf("%zu KiB pages, %d threads, 64 MiB, %d interleaved rounds (GB/s)\n", page >> 10, threads,
         rounds);
  for (int m = 0; m < kModes; m++) {
    qsort(secs + m * rounds, rounds, sizeof(double), by_value);
    median[m] = secs[m * rounds + rounds / 2];
    printf("  %-18s median %5.1f  best %5.1f\n", kNames[m], kWire / median[m] / 1e9,
           kWire / secs[m * rounds] / 1e9);
  }
  const double seq = median[kSeqMemcpy] < median[kSeqStream] ? median[kSeqMemcpy] : median[kSeqStream];
  const double gat =
      median[kGatherMemcpy] < median[kGatherStream] ? median[kGatherMemcpy] : median[kGatherStream];
  printf("  faster gather / faster sequential copy: %.2fx\n", seq / gat);
  return 0;
}
