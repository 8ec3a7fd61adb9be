/* Matrix products with quantized weights, read in the file's own packed blocks.
 *
 * A weight matrix is N rows (output channels) of K inputs; each row is `row_bytes` bytes of blocks:
 *   W_I8    our per-channel int8: [float32 scale][K x int8]           w = scale * q
 *   W_Q8_0  34-byte blocks of 32: f16 d, 32 x int8                   w = d * q
 *   W_Q4_0  18-byte blocks of 32: f16 d, 16 bytes of nibbles         w = d * (q - 8)
 *   W_Q4_1  20-byte blocks of 32: f16 d, f16 m, 16 bytes of nibbles  w = d * q + m
 *   W_Q4_K  144-byte super-blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs for
 *           8 sub-blocks of 32, 128 bytes of nibbles                 w = d * sc * q - dmin * mn
 *   W_Q6_K  210-byte super-blocks of 256: 128 bytes low nibbles, 64 bytes of high 2-bit pairs,
 *           16 int8 scales (one per 16), f16 d                       w = d * sc * (q - 32)
 * (the layouts of ggml's block_q8_0 ... block_q6_K; nibble j of a 32-block holds element j in its
 * low half and element j + 16 in its high half).
 *
 * qmatmul:  out[m, n] = sum_k x[m, k] * w[n, k] for a few rows of x (decode steps): every 32 weights
 *           are widened and scaled in registers once and multiplied with all M rows; the weights are
 *           read once per call, so a one-row step reads ~5 bits per weight instead of 32.
 * qdequant: rows of the matrix (all, or a list: embedding lookups) written out as float32 or
 *           bfloat16, for GEMMs of many rows done by torch (AMX / AVX512-BF16 where the CPU has it).
 *
 * Vectors are GCC vector extensions of 16 lanes (one zmm with AVX-512, two ymm with AVX2); the
 * source is built per ISA level like paged_attention.c. */
#include "vec16.h"

enum { W_I8 = 0, W_Q8_0 = 1, W_Q4_0 = 2, W_Q4_1 = 3, W_Q4_K = 4, W_Q6_K = 5,
       W_Q4_0X8 = 6, W_Q4_1X8 = 7, W_Q8_0X8 = 8, W_I8X8 = 9, W_Q4_KX8 = 10, W_Q6_KX8 = 11,    /* 8-row groups: qmatmul_q8 and qdequant only */
       W_Q5_0X8 = 12,
       W_Q5_0 = 13 };   /* GGUF's Q5_0 rows: only as Q5_0x8's rows unpacked for qdequant (the loader keeps Q5_0 files as Q8_0) */

DEFINE_SET_THREADS(qmatmul_set_threads)

typedef uint16_t v16h __attribute__((vector_size(32)));

#define MAXM 8
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8
#endif


static float f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, u;
    float f;
    if (e == 31) u = s | 0x7f800000u | (m << 13);
    else if (e) u = s | ((e + 112) << 23) | (m << 13);
    else if (!m) u = s;
    else { f = (float)m * (1.0f / 16777216.0f); memcpy(&u, &f, 4); u |= s; }
    memcpy(&f, &u, 4);
    return f;
}

/* every float16 as float32 (256 KiB, as ggml does): a block's scale is then one load that the
 * broadcast takes straight from memory; converting in registers (insert, vcvtph2ps, broadcast) put
 * ~5 uops per block on the shuffle port, which bounded the whole kernel */
static float F16[65536];
__attribute__((constructor)) static void init_f16(void) {
    for (int h = 0; h < 65536; h++) F16[h] = f16_to_f32((uint16_t)h);
}

INLINE float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return F16[h];
}

/* Q4_K: the 6-bit (scale, min) of sub-block j of 8, as ggml's get_scale_min_k4 */
INLINE void q4k_scale_min(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* weights 32j .. 32j+31 of a row as two vectors (W_I8 unscaled: the row's scale is applied once) */
INLINE void deq32(int fmt, const uint8_t *row, int j, v16 *lo, v16 *hi) {
    if (fmt == W_I8) {
        const uint8_t *q = row + 4 + 32 * (int64_t)j;
        *lo = cvt(s8x16(q));
        *hi = cvt(s8x16(q + 16));
    } else if (fmt == W_Q8_0) {
        const uint8_t *b = row + 34 * (int64_t)j;
        v16 d = splat(f16(b));
        *lo = d * cvt(s8x16(b + 2));
        *hi = d * cvt(s8x16(b + 18));
    } else if (fmt == W_Q4_0) {
        const uint8_t *b = row + 18 * (int64_t)j;
        v16 d = splat(f16(b));
        v16i u = u8x16(b + 2);
        *lo = d * cvt((u & 15) - 8);
        *hi = d * cvt((u >> 4) - 8);
    } else if (fmt == W_Q4_1) {
        const uint8_t *b = row + 20 * (int64_t)j;
        v16 d = splat(f16(b)), m = splat(f16(b + 2));
        v16i u = u8x16(b + 4);
        *lo = d * cvt(u & 15) + m;
        *hi = d * cvt(u >> 4) + m;
    } else if (fmt == W_Q4_K) {
        const uint8_t *b = row + 144 * (int64_t)(j >> 3);
        int s = j & 7, sc, mn;
        q4k_scale_min(b + 4, s, &sc, &mn);
        v16 d = splat(f16(b) * (float)sc), m = splat(f16(b + 2) * (float)mn);
        const uint8_t *q = b + 16 + 32 * (s >> 1);
        int sh = (s & 1) * 4;
        *lo = d * cvt((u8x16(q) >> sh) & 15) - m;
        *hi = d * cvt((u8x16(q + 16) >> sh) & 15) - m;
    } else if (fmt == W_Q5_0) {     /* 22-byte blocks: f16 d, u32 high bits, 16 bytes of nibbles: w = d (q - 16) */
        const uint8_t *b = row + 22 * (int64_t)j;
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        const v16i e = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        const v16i u = u8x16(b + 6), hl = (v16i){} + (int32_t)(qh & 0xffff), hh = (v16i){} + (int32_t)(qh >> 16);
        v16 d = splat(f16(b));
        *lo = d * cvt(((u & 15) | (((hl >> e) & 1) << 4)) - 16);
        *hi = d * cvt(((u >> 4) | (((hh >> e) & 1) << 4)) - 16);
    } else { /* W_Q6_K */
        const uint8_t *b = row + 210 * (int64_t)(j >> 3);
        int s = j & 7, h = s >> 2, t = s & 3;
        const uint8_t *ql = b + 64 * h + (t & 1) * 32, *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * t;
        float d = f16(b + 208);
        int shl = (t >> 1) * 4, shh = 2 * t;
        v16i q0 = ((u8x16(ql) >> shl) & 15) | (((u8x16(qh) >> shh) & 3) << 4);
        v16i q1 = ((u8x16(ql + 16) >> shl) & 15) | (((u8x16(qh + 16) >> shh) & 3) << 4);
        *lo = splat(d * sc[0]) * cvt(q0 - 32);
        *hi = splat(d * sc[1]) * cvt(q1 - 32);
    }
}

INLINE float row_scale(int fmt, const uint8_t *row) {
    float s = 1.0f;
    if (fmt == W_I8) memcpy(&s, row, 4);
    return s;
}

/* Q8_0 / Q4_0 / Q4_1 are affine per 32-block, w = d * q + m, so a block's dot product with x is
 * d * (q . x) + m * sum(x): the scale is applied once per block, not per weight, and m * sum(x) is
 * scalar work (sum(x) per block computed once per call). Fewer 512-bit uops per weight: on two cores
 * this kernel is bound by them, not by memory, once the rows are prefetched. */
INLINE void affine32(int fmt, const uint8_t *row, int j, v16 *qlo, v16 *qhi, float *d, float *m) {
    if (fmt == W_Q8_0) {
        const uint8_t *b = row + 34 * (int64_t)j;
        *d = f16(b), *m = 0.0f;
        *qlo = cvt(s8x16(b + 2));
        *qhi = cvt(s8x16(b + 18));
    } else {
        const uint8_t *b = row + (fmt == W_Q4_1 ? 20 : 18) * (int64_t)j;
        *d = f16(b);
        *m = fmt == W_Q4_1 ? f16(b + 2) : -8.0f * *d;
        v16i u = u8x16(b + (fmt == W_Q4_1 ? 4 : 2));
        *qlo = cvt(u & 15);
        *qhi = cvt(u >> 4);
    }
}

#define IS_AFFINE(fmt) ((fmt) == W_Q8_0 || (fmt) == W_Q4_0 || (fmt) == W_Q4_1)

/* rows n0..n1 of out = x (M x K) . W^T, M a compile-time constant; sx: the sum of each 32-block of x.
 * The m loops are unrolled (M is a constant) so the accumulators live in registers: kept in an array
 * on the stack, each block paid a store-to-load round trip (~9 cycles per 32 weights). */
INLINE void dot_rows(int fmt, int M, const float *x, int ldx, const float *sx, int K, const uint8_t *w,
                     int64_t row_bytes, float *out, int ldo, int n0, int n1) {
    const int nb = K / 32;
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (int64_t)n * row_bytes;
        /* ask for the row PREFETCH_ROWS ahead: one row is a few hundred bytes, too short a stream for
         * the hardware prefetcher to reach full speed (cold weights ran at 1/5 of the read bandwidth) */
        const uint8_t *ahead = row + PREFETCH_ROWS * row_bytes;
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 0);
        v16 acc[MAXM];
        float mins[MAXM];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = splat(0.0f), mins[m] = 0.0f;
        for (int j = 0; j < nb; j++) {
            v16 lo, hi;
            if (IS_AFFINE(fmt)) {
                float d, mn;
                affine32(fmt, row, j, &lo, &hi, &d, &mn);
                v16 dv = splat(d);
#pragma GCC unroll 8
                for (int m = 0; m < M; m++) {
                    const float *xr = x + (int64_t)m * ldx + 32 * j;
                    acc[m] += (lo * load_f32(xr) + hi * load_f32(xr + 16)) * dv;
                    if (fmt != W_Q8_0) mins[m] += mn * sx[m * nb + j];
                }
            } else {
                deq32(fmt, row, j, &lo, &hi);
#pragma GCC unroll 8
                for (int m = 0; m < M; m++) {
                    const float *xr = x + (int64_t)m * ldx + 32 * j;
                    acc[m] += lo * load_f32(xr) + hi * load_f32(xr + 16);
                }
            }
        }
        float s = row_scale(fmt, row);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) out[(int64_t)m * ldo + n] = s * hsum(acc[m]) + mins[m];
    }
}

