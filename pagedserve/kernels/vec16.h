/* What both kernel sources share: 16-lane GCC vector types (one zmm with AVX-512, two ymm with AVX2,
 * four xmm otherwise), their loads, sums and byte widenings, and the OpenMP thread count that
 * kernels/__init__.py sets to torch's. Part of every build's cache key. */
#ifndef PAGEDSERVE_VEC16_H
#define PAGEDSERVE_VEC16_H
#include <math.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#define INLINE static inline __attribute__((always_inline))

/* 0: OpenMP's default (all cores); set to match torch's threads by <source>_set_threads */
static int g_threads = 0;
#define THREADS (g_threads > 0 ? g_threads : omp_get_max_threads())
#define DEFINE_SET_THREADS(name) \
    void name(int n) { g_threads = n > 0 ? n : 0; }

/* the level a build was compiled for, so the loader can log it and tests can name it */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define ISA_NAME "avx512-vnni"
#elif defined(__AVX512F__)
#define ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__AVXVNNI__)
#define ISA_NAME "avx2-vnni"
#elif defined(__AVX2__)
#define ISA_NAME "avx2"
#else
#define ISA_NAME "generic"
#endif
#define DEFINE_ISA(name) \
    const char *name(void) { return ISA_NAME; }

INLINE v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
INLINE v16 load_f32(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
INLINE void store_f32(float *p, v16 v) { memcpy(p, &v, sizeof v); }
INLINE v16 cvt(v16i v) { return __builtin_convertvector(v, v16); }

/* horizontal sum in log steps (4 shuffles), not 15 dependent lane extracts */
INLINE float hsum(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* exp(x) for x <= 0 (scores minus their running max), Cephes-style: 2^n * p(r), |rel err| < 2e-7;
 * below -87 the result is 0 (and exp(-inf) = 0 for masked keys). */
INLINE v16 vexp(v16 x) {
    const v16 lo = splat(-87.f);
    const v16i dead = x < lo;                                     /* all-ones lanes where x < -87 */
    x = (v16)(((v16i)x & ~dead) | ((v16i)lo & dead));
    const v16 fx = x * splat(1.44269504088896341f), t = fx + splat(0.5f);
    v16 nf = __builtin_convertvector(__builtin_convertvector(t, v16i), v16);   /* trunc toward 0 */
    nf += __builtin_convertvector((v16i)(nf > t), v16);                         /* -> floor(fx + 0.5) */
    const v16i n = __builtin_convertvector(nf, v16i);
    const v16 r = x - nf * splat(0.693359375f) + nf * splat(2.12194440e-4f);
    v16 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.f);
    const v16 y = p * (v16)((n + 127) << 23);
    return (v16)((v16i)y & ~dead);
}

#if defined(__AVX2__)
/* the sum of one ymm's 8 floats */
INLINE float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

/* 16 bytes widened to 16 int32 lanes, zero- or sign-extended. GCC's __builtin_convertvector turns
 * 8-bit -> 32-bit into scalar code, so the widening uses the ISA's own instructions. */
#if defined(__AVX512F__)
#define WIDEN8(p, ext) ((v16i)_mm512_##ext##_epi32(_mm_loadu_si128((const __m128i *)(p))))
#elif defined(__AVX2__)
#define WIDEN8(p, ext)                                                                              \
    __builtin_shufflevector((v8i)_mm256_##ext##_epi32(_mm_loadl_epi64((const __m128i *)(p))),        \
                            (v8i)_mm256_##ext##_epi32(_mm_loadl_epi64((const __m128i *)((p) + 8))), \
                            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#endif

INLINE v16i u8x16(const uint8_t *p) {
#if defined(__AVX2__)
    return WIDEN8(p, cvtepu8);
#else
    v16i r;
    for (int e = 0; e < 16; e++) r[e] = p[e];
    return r;
#endif
}

INLINE v16i s8x16(const uint8_t *p) {
#if defined(__AVX2__)
    return WIDEN8(p, cvtepi8);
#else
    v16i r;
    for (int e = 0; e < 16; e++) r[e] = (int8_t)p[e];
    return r;
#endif
}
#endif
