/* Independent check of the kvbridge C ABI, written from pack.md, layouts.md,
 * protocol-section7.md and the public headers only. C99. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvbridge/pack.h"

static int g_fail = 0, g_checks = 0;
#define CHECK(cond, ...)                                        \
  do {                                                          \
    g_checks++;                                                 \
    if (!(cond)) {                                              \
      g_fail++;                                                 \
      printf("FAIL %s:%d: ", __FILE__, __LINE__);               \
      printf(__VA_ARGS__);                                      \
      printf("\n");                                             \
    }                                                           \
  } while (0)

/* ---------- rng ---------- */
static uint64_t rs = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
  rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return rs;
}
static uint64_t rndn(uint64_t n) { return n ? rnd() % n : 0; }
static uint8_t hb8(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
  return (uint8_t)x;
}

/* ---------- layouts ---------- */
enum { KV_FIRST = 0, PAGE_FIRST = 1 };
typedef struct {
  const char* name;
  int L, H, D, isz;
  int64_t pt, P;
  int order, hnd, stacked, mla;
} Lay;

typedef struct {
  Lay lay;
  int C;
  int64_t layer_bytes;
  uint8_t* block;      /* stacked: one allocation */
  uint8_t** bases;     /* per layer */
  kvb_cache_desc d;
} Cache;

static void strides(const Lay* y, int64_t* sc, int64_t* sp, int64_t* st, int64_t* sh) {
  int64_t u = (int64_t)y->D * y->isz; /* one head in bytes: tables are in units of D elements */
  int64_t P = y->P, pt = y->pt, H = y->H;
  if (y->mla) { /* [P, pt, D]: -, pt, 1, - */
    *sc = 0; *sp = pt * u; *st = u; *sh = 0; return;
  }
  if (y->order == KV_FIRST) {
    *sc = P * pt * H * u; *sp = pt * H * u;
  } else {
    *sc = pt * H * u; *sp = 2 * pt * H * u;
  }
  if (!y->hnd) { *st = H * u; *sh = u; }
  else { *st = u; *sh = pt * u; }
}

static void cache_init(Cache* c, const Lay* y, uint64_t seed) {
  memset(c, 0, sizeof *c);
  c->lay = *y;
  c->C = y->mla ? 1 : 2;
  c->layer_bytes = (int64_t)c->C * y->P * y->pt * y->H * y->D * y->isz;
  c->bases = (uint8_t**)malloc(sizeof(uint8_t*) * y->L);
  if (y->stacked) {
    c->block = (uint8_t*)malloc((size_t)(c->layer_bytes * y->L));
    for (int l = 0; l < y->L; l++) c->bases[l] = c->block + l * c->layer_bytes;
  } else {
    for (int l = 0; l < y->L; l++) c->bases[l] = (uint8_t*)malloc((size_t)c->layer_bytes);
  }
  for (int l = 0; l < y->L; l++)
    for (int64_t i = 0; i < c->layer_bytes; i++) c->bases[l][i] = hb8(seed * 1000003u + (uint64_t)l * 7919u * 65536u + (uint64_t)i);
  kvb_cache_desc* d = &c->d;
  d->abi_version = KVB_ABI_VERSION;
  d->num_layers = y->L;
  d->num_components = c->C;
  d->num_heads = y->H;
  d->head_bytes = (int64_t)y->D * y->isz;
  d->page_tokens = y->pt;
  d->num_pages = y->P;
  strides(y, &d->stride_component, &d->stride_page, &d->stride_token, &d->stride_head);
  d->layer_base = (void* const*)c->bases;
  d->device = -1;
}
static void cache_free(Cache* c) {
  if (c->lay.stacked) free(c->block);
  else for (int l = 0; l < c->lay.L; l++) free(c->bases[l]);
  free(c->bases);
}
/* snapshot of all layers */
static uint8_t* cache_snap(const Cache* c) {
  uint8_t* s = (uint8_t*)malloc((size_t)(c->layer_bytes * c->lay.L));
  for (int l = 0; l < c->lay.L; l++) memcpy(s + l * c->layer_bytes, c->bases[l], (size_t)c->layer_bytes);
  return s;
}
static int cache_eq(const Cache* c, const uint8_t* s) {
  for (int l = 0; l < c->lay.L; l++)
    if (memcmp(s + l * c->layer_bytes, c->bases[l], (size_t)c->layer_bytes)) return 0;
  return 1;
}

/* ---------- reference wire layout ---------- */
/* offset (in the layer) of wire byte w, and its layer */
static int64_t ref_addr(const Cache* c, const kvb_range* r, uint64_t w, int* layer) {
  const kvb_cache_desc* d = &c->d;
  int64_t T = r->token_end - r->token_start;
  int64_t hbts = d->head_bytes;
  int64_t per_comp = T * d->num_heads * hbts;
  int64_t per_layer = per_comp * d->num_components;
  int64_t l = (int64_t)(w / (uint64_t)per_layer), rem = (int64_t)(w % (uint64_t)per_layer);
  int64_t comp = rem / per_comp; rem %= per_comp;
  int64_t t = r->token_start + rem / (d->num_heads * hbts); rem %= d->num_heads * hbts;
  int64_t h = rem / hbts, b = rem % hbts;
  *layer = (int)(r->layer_start + l);
  int64_t page = r->block_table[t / d->page_tokens];
  return comp * d->stride_component + page * d->stride_page + (t % d->page_tokens) * d->stride_token +
         h * d->stride_head + b;
}
static uint64_t ref_nbytes(const Cache* c, const kvb_range* r) {
  return (uint64_t)(r->layer_end - r->layer_start) * (uint64_t)(r->token_end - r->token_start) *
         (uint64_t)c->C * (uint64_t)c->lay.H * (uint64_t)c->lay.D * (uint64_t)c->lay.isz;
}
static void ref_pack(const Cache* c, const kvb_range* r, uint8_t* out, uint64_t n) {
  for (uint64_t w = 0; w < n; w++) {
    int l; int64_t a = ref_addr(c, r, w, &l);
    out[w] = c->bases[l][a];
  }
}
/* apply a reference unpack onto a snapshot image */
static void ref_unpack(const Cache* c, const kvb_range* r, const uint8_t* wire, uint64_t n, uint8_t* img) {
  for (uint64_t w = 0; w < n; w++) {
    int l; int64_t a = ref_addr(c, r, w, &l);
    img[l * c->layer_bytes + a] = wire[w];
  }
}