#define DOT_M(fmt)                                                                                       \
    static void dot_##fmt(int M, const float *x, int ldx, const float *sx, int K, const uint8_t *w,        \
                          int64_t rb, float *out, int ldo, int n0, int n1) {                             \
        switch (M) {                                                                                     \
        case 1: dot_rows(fmt, 1, x, ldx, sx, K, w, rb, out, ldo, n0, n1); break;                             \
        case 2: dot_rows(fmt, 2, x, ldx, sx, K, w, rb, out, ldo, n0, n1); break;                             \
        case 3: dot_rows(fmt, 3, x, ldx, sx, K, w, rb, out, ldo, n0, n1); break;                             \
        case 4: dot_rows(fmt, 4, x, ldx, sx, K, w, rb, out, ldo, n0, n1); break;                             \
        case 5: dot_rows(fmt, 5, x, ldx, sx, K, w, rb, out, ldo, n0, n1); break;                             \
        case 6: dot_rows(fmt, 6, x, ldx, sx, K, w, rb, out, ldo, n0, n1); break;                             \
        case 7: dot_rows(fmt, 7, x, ldx, sx, K, w, rb, out, ldo, n0, n1); break;                             \
        default: dot_rows(fmt, 8, x, ldx, sx, K, w, rb, out, ldo, n0, n1); break;                            \
        }                                                                                                \
    }
DOT_M(W_I8)
DOT_M(W_Q8_0)
DOT_M(W_Q4_0)
DOT_M(W_Q4_1)
DOT_M(W_Q4_K)
DOT_M(W_Q6_K)

typedef void (*dot_fn)(int, const float *, int, const float *, int, const uint8_t *, int64_t, float *, int, int,
                       int);
static const dot_fn DOT[] = {dot_W_I8, dot_W_Q8_0, dot_W_Q4_0, dot_W_Q4_1, dot_W_Q4_K, dot_W_Q6_K};

/* out (M x N, row stride ldo) = x (M x K, row stride ldx, float32) . W^T; any M (taken MAXM rows at a
 * time, so the weights are read ceil(M / MAXM) times) */
void qmatmul(const float *x, int M, int ldx, int K, const uint8_t *w, int fmt, int N, int64_t row_bytes,
             float *out, int ldo) {
    if (fmt > W_Q6_K) return;                  /* 8-row groups are int8-activation only (Python refuses first) */
    dot_fn f = DOT[fmt];
    const int chunk = 16;                      /* rows of W per work item */
    const int items = (N + chunk - 1) / chunk, nb = K / 32;
    float *sx = malloc(sizeof(float) * (size_t)M * nb);
    if (!sx) return;
    for (int m = 0; m < M; m++)
        for (int j = 0; j < nb; j++) sx[m * nb + j] = hsum(load_f32(x + (int64_t)m * ldx + 32 * j) +
                                                         load_f32(x + (int64_t)m * ldx + 32 * j + 16));
#pragma omp parallel for num_threads(THREADS) schedule(static)
    for (int it = 0; it < items; it++) {
        int n0 = it * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        for (int m0 = 0; m0 < M; m0 += MAXM)
            f(M - m0 < MAXM ? M - m0 : MAXM, x + (int64_t)m0 * ldx, ldx, sx + (int64_t)m0 * nb, K, w, row_bytes,
              out + (int64_t)m0 * ldo, ldo, n0, n1);
    }
    free(sx);
}

INLINE void store_row(v16 v, void *out, int64_t i, int bf16) {
    if (!bf16) {
        memcpy((float *)out + i, &v, sizeof v);
        return;
    }
    v16u u = (v16u)v;                          /* round to nearest even, as torch's .to(bfloat16) */
    u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16((__m512i)u));
#else
    v16h h = __builtin_convertvector(u, v16h);
    memcpy((uint16_t *)out + i, &h, sizeof h);
#endif
}

static void deq_row(int fmt, const uint8_t *row, int K, void *out, int64_t o, int bf16) {
    v16 s = splat(row_scale(fmt, row));
    for (int j = 0; j < K / 32; j++) {
        v16 lo, hi;
        deq32(fmt, row, j, &lo, &hi);
        store_row(lo * s, out, o + 32 * j, bf16);
        store_row(hi * s, out, o + 32 * j + 16, bf16);
    }
}

#define DEQ_FMT(fmt)                                                                                     \
    static void deq_##fmt(const uint8_t *w, int K, int64_t rb, const int64_t *rows, int n, void *out,    \
                          int bf16) {                                                                    \
        _Pragma("omp parallel for num_threads(THREADS) schedule(static)")                                \
        for (int i = 0; i < n; i++)                                                                      \
            deq_row(fmt, w + (rows ? rows[i] : i) * rb, K, out, (int64_t)i * K, bf16);                   \
    }
DEQ_FMT(W_I8)
DEQ_FMT(W_Q8_0)
DEQ_FMT(W_Q4_0)
DEQ_FMT(W_Q4_1)
DEQ_FMT(W_Q4_K)
DEQ_FMT(W_Q6_K)

typedef void (*deq_fn)(const uint8_t *, int, int64_t, const int64_t *, int, void *, int);
static const deq_fn DEQ[] = {deq_W_I8, deq_W_Q8_0, deq_W_Q4_0, deq_W_Q4_1, deq_W_Q4_K, deq_W_Q6_K};


/* ---- int8 activations: qmatmul_q8 ------------------------------------------------------------------
 * For --dtype bfloat16 / float16 (activations are rounded anyway) the rows of x are rounded to int8 per
 * 32 values as GGUF's Q8 blocks (d = max|x| / 127, q = round(x / d)), and each 32-block of weights is
 * multiplied with them in integers: u8 x s8 products summed by `vpdpbusd` where the CPU has VNNI
 * (AVX512-VNNI or AVX-VNNI: 32 multiply-adds per 256-bit uop), `vpmaddubsw` + `vpmaddwd` on AVX2, a
 * scalar loop otherwise. A block's result is then one int32 -> float convert and one multiply-add with
 * d_w * d_x per row, where the float path widens and converts every weight (~8 uops per 32 weights).
 * Weights as unsigned bytes u with w = d * u + m (Q4_0: u = q, m = -8 d; Q4_1: m from the block;
 * Q4_K: d * sc, -dmin * mn; Q6_K: per-16 scales, m = -32 d sc), so sum_k w x = d dx sum(u q) + m dx sum(q);
 * Q8_0 and our int8 are signed and use |w| with the sign moved onto q (no u8 x s8 overflow: |q| <= 127).
 * The pair sums of vpmaddubsw stay within int16: 2 x 63 x 127 at most. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_DOT_ISA "vnni512"
#define Q8_VNNI 1
#elif defined(__AVXVNNI__)
#define Q8_DOT_ISA "avxvnni"
#define Q8_VNNI 1
#elif defined(__AVX2__)
#define Q8_DOT_ISA "maddubs"
#define Q8_VNNI 0
#else
#define Q8_DOT_ISA "scalar"
#define Q8_VNNI 0
#endif

/* the products' instruction this build uses, for the log and the tests */
const char *qmatmul_q8_isa(void) { return Q8_DOT_ISA; }

typedef struct {
    const int8_t *q;    /* M x K, row stride K */
    const float *d;     /* M x nb: each block's scale */
    const float *ds;    /* M x nb: d * sum(q) of each block (the m term) */
    const int32_t *s16; /* M x K/16: 32 x the sum of q over each 16 (Q6_Kx8's -32; NULL for the others) */
    const int32_t *xe;  /* M x 2K: q widened for x8w_rows (NULL where it is not taken) */
} q8rows;

