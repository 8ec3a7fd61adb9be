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

enum { W_I8 = 0, W_Q8_0 = 1, W_Q4_0 = 2, W_Q4_1 = 3, W_Q4_K = 4, W_Q6_K = 5 };

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

/* n rows (rows[i], or 0..n-1 when rows is NULL) of W as float32 or bfloat16, n x K, contiguous */
void qdequant(const uint8_t *w, int fmt, int K, int64_t row_bytes, const int64_t *rows, int n, void *out,
              int bf16) {
    DEQ[fmt](w, K, row_bytes, rows, n, out, bf16);
}

DEFINE_ISA(qmatmul_isa)
