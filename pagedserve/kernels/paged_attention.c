/* Paged attention on the CPU, reading K/V in place through block tables (no gather copy).
 *
 * Cache layout per layer: [num_blocks, block_size, n_kv, head_dim] in one of three formats:
 *   KV_F32  float32
 *   KV_BF16 bfloat16 (the high half of a float32: widened by a shift)
 *   KV_I8   int8 with one float32 scale per token and kv head ([num_blocks, block_size, n_kv])
 * Every format is read natively: a row is widened to float32 in registers (decode) or into a
 * 16-token tile in L1 (prefill), never by a pass over the cache.
 *
 * Vectors are GCC vector extensions of 16 floats: one zmm register with AVX-512, two ymm with
 * AVX2, four xmm otherwise. The same source is compiled once per ISA level (kernels/__init__.py
 * keys each build by the host's CPU flags) and the best level the host runs is loaded.
 *
 * decode:  one query row per sequence; work items are (sequence, context range) so that few or
 *          long sequences still fill every thread (flash-decoding); each item runs an online
 *          softmax over its range, block by block; items of one sequence are merged at the end.
 *          A K/V row of a kv head is loaded once for all query heads of its group.
 * prefill: all prefill chunks of a step in one call (varlen: cu_q gives each chunk's rows);
 *          queries of a chunk see the cached prefix and, causally, the chunk itself. Work items
 *          are (chunk, 16-query tile, kv head): the tile's rows (group x 16; a tile of few queries packs
 *          the group's rows into as few vectors as they fill) are multiplied with 32-key tiles of K and V
 *          with an online softmax per row; float32 FMAs, or bf16 pairs (vdpbf16ps) for a bf16 model
 *          on a bf16 cache where the host has AVX512-BF16 (KV_BF16_DOT). */
#include "vec16.h"

/* KV_BF16_DOT: a bf16 cache whose prefill products may be bf16 too (dots_item, where the host has
 * AVX512-BF16; KV_BF16 elsewhere); prefill only: decode always gets the cache's own format */
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2, KV_BF16_DOT = 3 };

DEFINE_SET_THREADS(paged_attention_set_threads)

#define KV_BYTES(dt) ((dt) == KV_F32 ? 4 : (dt) == KV_BF16 ? 2 : 1)
#ifndef PREFETCH_KEYS
#define PREFETCH_KEYS 64          /* how far ahead decode asks for K/V rows, in keys */
#endif

/* 16 consecutive elements of a cache row, widened to float32 (uint16 -> int32 with the ISA's own
 * instructions, as vec16.h widens bytes: GCC's __builtin_convertvector would scalarise it). */
INLINE v16 load_kv(int dt, const void *base, int64_t i) {
    if (dt == KV_F32) return load_f32((const float *)base + i);
    if (dt == KV_BF16) {
        const uint16_t *p = (const uint16_t *)base + i;
#if defined(__AVX512F__)
        return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
        __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
        __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8))), 16);
        v8 a = (v8)lo, b = (v8)hi;
        return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
        v16u w;
        for (int e = 0; e < 16; e++) w[e] = (uint32_t)p[e] << 16;
        return (v16)w;
#endif
    }
    return cvt(s8x16((const uint8_t *)base + i));
}

INLINE v8 max8(v8 a, v8 b) {
    const v8i gt = a > b;
    return (v8)((gt & (v8i)a) | (~gt & (v8i)b));
}

INLINE v16 vmax(v16 a, v16 b) {
    const v16i gt = a > b;
    return (v16)((gt & (v16i)a) | (~gt & (v16i)b));
}

INLINE float hmax(v16 v) {
    v8 a = max8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
    float m = a[0];
    for (int i = 1; i < 8; i++) m = a[i] > m ? a[i] : m;
    return m;
}

/* 16 vectors of partial dot products (one per key) -> one vector of the 16 dots, lane j = key j:
 * four levels of folding, each halving the lanes a key occupies (15 shuffle pairs for 16 dots) */