/* x (M x K float32) -> int8 blocks of 32 */
static void quantize_q8(const float *x, int M, int ldx, int K, int8_t *q, float *d, float *ds) {
    const int nb = K / 32;
    for (int m = 0; m < M; m++)
        for (int j = 0; j < nb; j++) {
            const float *xb = x + (int64_t)m * ldx + 32 * j;
            int8_t *qb = q + (int64_t)m * K + 32 * j;
#if defined(__AVX2__)
            __m256 v[4], amax = _mm256_setzero_ps();
            const __m256 sign = _mm256_set1_ps(-0.0f);
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 h = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            float mx = _mm_cvtss_f32(h), dd = mx / 127.0f;
            const __m256 id = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id));
            /* the block's sum (two halves), for the m terms */
            __m256i lo = _mm256_add_epi32(i0, i1), hi = _mm256_add_epi32(i2, i3);
            __m128i l4 = _mm_add_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
            __m128i h4 = _mm_add_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
            __m128i sums = _mm_hadd_epi32(_mm_hadd_epi32(l4, h4), _mm_setzero_si128());
            int32_t a = _mm_extract_epi32(sums, 0), b = _mm_extract_epi32(sums, 1);
            /* int32 -> int8 in element order (the packs interleave the 128-bit lanes) */
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)qb, p);
#else
            float mx = 0.0f;
            for (int i = 0; i < 32; i++) mx = fmaxf(mx, fabsf(xb[i]));
            float dd = mx / 127.0f, id = mx > 0.0f ? 127.0f / mx : 0.0f;
            int32_t a = 0, b = 0;
            for (int i = 0; i < 32; i++) {
                int v = (int)nearbyintf(xb[i] * id);
                qb[i] = (int8_t)v;
                if (i < 16) a += v; else b += v;
            }
#endif
            d[m * nb + j] = dd;
            ds[m * nb + j] = dd * (float)(a + b);
        }
}

/* block j of a row: its 32 weights as bytes (unsigned, or signed for Q8_0 / I8), its scale d, m term and
 * the two per-16 scales (Q6_K; 1 otherwise) */
INLINE void weight_block(int fmt, const uint8_t *row, int j, uint8_t *u, float *d, float *mn, int16_t *sc) {
    sc[0] = sc[1] = 1;
    if (fmt == W_I8 || fmt == W_Q8_0) {
        const uint8_t *q = fmt == W_I8 ? row + 4 + 32 * (int64_t)j : row + 34 * (int64_t)j + 2;
        memcpy(u, q, 32);
        *d = fmt == W_I8 ? 1.0f : f16(row + 34 * (int64_t)j), *mn = 0.0f;
    } else if (fmt == W_Q4_0 || fmt == W_Q4_1) {
        const uint8_t *b = row + (fmt == W_Q4_1 ? 20 : 18) * (int64_t)j, *q = b + (fmt == W_Q4_1 ? 4 : 2);
        for (int i = 0; i < 16; i++) u[i] = q[i] & 15, u[i + 16] = q[i] >> 4;
        *d = f16(b);
        *mn = fmt == W_Q4_1 ? f16(b + 2) : -8.0f * *d;
    } else if (fmt == W_Q4_K) {
        const uint8_t *b = row + 144 * (int64_t)(j >> 3);
        int s = j & 7, isc, imn;
        q4k_scale_min(b + 4, s, &isc, &imn);
        const uint8_t *q = b + 16 + 32 * (s >> 1);
        for (int i = 0; i < 32; i++) u[i] = (q[i] >> ((s & 1) * 4)) & 15;
        *d = f16(b) * (float)isc, *mn = -f16(b + 2) * (float)imn;
    } else { /* W_Q6_K: u = q in 0..63, w = d * sc * (u - 32) */
        const uint8_t *b = row + 210 * (int64_t)(j >> 3);
        int s = j & 7, h = s >> 2, t = s & 3;
        const uint8_t *ql = b + 64 * h + (t & 1) * 32, *qh = b + 128 + 32 * h;
        for (int i = 0; i < 32; i++) u[i] = ((ql[i] >> ((t >> 1) * 4)) & 15) | (((qh[i] >> (2 * t)) & 3) << 4);
        const int8_t *s8 = (const int8_t *)(b + 192) + 8 * h + 2 * t;
        sc[0] = s8[0], sc[1] = s8[1];
        *d = f16(b + 208), *mn = 0.0f;      /* the -32 is taken in the integers, see q8_rows */
    }
}

#if defined(__AVX2__)
/* acc + 8 int32 sums of 4 adjacent u8 x s8 products */
INLINE __m256i dpb(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* 8 int32: sums of 4 adjacent u8 x s8 products */
INLINE __m256i dot_u8s8(__m256i u, __m256i s) { return dpb(_mm256_setzero_si256(), u, s); }

/* the block's weights as 32 bytes in a register, straight from the packed layout */
INLINE __m256i weight_bytes(int fmt, const uint8_t *row, int j, float *d, float *mn, int16_t *sc) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (fmt == W_I8 || fmt == W_Q8_0) {
        const uint8_t *q = fmt == W_I8 ? row + 4 + 32 * (int64_t)j : row + 34 * (int64_t)j + 2;
        *d = fmt == W_I8 ? 1.0f : f16(row + 34 * (int64_t)j), *mn = 0.0f;
        return _mm256_loadu_si256((const __m256i *)q);
    }
    if (fmt == W_Q4_0 || fmt == W_Q4_1) {
        const uint8_t *b = row + (fmt == W_Q4_1 ? 20 : 18) * (int64_t)j;
        __m128i q = _mm_loadu_si128((const __m128i *)(b + (fmt == W_Q4_1 ? 4 : 2)));
        *d = f16(b);
        *mn = fmt == W_Q4_1 ? f16(b + 2) : -8.0f * *d;
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low4);
    }
    if (fmt == W_Q4_K) {
        const uint8_t *b = row + 144 * (int64_t)(j >> 3);
        int s = j & 7, isc, imn;
        q4k_scale_min(b + 4, s, &isc, &imn);
        *d = f16(b) * (float)isc, *mn = -f16(b + 2) * (float)imn;
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (s >> 1)));
        return _mm256_and_si256(_mm256_srli_epi16(q, (s & 1) * 4), low4);
    }
    const uint8_t *b = row + 210 * (int64_t)(j >> 3);
    int s = j & 7, h = s >> 2, t = s & 3;
    __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + (t & 1) * 32));
    __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    ql = _mm256_and_si256(_mm256_srli_epi16(ql, (t >> 1) * 4), low4);
    qh = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), _mm256_set1_epi8(3));
    const int8_t *s8 = (const int8_t *)(b + 192) + 8 * h + 2 * t;
    sc[0] = s8[0], sc[1] = s8[1];
    *d = f16(b + 208), *mn = 0.0f;
    return _mm256_or_si256(ql, _mm256_slli_epi16(qh, 4));
}
#endif

/* the block's m term for row block b of x: m dx sum(q) (Q6_K's -32 offset is taken in the integers) */
INLINE float m_term(q8rows x, int b, float mn) { return mn != 0.0f ? mn * x.ds[b] : 0.0f; }

/* rows n0..n1 of out = x . W^T with x as int8 blocks; M a compile-time constant as in dot_rows */
INLINE void q8_rows(int fmt, int M, q8rows x, int K, const uint8_t *w, int64_t row_bytes, float *out, int ldo,
                    int n0, int n1) {
    const int nb = K / 32;
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (int64_t)n * row_bytes;
        const uint8_t *ahead = row + PREFETCH_ROWS * row_bytes;
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 0);
        float mins[MAXM];
#if defined(__AVX2__)
        __m256 acc[MAXM];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps(), mins[m] = 0.0f;
        for (int j = 0; j < nb; j++) {
            float d, mn;
            int16_t sc[2] = {1, 1};
            __m256i u = weight_bytes(fmt, row, j, &d, &mn, sc);
            const __m256i sc16 = _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0]));
            const int sgn = fmt == W_I8 || fmt == W_Q8_0;
            __m256i au = sgn ? _mm256_sign_epi8(u, u) : u;
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(x.q + (int64_t)m * K + 32 * j));
                __m256i p;
                if (fmt == W_Q6_K)      /* sum((u - 32) q) per pair in int16, exact: no float cancellation */
                    p = _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(au, q),
                                                           _mm256_maddubs_epi16(_mm256_set1_epi8(32), q)), sc16);
                else
                    p = dot_u8s8(au, sgn ? _mm256_sign_epi8(q, u) : q);
                float dx = x.d[m * nb + j];
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx), acc[m]);
                mins[m] += m_term(x, m * nb + j, mn);
            }
        }
        float s = row_scale(fmt, row);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) out[(int64_t)m * ldo + n] = s * hsum8(acc[m]) + mins[m];
#else
        float acc[MAXM];
        for (int m = 0; m < M; m++) acc[m] = 0.0f, mins[m] = 0.0f;
        for (int j = 0; j < nb; j++) {
            uint8_t u[32];
            float d, mn;
            int16_t sc[2];
            weight_block(fmt, row, j, u, &d, &mn, sc);
            const int sgn = fmt == W_I8 || fmt == W_Q8_0;
            for (int m = 0; m < M; m++) {
                const int8_t *q = x.q + (int64_t)m * K + 32 * j;
                int32_t p = 0;
                for (int i = 0; i < 32; i++)
                    p += (sgn ? (int8_t)u[i] : fmt == W_Q6_K ? (int)u[i] - 32 : (int)u[i]) * q[i] * sc[i >> 4];
                float dx = x.d[m * nb + j];
                acc[m] += (float)p * d * dx;
                mins[m] += m_term(x, m * nb + j, mn);
            }
        }
        float s = row_scale(fmt, row);
        for (int m = 0; m < M; m++) out[(int64_t)m * ldo + n] = s * acc[m] + mins[m];
#endif
    }
}