static int32_t* make_table(int64_t len, int64_t P, int64_t first_cov, int64_t last_cov, int distinct) {
  /* entries outside [first_cov, last_cov] get garbage ids (never read, per layouts.md:45-47) */
  int32_t* t = (int32_t*)malloc(sizeof(int32_t) * (size_t)(len > 0 ? len : 1));
  int64_t n = last_cov - first_cov + 1;
  int32_t* perm = (int32_t*)malloc(sizeof(int32_t) * (size_t)P);
  for (int64_t i = 0; i < P; i++) perm[i] = (int32_t)i;
  for (int64_t i = P - 1; i > 0; i--) { int64_t j = (int64_t)rndn((uint64_t)i + 1); int32_t x = perm[i]; perm[i] = perm[j]; perm[j] = x; }
  for (int64_t i = 0; i < len; i++) t[i] = -777;
  for (int64_t i = 0; i < n; i++) t[first_cov + i] = distinct ? perm[i % P] : (int32_t)rndn((uint64_t)P);
  free(perm);
  return t;
}

static const char* sname(int s) { const char* n = kvb_status_name(s); return n ? n : "(null)"; }

/* ---------- one round-trip case ---------- */
static void run_case(const Lay* src_l, const Lay* dst_l, int64_t start, int64_t end, int l0, int l1, int nthreads) {
  Cache s, d;
  cache_init(&s, src_l, 11 + rnd() % 1000);
  cache_init(&d, dst_l, 5000 + rnd() % 1000);
  int64_t fs = start / src_l->pt, ls = (end - 1) / src_l->pt;
  int64_t fd = start / dst_l->pt, ld = (end - 1) / dst_l->pt;
  int32_t* bts = make_table(ls + 1 + 2, src_l->P, fs, ls, 1);
  int32_t* btd = make_table(ld + 1, dst_l->P, fd, ld, 1);
  kvb_range rs_ = {start, end, l0, l1, bts, ls + 1 + 2};
  kvb_range rd_ = {start, end, l0, l1, btd, ld + 1};
  kvb_exec ex = {nthreads, 0};
  char tag[256];
  snprintf(tag, sizeof tag, "%s -> %s [%lld,%lld) L[%d,%d) thr=%d", src_l->name, dst_l->name,
           (long long)start, (long long)end, l0, l1, nthreads);

  /* 1. wire bytes */
  uint64_t n = kvb_wire_nbytes(&s.d, &rs_);
  uint64_t nref = ref_nbytes(&s, &rs_);
  CHECK(n == nref, "%s: kvb_wire_nbytes=%llu ref=%llu", tag, (unsigned long long)n, (unsigned long long)nref);
  CHECK(kvb_wire_nbytes(&d.d, &rd_) == nref, "%s: dst wire_nbytes differs", tag);
  CHECK(kvb_validate(&s.d, &rs_, 0, nref) == KVB_OK, "%s: validate src %s %s", tag, sname(kvb_validate(&s.d, &rs_, 0, nref)), kvb_last_error());

  /* 2. pack whole */
  uint8_t* wire = (uint8_t*)malloc(nref + 16);
  uint8_t* ref = (uint8_t*)malloc(nref + 1);
  memset(wire, 0xCD, nref + 16);
  ref_pack(&s, &rs_, ref, nref);
  int st = kvb_pack_cpu(&s.d, &rs_, 0, wire, nref, &ex);
  CHECK(st == KVB_OK, "%s: pack %s: %s", tag, sname(st), kvb_last_error());
  uint64_t bad = 0, first_bad = (uint64_t)-1;
  for (uint64_t i = 0; i < nref; i++) if (wire[i] != ref[i]) { if (!bad) first_bad = i; bad++; }
  CHECK(bad == 0, "%s: %llu wire bytes differ (first at %llu)", tag, (unsigned long long)bad, (unsigned long long)first_bad);
  for (int i = 0; i < 16; i++) CHECK(wire[nref + i] == 0xCD, "%s: pack wrote past nbytes", tag);

  /* 4. pack in unaligned slices */
  {
    uint8_t* pieces = (uint8_t*)malloc(nref + 16);
    memset(pieces, 0xEE, nref + 16);
    uint64_t off = 0;
    int k = 0;
    while (off < nref) {
      uint64_t len = 1 + rndn(k % 3 == 0 ? 7 : (nref / 3 + 1));
      if (off + len > nref) len = nref - off;
      /* pack into a misaligned scratch buffer, then copy */
      uint8_t* scratch = (uint8_t*)malloc(len + 3);
      st = kvb_pack_cpu(&s.d, &rs_, off, scratch + 1 + (k % 3), len, &ex);
      CHECK(st == KVB_OK, "%s: slice pack [%llu,+%llu) %s %s", tag, (unsigned long long)off, (unsigned long long)len, sname(st), kvb_last_error());
      memcpy(pieces + off, scratch + 1 + (k % 3), len);
      free(scratch);
      off += len; k++;
    }
    CHECK(memcmp(pieces, ref, nref) == 0, "%s: sliced pack (%d slices) != whole", tag, k);
    free(pieces);
  }

  /* 3. unpack into a different layout */
  uint8_t* img = cache_snap(&d);
  ref_unpack(&d, &rd_, ref, nref, img);
  st = kvb_unpack_cpu(&d.d, &rd_, 0, wire, nref, &ex);
  CHECK(st == KVB_OK, "%s: unpack %s: %s", tag, sname(st), kvb_last_error());
  CHECK(cache_eq(&d, img), "%s: unpacked cache != reference (incl. untouched slots)", tag);
  /* re-pack from destination gives same wire */
  {
    uint8_t* w2 = (uint8_t*)malloc(nref + 1);
    st = kvb_pack_cpu(&d.d, &rd_, 0, w2, nref, &ex);
    CHECK(st == KVB_OK && memcmp(w2, ref, nref) == 0, "%s: repack from dst differs", tag);
    free(w2);
  }

  /* 4b. unpack in slices, in random order, into a fresh copy of dst */
  {
    Cache d2;
    cache_init(&d2, dst_l, 9999);
    uint8_t* img2 = cache_snap(&d2);
    ref_unpack(&d2, &rd_, ref, nref, img2);
    enum { MAXS = 64 };
    uint64_t cuts[MAXS + 1]; int ns = 0;
    cuts[0] = 0;
    while (ns < MAXS - 1 && cuts[ns] < nref) {
      uint64_t len = 1 + rndn(nref / 5 + 3);
      cuts[ns + 1] = cuts[ns] + len > nref ? nref : cuts[ns] + len; ns++;
    }
    if (cuts[ns] < nref) { cuts[ns + 1] = nref; ns++; }
    int order[MAXS];
    for (int i = 0; i < ns; i++) order[i] = i;
    for (int i = ns - 1; i > 0; i--) { int j = (int)rndn((uint64_t)i + 1); int x = order[i]; order[i] = order[j]; order[j] = x; }
    for (int i = 0; i < ns; i++) {
      uint64_t o = cuts[order[i]], len = cuts[order[i] + 1] - o;
      uint8_t* scratch = (uint8_t*)malloc(len + 3);
      memcpy(scratch + 2, ref + o, len);
      st = kvb_unpack_cpu(&d2.d, &rd_, o, scratch + 2, len, &ex);
      CHECK(st == KVB_OK, "%s: slice unpack %s %s", tag, sname(st), kvb_last_error());
      free(scratch);
    }
    CHECK(cache_eq(&d2, img2), "%s: sliced unpack (%d slices) != reference", tag, ns);
    free(img2);
    cache_free(&d2);
  }

  free(img); free(wire); free(ref); free(bts); free(btd);
  cache_free(&s); cache_free(&d);
}