#define FOLD(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))
INLINE v16 fold16(v16 x, v16 y) {
    return FOLD(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           FOLD(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
INLINE v16 fold8(v16 x, v16 y) {
    return FOLD(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           FOLD(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
INLINE v16 fold4(v16 x, v16 y) {
    return FOLD(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           FOLD(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
INLINE v16 fold2(v16 x, v16 y) {
    return FOLD(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           FOLD(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
INLINE v16 reduce16(const v16 *a) {
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) b[i] = fold16(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 4; i++) c[i] = fold8(b[2 * i], b[2 * i + 1]);
    for (int i = 0; i < 2; i++) d[i] = fold4(c[2 * i], c[2 * i + 1]);
    return fold2(d[0], d[1]);
}

INLINE float sexp(float x) { return expf(x); }

/* ------------------------------------------------------------------ decode */

/* cache slots of keys t0 .. t0 + n - 1 through a block table: one division per tile, not per key */
INLINE void slots_of(const int64_t *table, int bs, int64_t t0, int n, int64_t *slot) {
    int64_t b = t0 / bs;
    int off = (int)(t0 - b * bs);
    for (int j = 0; j < n; j++) {
        slot[j] = table[b] * bs + off;
        if (++off == bs) { off = 0; b++; }
    }
}

/* Ask for kv head g's share of the rows at slot[0..n): decode uses it PREFETCH_KEYS ahead, where
 * the next block sits elsewhere in memory and the hardware prefetcher cannot follow. */
INLINE void prefetch_rows(int dt, int HD, const void *cache, const int64_t *slot, int n, int g, int n_kv) {
    const int64_t row = (int64_t)n_kv * HD;
    for (int j = 0; j < n; j++)
        for (int b = 0; b < HD * KV_BYTES(dt); b += 64)
            __builtin_prefetch((const char *)cache + (slot[j] * row + (int64_t)g * HD) * KV_BYTES(dt) + b);
}

/* Row pointers of kv head g for the keys at slot[0..n): float32 rows where they lie; bf16 and int8
 * rows widened (int8: times its scale) into tile, n x HD floats, once per tile. */
INLINE void head_rows(int dt, int HD, const void *cache, const float *scales, const int64_t *slot, int n, int g,
                      int n_kv, float *tile, const float **rows) {
    const int64_t row = (int64_t)n_kv * HD;
    for (int j = 0; j < n; j++) {
        const int64_t off = slot[j] * row + (int64_t)g * HD;
        if (dt == KV_F32) { rows[j] = (const float *)cache + off; continue; }
        const float s = dt == KV_I8 ? scales[slot[j] * n_kv + g] : 1.f;
        for (int c = 0; c < HD / 16; c++) store_f32(tile + j * HD + 16 * c, load_kv(dt, cache, off + 16 * c) * s);
        rows[j] = tile + j * HD;
    }
}

#define DT_KEYS 32      /* decode keys per tile: two vectors of scores per head, one softmax update */
/* heads of a GQA group that share each V row load: 3 x head_dim / 16 accumulators fit AVX-512's 32
 * registers; on 16-register ISAs they spilled on every key, so one head at a time there */
#if defined(__AVX512F__)
#define PV_HEADS 3
#else
#define PV_HEADS 1
#endif

/* Rows of one sequence that share each K/V tile in one work unit (a speculative step's verification
 * rows: its decode and the draft tokens after it); bounds the per-row scratch on a thread's stack. */
#define MAX_GROUP 8

/* One work unit: G query rows of one sequence (row r: q + r * n_heads * hd, already multiplied by
 * the softmax scale; its keys [t0, t1[r]), t1 rising with r), read through one block table. Each K/V
 * tile is loaded (and widened) once for all G rows; each row's arithmetic is exactly what it does
 * alone (G = 1), so a verification row computes the bits of a one-row decode. Leaves each row's
 * unnormalised state at st[r]: m (running max), l (sum), acc (n_heads x hd). */
INLINE void decode_range(const int dt, const int HD, const int G, const float *q, const void *kc, const void *vc,
                         const float *ks, const float *vs, const int64_t *table, int64_t t0, const int64_t *t1,
                         int n_heads, int n_kv, int bs, float *const *st) {
    const int group = n_heads / n_kv, C = HD / 16;
    float scr[G * n_heads * DT_KEYS] __attribute__((aligned(64)));
    float tile[DT_KEYS * HD] __attribute__((aligned(64)));     /* bf16 / int8 rows widened (and scaled) once */
    for (int r = 0; r < G; r++) {
        for (int h = 0; h < n_heads; h++) { st[r][h] = -INFINITY; st[r][n_heads + h] = 0.f; }
        memset(st[r] + 2 * n_heads, 0, sizeof(float) * n_heads * HD);
    }
    const int64_t t_end = t1[G - 1];
    for (int64_t c0 = t0; c0 < t_end; c0 += DT_KEYS) {
        const int nk = (int)(t_end - c0 < DT_KEYS ? t_end - c0 : DT_KEYS);
        int nkr[MAX_GROUP];                               /* row r's keys in this tile (<= 0: it has ended) */
        for (int r = 0; r < G; r++) nkr[r] = (int)(t1[r] - c0 < DT_KEYS ? t1[r] - c0 : DT_KEYS);
        int64_t slot[DT_KEYS];
        slots_of(table, bs, c0, nk, slot);
        /* the tile PREFETCH_KEYS ahead sits in other blocks, where the hardware prefetcher cannot follow:
         * ask for its rows, one kv head's share at a time, between the loads of this tile */
        const int64_t p0 = c0 + PREFETCH_KEYS;
        const int np = (int)(t_end - p0 < DT_KEYS ? (t_end > p0 ? t_end - p0 : 0) : DT_KEYS);
        int64_t pslot[DT_KEYS];
        slots_of(table, bs, p0, np, pslot);
        for (int g = 0; g < n_kv; g++) {                  /* scores: each K row serves the whole group */
            prefetch_rows(dt, HD, kc, pslot, np, g, n_kv);
            const float *kr[DT_KEYS];
            head_rows(dt, HD, kc, ks, slot, nk, g, n_kv, tile, kr);
            for (int r = 0; r < G; r++) {
                const int nk_r = nkr[r];
                if (nk_r <= 0) continue;
                const float *qr = q + (int64_t)r * n_heads * HD;
                float *sc = scr + r * n_heads * DT_KEYS;
                for (int hh = 0; hh < group; hh++) {
                    const int h = g * group + hh;
#if defined(__AVX512F__)
                    v16 qv[C];
                    for (int c = 0; c < C; c++) qv[c] = load_f32(qr + h * HD + 16 * c);
                    for (int j0 = 0; j0 < DT_KEYS; j0 += 16) {
                        v16 a[16];
                        for (int j = 0; j < 16; j++) {
                            a[j] = splat(0.f);
                            if (j0 + j < nk_r)
                                for (int c = 0; c < C; c++) a[j] += qv[c] * load_f32(kr[j0 + j] + 16 * c);
                        }
                        store_f32(sc + h * DT_KEYS + j0, reduce16(a));
                    }
#elif defined(__AVX2__)
                    /* 16 ymm registers: GCC keeps 16-lane vectors of this loop on the stack (every FMA a
                     * store and a reload), so here it is written in ymm intrinsics, one key at a time */
                    for (int j = 0; j < DT_KEYS; j++) {
                        float d = 0.f;
                        if (j < nk_r) {
                            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                            for (int e = 0; e < HD; e += 16) {
                                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + h * HD + e), _mm256_loadu_ps(kr[j] + e), a0);
                                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + h * HD + e + 8), _mm256_loadu_ps(kr[j] + e + 8),
                                                     a1);
                            }
                            d = hsum8(_mm256_add_ps(a0, a1));
                        }
                        sc[h * DT_KEYS + j] = d;
                    }
#else
                    for (int j = 0; j < DT_KEYS; j++) {
                        v16 a = splat(0.f);
                        if (j < nk_r)
                            for (int c = 0; c < C; c++) a += load_f32(qr + h * HD + 16 * c) * load_f32(kr[j] + 16 * c);
                        sc[h * DT_KEYS + j] = hsum(a);
                    }
#endif
                }
            }
        }
        for (int r = 0; r < G; r++) {                     /* online softmax, 32 keys per head at once */
            const int nk_r = nkr[r];
            if (nk_r <= 0) continue;
            float *sc = scr + r * n_heads * DT_KEYS, *m = st[r], *l = st[r] + n_heads, *acc = st[r] + 2 * n_heads;
            for (int h = 0; h < n_heads; h++) {
                v16 s0 = load_f32(sc + h * DT_KEYS), s1 = load_f32(sc + h * DT_KEYS + 16);
                if (nk_r < DT_KEYS)
                    for (int j = nk_r; j < DT_KEYS; j++) {
                        if (j < 16) s0[j] = -INFINITY; else s1[j - 16] = -INFINITY;
                    }
                const float mx = hmax(vmax(s0, s1)), mn = mx > m[h] ? mx : m[h];
                if (mn > m[h]) {
                    const float corr = sexp(m[h] - mn);
                    l[h] *= corr;
                    for (int c = 0; c < C; c++) store_f32(acc + h * HD + 16 * c, load_f32(acc + h * HD + 16 * c) * corr);
                    m[h] = mn;
                }
                const v16 p0v = vexp(s0 - splat(mn)), p1v = vexp(s1 - splat(mn));
                l[h] += hsum(p0v + p1v);
                store_f32(sc + h * DT_KEYS, p0v);
                store_f32(sc + h * DT_KEYS + 16, p1v);
            }
        }
        for (int g = 0; g < n_kv; g++) {                  /* acc += p V: up to 3 heads per V load */
            prefetch_rows(dt, HD, vc, pslot, np, g, n_kv);
            const float *vr[DT_KEYS];
            head_rows(dt, HD, vc, vs, slot, nk, g, n_kv, tile, vr);
            for (int r = 0; r < G; r++) {
                const int nk_r = nkr[r];
                if (nk_r <= 0) continue;
                const float *sc = scr + r * n_heads * DT_KEYS;
                float *acc = st[r] + 2 * n_heads;
#if !defined(__AVX512F__) && defined(__AVX2__)
                /* ymm intrinsics, one head and 64 dims (8 accumulators) at a time, as for the scores */
                for (int h = g * group; h < (g + 1) * group; h++)
                    for (int e0 = 0; e0 < HD; e0 += 64) {
                        const int ne = HD - e0 < 64 ? (HD - e0) / 8 : 8;
                        __m256 o[8];
                        for (int c = 0; c < ne; c++) o[c] = _mm256_loadu_ps(acc + h * HD + e0 + 8 * c);
                        for (int j = 0; j < nk_r; j++) {
                            const __m256 w = _mm256_set1_ps(sc[h * DT_KEYS + j]);
                            for (int c = 0; c < ne; c++) o[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr[j] + e0 + 8 * c), o[c]);
                        }
                        for (int c = 0; c < ne; c++) _mm256_storeu_ps(acc + h * HD + e0 + 8 * c, o[c]);
                    }
                continue;
#endif
                for (int h0 = g * group; h0 < (g + 1) * group; h0 += PV_HEADS) {
                    const int nh = (g + 1) * group - h0 < PV_HEADS ? (g + 1) * group - h0 : PV_HEADS;
                    v16 o0[C], o1[C], o2[C];
                    for (int c = 0; c < C; c++) {
                        o0[c] = load_f32(acc + h0 * HD + 16 * c);
                        o1[c] = PV_HEADS > 1 && nh > 1 ? load_f32(acc + (h0 + 1) * HD + 16 * c) : splat(0.f);
                        o2[c] = PV_HEADS > 2 && nh > 2 ? load_f32(acc + (h0 + 2) * HD + 16 * c) : splat(0.f);
                    }
                    for (int j = 0; j < nk_r; j++) {
                        const float w0 = sc[h0 * DT_KEYS + j], w1 = PV_HEADS > 1 && nh > 1 ? sc[(h0 + 1) * DT_KEYS + j] : 0.f,
                                    w2 = PV_HEADS > 2 && nh > 2 ? sc[(h0 + 2) * DT_KEYS + j] : 0.f;
                        for (int c = 0; c < C; c++) {
                            const v16 v = load_f32(vr[j] + 16 * c);
                            o0[c] += w0 * v;
                            if (PV_HEADS > 1) o1[c] += w1 * v;
                            if (PV_HEADS > 2) o2[c] += w2 * v;
                        }
                    }
                    for (int c = 0; c < C; c++) {
                        store_f32(acc + h0 * HD + 16 * c, o0[c]);
                        if (PV_HEADS > 1 && nh > 1) store_f32(acc + (h0 + 1) * HD + 16 * c, o1[c]);
                        if (PV_HEADS > 2 && nh > 2) store_f32(acc + (h0 + 2) * HD + 16 * c, o2[c]);
                    }
                }
            }
        }
    }
}

/* Decode work plan: each context split into ranges of `chunk` keys, chunk from that context's own length
 * (up to 4 items per thread: a lone long context is shared by all threads), never from the rest of the
 * batch, so a row's arithmetic is the same whatever rows share its step (a speculative step's verification
 * rows compute what a one-row decode would); items[first[d] .. first[d + 1]) are sequence d's.
 * Rows that continue one another (row d + 1 sees one key more through the same blocks, with ranges of
 * the same split: a verification's rows) form groups of up to MAX_GROUP; a work unit is the j-th range
 * of every row of a group, run together (decode_range), each row's state in its own item's place. */
typedef struct { int seq; int64_t t0, t1; } item_t;
typedef struct { int d, rows, j; } unit_t;
typedef struct { int threads, n_items, n_units, max_rows; int *first; item_t *items; unit_t *units; float *part; } plan_t;

/* window > 0: a sliding-window layer, each query sees only the last `window` positions */
static inline int64_t first_key(int64_t ctx, int window) { return window > 0 && ctx > window ? ctx - window : 0; }

static plan_t plan_decode(const int64_t *context_lens, int num_seqs, int n_heads, int HD, int window,
                          const int64_t *block_tables, int max_blocks, int bs) {
    plan_t pl;
    pl.threads = THREADS;
    pl.first = malloc(sizeof(int) * (num_seqs + 1));
    int64_t *chunks = malloc(sizeof(int64_t) * (num_seqs ? num_seqs : 1));
    pl.n_items = 0;
    for (int d = 0; d < num_seqs; d++) {
        pl.first[d] = pl.n_items;
        const int64_t n = context_lens[d] - first_key(context_lens[d], window);
        int64_t chunk = (n + 4 * pl.threads - 1) / (4 * pl.threads);
        chunks[d] = chunk < 64 ? 64 : (chunk + 63) / 64 * 64;
        pl.n_items += n > 0 ? (int)((n + chunks[d] - 1) / chunks[d]) : 0;
    }
    pl.first[num_seqs] = pl.n_items;
    pl.items = malloc(sizeof(item_t) * (pl.n_items ? pl.n_items : 1));
    for (int d = 0; d < num_seqs; d++)
        for (int i = pl.first[d]; i < pl.first[d + 1]; i++) {
            const int64_t t0 = first_key(context_lens[d], window) + (int64_t)(i - pl.first[d]) * chunks[d];
            const int64_t t1 = t0 + chunks[d];
            pl.items[i] = (item_t){d, t0, t1 < context_lens[d] ? t1 : context_lens[d]};
        }
    pl.units = malloc(sizeof(unit_t) * (pl.n_items ? pl.n_items : 1));
    pl.n_units = 0;
    pl.max_rows = 1;
    for (int d = 0; d < num_seqs;) {
        int rows = 1;
        const int n_d = pl.first[d + 1] - pl.first[d];
        while (!window && d + rows < num_seqs && rows < MAX_GROUP) {   /* a window: each row's keys start elsewhere */
            const int a = d + rows - 1, b = d + rows;
            if (context_lens[b] != context_lens[a] + 1 || chunks[b] != chunks[d] || pl.first[b + 1] - pl.first[b] != n_d ||
                memcmp(block_tables + (int64_t)a * max_blocks, block_tables + (int64_t)b * max_blocks,
                       sizeof(int64_t) * ((context_lens[b] + bs - 1) / bs)))
                break;
            rows++;
        }
        for (int j = 0; j < n_d; j++) pl.units[pl.n_units++] = (unit_t){d, rows, j};
        pl.max_rows = rows > pl.max_rows ? rows : pl.max_rows;
        d += rows;
    }
    free(chunks);
    pl.part = malloc(sizeof(float) * (int64_t)n_heads * (HD + 2) * (pl.n_items ? pl.n_items : 1));
    return pl;
}

/* out[d] = the items' (m, l, acc) states of sequence d merged: rescale each to the common max (run in the
 * kernel's own parallel region, after its items: no second fork and join per layer) */
static void merge_decode(const plan_t *pl, float *out, int d, int n_heads, int HD) {
    const int64_t state = (int64_t)n_heads * (HD + 2);
    const float *part = pl->part;
    for (int h = 0; h < n_heads; h++) {
        float M = -INFINITY, L = 0.f;
        for (int i = pl->first[d]; i < pl->first[d + 1]; i++) M = part[state * i + h] > M ? part[state * i + h] : M;
        float *o = out + ((int64_t)d * n_heads + h) * HD;
        memset(o, 0, sizeof(float) * HD);
        for (int i = pl->first[d]; i < pl->first[d + 1]; i++) {
            const float *st = part + state * i;
            if (st[h] == -INFINITY) continue;
            const float w = sexp(st[h] - M);
            L += st[n_heads + h] * w;
            const float *acc = st + 2 * n_heads + (int64_t)h * HD;
            for (int e = 0; e < HD; e++) o[e] += w * acc[e];
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int e = 0; e < HD; e++) o[e] *= inv;
    }
}

static void free_plan(plan_t *pl) { free(pl->part); free(pl->units); free(pl->items); free(pl->first); }

/* ------------------------------------------------------------------ prefill */

#define QT 16      /* queries per tile: one vector lane per query */
#define KT 32      /* keys per tile */
#ifndef QK_KEYS
#define QK_KEYS 8  /* keys per block of score accumulators (x 3 heads' vectors) */
#endif

/* Scores of a vector of lanes for key t of a tile, masked: a key past the tile (j >= nk), past a lane's
 * position (causal: the lane of query i sees t <= first_pos + i; qi holds each lane's i) or before its
 * window -> -inf. */
INLINE v16 mask_scores(v16 x, int j, int nk, int64_t t, int64_t first_pos, int window, v16 qi) {
    if (j >= nk) return splat(-INFINITY);
    if (t > first_pos) {
        const v16i hide = splat((float)(t - first_pos)) > qi;
        x = (v16)((~hide & (v16i)x) | (hide & (v16i)splat(-INFINITY)));
    }
    if (window > 0 && t - first_pos + window - 1 < QT - 1) {       /* window: t > first_pos + i - window */
        const v16i hide = qi > splat((float)(t - first_pos + window - 1));
        x = (v16)((~hide & (v16i)x) | (hide & (v16i)splat(-INFINITY)));
    }
    return x;
}

/* The online softmax over a tile's scores P[key][head v * 16 + query] (nk keys, NV heads), lane-wise:
 * P becomes exp(s - running max), the running max m and sum l move on, O's rows are rescaled. */
INLINE void softmax_tile(float *P, int nk, int NV, v16 *m, v16 *l, float *O, int HD) {
    for (int v = 0; v < NV; v++) {
        v16 mx = m[v];
        for (int j = 0; j < nk; j++) mx = vmax(mx, load_f32(P + j * 48 + 16 * v));
        const v16 corr = vexp(m[v] - mx);                            /* exp(-inf) = 0 on the first tile */
        m[v] = mx;
        v16 sum = splat(0.f);
        for (int j = 0; j < nk; j++) {
            const v16 pj = vexp(load_f32(P + j * 48 + 16 * v) - mx);
            sum += pj;
            store_f32(P + j * 48 + 16 * v, pj);
        }
        l[v] = l[v] * corr + sum;
        for (int i = 0; i < QT; i++)
            if (corr[i] != 1.f) {
                float *o = O + (v * 16 + i) * HD;
                for (int c = 0; c < HD / 16; c++) store_f32(o + 16 * c, load_f32(o + 16 * c) * corr[i]);
            }
    }
}

/* Which query and head each of an item's 48 lanes (3 vectors of 16) computes, -1 for none. A pass covers
 * up to 3 heads of the group, a vector each, its queries across the lanes; where the whole group's
 * rows fit the 48 lanes (group x nq <= 48) one pass packs them (lane = head * nq + query) in as few
 * vectors as they fill, so a short chunk at a long context costs what its rows need, not a full tile's
 * 48 lanes (5 queries of a group of 3: one vector). Each lane's arithmetic is the same wherever it
 * sits: packing changes no bit. The pass from head h0 of the group's [.., hg1): returns its vectors,
 * *heads the heads it covers. */
INLINE int map_lanes(int nq, int group, int h0, int hg1, int *lq, int *lh, v16 *qi, int *heads) {
    const int packed = nq * group <= 48;
    const int NV = packed ? (nq * group + 15) / 16 : hg1 - h0 < 3 ? hg1 - h0 : 3;
    *heads = packed ? group : NV;
    for (int x = 0; x < 48; x++) {
        const int v = x / 16, i = x % 16;
        lq[x] = packed ? (x < nq * group ? x % nq : -1) : v < NV && i < nq ? i : -1;
        lh[x] = lq[x] < 0 ? -1 : packed ? h0 + x / nq : h0 + v;
        qi[v][i] = lq[x] < 0 ? 0.f : (float)lq[x];
    }
    return NV;
}

/* An item's rows out: normalised into `out`, or (a split item) unnormalised with their max and sum into
 * `part` (by head of the group and query), merged by merge_prefill. */
INLINE void item_out(const float *O, const v16 *m, const v16 *l, const int *lq, const int *lh, int HD, int64_t i0,
                     int hg0, int n_heads, float *out, float *part) {
    for (int x = 0; x < 48; x++) {
        if (lq[x] < 0) continue;
        const int v = x / 16, i = x % 16;
        if (part) {
            float *st = part + ((lh[x] - hg0) * QT + lq[x]) * (HD + 2);
            memcpy(st, O + x * HD, sizeof(float) * HD);
            st[HD] = m[v][i];
            st[HD + 1] = l[v][i];
            continue;
        }
        float *dst = out + ((i0 + lq[x]) * n_heads + lh[x]) * HD;
        const float inv = 1.f / l[v][i];
        for (int e = 0; e < HD; e++) dst[e] = O[x * HD + e] * inv;
    }
}

/* One work item: queries i0 .. i0 + nq - 1 of a chunk, the heads of kv head g. Scores are kept
 * transposed, S[key][query] with the queries across vector lanes, so the online softmax runs
 * lane-wise over keys (no horizontal max or sum), K rows are used as they lie in the cache (no
 * transpose), and Q is transposed once per item. Up to 3 heads (3 vectors of 16 queries) share
 * every K and V load. */
INLINE void prefill_item(const int dt, const int HD, const float *q, float *out, const void *kc, const void *vc,
                         const float *ks, const float *vs, const int64_t *table, int64_t ctx, int64_t q_len,
                         int64_t i0, int nq, int g, int n_heads, int n_kv, int bs, float scale, int window,
                         int64_t k_lo, int64_t k_hi, float *part) {
    const int group = n_heads / n_kv, C = HD / 16;
    const int64_t first_pos = ctx - q_len + i0;
    /* keys [start, end) are visible (window: from the first query's); a split item takes [k_lo, k_hi) of them */
    const int64_t first = first_key(first_pos + 1, window), start = first > k_lo ? first : k_lo;
    const int64_t end = first_pos + nq < k_hi ? first_pos + nq : k_hi;
    int lq[48], lh[48], heads;
    v16 qi[3];
    float Qt[HD * 48] __attribute__((aligned(64)));       /* [e][lane] */
    float O[48 * HD] __attribute__((aligned(64)));        /* [head v * 16 + query][e] */
    float P[KT * 48] __attribute__((aligned(64)));        /* [key][head v * 16 + query] */
    float tile[2 * KT * HD] __attribute__((aligned(64)));  /* widened K then V rows (bf16 / int8) */
    for (int h0 = g * group; h0 < (g + 1) * group; h0 += heads) {
        const int NV = map_lanes(nq, group, h0, (g + 1) * group, lq, lh, qi, &heads);
        for (int x = 0; x < 48; x++)
            for (int e = 0; e < HD; e++)
                Qt[e * 48 + x] = lq[x] < 0 ? 0.f : q[((i0 + lq[x]) * n_heads + lh[x]) * HD + e] * scale;
        memset(O, 0, sizeof(float) * 48 * HD);
        v16 m[3], l[3];
        for (int v = 0; v < 3; v++) { m[v] = splat(-INFINITY); l[v] = splat(0.f); }
        for (int64_t k0 = start; k0 < end; k0 += KT) {
            const int nk = (int)(end - k0 < KT ? end - k0 : KT);
            int64_t slot[KT];
            slots_of(table, bs, k0, nk, slot);
            const float *kr[KT], *vr[KT];
            head_rows(dt, HD, kc, ks, slot, nk, g, n_kv, tile, kr);
            head_rows(dt, HD, vc, vs, slot, nk, g, n_kv, tile + KT * HD, vr);
            for (int j = nk; j < KT; j++) kr[j] = vr[j] = kr[0];            /* masked below */
            /* S[key][lanes] = sum_e K[key][e] * Qt[e][lanes]: QK_KEYS keys x NV vectors of accumulators */
            for (int j0 = 0; j0 < KT; j0 += QK_KEYS) {
                v16 s[QK_KEYS][3];
                for (int kk = 0; kk < QK_KEYS; kk++) for (int v = 0; v < 3; v++) s[kk][v] = splat(0.f);
                for (int e = 0; e < HD; e++) {
                    const v16 q0 = load_f32(Qt + e * 48), q1 = load_f32(Qt + e * 48 + 16), q2 = load_f32(Qt + e * 48 + 32);
                    for (int kk = 0; kk < QK_KEYS; kk++) {
                        const float kv = kr[j0 + kk][e];
                        s[kk][0] += kv * q0;
                        if (NV > 1) s[kk][1] += kv * q1;
                        if (NV > 2) s[kk][2] += kv * q2;
                    }
                }
                for (int kk = 0; kk < QK_KEYS; kk++)
                    for (int v = 0; v < NV; v++)
                        store_f32(P + (j0 + kk) * 48 + 16 * v,
                                  mask_scores(s[kk][v], j0 + kk, nk, k0 + j0 + kk, first_pos, window, qi[v]));
            }
            softmax_tile(P, nk, NV, m, l, O, HD);
            /* O[row] += sum_key P[key][row] V[key]: 4 rows x C vectors of accumulators (48 rows = 12 x 4) */
            for (int r = 0; r < NV * 16; r += 4) {
                v16 a0[C], a1[C], a2[C], a3[C];
                for (int c = 0; c < C; c++) {
                    a0[c] = load_f32(O + r * HD + 16 * c); a1[c] = load_f32(O + (r + 1) * HD + 16 * c);
                    a2[c] = load_f32(O + (r + 2) * HD + 16 * c); a3[c] = load_f32(O + (r + 3) * HD + 16 * c);
                }
                for (int j = 0; j < nk; j++) {
                    const float *pj = P + j * 48 + r;
                    for (int c = 0; c < C; c++) {
                        const v16 vv = load_f32(vr[j] + 16 * c);
                        a0[c] += pj[0] * vv;
                        a1[c] += pj[1] * vv;
                        a2[c] += pj[2] * vv;
                        a3[c] += pj[3] * vv;
                    }
                }
                for (int c = 0; c < C; c++) {
                    store_f32(O + r * HD + 16 * c, a0[c]); store_f32(O + (r + 1) * HD + 16 * c, a1[c]);
                    store_f32(O + (r + 2) * HD + 16 * c, a2[c]); store_f32(O + (r + 3) * HD + 16 * c, a3[c]);
                }
            }
        }
        item_out(O, m, l, lq, lh, HD, i0, g * group, n_heads, out, part);
    }
}

#if defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
/* ---- bfloat16 products (KV_BF16_DOT: a bf16 cache beside a model computing in bf16, on hosts with
 * AVX512-BF16). The same item as prefill_item, with both products done by vdpbf16ps, which multiplies
 * pairs of bf16 and adds them to float32 lanes: 32 multiply-adds an instruction against an FMA's 16.
 * The queries (times the scale) and the softmax's probabilities are rounded to bf16 (as flash attention
 * does on GPUs); K is read in place from the cache, V two keys interleaved per tile; sums stay float32.
 * Not invariant to anything float32 promises: chosen only where the model's activations are bf16 anyway. */
#define HAVE_BF16_DOTS 1
#define TDOTS __attribute__((target("avx512bf16")))

/* word indices interleaving a zmm's two halves: (lo[0], hi[0], lo[1], hi[1], ...) */
#define PAIRS_IDX _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, \
                                   23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0)

INLINE uint32_t bf16_bits(float x) {          /* round to nearest even (finite x) */
    uint32_t u;
    memcpy(&u, &x, 4);
    return (u + 0x7fff + ((u >> 16) & 1)) >> 16;
}

TDOTS INLINE void dots_item(const int HD, const float *q, float *out, const uint16_t *kc, const uint16_t *vc,
                            const int64_t *table, int64_t ctx, int64_t q_len, int64_t i0, int nq, int g, int n_heads,
                            int n_kv, int bs, float scale, int64_t k_lo, int64_t k_hi, float *part) {
    const int group = n_heads / n_kv, C = HD / 16, E2 = HD / 2;
    const int64_t first_pos = ctx - q_len + i0, row = (int64_t)n_kv * HD;
    const int64_t end = first_pos + nq < k_hi ? first_pos + nq : k_hi;
    const __m512i pairs = PAIRS_IDX;
    int lq[48], lh[48], heads;
    v16 qi[3];
    uint32_t Q2[E2 * 48] __attribute__((aligned(64)));     /* [e / 2][lane]: q[e], q[e + 1] */
    float O[48 * HD] __attribute__((aligned(64)));         /* [head v * 16 + query][e] */
    float P[KT * 48] __attribute__((aligned(64)));         /* [key][head v * 16 + query] */
    uint32_t P2[KT / 2 * 48] __attribute__((aligned(64))); /* [key / 2][row]: p of keys 2j, 2j + 1 */
    uint32_t V2[KT / 2 * HD] __attribute__((aligned(64))); /* [key / 2][e]: V of keys 2j, 2j + 1 */
    for (int h0 = g * group; h0 < (g + 1) * group; h0 += heads) {
        const int NV = map_lanes(nq, group, h0, (g + 1) * group, lq, lh, qi, &heads);
        for (int x = 0; x < 48; x++) {
            const float *qx = lq[x] < 0 ? NULL : q + ((i0 + lq[x]) * n_heads + lh[x]) * HD;
            for (int e = 0; e < E2; e++)
                Q2[e * 48 + x] = qx ? bf16_bits(qx[2 * e] * scale) | bf16_bits(qx[2 * e + 1] * scale) << 16 : 0;
        }
        memset(O, 0, sizeof(float) * 48 * HD);
        v16 m[3], l[3];
        for (int v = 0; v < 3; v++) { m[v] = splat(-INFINITY); l[v] = splat(0.f); }
        for (int64_t k0 = k_lo; k0 < end; k0 += KT) {
            const int nk = (int)(end - k0 < KT ? end - k0 : KT);
            int64_t slot[KT];
            slots_of(table, bs, k0, nk, slot);
            for (int j = nk; j < KT; j++) slot[j] = slot[0];                /* masked below */
            for (int j0 = 0; j0 < KT; j0 += QK_KEYS) {
                const uint32_t *kr[QK_KEYS];
                for (int kk = 0; kk < QK_KEYS; kk++) kr[kk] = (const uint32_t *)(kc + slot[j0 + kk] * row + g * HD);
                __m512 s[QK_KEYS][3];
                for (int kk = 0; kk < QK_KEYS; kk++) for (int v = 0; v < 3; v++) s[kk][v] = _mm512_setzero_ps();
                for (int e = 0; e < E2; e++) {
                    const __m512bh q0 = (__m512bh)_mm512_load_si512(Q2 + e * 48),
                                   q1 = (__m512bh)_mm512_load_si512(Q2 + e * 48 + 16),
                                   q2 = (__m512bh)_mm512_load_si512(Q2 + e * 48 + 32);
                    for (int kk = 0; kk < QK_KEYS; kk++) {
                        const __m512bh kv = (__m512bh)_mm512_set1_epi32((int)kr[kk][e]);
                        s[kk][0] = _mm512_dpbf16_ps(s[kk][0], q0, kv);
                        if (NV > 1) s[kk][1] = _mm512_dpbf16_ps(s[kk][1], q1, kv);
                        if (NV > 2) s[kk][2] = _mm512_dpbf16_ps(s[kk][2], q2, kv);
                    }
                }
                for (int kk = 0; kk < QK_KEYS; kk++)
                    for (int v = 0; v < NV; v++)
                        store_f32(P + (j0 + kk) * 48 + 16 * v,
                                  mask_scores((v16)s[kk][v], j0 + kk, nk, k0 + j0 + kk, first_pos, 0, qi[v]));
            }
            softmax_tile(P, nk, NV, m, l, O, HD);
            /* probabilities and V rows as bf16 pairs of consecutive keys (a key past the tile: 0) */
            const int np = (nk + 1) / 2;
            for (int j = 0; j < np; j++) {
                for (int v = 0; v < NV; v++) {
                    const __m512 a = _mm512_load_ps(P + 2 * j * 48 + 16 * v),
                                 b = 2 * j + 1 < nk ? _mm512_load_ps(P + (2 * j + 1) * 48 + 16 * v) : _mm512_setzero_ps();
                    _mm512_store_si512(P2 + j * 48 + 16 * v,
                                       _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(b, a)));
                }
                const uint16_t *va = vc + slot[2 * j] * row + g * HD, *vb = vc + slot[2 * j + 1] * row + g * HD;
                for (int c = 0; c < C; c++) {
                    const __m256i b = 2 * j + 1 < nk ? _mm256_loadu_si256((const __m256i *)(vb + 16 * c))
                                                     : _mm256_setzero_si256();
                    const __m512i ab = _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(va + 16 * c))), b, 1);
                    _mm512_store_si512(V2 + j * HD + 16 * c, _mm512_permutexvar_epi16(pairs, ab));
                }
            }
            /* O[row] += sum_key P[key][row] V[key], two keys an instruction: 4 rows x C accumulators */
            for (int r = 0; r < NV * 16; r += 4) {
                __m512 a0[C], a1[C], a2[C], a3[C];
                for (int c = 0; c < C; c++) {
                    a0[c] = _mm512_load_ps(O + r * HD + 16 * c); a1[c] = _mm512_load_ps(O + (r + 1) * HD + 16 * c);
                    a2[c] = _mm512_load_ps(O + (r + 2) * HD + 16 * c); a3[c] = _mm512_load_ps(O + (r + 3) * HD + 16 * c);
                }
                for (int j = 0; j < np; j++) {
                    const uint32_t *pj = P2 + j * 48 + r;
                    const __m512bh w0 = (__m512bh)_mm512_set1_epi32((int)pj[0]), w1 = (__m512bh)_mm512_set1_epi32((int)pj[1]),
                                   w2 = (__m512bh)_mm512_set1_epi32((int)pj[2]), w3 = (__m512bh)_mm512_set1_epi32((int)pj[3]);
                    for (int c = 0; c < C; c++) {
                        const __m512bh vv = (__m512bh)_mm512_load_si512(V2 + j * HD + 16 * c);
                        a0[c] = _mm512_dpbf16_ps(a0[c], vv, w0);
                        a1[c] = _mm512_dpbf16_ps(a1[c], vv, w1);
                        a2[c] = _mm512_dpbf16_ps(a2[c], vv, w2);
                        a3[c] = _mm512_dpbf16_ps(a3[c], vv, w3);
                    }
                }
                for (int c = 0; c < C; c++) {
                    _mm512_store_ps(O + r * HD + 16 * c, a0[c]); _mm512_store_ps(O + (r + 1) * HD + 16 * c, a1[c]);
                    _mm512_store_ps(O + (r + 2) * HD + 16 * c, a2[c]); _mm512_store_ps(O + (r + 3) * HD + 16 * c, a3[c]);
                }
            }
        }
        item_out(O, m, l, lq, lh, HD, i0, g * group, n_heads, out, part);
    }
}
#endif

/* Prefill work items (chunk, first query of a 16-query tile, kv head, first key, end of keys, split); a
 * chunk's last tiles see the most keys, so they are handed out first. A chunk of one tile (<= 16 queries:
 * one item per kv head, fewer items than threads) after a long prefix has the keys every query sees (up to
 * its first query's position) cut into ranges of at least SPLIT_KEYS (at most MAX_SPLITS), the last range
 * keeping the causal diagonal, so every thread gets work; merge_prefill combines the ranges' (output, max,
 * sum) as the decode merge does. Longer chunks have items enough (cutting them measured 2-8 % slower on a
 * 4,000-token prompt). The cut follows from the chunk's own length and position only, never from the rest of
 * the step, so a chunk computes the same bits whatever else the step holds (float32's invariance to batch
 * shapes). Not with a window (a range could hide whole lanes). */
#define SPLIT_KEYS 512
#define MAX_SPLITS 4
typedef struct { int64_t p, i0, g, k_lo, k_hi, splits; } pitem_t;

static pitem_t *plan_prefill(const int64_t *cu_q, const int64_t *context_lens, int num_seqs, int n_kv, int window,
                             int *n_items) {
    int n = 0;
    for (int p = 0; p < num_seqs; p++) n += (int)((cu_q[p + 1] - cu_q[p] + QT - 1) / QT) * n_kv;
    pitem_t *items = malloc(sizeof(pitem_t) * (n ? n : 1) * MAX_SPLITS);
    int k = 0;
    for (int p = 0; p < num_seqs; p++)
        for (int64_t i0 = (cu_q[p + 1] - cu_q[p] - 1) / QT * QT; i0 >= 0; i0 -= QT)
            for (int g = 0; g < n_kv; g++) {
                const int64_t seen = context_lens[p] - (cu_q[p + 1] - cu_q[p]) + i0 + 1;   /* keys all lanes see */
                int64_t s = window > 0 || cu_q[p + 1] - cu_q[p] > QT ? 1 : seen / SPLIT_KEYS;
                s = s < 1 ? 1 : s > MAX_SPLITS ? MAX_SPLITS : s;
                for (int64_t r = 0; r < s; r++)
                    items[k++] = (pitem_t){p, i0, g, seen * r / s, r + 1 < s ? seen * (r + 1) / s : INT64_MAX, s};
            }
    *n_items = k;
    return items;
}

/* The ranges of a split item (consecutive in the plan), merged into `out`. */
static void merge_prefill(const pitem_t *items, int n_items, const float *parts, const int64_t *cu_q, float *out,
                          int n_heads, int n_kv, int HD) {
    const int group = n_heads / n_kv;
    const int64_t per = (int64_t)group * QT * (HD + 2);
    for (int k = 0; k < n_items; k += (int)items[k].splits) {
        const pitem_t it = items[k];
        if (it.splits == 1) continue;
        const int64_t q_len = cu_q[it.p + 1] - cu_q[it.p];
        const int nq = (int)(q_len - it.i0 < QT ? q_len - it.i0 : QT);
        for (int hv = 0; hv < group; hv++)
            for (int i = 0; i < nq; i++) {
                float mx = -INFINITY, sum = 0.f;
                for (int r = 0; r < it.splits; r++) {
                    const float mr = parts[(k + r) * per + (hv * QT + i) * (HD + 2) + HD];
                    mx = mr > mx ? mr : mx;
                }
                float *dst = out + ((cu_q[it.p] + it.i0 + i) * n_heads + it.g * group + hv) * HD;
                for (int e = 0; e < HD; e++) dst[e] = 0.f;
                for (int r = 0; r < it.splits; r++) {
                    const float *st = parts + (k + r) * per + (hv * QT + i) * (HD + 2);
                    const float w = st[HD] == -INFINITY ? 0.f : expf(st[HD] - mx);
                    sum += st[HD + 1] * w;
                    for (int e = 0; e < HD; e++) dst[e] += st[e] * w;
                }
                const float inv = 1.f / sum;
                for (int e = 0; e < HD; e++) dst[e] *= inv;
            }
    }
}

/* ------------------------------------------------------------------ entry points, one per (format, hd) */

/* The parallel loops live in these generated functions, not in an inline helper: OpenMP outlines a
 * loop body before inlining, so DT and HD must be literals here for the body to be specialised. */
#define DEFINE_KERNELS(NAME, DT, HD_)                                                                       \
    static void decode_##NAME(const float *q, const void *kc, const void *vc, const float *ks, const float *vs, \
                              const int64_t *block_tables, const int64_t *context_lens, float *out, int num_seqs, \
                              int n_heads, int n_kv, int hd, int bs, int max_blocks, float scale, int window) {   \
        const int HD = HD_ ? HD_ : hd;                                                                      \
        plan_t pl = plan_decode(context_lens, num_seqs, n_heads, HD, window, block_tables, max_blocks, bs);  \
        const int64_t state = (int64_t)n_heads * (HD + 2), per_row = (int64_t)n_heads * HD;                 \
        _Pragma("omp parallel num_threads(pl.threads)") {                                                   \
            float qs[pl.max_rows * n_heads * HD];                                                           \
            _Pragma("omp for schedule(dynamic, 1)")                                                         \
            for (int u = 0; u < pl.n_units; u++) {                                                          \
                const unit_t un = pl.units[u];                                                              \
                int64_t t1[MAX_GROUP];                                                                      \
                float *st[MAX_GROUP];                                                                       \
                for (int r = 0; r < un.rows; r++) {                                                         \
                    const int i = pl.first[un.d + r] + un.j;                                                \
                    const float *qd = q + (int64_t)(un.d + r) * per_row;                                    \
                    for (int e = 0; e < per_row; e++) qs[r * per_row + e] = qd[e] * scale;                  \
                    t1[r] = pl.items[i].t1;                                                                 \
                    st[r] = pl.part + state * i;                                                            \
                }                                                                                           \
                const int last = un.d + un.rows - 1;                                                        \
                decode_range(DT, HD_ ? HD_ : hd, un.rows, qs, kc, vc, ks, vs,                               \
                             block_tables + (int64_t)last * max_blocks, pl.items[pl.first[un.d] + un.j].t0, t1, \
                             n_heads, n_kv, bs, st);                                                        \
            }                                                                                               \
            _Pragma("omp for schedule(static)")                                                             \
            for (int d = 0; d < num_seqs; d++) merge_decode(&pl, out, d, n_heads, HD);                      \
        }                                                                                                   \
        free_plan(&pl);                                                                                     \
    }                                                                                                       \
    static void prefill_##NAME(const float *q, const void *kc, const void *vc, const float *ks, const float *vs, \
                               const int64_t *block_tables, const int64_t *cu_q, const int64_t *context_lens,    \
                               float *out, int num_seqs, int n_heads, int n_kv, int hd, int bs, int max_blocks, \
                               float scale, int window) {                                                   \
        PREFILL_LOOP(prefill_item(DT, HD_ ? HD_ : hd, q + cu_q[p] * n_heads * hd, out + cu_q[p] * n_heads * hd, \
                                  kc, vc, ks, vs, block_tables + (int64_t)p * max_blocks, context_lens[p], q_len, \
                                  i0, nq, g, n_heads, n_kv, bs, scale, window, it.k_lo, it.k_hi, part))     \
    }