/* q8_<fmt>(M, ...): the kernel with M as a compile-time constant (1..8), as dot_rows' DOT_M */
#define BY_M(fmt, kernel)                                                                                \
    static void q8_##fmt(int M, q8rows x, int K, const uint8_t *w, int64_t rb, float *out, int ldo, int n0,    \
                         int n1) {                                                                       \
        switch (M) {                                                                                     \
        case 1: kernel(fmt, 1, x, K, w, rb, out, ldo, n0, n1); break;                                      \
        case 2: kernel(fmt, 2, x, K, w, rb, out, ldo, n0, n1); break;                                      \
        case 3: kernel(fmt, 3, x, K, w, rb, out, ldo, n0, n1); break;                                      \
        case 4: kernel(fmt, 4, x, K, w, rb, out, ldo, n0, n1); break;                                      \
        case 5: kernel(fmt, 5, x, K, w, rb, out, ldo, n0, n1); break;                                      \
        case 6: kernel(fmt, 6, x, K, w, rb, out, ldo, n0, n1); break;                                      \
        case 7: kernel(fmt, 7, x, K, w, rb, out, ldo, n0, n1); break;                                      \
        default: kernel(fmt, 8, x, K, w, rb, out, ldo, n0, n1); break;                                     \
        }                                                                                                \
    }
#define Q8_M(fmt) BY_M(fmt, q8_rows)
Q8_M(W_I8)
Q8_M(W_Q8_0)
Q8_M(W_Q4_0)
Q8_M(W_Q4_1)
Q8_M(W_Q4_K)
Q8_M(W_Q6_K)

/* ---- 8-row groups for int8 activations: Q4_0x8, Q4_1x8, Q8_0x8, I8x8 ------------------------------
 * For qmatmul_q8 the 4- and 8-bit formats' rows are interleaved at load in groups of 8 output rows
 * (PackedWeight.interleave, as ggml's Q4_0_8x8 repacking): per 32-block, the 8 rows' f16 scales d
 * (16 bytes), Q4_1's 8 f16 minima m (16 bytes), then the weights as 32-byte vectors V_p (p = 0..7) whose
 * 4-byte lane c holds row c's elements 4p .. 4p+3 as unsigned bytes. Q4: 4 chunks of 32 bytes, chunk h's
 * lane c = row c's file bytes 4h .. 4h+3 unchanged, so V_h is a chunk's low nibbles and V_{h+4} its high
 * ones; Q8_0: 8 chunks of the int8 weights + 128 (w = d (u - 128), like Q4_0's d (u - 8)). One vpdpbusd
 * then multiplies 4 inputs of an x row (broadcast) with 8 output rows: a block of 8 outputs is 8
 * dot-product uops, a convert and three multiply(-add)s per x row, where q8_rows spends ~6 uops per
 * output row (its per-block convert, scale broadcast and m term), and 8 outputs are one store, not 8
 * horizontal sums. A group's block is 8 file blocks' bytes, so the matrix keeps its size and row_bytes.
 * I8x8 (our per-channel int8): the group starts with the 8 rows' float32 scales (32 bytes), then per
 * 32-block the 8 chunks of weights + 128 as Q8_0's, without per-block scales (d = 1; the row scale is
 * applied once at the end). */
/* the file format an 8-row layout came from */
INLINE int x8_base(int fmt) {
    return fmt == W_Q4_0X8 ? W_Q4_0 : fmt == W_Q4_1X8 ? W_Q4_1 : fmt == W_Q8_0X8 ? W_Q8_0
         : fmt == W_Q4_KX8 ? W_Q4_K : fmt == W_Q6_KX8 ? W_Q6_K : fmt == W_Q5_0X8 ? W_Q5_0 : W_I8;
}
INLINE int x8_header(int fmt) { return fmt == W_Q4_1X8 ? 32 : fmt == W_I8X8 ? 0 : 16; }
INLINE float x8_m_per_d(int fmt) {                                                /* Q4_1 has its own m */
    return fmt == W_Q4_0X8 ? -8.0f : fmt == W_Q5_0X8 ? -16.0f : -128.0f;
}
INLINE int x8_bytes8(int fmt) { return fmt == W_Q8_0X8 || fmt == W_I8X8; }        /* 8-bit: w + 128 */
/* block j of the group of 8 rows at g (row_bytes each) */
INLINE const uint8_t *x8_block(int fmt, const uint8_t *g, int j, int64_t row_bytes, int nb) {
    return fmt == W_I8X8 ? g + 32 + 256 * (int64_t)j : g + j * (row_bytes / nb * 8);
}

/* row r of an interleaved matrix back in its file layout (qdequant: embedding lookups, tiles) */
static void x8_unpack_row(int fmt, const uint8_t *w, int64_t rb, int64_t r, int K, uint8_t *row) {
    const int nb = K / 32, ob = (int)(rb / nb), hdr = x8_header(fmt), c = (int)(r & 7);
    const uint8_t *g = w + (r >> 3) * 8 * rb;
    if (fmt == W_I8X8) {
        memcpy(row, g + 4 * c, 4);
        for (int j = 0; j < nb; j++) {
            const uint8_t *b = x8_block(fmt, g, j, rb, nb);
            for (int p = 0; p < 8; p++)
                for (int t = 0; t < 4; t++) row[4 + 32 * j + 4 * p + t] = b[32 * p + 4 * c + t] ^ 0x80;
        }
        return;
    }
    for (int j = 0; j < nb; j++) {
        const uint8_t *b = g + (int64_t)j * 8 * ob;
        uint8_t *o = row + (int64_t)j * ob;
        memcpy(o, b + 2 * c, 2);
        if (fmt == W_Q5_0X8) {              /* d, the u32 of high bits, the nibbles */
            memcpy(o + 2, b + 144 + 4 * c, 4);
            for (int h = 0; h < 4; h++) memcpy(o + 6 + 4 * h, b + 16 + 32 * h + 4 * c, 4);
            continue;
        }
        if (fmt == W_Q4_1X8) memcpy(o + 2, b + 16 + 2 * c, 2);
        uint8_t *qs = o + (fmt == W_Q4_1X8 ? 4 : 2);
        if (fmt == W_Q8_0X8)
            for (int p = 0; p < 8; p++)
                for (int t = 0; t < 4; t++) qs[4 * p + t] = b[hdr + 32 * p + 4 * c + t] ^ 0x80;
        else
            for (int h = 0; h < 4; h++) memcpy(qs + 4 * h, b + hdr + 32 * h + 4 * c, 4);
    }
}

#if defined(__AVX2__)
/* vpmaddubsw's pair sums saturate at int16: Q8_0's unsigned w + 128 (up to 255) x 127 could reach 64,770,
 * so without VNNI its weights go in as |w| with the sign moved onto x (as q8_rows does) and no m term */
#define X8_SIGNED (!Q8_VNNI)

/* 4 int8 inputs in every 32-bit lane: one vpbroadcastd from memory (a load). Through an int (memcpy, set1)
 * GCC merged neighbouring loads into 64-bit ones and broadcast from general registers: ~3 uops a broadcast,
 * two of them on the vector ALU's shuffle pipes, which the products were bound by */
INLINE __m256i bcast4(const int8_t *p) { return _mm256_broadcastd_epi32(_mm_loadu_si32(p)); }

/* 8 outputs' dot products with 16 inputs xq[0..15]: v[p] holds the 8 rows' weights 4p .. 4p+3 (sg: their signs,
 * moved onto x, where the weights went in as |w|; NULL otherwise) */
INLINE __m256i dot16(const __m256i *v, const __m256i *sg, const int8_t *xq) {
    __m256i a = _mm256_setzero_si256();
    for (int p = 0; p < 4; p++)
        a = dpb(a, v[p], sg ? _mm256_sign_epi8(bcast4(xq + 4 * p), sg[p]) : bcast4(xq + 4 * p));
    return a;
}
#endif

/* The grouped kernels ask for the next group's (or pair's) bytes at the same offset as they read, a block's
 * lines per block (prefetch_span): at the pace they read, so the requests are in flight while the products
 * run. Asked for in one burst at a group's start (and with the non-temporal hint), the lines stalled the
 * loads behind them and memory and arithmetic took turns: a one-row Q4_Kx8 product of 8960 x 1536 read from
 * memory at 11 GB/s on one Zen 4 core (24 GB/s by a plain read), 22 GB/s spread. Distance: a group (pair)
 * of rows, 7 to 80 KB for K of 1536 to 8960, inside L2. */
#ifndef PF_LOCALITY
#define PF_LOCALITY 2
#endif
#ifndef PF_PAIRS
#define PF_PAIRS 1
#endif
/* the lines of [p, p + bytes) asked for (one more where p is not line-aligned) */
INLINE void prefetch_span(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes + 63; o += 64) __builtin_prefetch(p + o, 0, PF_LOCALITY);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Two groups (16 output rows) a zmm: group g's 8 lanes in the low half, group g + 1's in the high half, so one
 * broadcast of 4 x inputs feeds both and a vpdpbusd does 64 multiply-adds (the 8-row path: 32). Each lane does
 * the 8-row path's operations in its order (integer sums, then the same convert, multiply and multiply-adds):
 * the outputs are that path's to the bit. Returns the first row it left (a last lone group: the 8-row path). */
#define X16 1
INLINE __m512i cat256(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
INLINE __m512 cat_f16(const uint8_t *a, const uint8_t *b) {      /* 8 + 8 f16 -> 16 float */
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}

/* 16 rows' dot products with 16 inputs xq[0..15]: v[p] holds the rows' weights 4p .. 4p+3 (dot16's, 16 rows wide) */
INLINE __m512i dot16x16(const __m512i *v, const int8_t *xq) {
    __m512i a = _mm512_setzero_si512();
    for (int p = 0; p < 4; p++) a = _mm512_dpbusd_epi32(a, v[p], _mm512_broadcastd_epi32(_mm_loadu_si32(xq + 4 * p)));
    return a;
}

/* one 32-block of x row m against 16 rows' weights v (8 chunks of 4 inputs): acc += d_w dx sum(u q), accm += m_w ds */
INLINE void x16_block(const __m512i *v, const int8_t *xq, __m512 dw, __m512 mw, float dx, float ds, __m512 *acc,
                      __m512 *accm) {
    const __m512i a = _mm512_add_epi32(dot16x16(v, xq), dot16x16(v + 4, xq + 16));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), *acc);
    *accm = _mm512_fmadd_ps(mw, _mm512_set1_ps(ds), *accm);
}