/* ---------- errors ---------- */
static void expect_err(const char* what, int got, int want_status, const char* want_name, int unchanged) {
  const char* msg = kvb_last_error();
  CHECK(got == want_status, "%s: got %d %s, want %s", what, got, sname(got), want_name);
  CHECK(strcmp(sname(got), want_name) == 0 || got != want_status, "%s: kvb_status_name(%d)=%s", what, got, sname(got));
  CHECK(msg && msg[0], "%s: kvb_last_error empty", what);
  CHECK(unchanged, "%s: destination modified on error", what);
  printf("  %-52s -> %-24s \"%s\"\n", what, sname(got), msg ? msg : "(null)");
}

static void run_errors(void) {
  printf("error cases:\n");
  Lay y = {"kvNHD fp16", 3, 2, 5, 2, 5, 8, KV_FIRST, 0, 0, 0};
  Cache c; cache_init(&c, &y, 42);
  int64_t start = 3, end = 22; /* pages 0..4 */
  int32_t bt[6] = {7, 2, 5, 0, 3, 6};
  kvb_range r = {start, end, 0, 3, bt, 6};
  kvb_exec ex = {1, 0};
  uint64_t n = kvb_wire_nbytes(&c.d, &r);
  CHECK(n == ref_nbytes(&c, &r), "err setup nbytes");
  uint8_t* w = (uint8_t*)malloc(n), *w0 = (uint8_t*)malloc(n);
  for (uint64_t i = 0; i < n; i++) w[i] = w0[i] = hb8(i + 77);
  uint8_t* snap = cache_snap(&c);
#define PACK_UNCH (memcmp(w, w0, n) == 0)
#define UNPK_UNCH (cache_eq(&c, snap))
  int st;

  /* sanity: ok */
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  CHECK(st == KVB_OK, "err setup pack ok: %s %s", sname(st), kvb_last_error());
  memcpy(w0, w, n);
  printf("  (after success kvb_last_error()=\"%s\")\n", kvb_last_error());

  /* page id out of range */
  bt[2] = 8;
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  expect_err("pack: page id == num_pages", st, KVB_ERR_OUT_OF_RANGE, "KVB_ERR_OUT_OF_RANGE", PACK_UNCH);
  st = kvb_unpack_cpu(&c.d, &r, 0, w, n, &ex);
  expect_err("unpack: page id == num_pages", st, KVB_ERR_OUT_OF_RANGE, "KVB_ERR_OUT_OF_RANGE", UNPK_UNCH);
  bt[2] = -1;
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  expect_err("pack: negative page id", st, KVB_ERR_OUT_OF_RANGE, "KVB_ERR_OUT_OF_RANGE", PACK_UNCH);
  st = kvb_validate(&c.d, &r, 0, n);
  expect_err("validate: negative page id", st, KVB_ERR_OUT_OF_RANGE, "KVB_ERR_OUT_OF_RANGE", 1);
  bt[2] = 5;
  /* page id in last (uncovered) entry is never read */
  bt[5] = 1000;
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  CHECK(st == KVB_OK, "uncovered bad entry should be ignored: %s %s", sname(st), kvb_last_error());
  bt[5] = 6;

  /* block table too short: range covers entries 0..4 */
  r.block_table_len = 4;
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  expect_err("pack: block table too short", st, KVB_ERR_OUT_OF_RANGE, "KVB_ERR_OUT_OF_RANGE", PACK_UNCH);
  st = kvb_unpack_cpu(&c.d, &r, 0, w, n, &ex);
  expect_err("unpack: block table too short", st, KVB_ERR_OUT_OF_RANGE, "KVB_ERR_OUT_OF_RANGE", UNPK_UNCH);
  r.block_table_len = 5; /* exactly enough */
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  CHECK(st == KVB_OK, "table exactly long enough: %s %s", sname(st), kvb_last_error());
  r.block_table_len = 6;

  /* repeated page ids */
  bt[3] = bt[1];
  st = kvb_unpack_cpu(&c.d, &r, 0, w, n, &ex);
  expect_err("unpack: repeated page id", st, KVB_ERR_OVERLAP, "KVB_ERR_OVERLAP", UNPK_UNCH);
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  printf("  %-52s -> %-24s (docs: only unpack requires distinct ids)\n", "pack: repeated page id", sname(st));
  CHECK(st == KVB_OK, "pack with repeated page ids should be allowed: %s %s", sname(st), kvb_last_error());
  if (st == KVB_OK) { uint8_t* rf = (uint8_t*)malloc(n); ref_pack(&c, &r, rf, n); CHECK(memcmp(rf, w, n) == 0, "pack repeated ids bytes"); free(rf); }
  st = kvb_validate(&c.d, &r, 0, n);
  printf("  %-52s -> %-24s \"%s\"\n", "validate: repeated page id (pack or unpack?)", sname(st), st ? kvb_last_error() : "");
  bt[3] = 0;
  /* restore w0 to proper wire */
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  memcpy(w0, w, n);

  /* repeated id outside coverage is fine on unpack */
  bt[5] = bt[0];
  {
    Cache c2; cache_init(&c2, &y, 43);
    st = kvb_unpack_cpu(&c2.d, &r, 0, w, n, &ex);
    CHECK(st == KVB_OK, "unpack: repeat only in uncovered entry: %s %s", sname(st), kvb_last_error());
    cache_free(&c2);
  }
  bt[5] = 6;

  /* overlapping wire buffer */
  {
    uint8_t* inside = c.bases[1] + 10;
    uint8_t* sv = cache_snap(&c);
    st = kvb_pack_cpu(&c.d, &r, 0, inside, 64 < n ? 64 : n, &ex);
    expect_err("pack: dst inside cache layer 1", st, KVB_ERR_OVERLAP, "KVB_ERR_OVERLAP", cache_eq(&c, sv));
    st = kvb_unpack_cpu(&c.d, &r, 0, inside, 64 < n ? 64 : n, &ex);
    expect_err("unpack: src inside cache layer 1", st, KVB_ERR_OVERLAP, "KVB_ERR_OVERLAP", cache_eq(&c, sv));
    /* partially overlapping: buffer ends 1 byte into layer 0 */
    uint8_t* before = c.bases[0] - 1; /* not dereferenced by us; only valid if the core refuses */
    (void)before;
    free(sv);
  }
  /* two layers sharing memory on unpack */
  {
    void* saved = c.bases[2];
    c.bases[2] = c.bases[1];
    st = kvb_unpack_cpu(&c.d, &r, 0, w, n, &ex);
    c.bases[2] = (uint8_t*)saved;
    expect_err("unpack: two layers share memory", st, KVB_ERR_OVERLAP, "KVB_ERR_OVERLAP", UNPK_UNCH);
  }

  /* wrong abi version */
  c.d.abi_version = KVB_ABI_VERSION + 1;
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  printf("  [abi] ");
  expect_err("pack: abi_version+1 (status undocumented)", st, st < 0 ? st : -999, st < 0 ? sname(st) : "<any error>", PACK_UNCH);
  st = kvb_unpack_cpu(&c.d, &r, 0, w, n, &ex);
  printf("  [abi] ");
  expect_err("unpack: abi_version+1", st, st < 0 ? st : -999, st < 0 ? sname(st) : "<any error>", UNPK_UNCH);
  c.d.abi_version = 0;
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  printf("  [abi] ");
  expect_err("pack: abi_version 0", st, st < 0 ? st : -999, st < 0 ? sname(st) : "<any error>", PACK_UNCH);
  printf("  wire_nbytes with bad abi: %llu\n", (unsigned long long)kvb_wire_nbytes(&c.d, &r));
  c.d.abi_version = KVB_ABI_VERSION;

  /* null pointers */
  st = kvb_pack_cpu(NULL, &r, 0, w, n, &ex);
  expect_err("pack: cache NULL", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
  st = kvb_pack_cpu(&c.d, NULL, 0, w, n, &ex);
  expect_err("pack: range NULL", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
  st = kvb_pack_cpu(&c.d, &r, 0, NULL, n, &ex);
  expect_err("pack: dst NULL", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
  st = kvb_unpack_cpu(&c.d, &r, 0, NULL, n, &ex);
  expect_err("unpack: src NULL", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", UNPK_UNCH);
  r.block_table = NULL;
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  expect_err("pack: block_table NULL", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
  r.block_table = bt;
  c.d.layer_base = NULL;
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  expect_err("pack: layer_base NULL", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
  c.d.layer_base = (void* const*)c.bases;
  {
    void* saved = c.bases[1];
    c.bases[1] = NULL;
    st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
    expect_err("pack: layer_base[1] NULL", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
    /* layer 1 outside the layer range: is a NULL there accepted? */
    kvb_range r2 = r; r2.layer_start = 2; r2.layer_end = 3;
    uint64_t n2 = kvb_wire_nbytes(&c.d, &r2);
    uint8_t* w2 = (uint8_t*)malloc(n2);
    st = kvb_pack_cpu(&c.d, &r2, 0, w2, n2, &ex);
    printf("  %-52s -> %-24s \"%s\"\n", "pack: layer_base[1] NULL, layers [2,3)", sname(st), st ? kvb_last_error() : "");
    free(w2);
    c.bases[1] = (uint8_t*)saved;
  }
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, NULL);
  printf("  %-52s -> %-24s \"%s\"\n", "pack: exec NULL (undocumented)", sname(st), st ? kvb_last_error() : "");
  if (st == KVB_OK) CHECK(memcmp(w, w0, n) == 0, "exec NULL pack bytes");
  memcpy(w, w0, n);

  /* slice outside the wire */
  st = kvb_pack_cpu(&c.d, &r, 1, w, n, &ex);
  expect_err("pack: slice [1, n+1)", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
  st = kvb_unpack_cpu(&c.d, &r, n - 3, w, 4, &ex);
  expect_err("unpack: slice [n-3, n+1)", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", UNPK_UNCH);
  st = kvb_pack_cpu(&c.d, &r, UINT64_MAX - 1, w, 4, &ex);
  expect_err("pack: offset near UINT64_MAX (wrap)", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
  st = kvb_pack_cpu(&c.d, &r, n + 1, w, 0, &ex);
  printf("  %-52s -> %-24s \"%s\"\n", "pack: offset n+1, nbytes 0", sname(st), st ? kvb_last_error() : "");
  st = kvb_pack_cpu(&c.d, &r, n, w, 0, &ex);
  printf("  %-52s -> %-24s \"%s\"\n", "pack: offset n, nbytes 0", sname(st), st ? kvb_last_error() : "");
  CHECK(PACK_UNCH, "nbytes 0 wrote");
  st = kvb_validate(&c.d, &r, 5, n);
  expect_err("validate: slice [5, n+5)", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", 1);

  /* extra: bad ranges, layers, threads, device */
  kvb_range rb = r;
  rb.token_start = 10; rb.token_end = 5;
  st = kvb_pack_cpu(&c.d, &rb, 0, w, 1, &ex);
  expect_err("pack: token_start > token_end", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
  printf("  wire_nbytes(start>end) = %llu\n", (unsigned long long)kvb_wire_nbytes(&c.d, &rb));
  rb = r; rb.token_start = -2;
  st = kvb_pack_cpu(&c.d, &rb, 0, w, 1, &ex);
  expect_err("pack: token_start < 0", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
  rb = r; rb.token_end = rb.token_start;
  st = kvb_pack_cpu(&c.d, &rb, 0, w, 0, &ex);
  printf("  %-52s -> %-24s \"%s\" wire_nbytes=%llu\n", "pack: empty token range", sname(st), st ? kvb_last_error() : "", (unsigned long long)kvb_wire_nbytes(&c.d, &rb));
  rb = r; rb.layer_end = 4;
  st = kvb_pack_cpu(&c.d, &rb, 0, w, 1, &ex);
  printf("  [layers] ");
  expect_err("pack: layer_end > num_layers (LayoutError in py)", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
  rb = r; rb.layer_start = 2; rb.layer_end = 1;
  st = kvb_pack_cpu(&c.d, &rb, 0, w, 1, &ex);
  printf("  [layers] ");
  expect_err("pack: layer_start > layer_end", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
  rb = r; rb.layer_start = 1; rb.layer_end = 1;
  st = kvb_pack_cpu(&c.d, &rb, 0, w, 0, &ex);
  printf("  %-52s -> %-24s \"%s\" wire_nbytes=%llu\n", "pack: empty layer range", sname(st), st ? kvb_last_error() : "", (unsigned long long)kvb_wire_nbytes(&c.d, &rb));
  {
    kvb_exec bx = {-1, 0};
    st = kvb_pack_cpu(&c.d, &r, 0, w, n, &bx);
    printf("  [threads] ");
    expect_err("pack: num_threads = -1", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
    bx.num_threads = 1000;
    st = kvb_pack_cpu(&c.d, &r, 0, w, n, &bx);
    printf("  %-52s -> %-24s \"%s\"\n", "pack: num_threads = 1000", sname(st), st ? kvb_last_error() : "");
    bx.num_threads = 1; bx.cuda_stream = 12345;
    st = kvb_pack_cpu(&c.d, &r, 0, w, n, &bx);
    printf("  %-52s -> %-24s \"%s\"\n", "pack_cpu: cuda_stream = 12345 (ignored?)", sname(st), st ? kvb_last_error() : "");
    CHECK(memcmp(w, w0, n) == 0, "bytes after threads/stream variants");
  }
  c.d.device = 0;
  st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
  printf("  [device] ");
  expect_err("pack_cpu: desc.device = 0", st, KVB_ERR_INVALID_ARG, "KVB_ERR_INVALID_ARG", PACK_UNCH);
  c.d.device = -1;
  st = kvb_pack_cuda(&c.d, &r, 0, w, n, &ex);
  printf("  %-52s -> %-24s \"%s\" (built_with_cuda=%d, devices=%d)\n", "pack_cuda on a host cache", sname(st), st ? kvb_last_error() : "", kvb_built_with_cuda(), kvb_cuda_device_count());
  /* overlapping strides */
  {
    int64_t sv = c.d.stride_head;
    c.d.stride_head = c.d.head_bytes - 1;
    st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
    printf("  [strides] ");
    expect_err("pack: stride_head = head_bytes-1 (overlap)", st, st < 0 ? st : -999, st < 0 ? sname(st) : "<any error>", PACK_UNCH);
    c.d.stride_head = sv;
    sv = c.d.stride_page;
    c.d.stride_page = c.d.stride_page - 1;
    st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
    printf("  [strides] ");
    expect_err("pack: stride_page = nominal-1 (overlap)", st, st < 0 ? st : -999, st < 0 ? sname(st) : "<any error>", PACK_UNCH);
    c.d.stride_page = sv;
    c.d.num_components = 3;
    st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
    printf("  %-52s -> %-24s \"%s\"\n", "pack: num_components = 3", sname(st), st ? kvb_last_error() : "");
    c.d.num_components = 2;
    c.d.head_bytes = 0;
    st = kvb_pack_cpu(&c.d, &r, 0, w, n, &ex);
    printf("  %-52s -> %-24s \"%s\"\n", "pack: head_bytes = 0", sname(st), st ? kvb_last_error() : "");
    c.d.head_bytes = (int64_t)y.D * y.isz;
  }
  /* kvb_status_name of unknown */
  printf("  kvb_status_name(0)=%s (1)=%s (-3)=%s (-99)=%s (7)=%s\n", sname(0), sname(1), sname(-3), sname(-99), sname(7));
  CHECK(strcmp(sname(-2), "KVB_ERR_OUT_OF_RANGE") == 0, "status name example status.h:30");
  CHECK(UNPK_UNCH, "cache modified by some error case");
  free(w); free(w0); free(snap);
  cache_free(&c);
}


/* ---------- extras: generic strides, padding, misalignment, overlap edges, threads ---------- */
#include <pthread.h>
static void custom_cache(Cache* c, int L, int C, int H, int64_t hb, int64_t pt, int64_t P, int64_t sc, int64_t sp,
                         int64_t st, int64_t sh, int64_t layer_bytes, int misalign, uint64_t seed) {
  memset(c, 0, sizeof *c);
  c->lay.L = L; c->lay.H = H; c->lay.D = (int)hb; c->lay.isz = 1; c->lay.pt = pt; c->lay.P = P; c->lay.stacked = 1;
  c->C = C; c->layer_bytes = layer_bytes;
  c->block = (uint8_t*)malloc((size_t)(layer_bytes * L + 64));
  c->bases = (uint8_t**)malloc(sizeof(uint8_t*) * L);
  for (int l = 0; l < L; l++) c->bases[l] = c->block + misalign + l * layer_bytes;
  for (int64_t i = 0; i < layer_bytes * L + 64; i++) c->block[i] = hb8(seed * 31 + (uint64_t)i);
  kvb_cache_desc* d = &c->d;
  d->abi_version = KVB_ABI_VERSION; d->num_layers = L; d->num_components = C; d->num_heads = H;
  d->head_bytes = hb; d->page_tokens = pt; d->num_pages = P;
  d->stride_component = sc; d->stride_page = sp; d->stride_token = st; d->stride_head = sh;
  d->layer_base = (void* const*)c->bases; d->device = -1;
}
static void custom_roundtrip(const char* name, Cache* c, const Lay* other, int64_t start, int64_t end, int l0, int l1) {
  int64_t pt = c->d.page_tokens;
  int32_t* bt = make_table((end - 1) / pt + 1, c->d.num_pages, start / pt, (end - 1) / pt, 1);
  kvb_range r = {start, end, l0, l1, bt, (end - 1) / pt + 1};
  kvb_exec ex = {0, 0};
  uint64_t n = kvb_wire_nbytes(&c->d, &r);
  uint64_t nref = (uint64_t)(l1 - l0) * (uint64_t)(end - start) * c->C * c->d.num_heads * c->d.head_bytes;
  CHECK(n == nref, "%s: nbytes %llu vs %llu", name, (unsigned long long)n, (unsigned long long)nref);
  uint8_t* w = (uint8_t*)malloc(nref), *rf = (uint8_t*)malloc(nref);
  ref_pack(c, &r, rf, nref);
  int st = kvb_pack_cpu(&c->d, &r, 0, w, nref, &ex);
  CHECK(st == KVB_OK && memcmp(w, rf, nref) == 0, "%s: pack %s %s", name, sname(st), kvb_last_error());
  /* unpack into the custom cache from a standard one */
  Cache s; cache_init(&s, other, 321);
  int64_t spt = other->pt;
  int32_t* bts = make_table((end - 1) / spt + 1, other->P, start / spt, (end - 1) / spt, 1);
  kvb_range rs_ = {start, end, l0, l1, bts, (end - 1) / spt + 1};
  st = kvb_pack_cpu(&s.d, &rs_, 0, w, nref, &ex);
  CHECK(st == KVB_OK, "%s: pack std", name);
  uint8_t* img = (uint8_t*)malloc((size_t)(c->layer_bytes * c->lay.L + 64));
  memcpy(img, c->block, (size_t)(c->layer_bytes * c->lay.L + 64));
  for (uint64_t i = 0; i < nref; i++) { int l; int64_t a = ref_addr(c, &r, i, &l); img[(c->bases[l] - c->block) + a] = w[i]; }
  st = kvb_unpack_cpu(&c->d, &r, 0, w, nref, &ex);
  CHECK(st == KVB_OK, "%s: unpack %s %s", name, sname(st), kvb_last_error());
  CHECK(memcmp(img, c->block, (size_t)(c->layer_bytes * c->lay.L + 64)) == 0, "%s: unpack result (incl. padding) differs", name);
  printf("  %-52s -> %s\n", name, sname(st));
  free(img); free(bts); cache_free(&s); free(w); free(rf); free(bt);
}
typedef struct { int id; int ok; } TArg;
static void* thr_main(void* p) {
  TArg* a = (TArg*)p;
  Lay y = {"t", 2, 8, 128, 2, 16, 40, KV_FIRST, a->id & 1, 0, 0};
  Cache c; cache_init(&c, &y, 100 + a->id);
  int32_t* bt = make_table(40, 40, 0, 39, 1); /* rnd() not thread-safe: only a seed race, contents still a permutation? */
  for (int i = 0; i < 40; i++) bt[i] = (int32_t)((i * 7 + a->id) % 40);
  kvb_range r = {3, 630, 0, 2, bt, 40};
  uint64_t n = kvb_wire_nbytes(&c.d, &r);
  uint8_t* w = (uint8_t*)malloc(n), *rf = (uint8_t*)malloc(n);
  ref_pack(&c, &r, rf, n);
  a->ok = 1;
  for (int it = 0; it < 20; it++) {
    kvb_exec ex = {it % 3, 0};
    if (kvb_pack_cpu(&c.d, &r, 0, w, n, &ex) != KVB_OK || memcmp(w, rf, n)) a->ok = 0;
    /* per-thread error message */
    char want[64]; snprintf(want, sizeof want, "bad token range [%d, 1)", 100 + a->id);
    kvb_range rb = r; rb.token_start = 100 + a->id; rb.token_end = 1;
    if (kvb_pack_cpu(&c.d, &rb, 0, w, 1, &ex) != KVB_ERR_INVALID_ARG) a->ok = 0;
    if (strcmp(kvb_last_error(), want) != 0) a->ok = 0;
  }
  free(w); free(rf); free(bt); cache_free(&c);
  return NULL;
}
static void run_extras(void) {
  printf("extras:\n");
  Lay stdA = {"std", 3, 2, 6, 1, 4, 40, KV_FIRST, 0, 0, 0}; /* H=2, head_bytes 6, C=2 */
  /* padded pages: [2, P, pt, H, hb] with 5 pad bytes after each page and 3 after each token */
  {
    int64_t hb = 6, H = 2, pt = 5, P = 30;
    int64_t stt = H * hb + 3, sp = pt * stt + 5, sc = P * sp + 1;
    Cache c; custom_cache(&c, 3, 2, (int)H, hb, pt, P, sc, sp, stt, hb, 2 * sc, 0, 1);
    custom_roundtrip("padded kv_first NHD (pad token/page/comp)", &c, &stdA, 6, 97, 0, 3);
    cache_free(&c);
  }
  /* token-outermost: [pt, P, 2, H, hb] */
  {
    int64_t hb = 6, H = 2, pt = 3, P = 40;
    int64_t sh = hb, sc = H * hb, sp = 2 * sc, stt = P * sp;
    Cache c; custom_cache(&c, 3, 2, (int)H, hb, pt, P, sc, sp, stt, sh, pt * stt, 0, 2);
    custom_roundtrip("exotic order [pt, P, 2, H, hb]", &c, &stdA, 1, 100, 1, 3);
    cache_free(&c);
  }
  /* misaligned bases (odd address) for 2-byte elements, FI HND */
  {
    int64_t hb = 6, H = 2, pt = 7, P = 20;
    Cache c; custom_cache(&c, 3, 2, (int)H, hb, pt, P, pt * H * hb, 2 * pt * H * hb, hb, pt * hb, P * 2 * pt * H * hb, 3, 3);
    custom_roundtrip("FI HND, layer bases at odd addresses", &c, &stdA, 4, 111, 0, 2);
    cache_free(&c);
  }
  /* MLA with garbage component / head strides (table says '-') */
  {
    Lay m = {"mla", 2, 1, 6, 1, 4, 40, KV_FIRST, 0, 0, 1};
    int64_t hb = 6, pt = 5, P = 30;
    Cache c; custom_cache(&c, 2, 1, 1, hb, pt, P, 77777, pt * hb, hb, 99999, P * pt * hb, 0, 4);
    int32_t bt[3] = {4, 9, 2}; kvb_range r = {2, 13, 0, 2, bt, 3};
    int st = kvb_validate(&c.d, &r, 0, kvb_wire_nbytes(&c.d, &r));
    printf("  %-52s -> %-24s \"%s\"\n", "MLA: stride_component=77777 stride_head=99999", sname(st), st ? kvb_last_error() : "");
    if (st == KVB_OK) custom_roundtrip("MLA with garbage '-' strides", &c, &m, 2, 100, 0, 2);
    c.d.stride_component = -5; c.d.stride_head = -5;
    st = kvb_validate(&c.d, &r, 0, kvb_wire_nbytes(&c.d, &r));
    printf("  %-52s -> %-24s \"%s\"\n", "MLA: negative '-' strides", sname(st), st ? kvb_last_error() : "");
    c.d.stride_component = 0; c.d.stride_head = 0;
    custom_roundtrip("MLA with 0 for '-' strides", &c, &m, 2, 100, 0, 2);
    cache_free(&c);
  }
  /* C=2 with stride_component 0 -> overlap; H=1 with stride_head 0 */
  {
    Lay y = {"x", 2, 1, 4, 2, 4, 10, KV_FIRST, 0, 0, 0};
    Cache c; cache_init(&c, &y, 5);
    int32_t bt[2] = {1, 3}; kvb_range r = {0, 8, 0, 2, bt, 2};
    int64_t sv = c.d.stride_head; c.d.stride_head = 0;
    int st = kvb_validate(&c.d, &r, 0, kvb_wire_nbytes(&c.d, &r));
    printf("  %-52s -> %-24s \"%s\"\n", "H=1, stride_head=0", sname(st), st ? kvb_last_error() : "");
    c.d.stride_head = sv; c.d.stride_component = 0;
    st = kvb_validate(&c.d, &r, 0, kvb_wire_nbytes(&c.d, &r));
    printf("  %-52s -> %-24s \"%s\"\n", "C=2, stride_component=0", sname(st), st ? kvb_last_error() : "");
    c.d.stride_component = -c.d.stride_component;
    cache_free(&c);
  }
  /* wire buffer overlap edges; layer bases inside one block so we can point just before/after */
  {
    int64_t hb = 4, H = 1, pt = 4, P = 8, lb = 2 * P * pt * H * hb; /* 256 */
    Cache c; custom_cache(&c, 2, 2, 1, hb, pt, P, P * pt * hb, pt * hb, hb, hb, lb, 32, 6);
    /* layers at block+32 and block+32+256; block has 64 spare bytes: 32 before, 32 after */
    int32_t bt[2] = {3, 5}; kvb_range r = {1, 6, 1, 2, bt, 2};
    kvb_exec ex = {1, 0};
    uint64_t n = kvb_wire_nbytes(&c.d, &r); /* 40 */
    uint8_t* snap = cache_snap(&c);
    int st = kvb_pack_cpu(&c.d, &r, 0, c.block + 32 + 2 * lb, 32 < n ? 32 : n, &ex);
    printf("  %-52s -> %-24s \"%s\"\n", "pack: dst right after last layer (adjacent)", sname(st), st ? kvb_last_error() : "");
    st = kvb_pack_cpu(&c.d, &r, 0, c.block + 32 + 2 * lb - 1, 20, &ex);
    printf("  %-52s -> %-24s \"%s\"\n", "pack: dst overlaps last byte of layer 1", sname(st), st ? kvb_last_error() : "");
    CHECK(st == KVB_ERR_OVERLAP, "1-byte overlap not refused");
    st = kvb_pack_cpu(&c.d, &r, 0, c.block + 12, 20, &ex);
    printf("  %-52s -> %-24s \"%s\"\n", "pack: dst adjacent before layer 0 (not in range)", sname(st), st ? kvb_last_error() : "");
    memcpy(snap, c.block, 0); /* no-op */
    free(snap); snap = cache_snap(&c);
    st = kvb_pack_cpu(&c.d, &r, 0, c.block + 40, 20, &ex);
    printf("  %-52s -> %-24s \"%s\"\n", "pack: dst inside layer 0 (outside layer range [1,2))", sname(st), st ? kvb_last_error() : "");
    /* dst inside an untouched slot of a touched layer */
    free(snap);
    cache_free(&c);
  }
  /* kvb_last_error after success following an error */
  {
    Lay y = {"x", 1, 1, 4, 2, 4, 10, KV_FIRST, 0, 0, 0};
    Cache c; cache_init(&c, &y, 5);
    int32_t bt[2] = {1, 3}; kvb_range r = {0, 8, 0, 1, bt, 2};
    uint8_t w[128];
    kvb_pack_cpu(&c.d, &r, 0, NULL, 8, NULL);
    printf("  last_error after an error: \"%s\"\n", kvb_last_error());
    int st = kvb_pack_cpu(&c.d, &r, 0, w, 8, NULL);
    printf("  last_error after a following success (%s): \"%s\"\n", sname(st), kvb_last_error());
    kvb_pack_cpu(&c.d, &r, 0, NULL, 8, NULL);
    kvb_wire_nbytes(&c.d, &r);
    printf("  last_error after error then kvb_wire_nbytes ok: \"%s\"\n", kvb_last_error());
    kvb_status_name(-1);
    printf("  last_error after error then kvb_status_name: \"%s\"\n", kvb_last_error());
    cache_free(&c);
  }
  /* concurrent calls from 4 threads */
  {
    pthread_t th[4]; TArg a[4];
    for (int i = 0; i < 4; i++) { a[i].id = i; pthread_create(&th[i], NULL, thr_main, &a[i]); }
    for (int i = 0; i < 4; i++) { pthread_join(th[i], NULL); CHECK(a[i].ok, "thread %d: concurrent pack or per-thread last_error wrong", i); }
    printf("  4 concurrent threads x 20 packs (+errors): %s\n", (a[0].ok && a[1].ok && a[2].ok && a[3].ok) ? "ok" : "FAILED");
  }
}

int main(void) {
  /* name, L, H, D, isz, pt, P, order, hnd, stacked, mla */
  Lay kvN16 = {"vLLM kv_first NHD fp16 pt16", 4, 3, 7, 2, 16, 9, KV_FIRST, 0, 0, 0};
  Lay kvH5 = {"vLLM kv_first HND fp16 pt5 stacked", 4, 3, 7, 2, 5, 30, KV_FIRST, 1, 1, 0};
  Lay fiN7 = {"FI page_first NHD fp16 pt7 stacked", 4, 3, 7, 2, 7, 20, PAGE_FIRST, 0, 1, 0};
  Lay fiH3 = {"FI page_first HND fp16 pt3", 4, 3, 7, 2, 3, 50, PAGE_FIRST, 1, 0, 0};
  /* fp8 (1-byte): head_bytes = D */
  Lay kvN8 = {"vLLM kv_first NHD fp8 pt4", 5, 2, 13, 1, 4, 20, KV_FIRST, 0, 1, 0};
  Lay fiH8 = {"FI page_first HND fp8 pt9", 5, 2, 13, 1, 9, 12, PAGE_FIRST, 1, 0, 0};
  Lay kvH8 = {"vLLM kv_first HND fp8 pt1", 5, 2, 13, 1, 1, 80, KV_FIRST, 1, 0, 0};
  /* MLA */
  Lay mla16 = {"MLA fp16 D=9 pt6", 3, 1, 9, 2, 6, 15, KV_FIRST, 0, 0, 1};
  Lay mla8s = {"MLA fp8 D=11 pt11 stacked", 3, 1, 11, 1, 11, 10, PAGE_FIRST, 0, 1, 1};
  /* fp32, one head, D=1 */
  Lay kvN32 = {"vLLM NHD fp32 H1 D1 pt2", 2, 1, 1, 4, 2, 50, KV_FIRST, 0, 0, 0};
  Lay fiH32 = {"FI HND fp32 H1 D1 pt8 stacked", 2, 1, 1, 4, 8, 12, PAGE_FIRST, 1, 1, 0};
  /* bigger (> 1 MiB) to hit the thread pool: H=8 D=128 fp16, 16-token pages */
  Lay bigA = {"big vLLM NHD fp16 pt16", 3, 8, 128, 2, 16, 40, KV_FIRST, 0, 0, 0};
  Lay bigB = {"big FI HND fp16 pt64 stacked", 3, 8, 128, 2, 64, 12, PAGE_FIRST, 1, 1, 0};

  printf("kvb_built_with_cuda=%d kvb_cuda_device_count=%d\n", kvb_built_with_cuda(), kvb_cuda_device_count());
  int thr[] = {0, 1, 2, 3};
  for (int rep = 0; rep < 3; rep++) {
    int t = thr[rep % 4];
    run_case(&kvN16, &kvH5, 13, 101, 1, 4, t);
    run_case(&kvH5, &fiN7, 2, 37, 0, 4, t);
    run_case(&fiN7, &fiH3, 20, 21, 2, 3, t);      /* one token */
    run_case(&fiH3, &kvN16, 0, 120, 0, 2, t);
    run_case(&kvN16, &fiH3, 16, 32, 3, 4, t);     /* exactly one page */
    run_case(&kvN8, &fiH8, 5, 70, 1, 5, t);
    run_case(&fiH8, &kvH8, 17, 79, 0, 3, t);
    run_case(&kvH8, &kvN8, 0, 1, 4, 5, t);
    { Lay m2 = mla16; m2.name = "MLA fp16 D=9 pt13 stacked"; m2.pt = 13; m2.P = 9; m2.stacked = 1; run_case(&mla16, &m2, 7, 80, 0, 3, t); }
    run_case(&kvN32, &fiH32, 1, 80, 0, 2, t);
    run_case(&fiH32, &kvN32, 33, 90, 1, 2, t);
  }
  {
    Lay mla8 = mla8s; mla8.name = "MLA fp8 D=11 pt4"; mla8.stacked = 0; mla8.pt = 4; mla8.P = 30;
    run_case(&mla8s, &mla8, 3, 104, 1, 3, 0);
    run_case(&mla8, &mla8s, 0, 109, 0, 3, 2);
  }
  for (int t = 0; t < 4; t++) run_case(&bigA, &bigB, 7, 599, 0, 3, t); /* ~7 MiB wire */
  run_errors();
  run_extras();
  printf("%d checks, %d failures\n", g_checks, g_fail);
  return g_fail ? 1 : 0;
}