/* Every prefill item of the step in parallel (ITEM: one item's call, reading p, g, i0, q_len, nq, it and
 * part, its split state or NULL), then the split items merged. */
#define PREFILL_LOOP(ITEM)                                                                                  \
    int n_items;                                                                                            \
    pitem_t *items = plan_prefill(cu_q, context_lens, num_seqs, n_kv, window, &n_items);                   \
    const int64_t per = (int64_t)(n_heads / n_kv) * QT * (hd + 2);                                        \
    float *parts = NULL;                    /* split items' (output, max, sum): only when there are some */ \
    for (int i = 0; i < n_items && !parts; i++)                                                             \
        if (items[i].splits > 1) parts = malloc(sizeof(float) * per * n_items);                             \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(THREADS)")                                   \
    for (int i = 0; i < n_items; i++) {                                                                     \
        const pitem_t it = items[i];                                                                        \
        const int p = (int)it.p, g = (int)it.g;                                                             \
        const int64_t i0 = it.i0, q_len = cu_q[p + 1] - cu_q[p];                                            \
        const int nq = (int)(q_len - i0 < QT ? q_len - i0 : QT);                                            \
        float *part = it.splits > 1 ? parts + per * i : NULL;                                               \
        ITEM;                                                                                               \
    }                                                                                                       \
    if (parts) merge_prefill(items, n_items, parts, cu_q, out, n_heads, n_kv, hd);                          \
    free(parts);                                                                                            \
    free(items);