/* Q5_0x8's 5th bits added to the nibbles: byte t of lane c of v[p] gets 16 where bit 4p + t of lane c's u32 is
 * set. Byte b of each lane's u32 (inputs 8b .. 8b+7) copied to its 4 bytes (vpshufb), then each byte tests its
 * own bit (vptestmb) and the set ones add 16: 2.5 uops a vector */
INLINE void q5_high16(__m512i *v, __m512i qh) {
    const __m512i lanes = _mm512_set_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0, 0x0c0c0c0c, 0x08080808, 0x04040404, 0,
                                           0x0c0c0c0c, 0x08080808, 0x04040404, 0, 0x0c0c0c0c, 0x08080808, 0x04040404, 0);
    const __m512i lo = _mm512_set1_epi32(0x08040201), hi = _mm512_set1_epi32((int)0x80402010), x10 = _mm512_set1_epi8(16);
    for (int b = 0; b < 4; b++) {
        const __m512i spread = _mm512_shuffle_epi8(qh, _mm512_add_epi8(lanes, _mm512_set1_epi8((char)b)));
        v[2 * b] = _mm512_mask_add_epi8(v[2 * b], _mm512_test_epi8_mask(spread, lo), v[2 * b], x10);
        v[2 * b + 1] = _mm512_mask_add_epi8(v[2 * b + 1], _mm512_test_epi8_mask(spread, hi), v[2 * b + 1], x10);
    }
}

INLINE int x16_rows(int fmt, int M, q8rows x, int K, const uint8_t *w, int64_t row_bytes, float *out, int ldo,
                    int n0, int n1) {
    const int nb = K / 32, hdr = x8_header(fmt);
    int n = n0;
    for (; n + 16 <= n1; n += 16) {
        const uint8_t *g0 = w + (int64_t)n * row_bytes, *g1 = g0 + 8 * row_bytes;
        __m512 acc[MAXM], accm[MAXM];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = accm[m] = _mm512_setzero_ps();
        for (int j = 0; j < nb; j++) {
            const uint8_t *b0 = x8_block(fmt, g0, j, row_bytes, nb), *b1 = x8_block(fmt, g1, j, row_bytes, nb);
            prefetch_span(b0 + PF_PAIRS * 16 * row_bytes, (int)(row_bytes / nb * 8));
            prefetch_span(b1 + PF_PAIRS * 16 * row_bytes, (int)(row_bytes / nb * 8));
            const __m512 dw = fmt == W_I8X8 ? _mm512_set1_ps(1.0f) : cat_f16(b0, b1);
            const __m512 mw = fmt == W_Q4_1X8 ? cat_f16(b0 + 16, b1 + 16)
                                              : _mm512_mul_ps(dw, _mm512_set1_ps(x8_m_per_d(fmt)));
            __m512i v[8];
            if (x8_bytes8(fmt)) {
                for (int p = 0; p < 8; p++) v[p] = cat256(b0 + hdr + 32 * p, b1 + hdr + 32 * p);
            } else {
                const __m512i low4 = _mm512_set1_epi8(15);
                for (int h = 0; h < 4; h++) {
                    __m512i c = cat256(b0 + hdr + 32 * h, b1 + hdr + 32 * h);
                    v[h] = _mm512_and_si512(c, low4);
                    v[h + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
                }
                if (fmt == W_Q5_0X8) {          /* the 5th bits: a u32 a row after the nibbles */
                    q5_high16(v, cat256(b0 + hdr + 128, b1 + hdr + 128));
                }
            }
#pragma GCC unroll 8
            for (int m = 0; m < M; m++)
                x16_block(v, x.q + (int64_t)m * K + 32 * j, dw, mw, x.d[m * nb + j], x.ds[m * nb + j], &acc[m], &accm[m]);
        }
        const __m512 rs = fmt == W_I8X8 ? _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps((const float *)g0)),
                                                             _mm256_loadu_ps((const float *)g1), 1)
                                        : _mm512_set1_ps(1.0f);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            _mm512_storeu_ps(out + (int64_t)m * ldo + n, _mm512_mul_ps(_mm512_add_ps(acc[m], accm[m]), rs));
    }
    return n;
}
#endif

#if defined(X16)
/* 8-bit groups (Q8_0x8, I8x8) for 1 or 2 x rows: one group a zmm read as it lies (chunks 2i and 2i + 1: no
 * inserts, which x16_rows spends one a vector on), against x widened once per call (x8w_expand: 4 inputs
 * in the low 8 lanes, the next 4 in the high 8); the two halves' integer sums added, then x8_rows' float
 * operations in its order (the same bits). 0.5B's Q8_0 LM head, 2 rows: 1.25x (1 row: memory-bound, even) */
#define X8W_MAX_M 2
INLINE int x8w_takes(int fmt, int M) { return (fmt == W_Q8_0X8 || fmt == W_I8X8) && M <= X8W_MAX_M; }

static void x8w_expand(const int8_t *q, int64_t n, int32_t *xe) {
    for (int64_t i = 0; i < n / 8; i++) {
        const __m512i v = _mm512_inserti64x4(_mm512_broadcastd_epi32(_mm_loadu_si32(q + 8 * i)),
                                             _mm256_broadcastd_epi32(_mm_loadu_si32(q + 8 * i + 4)), 1);
        _mm512_storeu_si512(xe + 16 * i, v);
    }
}

INLINE int x8w_rows(int fmt, int M, q8rows x, int K, const uint8_t *w, int64_t row_bytes, float *out, int ldo,
                    int n0, int n1) {
    const int nb = K / 32, hdr = x8_header(fmt);
    int n = n0;
    for (; n + 8 <= n1; n += 8) {
        const uint8_t *g = w + (int64_t)n * row_bytes;
        __m256 acc[X8W_MAX_M], accm[X8W_MAX_M];
        for (int m = 0; m < M; m++) acc[m] = accm[m] = _mm256_setzero_ps();
        for (int j = 0; j < nb; j++) {
            const uint8_t *b = x8_block(fmt, g, j, row_bytes, nb);
            prefetch_span(b + PF_PAIRS * 8 * row_bytes, (int)(row_bytes / nb * 8));
            const __m256 dw = fmt == W_I8X8 ? _mm256_set1_ps(1.0f) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
            const __m256 mw = _mm256_mul_ps(dw, _mm256_set1_ps(x8_m_per_d(fmt)));
            __m512i v[4];
            for (int i = 0; i < 4; i++) v[i] = _mm512_loadu_si512(b + hdr + 64 * i);
            for (int m = 0; m < M; m++) {
                const int32_t *xe = x.xe + 2 * ((int64_t)m * K + 32 * j);
                __m512i a = _mm512_setzero_si512();
                for (int i = 0; i < 4; i++) a = _mm512_dpbusd_epi32(a, v[i], _mm512_loadu_si512(xe + 16 * i));
                const __m256i a8 = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
                const __m256 sx = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[m * nb + j]));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a8), sx, acc[m]);
                accm[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.ds[m * nb + j]), accm[m]);
            }
        }
        const __m256 rs = fmt == W_I8X8 ? _mm256_loadu_ps((const float *)g) : _mm256_set1_ps(1.0f);
        for (int m = 0; m < M; m++)
            _mm256_storeu_ps(out + (int64_t)m * ldo + n, _mm256_mul_ps(_mm256_add_ps(acc[m], accm[m]), rs));
    }
    return n;
}
#else
INLINE int x8w_takes(int fmt, int M) { (void)fmt, (void)M; return 0; }
#endif

