/* Decode attention read straight through block tables (CPU, fp32): no per-sequence copy of the
 * context. One task per sequence; each token's K (and V) row for all kv heads is one contiguous
 * run of n_kv * head_dim floats, loaded once for every query head (GQA).
 * Cache layout: [num_blocks, block_size, n_kv, head_dim]. */
#include <math.h>
#include <stdint.h>
#include <string.h>

void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int64_t *block_tables, const int64_t *context_lens, float *out,
                            float *scores, int num_seqs, int n_heads, int n_kv, int head_dim,
                            int block_size, int max_blocks, float scale) {
    const int group = n_heads / n_kv;
    const int64_t max_ctx = (int64_t)max_blocks * block_size;
    const int64_t row = (int64_t)n_kv * head_dim;
#pragma omp parallel for schedule(dynamic, 1)
    for (int d = 0; d < num_seqs; d++) {
        const int64_t n = context_lens[d];
        const int64_t *table = block_tables + (int64_t)d * max_blocks;
        const float *qd = q + (int64_t)d * n_heads * head_dim;
        float *s = scores + (int64_t)d * n_heads * max_ctx;      /* s[head][t] */
        for (int64_t t = 0; t < n; t++) {
            const float *kr = k_cache + (table[t / block_size] * block_size + t % block_size) * row;
            for (int qh = 0; qh < n_heads; qh++) {
                const float *kv = kr + (int64_t)(qh / group) * head_dim;
                const float *qv = qd + (int64_t)qh * head_dim;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int e = 0; e < head_dim; e++) acc += qv[e] * kv[e];
                s[qh * max_ctx + t] = acc * scale;
            }
        }
        for (int qh = 0; qh < n_heads; qh++) {
            float *sh = s + qh * max_ctx, mx = -INFINITY, sum = 0.f;
            for (int64_t t = 0; t < n; t++) mx = sh[t] > mx ? sh[t] : mx;
            for (int64_t t = 0; t < n; t++) { sh[t] = expf(sh[t] - mx); sum += sh[t]; }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < n; t++) sh[t] *= inv;
        }
        float *od = out + (int64_t)d * n_heads * head_dim;
        memset(od, 0, sizeof(float) * n_heads * head_dim);
        for (int64_t t = 0; t < n; t++) {
            const float *vr = v_cache + (table[t / block_size] * block_size + t % block_size) * row;
            for (int qh = 0; qh < n_heads; qh++) {
                const float *vv = vr + (int64_t)(qh / group) * head_dim;
                const float w = s[qh * max_ctx + t];
                float *o = od + (int64_t)qh * head_dim;
#pragma omp simd
                for (int e = 0; e < head_dim; e++) o[e] += w * vv[e];
            }
        }
    }
}