DEFINE_KERNELS(f32_64, KV_F32, 64)
DEFINE_KERNELS(f32_128, KV_F32, 128)
DEFINE_KERNELS(f32_any, KV_F32, 0)
DEFINE_KERNELS(bf16_64, KV_BF16, 64)
DEFINE_KERNELS(bf16_128, KV_BF16, 128)
DEFINE_KERNELS(bf16_any, KV_BF16, 0)
DEFINE_KERNELS(i8_64, KV_I8, 64)
DEFINE_KERNELS(i8_128, KV_I8, 128)
DEFINE_KERNELS(i8_any, KV_I8, 0)

#ifdef HAVE_BF16_DOTS
#define DEFINE_DOTS(HD_)                                                                                   \
    TDOTS static void prefill_dots_##HD_(const float *q, const void *kc, const void *vc, const int64_t *block_tables, \
                                         const int64_t *cu_q, const int64_t *context_lens, float *out, int num_seqs, \
                                         int n_heads, int n_kv, int hd, int bs, int max_blocks, float scale) {      \
        const int window = 0;                                                                               \
        PREFILL_LOOP(dots_item(HD_, q + cu_q[p] * n_heads * hd, out + cu_q[p] * n_heads * hd, kc, vc,       \
                               block_tables + (int64_t)p * max_blocks, context_lens[p], q_len, i0, nq, g, n_heads, \
                               n_kv, bs, scale, it.k_lo, it.k_hi, part))                                    \
    }