/* output rows n0 .. n1 (groups of 8) of out = x . W^T, W interleaved; M a compile-time constant */
INLINE void x8_rows(int fmt, int M, q8rows x, int K, const uint8_t *w, int64_t row_bytes, float *out, int ldo,
                    int n0, int n1) {
    const int nb = K / 32, hdr = x8_header(fmt);
#if defined(X16)
    n0 = x.xe ? x8w_rows(fmt, M, x, K, w, row_bytes, out, ldo, n0, n1) : x16_rows(fmt, M, x, K, w, row_bytes, out, ldo, n0, n1);
#endif
    for (int n = n0; n < n1; n += 8) {
        const uint8_t *g = w + (int64_t)n * row_bytes;
#if defined(__AVX2__)
        __m256 acc[MAXM], accm[MAXM];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = accm[m] = _mm256_setzero_ps();
        for (int j = 0; j < nb; j++) {
            const uint8_t *b = x8_block(fmt, g, j, row_bytes, nb);
            prefetch_span(b + PF_PAIRS * 8 * row_bytes, (int)(row_bytes / nb * 8));
            const __m256 dw = fmt == W_I8X8 ? _mm256_set1_ps(1.0f) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
            const __m256 mw = fmt == W_Q4_1X8 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16)))
                              : x8_bytes8(fmt) && X8_SIGNED ? _mm256_setzero_ps()
                                                            : _mm256_mul_ps(dw, _mm256_set1_ps(x8_m_per_d(fmt)));
            __m256i v[8], sg[8];
            if (x8_bytes8(fmt)) {
                for (int p = 0; p < 8; p++) v[p] = _mm256_loadu_si256((const __m256i *)(b + hdr + 32 * p));
                if (X8_SIGNED)
                    for (int p = 0; p < 8; p++)
                        sg[p] = _mm256_xor_si256(v[p], _mm256_set1_epi8(-128)), v[p] = _mm256_abs_epi8(sg[p]);
            } else {
                const __m256i low4 = _mm256_set1_epi8(15);
                for (int h = 0; h < 4; h++) {
                    __m256i c = _mm256_loadu_si256((const __m256i *)(b + hdr + 32 * h));
                    v[h] = _mm256_and_si256(c, low4);
                    v[h + 4] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
                }
                if (fmt == W_Q5_0X8) {          /* as x16_rows: the 5th bits to 0x10 */
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + hdr + 128));
                    const __m256i lanes = _mm256_set_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0,
                                                           0x0c0c0c0c, 0x08080808, 0x04040404, 0);
                    const __m256i bit[2] = {_mm256_set1_epi32(0x08040201), _mm256_set1_epi32((int)0x80402010)};
                    for (int p = 0; p < 8; p++) {
                        const __m256i spread = _mm256_shuffle_epi8(qh, _mm256_add_epi8(lanes, _mm256_set1_epi8((char)(p >> 1))));
                        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit[p & 1]), bit[p & 1]);
                        v[p] = _mm256_or_si256(v[p], _mm256_and_si256(set, _mm256_set1_epi8(16)));
                    }
                }
            }
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const int8_t *xq = x.q + (int64_t)m * K + 32 * j;
                const __m256i *sgn = x8_bytes8(fmt) && X8_SIGNED ? sg : NULL;
                const __m256i a = _mm256_add_epi32(dot16(v, sgn, xq), dot16(v + 4, sgn ? sgn + 4 : NULL, xq + 16));
                const __m256 s = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[m * nb + j]));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), s, acc[m]);
                accm[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.ds[m * nb + j]), accm[m]);
            }
        }
        const __m256 rs = fmt == W_I8X8 ? _mm256_loadu_ps((const float *)g) : _mm256_set1_ps(1.0f);   /* row scales */
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            _mm256_storeu_ps(out + (int64_t)m * ldo + n, _mm256_mul_ps(_mm256_add_ps(acc[m], accm[m]), rs));
#else
        float acc[MAXM][8], accm[MAXM][8];
        for (int m = 0; m < M; m++)
            for (int c = 0; c < 8; c++) acc[m][c] = accm[m][c] = 0.0f;
        for (int j = 0; j < nb; j++) {
            const uint8_t *b = x8_block(fmt, g, j, row_bytes, nb);
            for (int c = 0; c < 8; c++) {
                float d = fmt == W_I8X8 ? 1.0f : f16(b + 2 * c);
                float mn = fmt == W_Q4_1X8 ? f16(b + 16 + 2 * c) : x8_m_per_d(fmt) * d;
                for (int m = 0; m < M; m++) {
                    const int8_t *xq = x.q + (int64_t)m * K + 32 * j;
                    int32_t s = 0;
                    for (int p = 0; p < 8; p++)
                        for (int t = 0; t < 4; t++) {
                            int u = x8_bytes8(fmt) ? b[hdr + 32 * p + 4 * c + t]
                                                    : (b[hdr + 32 * (p & 3) + 4 * c + t] >> (4 * (p >> 2))) & 15;
                            if (fmt == W_Q5_0X8) {
                                uint32_t qh;
                                memcpy(&qh, b + hdr + 128 + 4 * c, 4);
                                u |= (int)((qh >> (4 * p + t)) & 1) << 4;
                            }
                            s += u * xq[4 * p + t];
                        }
                    acc[m][c] += (float)s * (d * x.d[m * nb + j]);
                    accm[m][c] += mn * x.ds[m * nb + j];
                }
            }
        }
        for (int m = 0; m < M; m++)
            for (int c = 0; c < 8; c++) {
                float rs = 1.0f;
                if (fmt == W_I8X8) memcpy(&rs, g + 4 * c, 4);
                out[(int64_t)m * ldo + n + c] = (acc[m][c] + accm[m][c]) * rs;
            }
#endif
    }
}

#define X8_M(fmt) BY_M(fmt, x8_rows)
X8_M(W_Q4_0X8)
X8_M(W_Q4_1X8)
X8_M(W_Q8_0X8)
X8_M(W_I8X8)
X8_M(W_Q5_0X8)

/* ---- Q4_Kx8: Q4_K's super-blocks for 8 rows ------------------------------------------------------------
 * Per super-block of 256 inputs and 8 rows (1,184 bytes: 8 x 148, 32 more than the file's 8 x 144): the
 * rows' f16 d (16 bytes) and dmin (16), their 6-bit sub-block scales and minima as bytes [sub-block][row]
 * (64 + 64), then for each pair of sub-blocks (the file's 32 shared bytes a row: low nibbles the even
 * sub-block, high nibbles the odd one) 8 chunks of 32 bytes whose lane c holds row c's bytes 4p .. 4p+3.
 * A sub-block of 8 rows is then what a Q4_0x8 block is: 8 vpdpbusd per x row, its scales d * sc and
 * minima -dmin * mn one 8-lane vector each. */
#define Q4KX8_BYTES 1184

static void q4kx8_unpack_row(const uint8_t *w, int64_t rb, int64_t r, int K, uint8_t *row) {
    const int c = (int)(r & 7);
    const uint8_t *g = w + (r >> 3) * 8 * rb;
    for (int sb = 0; sb < K / 256; sb++) {
        const uint8_t *b = g + (int64_t)sb * Q4KX8_BYTES;
        uint8_t *o = row + (int64_t)sb * 144, *q = o + 4;
        memcpy(o, b + 2 * c, 2);
        memcpy(o + 2, b + 16 + 2 * c, 2);
        const uint8_t *sc = b + 32, *mn = b + 96;       /* [sub-block][row] */
        for (int j = 0; j < 4; j++) {                   /* the inverse of q4k_scale_min */
            q[j] = (uint8_t)((sc[8 * j + c] & 63) | ((sc[8 * (j + 4) + c] >> 4) << 6));
            q[j + 4] = (uint8_t)((mn[8 * j + c] & 63) | ((mn[8 * (j + 4) + c] >> 4) << 6));
            q[j + 8] = (uint8_t)((sc[8 * (j + 4) + c] & 15) | ((mn[8 * (j + 4) + c] & 15) << 4));
        }
        for (int t = 0; t < 4; t++)
            for (int p = 0; p < 8; p++) memcpy(o + 16 + 32 * t + 4 * p, b + 160 + 256 * t + 32 * p + 4 * c, 4);
    }
}

#if defined(X16)
/* Q4_Kx8 two groups a zmm, as x16_rows: each lane does q4kx8_rows' operations in its order (the same bits) */
INLINE __m512 cat_u8ps(const uint8_t *a, const uint8_t *b) {   /* 8 + 8 bytes -> 16 float */
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a),
                                                                      _mm_loadl_epi64((const __m128i *)b))));
}

INLINE int q4kx16_rows(int M, q8rows x, int K, const uint8_t *w, int64_t row_bytes, float *out, int ldo, int n0,
                       int n1) {
    const int nb = K / 32;
    int n = n0;
    for (; n + 16 <= n1; n += 16) {
        const uint8_t *g0 = w + (int64_t)n * row_bytes, *g1 = g0 + 8 * row_bytes;
        __m512 acc[MAXM], accm[MAXM];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = accm[m] = _mm512_setzero_ps();
        for (int sb = 0; sb < K / 256; sb++) {
            const uint8_t *b0 = g0 + (int64_t)sb * Q4KX8_BYTES, *b1 = g1 + (int64_t)sb * Q4KX8_BYTES;
            const __m512 dv = cat_f16(b0, b1), mv = cat_f16(b0 + 16, b1 + 16);
            for (int t = 0; t < 4; t++) {          /* a pair of sub-blocks: their 32 shared bytes a row loaded once */
                prefetch_span(b0 + PF_PAIRS * 16 * row_bytes + Q4KX8_BYTES / 4 * t, Q4KX8_BYTES / 4);
                prefetch_span(b1 + PF_PAIRS * 16 * row_bytes + Q4KX8_BYTES / 4 * t, Q4KX8_BYTES / 4);
                __m512i ch[8];
                for (int p = 0; p < 8; p++) ch[p] = cat256(b0 + 160 + 256 * t + 32 * p, b1 + 160 + 256 * t + 32 * p);
                for (int half = 0; half < 2; half++) {
                    const int s = 2 * t + half, j = 8 * sb + s;
                    const __m512 sc = cat_u8ps(b0 + 32 + 8 * s, b1 + 32 + 8 * s);
                    const __m512 mn = cat_u8ps(b0 + 96 + 8 * s, b1 + 96 + 8 * s);
                    const __m512 dw = _mm512_mul_ps(dv, sc), mw = _mm512_mul_ps(_mm512_mul_ps(mv, mn), _mm512_set1_ps(-1.0f));
                    __m512i v[8];
                    for (int p = 0; p < 8; p++)
                        v[p] = _mm512_and_si512(half ? _mm512_srli_epi16(ch[p], 4) : ch[p], _mm512_set1_epi8(15));
#pragma GCC unroll 8
                    for (int m = 0; m < M; m++)
                        x16_block(v, x.q + (int64_t)m * K + 32 * j, dw, mw, x.d[m * nb + j], x.ds[m * nb + j],
                                  &acc[m], &accm[m]);
                }
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) _mm512_storeu_ps(out + (int64_t)m * ldo + n, _mm512_add_ps(acc[m], accm[m]));
    }
    return n;
}
#endif

INLINE void q4kx8_rows(int fmt, int M, q8rows x, int K, const uint8_t *w, int64_t row_bytes, float *out, int ldo, int n0,
                       int n1) {
    const int nb = K / 32;
#if defined(X16)
    n0 = q4kx16_rows(M, x, K, w, row_bytes, out, ldo, n0, n1);
#endif
    for (int n = n0; n < n1; n += 8) {
        const uint8_t *g = w + (int64_t)n * row_bytes;
#if defined(__AVX2__)
        __m256 acc[MAXM], accm[MAXM];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = accm[m] = _mm256_setzero_ps();
        for (int sb = 0; sb < K / 256; sb++) {
            const uint8_t *b = g + (int64_t)sb * Q4KX8_BYTES;
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
            const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16)));
            for (int t = 0; t < 4; t++) {
                prefetch_span(b + PF_PAIRS * 8 * row_bytes + Q4KX8_BYTES / 4 * t, Q4KX8_BYTES / 4);
                __m256i ch[8];
                for (int p = 0; p < 8; p++) ch[p] = _mm256_loadu_si256((const __m256i *)(b + 160 + 256 * t + 32 * p));
                for (int half = 0; half < 2; half++) {
                    const int s = 2 * t + half, j = 8 * sb + s;
                    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 32 + 8 * s))));
                    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 96 + 8 * s))));
                    const __m256 dw = _mm256_mul_ps(dv, sc), mw = _mm256_mul_ps(_mm256_mul_ps(mv, mn), _mm256_set1_ps(-1.0f));
                    __m256i v[8];
                    for (int p = 0; p < 8; p++)
                        v[p] = _mm256_and_si256(half ? _mm256_srli_epi16(ch[p], 4) : ch[p], _mm256_set1_epi8(15));
#pragma GCC unroll 8
                    for (int m = 0; m < M; m++) {
                        const int8_t *xq = x.q + (int64_t)m * K + 32 * j;
                        const __m256i a = _mm256_add_epi32(dot16(v, NULL, xq), dot16(v + 4, NULL, xq + 16));
                        const __m256 sx = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[m * nb + j]));
                        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), sx, acc[m]);
                        accm[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.ds[m * nb + j]), accm[m]);
                    }
                }
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) _mm256_storeu_ps(out + (int64_t)m * ldo + n, _mm256_add_ps(acc[m], accm[m]));
#else
        float acc[MAXM][8], accm[MAXM][8];
        for (int m = 0; m < M; m++)
            for (int c = 0; c < 8; c++) acc[m][c] = accm[m][c] = 0.0f;
        for (int sb = 0; sb < K / 256; sb++) {
            const uint8_t *b = g + (int64_t)sb * Q4KX8_BYTES;
            for (int s = 0; s < 8; s++) {
                const int j = 8 * sb + s, t = s >> 1, half = s & 1;
                for (int c = 0; c < 8; c++) {
                    float dw = f16(b + 2 * c) * (float)b[32 + 8 * s + c];
                    float mw = -(f16(b + 16 + 2 * c) * (float)b[96 + 8 * s + c]);
                    for (int m = 0; m < M; m++) {
                        const int8_t *xq = x.q + (int64_t)m * K + 32 * j;
                        int32_t sum = 0;
                        for (int p = 0; p < 8; p++)
                            for (int i = 0; i < 4; i++)
                                sum += ((b[160 + 256 * t + 32 * p + 4 * c + i] >> (4 * half)) & 15) * xq[4 * p + i];
                        acc[m][c] += (float)sum * (dw * x.d[m * nb + j]);
                        accm[m][c] += mw * x.ds[m * nb + j];
                    }
                }
            }
        }
        for (int m = 0; m < M; m++)
            for (int c = 0; c < 8; c++) out[(int64_t)m * ldo + n + c] = acc[m][c] + accm[m][c];
#endif
    }
}

BY_M(W_Q4_KX8, q4kx8_rows)

/* ---- Q6_Kx8: Q6_K's super-blocks for 8 rows -------------------------------------------------------------
 * Per super-block of 256 inputs and 8 rows (1,680 bytes: 8 x 210, the file's size): the rows' f16 d (16
 * bytes), their int8 scales (one per 16 inputs) [group][row] (128), then the file's low-nibble bytes (ql,
 * 128 a row) and high-bit-pair bytes (qh, 64 a row) in chunks of 32 bytes whose lane c holds row c's bytes
 * 4p .. 4p+3 of a 32-byte run (ql: 4 runs, qh: 2 runs, in file order). A 32-input sub-block s of a row is
 * u = (ql nibble) | (qh bit pair << 4) in 0..63, w = d sc (u - 32): per x row 8 vpdpbusd for 8 outputs, the
 * -32 taken as 32 x (the sum of the 16 inputs of a scale group), computed once per call. */
#define Q6KX8_BYTES 1680

static void q6kx8_unpack_row(const uint8_t *w, int64_t rb, int64_t r, int K, uint8_t *row) {
    const int c = (int)(r & 7);
    const uint8_t *g = w + (r >> 3) * 8 * rb;
    for (int sb = 0; sb < K / 256; sb++) {
        const uint8_t *b = g + (int64_t)sb * Q6KX8_BYTES;
        uint8_t *o = row + (int64_t)sb * 210;
        for (int run = 0; run < 4; run++)
            for (int p = 0; p < 8; p++) memcpy(o + 32 * run + 4 * p, b + 144 + 256 * run + 32 * p + 4 * c, 4);
        for (int run = 0; run < 2; run++)
            for (int p = 0; p < 8; p++) memcpy(o + 128 + 32 * run + 4 * p, b + 1168 + 256 * run + 32 * p + 4 * c, 4);
        for (int k = 0; k < 16; k++) o[192 + k] = b[16 + 8 * k + c];
        memcpy(o + 208, b + 2 * c, 2);
    }
}

#if defined(X16)
/* Q6_Kx8 two groups a zmm, as x16_rows: each lane does q6kx8_rows' operations in its order (the same bits).
 * Taken for every call since the x inputs are broadcast from memory (1.1-1.2x on 1 to 4 x rows, Zen 4); a
 * 6-bit weight is its nibble and its bit pair moved to bits 4-5, merged by one vpternlogd (bitwise select) */
INLINE __m512 cat_i8ps(const uint8_t *a, const uint8_t *b) {   /* 8 + 8 signed bytes -> 16 float */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a),
                                                                      _mm_loadl_epi64((const __m128i *)b))));
}

INLINE int q6kx16_rows(int M, q8rows x, int K, const uint8_t *w, int64_t row_bytes, float *out, int ldo, int n0,
                       int n1) {
    const int nb = K / 32, ng = K / 16;
    const int32_t *s16 = x.s16;
    int n = n0;
    for (; n + 16 <= n1; n += 16) {
        const uint8_t *g0 = w + (int64_t)n * row_bytes, *g1 = g0 + 8 * row_bytes;
        __m512 acc[MAXM];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int sb = 0; sb < K / 256; sb++) {
            const uint8_t *b0 = g0 + (int64_t)sb * Q6KX8_BYTES, *b1 = g1 + (int64_t)sb * Q6KX8_BYTES;
            const __m512 dv = cat_f16(b0, b1);
            for (int h = 0; h < 2; h++) {
                __m512i hb[8];
                for (int p = 0; p < 8; p++) hb[p] = cat256(b0 + 1168 + 256 * h + 32 * p, b1 + 1168 + 256 * h + 32 * p);
                for (int t = 0; t < 4; t++) {
                    const int j = 8 * sb + 4 * h + t, gi = 8 * h + 2 * t, lo_at = 144 + 256 * (2 * h + (t & 1));
                    prefetch_span(b0 + PF_PAIRS * 16 * row_bytes + Q6KX8_BYTES / 8 * (4 * h + t), Q6KX8_BYTES / 8);
                    prefetch_span(b1 + PF_PAIRS * 16 * row_bytes + Q6KX8_BYTES / 8 * (4 * h + t), Q6KX8_BYTES / 8);
                    __m512i v[8];
                    for (int p = 0; p < 8; p++) {
                        __m512i lo = cat256(b0 + lo_at + 32 * p, b1 + lo_at + 32 * p), hi = hb[p];
                        if (t >> 1) lo = _mm512_srli_epi16(lo, 4);
                        if (t < 2) hi = _mm512_slli_epi16(hi, 4 - 2 * t);        /* bit pair t to bits 4-5 */
                        else if (t == 3) hi = _mm512_srli_epi16(hi, 2);
                        v[p] = _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x30), hi, lo, 0xca);   /* m ? hi : lo */
                        v[p] = _mm512_and_si512(v[p], _mm512_set1_epi8(63));
                    }
                    const __m512 sc0 = _mm512_mul_ps(dv, cat_i8ps(b0 + 16 + 8 * gi, b1 + 16 + 8 * gi));
                    const __m512 sc1 = _mm512_mul_ps(dv, cat_i8ps(b0 + 16 + 8 * (gi + 1), b1 + 16 + 8 * (gi + 1)));
#pragma GCC unroll 8
                    for (int m = 0; m < M; m++) {
                        const int8_t *xq = x.q + (int64_t)m * K + 32 * j;
                        const __m512i a0 = _mm512_sub_epi32(dot16x16(v, xq), _mm512_set1_epi32(s16[m * ng + 2 * j]));
                        const __m512i a1 = _mm512_sub_epi32(dot16x16(v + 4, xq + 16),
                                                            _mm512_set1_epi32(s16[m * ng + 2 * j + 1]));
                        const __m512 dx = _mm512_set1_ps(x.d[m * nb + j]);
                        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), _mm512_mul_ps(sc0, dx), acc[m]);
                        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_mul_ps(sc1, dx), acc[m]);
                    }
                }
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) _mm512_storeu_ps(out + (int64_t)m * ldo + n, acc[m]);
    }
    return n;
}
#endif