DEFINE_DOTS(64)
DEFINE_DOTS(128)
#endif

/* Whether KV_BF16_DOT prefill runs dots_item here: an AVX-512 build on a host with AVX512-BF16. */
int paged_attention_bf16_dots(void) {
#ifdef HAVE_BF16_DOTS
    return __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

#define PICK(KIND, dt, hd)                                                                           \
    (dt == KV_F32 ? (hd == 64 ? KIND##_f32_64 : hd == 128 ? KIND##_f32_128 : KIND##_f32_any)         \
     : dt == KV_BF16 ? (hd == 64 ? KIND##_bf16_64 : hd == 128 ? KIND##_bf16_128 : KIND##_bf16_any)   \
     : (hd == 64 ? KIND##_i8_64 : hd == 128 ? KIND##_i8_128 : KIND##_i8_any))

/* q, out: (num_seqs, n_heads, head_dim) float32; head_dim a multiple of 16, at most 256 */
void paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, const float *k_scale,
                            const float *v_scale, int kv_dtype, const int64_t *block_tables,
                            const int64_t *context_lens, float *out, int num_seqs, int n_heads, int n_kv,
                            int head_dim, int block_size, int max_blocks, float scale, int window) {
    PICK(decode, kv_dtype, head_dim)(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, out,
                                     num_seqs, n_heads, n_kv, head_dim, block_size, max_blocks, scale, window);
}

/* q, out: (cu_q[num_seqs], n_heads, head_dim) float32; chunk p owns rows cu_q[p]..cu_q[p+1]-1, the
 * last q_len of its context_lens[p] positions (its K/V already written to the cache). */
void paged_prefill_attention(const float *q, const void *k_cache, const void *v_cache, const float *k_scale,
                             const float *v_scale, int kv_dtype, const int64_t *block_tables, const int64_t *cu_q,
                             const int64_t *context_lens, float *out, int num_seqs, int n_heads, int n_kv,
                             int head_dim, int block_size, int max_blocks, float scale, int window) {
    if (kv_dtype == KV_BF16_DOT) {
#ifdef HAVE_BF16_DOTS
        if (!window && (head_dim == 64 || head_dim == 128) && paged_attention_bf16_dots()) {
            (head_dim == 64 ? prefill_dots_64 : prefill_dots_128)(q, k_cache, v_cache, block_tables, cu_q,
                                                                   context_lens, out, num_seqs, n_heads, n_kv,
                                                                   head_dim, block_size, max_blocks, scale);
            return;
        }
#endif
        kv_dtype = KV_BF16;
    }
    PICK(prefill, kv_dtype, head_dim)(q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_q, context_lens,
                                      out, num_seqs, n_heads, n_kv, head_dim, block_size, max_blocks, scale, window);
}

DEFINE_ISA(paged_attention_isa)