INLINE void q6kx8_rows(int fmt, int M, q8rows x, int K, const uint8_t *w, int64_t row_bytes, float *out, int ldo, int n0,
                       int n1) {
    const int nb = K / 32, ng = K / 16;
    const int32_t *s16 = x.s16;
#if defined(X16)
    n0 = q6kx16_rows(M, x, K, w, row_bytes, out, ldo, n0, n1);
#endif
    for (int n = n0; n < n1; n += 8) {
        const uint8_t *g = w + (int64_t)n * row_bytes;
#if defined(__AVX2__)
        __m256 acc[MAXM];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        for (int sb = 0; sb < K / 256; sb++) {
            const uint8_t *b = g + (int64_t)sb * Q6KX8_BYTES;
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
            for (int h = 0; h < 2; h++) {
                __m256i hb[8];
                for (int p = 0; p < 8; p++) hb[p] = _mm256_loadu_si256((const __m256i *)(b + 1168 + 256 * h + 32 * p));
                for (int t = 0; t < 4; t++) {
                    const int s = 4 * h + t, j = 8 * sb + s, g0 = 8 * h + 2 * t;
                    prefetch_span(b + PF_PAIRS * 8 * row_bytes + Q6KX8_BYTES / 8 * s, Q6KX8_BYTES / 8);
                    const uint8_t *lb = b + 144 + 256 * (2 * h + (t & 1));
                    __m256i v[8];
                    for (int p = 0; p < 8; p++) {
                        __m256i lo = _mm256_loadu_si256((const __m256i *)(lb + 32 * p));
                        lo = _mm256_and_si256(_mm256_srli_epi16(lo, 4 * (t >> 1)), _mm256_set1_epi8(15));
                        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb[p], 2 * t), _mm256_set1_epi8(3));
                        v[p] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                    }
                    const __m256 sc0 = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                        _mm_loadl_epi64((const __m128i *)(b + 16 + 8 * g0)))));
                    const __m256 sc1 = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                        _mm_loadl_epi64((const __m128i *)(b + 16 + 8 * (g0 + 1))))));
#pragma GCC unroll 8
                    for (int m = 0; m < M; m++) {
                        const int8_t *xq = x.q + (int64_t)m * K + 32 * j;
                        const __m256i a0 = _mm256_sub_epi32(dot16(v, NULL, xq), _mm256_set1_epi32(s16[m * ng + 2 * j]));
                        const __m256i a1 = _mm256_sub_epi32(dot16(v + 4, NULL, xq + 16),
                                                            _mm256_set1_epi32(s16[m * ng + 2 * j + 1]));
                        const __m256 dx = _mm256_set1_ps(x.d[m * nb + j]);
                        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0), _mm256_mul_ps(sc0, dx), acc[m]);
                        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1), _mm256_mul_ps(sc1, dx), acc[m]);
                    }
                }
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) _mm256_storeu_ps(out + (int64_t)m * ldo + n, acc[m]);
#else
        float acc[MAXM][8];
        for (int m = 0; m < M; m++)
            for (int c = 0; c < 8; c++) acc[m][c] = 0.0f;
        for (int sb = 0; sb < K / 256; sb++) {
            const uint8_t *b = g + (int64_t)sb * Q6KX8_BYTES;
            for (int s = 0; s < 8; s++) {
                const int h = s >> 2, t = s & 3, j = 8 * sb + s, g0 = 8 * h + 2 * t;
                const uint8_t *lb = b + 144 + 256 * (2 * h + (t & 1)), *hb = b + 1168 + 256 * h;
                for (int c = 0; c < 8; c++) {
                    float d = f16(b + 2 * c);
                    for (int m = 0; m < M; m++) {
                        const int8_t *xq = x.q + (int64_t)m * K + 32 * j;
                        int32_t sum[2] = {0, 0};
                        for (int p = 0; p < 8; p++)
                            for (int i = 0; i < 4; i++) {
                                int u = ((lb[32 * p + 4 * c + i] >> (4 * (t >> 1))) & 15) |
                                        (((hb[32 * p + 4 * c + i] >> (2 * t)) & 3) << 4);
                                sum[p >> 2] += (u - 32) * xq[4 * p + i];
                            }
                        float dx = x.d[m * nb + j];
                        acc[m][c] += (float)sum[0] * (d * (float)(int8_t)b[16 + 8 * g0 + c] * dx) +
                                     (float)sum[1] * (d * (float)(int8_t)b[16 + 8 * (g0 + 1) + c] * dx);
                    }
                }
            }
        }
        for (int m = 0; m < M; m++)
            for (int c = 0; c < 8; c++) out[(int64_t)m * ldo + n + c] = acc[m][c];
#endif
    }
}

BY_M(W_Q6_KX8, q6kx8_rows)

/* row r of any 8-row layout back in its file layout (x8_base(fmt)) */
static void grouped_unpack_row(int fmt, const uint8_t *w, int64_t rb, int64_t r, int K, uint8_t *row) {
    if (fmt == W_Q4_KX8) q4kx8_unpack_row(w, rb, r, K, row);
    else if (fmt == W_Q6_KX8) q6kx8_unpack_row(w, rb, r, K, row);
    else x8_unpack_row(fmt, w, rb, r, K, row);
}

typedef void (*q8_fn)(int, q8rows, int, const uint8_t *, int64_t, float *, int, int, int);
static const q8_fn Q8[] = {q8_W_I8, q8_W_Q8_0, q8_W_Q4_0, q8_W_Q4_1, q8_W_Q4_K, q8_W_Q6_K,
                           q8_W_Q4_0X8, q8_W_Q4_1X8, q8_W_Q8_0X8, q8_W_I8X8,
                           q8_W_Q4_KX8, q8_W_Q6_KX8, q8_W_Q5_0X8};

/* out (M x N) = round_q8(x) (M x K float32) . W^T; any M, MAXM rows at a time */
void qmatmul_q8(const float *x, int M, int ldx, int K, const uint8_t *w, int fmt, int N, int64_t row_bytes,
                float *out, int ldo) {
    const int chunk = 16, items = (N + chunk - 1) / chunk, nb = K / 32;
    int8_t *q = malloc((size_t)M * K + sizeof(float) * 2 * (size_t)M * nb);
    if (!q) return;
    float *d = (float *)(q + (size_t)M * K), *ds = d + (size_t)M * nb;   /* K is a multiple of 32: aligned */
    quantize_q8(x, M, ldx, K, q, d, ds);
    int32_t *s16 = NULL;
    if (fmt == W_Q6_KX8) {                     /* 32 x each 16 inputs' sum, once per call */
        s16 = malloc(sizeof(int32_t) * (size_t)M * (K / 16));
        if (!s16) { free(q); return; }
        for (int64_t i = 0; i < (int64_t)M * (K / 16); i++) {
            int32_t sum = 0;
            for (int e = 0; e < 16; e++) sum += q[16 * i + e];
            s16[i] = 32 * sum;
        }
    }
    int32_t *xe = NULL;
    if (x8w_takes(fmt, M)) {                   /* x widened 8x for x8w_rows, once per call */
        xe = malloc(sizeof(int32_t) * 2 * (size_t)M * K);
        if (!xe) { free(q); free(s16); return; }
#if defined(X16)
        x8w_expand(q, (int64_t)M * K, xe);
#endif
    }
    q8_fn f = Q8[fmt];
#pragma omp parallel for num_threads(THREADS) schedule(static)
    for (int it = 0; it < items; it++) {
        int n0 = it * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        for (int m0 = 0; m0 < M; m0 += MAXM) {
            q8rows xr = {q + (int64_t)m0 * K, d + (int64_t)m0 * nb, ds + (int64_t)m0 * nb,
                         s16 ? s16 + (int64_t)m0 * (K / 16) : NULL, xe ? xe + 2 * (int64_t)m0 * K : NULL};
            f(M - m0 < MAXM ? M - m0 : MAXM, xr, K, w, row_bytes, out + (int64_t)m0 * ldo, ldo, n0, n1);
        }
    }
    free(q);
    free(s16);
    free(xe);
}

/* n rows (rows[i], or 0..n-1 when rows is NULL) of W as float32 or bfloat16, n x K, contiguous; an
 * interleaved matrix's rows are put back in their file layout one at a time first (w then starts at a
 * group: a multiple of 8 rows) */
void qdequant(const uint8_t *w, int fmt, int K, int64_t row_bytes, const int64_t *rows, int n, void *out,
              int bf16) {
    if (fmt <= W_Q6_K) {
        DEQ[fmt](w, K, row_bytes, rows, n, out, bf16);
        return;
    }
#pragma omp parallel for num_threads(THREADS) schedule(static)
    for (int i = 0; i < n; i++) {
        uint8_t row[row_bytes];
        grouped_unpack_row(fmt, w, row_bytes, rows ? rows[i] : i, K, row);
        deq_row(x8_base(fmt), row, K, out, (int64_t)i * K, bf16);
    }
}

DEFINE_ISA(qmatmul_isa)
