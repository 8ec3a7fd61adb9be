/* The float32 work of a decoder layer between its matrix products, one call each instead of a chain of
 * torch ops (each ~5-10 us of dispatch and allocation on these hosts, ~25 per layer: most of a
 * one-row step outside the weight reads):
 *   add_rms_norm  r = x + y (y optional); out = w * (r * rsqrt(mean(r^2) + eps))
 *   rope_kv       half-split RoPE on q and k of a fused qkv row, q written out contiguous for attention,
 *                 k and v written into their cache slots (float32, bfloat16, int8 + per-token scales)
 *   silu_mul      out = silu(gate) * up of a fused gate|up row (a vectorised exp: the scalar one cost
 *                 more than the rest of a 1,024-row prefill step's glue)
 * Every row is computed alone, the same way whatever the batch (float32 invariance to batch shapes);
 * rows are split over threads only when there are many. The arithmetic is torch's in float32 up to
 * the order of a row's sum of squares and fused multiply-adds. */
#include <time.h>

#include "vec16.h"

DEFINE_SET_THREADS(layer_ops_set_threads)

#define PAR_ROWS 8        /* rows from which a call is split over threads */

/* one row: r = x + y written to xo (when y), out = w * rmsnorm(r) */
static void norm_row(const float *x, const float *y, float *xo, const float *w, float *out, int H, float eps) {
    const float *r = y ? xo : x;
    int i = 0;
    v16 acc = splat(0.0f);
    for (; i + 16 <= H; i += 16) {
        v16 v = load_f32(x + i);
        if (y) {
            v += load_f32(y + i);
            store_f32(xo + i, v);
        }
        acc += v * v;
    }
    float ss = hsum(acc);
    for (; i < H; i++) {
        float v = y ? (xo[i] = x[i] + y[i]) : x[i];
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
    const v16 vi = splat(inv);
    for (i = 0; i + 16 <= H; i += 16) store_f32(out + i, load_f32(w + i) * (load_f32(r + i) * vi));
    for (; i < H; i++) out[i] = w[i] * (r[i] * inv);
}

/* T contiguous rows of H: with y, xo = x + y; out = w * rmsnorm(x + y, or x) */
void add_rms_norm(const float *x, const float *y, float *xo, const float *w, float *out, int T, int H, float eps) {
#pragma omp parallel for num_threads(THREADS) schedule(static) if (T >= PAR_ROWS)
    for (int t = 0; t < T; t++) {
        int64_t o = (int64_t)t * H;
        norm_row(x + o, y ? y + o : NULL, y ? xo + o : NULL, w, out + o, H, eps);
    }
}

/* one head: x (hd) rotated on its first rot dims into o; cos, sin (rot) */
INLINE void rope_head(const float *x, float *o, const float *c, const float *s, int hd, int rot) {
    const int half = rot / 2;
    for (int i = 0; i < half; i++) o[i] = x[i] * c[i] - x[i + half] * s[i];
    for (int i = half; i < rot; i++) o[i] = x[i] * c[i] + x[i - half] * s[i];
    for (int i = rot; i < hd; i++) o[i] = x[i];
}

static uint16_t to_bf16(float f) {         /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);       /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* a K or V row of one head into its slot: kv 0 float32, 1 bfloat16, 2 int8 with scale max|x| / 127 */
INLINE void store_kv(const float *x, void *cache, float *scales, int64_t at, int hd, int kv) {
    if (kv == 0) {
        memcpy((float *)cache + at * hd, x, sizeof(float) * hd);
    } else if (kv == 1) {
        uint16_t *o = (uint16_t *)cache + at * hd;
        for (int i = 0; i < hd; i++) o[i] = to_bf16(x[i]);
    } else {
        float mx = 0.0f;
        for (int i = 0; i < hd; i++) mx = fmaxf(mx, fabsf(x[i]));
        const float s = fmaxf(mx, 1e-8f) / 127.0f;
        int8_t *o = (int8_t *)cache + at * hd;
        for (int i = 0; i < hd; i++) {
            float q = nearbyintf(x[i] / s);
            o[i] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
        }
        scales[at] = s;
    }
}

/* qkv: T rows (stride ldqkv) of [q: nh x hd | k: nkv x hd | v: nkv x hd]; cos, sin: T x rot (rot 0: no
 * RoPE, a NoPE layer); q_out: T x nh x hd; slots: T cache slots (block * block_size + offset), the caches
 * (num_slots, nkv, hd) in format kv, scales (num_slots, nkv) for int8 */
void rope_kv(const float *qkv, int ldqkv, const float *cos_, const float *sin_, int rot, float *q_out,
             void *k_cache, void *v_cache, float *k_scale, float *v_scale, int kv, const int64_t *slots, int T,
             int nh, int nkv, int hd) {
#pragma omp parallel for num_threads(THREADS) schedule(static) if (T >= PAR_ROWS)
    for (int t = 0; t < T; t++) {
        const float *row = qkv + (int64_t)t * ldqkv, *c = cos_ + (int64_t)t * rot, *s = sin_ + (int64_t)t * rot;
        for (int h = 0; h < nh; h++) {
            float *o = q_out + ((int64_t)t * nh + h) * hd;
            if (rot) rope_head(row + h * hd, o, c, s, hd, rot);
            else memcpy(o, row + h * hd, sizeof(float) * hd);
        }
        float k[512];                       /* head_dim <= 256 (kernels.supports) */
        for (int h = 0; h < nkv; h++) {
            const float *kr = row + (nh + h) * hd, *vr = row + (nh + nkv + h) * hd;
            if (rot) rope_head(kr, k, c, s, hd, rot);
            else memcpy(k, kr, sizeof(float) * hd);
            const int64_t at = slots[t] * nkv + h;
            store_kv(k, k_cache, k_scale, at, hd, kv);
            store_kv(vr, v_cache, v_scale, at, hd, kv);
        }
    }
}

/* gu: T rows (stride ldgu) of [gate: I | up: I]; out: T x I = gate / (1 + exp(-gate)) * up */
void silu_mul(const float *gu, int ldgu, float *out, int T, int I) {
#pragma omp parallel for num_threads(THREADS) schedule(static) if (T >= PAR_ROWS)
    for (int t = 0; t < T; t++) {
        const float *g = gu + (int64_t)t * ldgu, *u = g + I;
        float *o = out + (int64_t)t * I;
        int i = 0;
        for (; i + 16 <= I; i += 16) {      /* sigmoid from exp(-|g|) <= 1: no overflow for either sign */
            const v16 gv = load_f32(g + i), one = splat(1.0f);
            const v16 e = vexp((v16)((v16i)gv | (v16i)splat(-0.0f)));          /* exp(-|g|) */
            const v16 sp = one / (one + e);                                     /* sigmoid(|g|) */
            const v16i neg = gv < splat(0.0f);
            const v16 sig = (v16)(((v16i)sp & ~neg) | ((v16i)(e * sp) & neg));  /* sigmoid(g) */
            store_f32(o + i, gv * sig * load_f32(u + i));
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* ---------------------------------------------------------------- a whole decode step's layers, one call
 * The few-row step of a Llama-shaped model whose products are packed (the default on a GGUF file): every
 * layer's norms, products, RoPE + K/V write, attention and SwiGLU in one call from Python instead of ~15
 * a layer (each ~3-10 us of Python, ctypes and allocation on these hosts: most of a one-row step outside
 * the weight reads). The products and the attention are the other two libraries' kernels, passed in as
 * function pointers (built for the same ISA level); the glue is this file's functions. The arithmetic is
 * exactly LlamaForCausalLM's native layer path (DecoderLayer._forward_native), call for call, but for
 * LoRA rows' deltas (lora_add: the same sums in another order). */
typedef void (*qmm_fn)(const float *x, int M, int ldx, int K, const uint8_t *w, int fmt, int N, int64_t row_bytes,
                       float *out, int ldo);
typedef void (*attn_fn)(const float *q, const void *k_cache, const void *v_cache, const float *k_scale,
                        const float *v_scale, int kv_dtype, const int64_t *block_tables, const int64_t *context_lens,
                        float *out, int num_seqs, int n_heads, int n_kv, int head_dim, int block_size, int max_blocks,
                        float scale, int window);
typedef void (*pattn_fn)(const float *q, const void *k_cache, const void *v_cache, const float *k_scale,
                         const float *v_scale, int kv_dtype, const int64_t *block_tables, const int64_t *cu_q,
                         const int64_t *context_lens, float *out, int num_seqs, int n_heads, int n_kv, int head_dim,
                         int block_size, int max_blocks, float scale, int window);

typedef struct {            /* a step's prefill chunks (rows after its decode rows), as paged_prefill_attention
                               takes them: chunk p owns rows cu_q[p] .. cu_q[p + 1] - 1 of them */
    const int64_t *block_tables, *cu_q, *context_lens;
    int32_t n, max_blocks;
    int32_t kv, pad_;       /* the format code their attention gets (KV_BF16_DOT: bf16 products) */
} chunks_t;

typedef struct packed {     /* one packed product: out (T x N) = x (T x K) . W^T (+ bias) */
    const uint8_t *w;
    const float *bias;      /* NULL: none; the whole product's (every part's columns) */
    int64_t row_bytes;
    int32_t fmt, N;         /* this part's format and rows */
    const struct packed *next;  /* the rows after these in another format (model/quant.PackedParts), or NULL */
} packed_t;

typedef struct {            /* one product's LoRA slots (model/lora.py LoRASlots), float32: A (parts x slots x
                               rank, K), part-major; part p's B (slots x rank, out[p]), its outputs after the
                               earlier parts' */
    const float *a;
    const float *b[3];
    int32_t out[3];
    int32_t parts;
} lora_t;

typedef struct {            /* one layer's weights and K/V planes */
    const float *attn_norm, *mlp_norm;
    packed_t qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    float *k_scale, *v_scale;   /* int8 KV only */
    int32_t window, pad_;
    const lora_t *lora[4];      /* qkv, o, gate_up, down: NULL where no adapter has that product */
} dlayer_t;

typedef struct {            /* the model's shape and the kernels its products and attention run */
    const dlayer_t *layers;
    qmm_fn qmm;
    attn_fn attn;
    int32_t L, H, nh, nkv, hd, I, block_size, kv;
    float eps, scale;
    double *prof;           /* NULL, or seconds accumulated: [0] products, [1] attention, [2] the glue */
    const int32_t *row_slot;    /* this step's LoRA slot of each row (-1: the base model); NULL: no LoRA */
    int32_t max_loras, rank;
    pattn_fn pattn;             /* the prefill chunks' attention */
} dstack_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* with s->prof: the time since *t added to prof[k], *t moved on */
#define LAP(k) do { if (s->prof) { double t_ = now_s(); s->prof[k] += t_ - t; t = t_; } } while (0)

/* d[j] = a . x row rows[j] for m <= 4 rows, reading a once: 8-lane accumulators, two per row (16 floats a
 * step), kept in registers (a 16-lane accumulator was kept on the stack on AVX2 inside OpenMP regions) */
static void dots(const float *a, const float *x, int K, const int *rows, int m, float *d) {
    v8 acc[4][2] = {{{0}}};
    const float *xr[4];
    for (int j = 0; j < 4; j++) xr[j] = x + (int64_t)rows[j < m ? j : 0] * K;
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        v8 a0, a1;
        memcpy(&a0, a + k, sizeof a0);
        memcpy(&a1, a + k + 8, sizeof a1);
        for (int j = 0; j < 4; j++) {
            v8 x0, x1;
            memcpy(&x0, xr[j] + k, sizeof x0);
            memcpy(&x1, xr[j] + k + 8, sizeof x1);
            acc[j][0] += a0 * x0;
            acc[j][1] += a1 * x1;
        }
    }
    for (int j = 0; j < m; j++) {
        const v8 v = acc[j][0] + acc[j][1];
        const v4 h = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
        float t = (h[0] + h[2]) + (h[1] + h[3]);
        for (int i = k; i < K; i++) t += a[i] * xr[j][i];
        d[j] = t;
    }
}

/* y[t, col + n0 .. n1) += xa[t, p] . B[:, n0 .. n1) for m <= 4 rows t = rows[j]: 8 columns at a time, the 4
 * rows' sums held in registers through B's R rows (one load and store of y per 8 columns, not per rank);
 * each sum runs over the ranks in order */
static void lora_b4(const float *B, int n_out, int R, int n0, int n1, const int *rows, int m, const float *xa,
                    int P, int p, float *out, int N, int col) {
    float *y[4];
    const float *xt[4];
    for (int j = 0; j < 4; j++) {             /* rows past m repeat the last one: computed, not stored */
        const int t = rows[j < m ? j : m - 1];
        y[j] = out + (int64_t)t * N + col;
        xt[j] = xa + ((int64_t)t * P + p) * R;
    }
    int n = n0;
    for (; n + 8 <= n1; n += 8) {
        v8 acc[4];
        for (int j = 0; j < 4; j++) memcpy(&acc[j], y[j] + n, sizeof acc[j]);
        for (int r = 0; r < R; r++) {
            v8 b;
            memcpy(&b, B + (int64_t)r * n_out + n, sizeof b);
            for (int j = 0; j < 4; j++) acc[j] += xt[j][r] * b;
        }
        for (int j = 0; j < m; j++) memcpy(y[j] + n, &acc[j], sizeof acc[j]);
    }
    for (; n < n1; n++)
        for (int j = 0; j < m; j++)
            for (int r = 0; r < R; r++) y[j][n] += xt[j][r] * B[(int64_t)r * n_out + n];
}

/* out row t += B(A(x row t)) of row t's adapter, part by part (LoRABatch.add's arithmetic, summed in
 * another order: close to it, not bit for bit). The rows are grouped by adapter slot, so each slot's A and
 * B are read once per step whatever the number of its rows (row by row, 16 rows of 4 adapters read each
 * adapter 4 times); one parallel region, threads splitting A's rows, then B's column blocks. Each row's
 * sums run in the same order as that row alone. */
static void lora_add(const dstack_t *s, const lora_t *lo, const float *x, int T, int K, float *out, int N,
                     float *scratch) {
    const int R = s->rank, S = s->max_loras, P = lo->parts, NB = 64;
    int first[S + 1], fill[S], chunk0[4] = {0}, col[3] = {0};
    int *order = (int *)scratch;                /* T row indices, then xa: T x parts x rank (decode_layers' buffer) */
    float *xa = scratch + T;
    memset(first, 0, sizeof first);
    for (int t = 0; t < T; t++)                 /* rows by slot (counting sort; -1: the base model) */
        if (s->row_slot[t] >= 0) first[s->row_slot[t] + 1]++;
    for (int k = 0; k < S; k++) first[k + 1] += first[k], fill[k] = first[k];
    for (int t = 0; t < T; t++)
        if (s->row_slot[t] >= 0) order[fill[s->row_slot[t]]++] = t;
    for (int p = 0; p < P; p++) {
        chunk0[p + 1] = chunk0[p] + (lo->out[p] + NB - 1) / NB;
        if (p + 1 < P) col[p + 1] = col[p] + lo->out[p];
    }
#pragma omp parallel num_threads(THREADS) if ((int64_t)first[S] * R * (K + N) >= 32768)
    {
#pragma omp for schedule(static)
        for (int task = 0; task < P * S * R; task++) {       /* xa[t, p, r] = x_t . A[p, slot(t), r] */
            const int p = task / (S * R), slot = task / R % S, r = task % R;
            const float *A = lo->a + ((int64_t)(p * S + slot) * R + r) * K;
            for (int i = first[slot]; i < first[slot + 1]; i += 4) {
                const int m = first[slot + 1] - i < 4 ? first[slot + 1] - i : 4;
                float d[4];
                dots(A, x, K, order + i, m, d);
                for (int j = 0; j < m; j++) xa[((int64_t)order[i + j] * P + p) * R + r] = d[j];
            }
        }
#pragma omp for schedule(static)
        for (int c = 0; c < chunk0[P]; c++) {                 /* y[t, block] += xa[t, p] . B[p, slot(t)][:, block] */
            int p = 0;
            while (c >= chunk0[p + 1]) p++;
            const int n_out = lo->out[p], n0 = (c - chunk0[p]) * NB, n1 = n0 + NB < n_out ? n0 + NB : n_out;
            for (int slot = 0; slot < S; slot++)
                for (int i = first[slot]; i < first[slot + 1]; i += 4)
                    lora_b4(lo->b[p] + (int64_t)slot * R * n_out, n_out, R, n0, n1, order + i,
                            first[slot + 1] - i < 4 ? first[slot + 1] - i : 4, xa, P, p, out, N, col[p]);
        }
    }
}

static void product(const dstack_t *s, const packed_t *p, const lora_t *lo, const float *x, int T, int K,
                    float *out, float *lora_scratch) {
    int N = 0;
    for (const packed_t *q = p; q; q = q->next) N += q->N;
    int col = 0;
    for (const packed_t *q = p; q; col += q->N, q = q->next)     /* each part its own kernel, into its columns */
        s->qmm(x, T, K, K, q->w, q->fmt, q->N, q->row_bytes, out + col, N);
    if (p->bias)
        for (int t = 0; t < T; t++)
            for (int n = 0; n < N; n++) out[(int64_t)t * N + n] += p->bias[n];
    if (lo && s->row_slot) lora_add(s, lo, x, T, K, out, N, lora_scratch);
}

/* x: T rows of the residual stream, H wide, updated in place through every layer: D decode rows (one per
 * sequence; block_tables D x max_blocks, context_lens D), then the rows of `chunks` (NULL: none; a chunk's
 * rows attend causally to its context, as the layer path's prefill kernel has them); cos, sin: T x rot (rot 0:
 * no RoPE); slots: each row's cache slot. Every row's K/V is written before any row attends. Returns 0, or -1
 * when its scratch could not be allocated (x untouched then). */
int decode_layers(const dstack_t *s, float *x, int T, const float *cos_, const float *sin_, int rot,
                  const int64_t *slots, const int64_t *block_tables, int max_blocks, const int64_t *context_lens,
                  int D, const chunks_t *chunks) {
    const int H = s->H, nh = s->nh, nkv = s->nkv, hd = s->hd, I = s->I;
    const int nqkv = (nh + 2 * nkv) * hd, nq = nh * hd;
    const int lora = s->row_slot ? 1 + 3 * s->rank : 0;     /* lora_add's scratch, a row: its index, xa */
    float *buf = malloc(sizeof(float) * (size_t)T * (H + nqkv + 2 * nq + H + 3 * I + H + lora));
    if (!buf) return -1;
    float *h = buf, *qkv = h + (size_t)T * H, *q = qkv + (size_t)T * nqkv, *o = q + (size_t)T * nq;
    float *y = o + (size_t)T * nq, *gu = y + (size_t)T * H, *a = gu + (size_t)T * 2 * I, *d = a + (size_t)T * I;
    float *ls = d + (size_t)T * H;
    double t = s->prof ? now_s() : 0.0;
    for (int l = 0; l < s->L; l++) {
        const dlayer_t *ly = &s->layers[l];
        add_rms_norm(x, NULL, NULL, ly->attn_norm, h, T, H, s->eps);
        LAP(2);
        product(s, &ly->qkv, ly->lora[0], h, T, H, qkv, ls);
        LAP(0);
        rope_kv(qkv, nqkv, cos_, sin_, rot, q, ly->k_cache, ly->v_cache, ly->k_scale, ly->v_scale, s->kv, slots, T,
                nh, nkv, hd);
        LAP(2);
        if (D)
            s->attn(q, ly->k_cache, ly->v_cache, ly->k_scale, ly->v_scale, s->kv, block_tables, context_lens, o, D,
                    nh, nkv, hd, s->block_size, max_blocks, s->scale, ly->window);
        if (chunks)
            s->pattn(q + (int64_t)D * nq, ly->k_cache, ly->v_cache, ly->k_scale, ly->v_scale, chunks->kv,
                     chunks->block_tables, chunks->cu_q, chunks->context_lens, o + (int64_t)D * nq, chunks->n, nh,
                     nkv, hd, s->block_size, chunks->max_blocks, s->scale, ly->window);
        LAP(1);
        product(s, &ly->o, ly->lora[1], o, T, nq, y, ls);
        LAP(0);
        add_rms_norm(x, y, x, ly->mlp_norm, h, T, H, s->eps);         /* x += y in place, h = its norm */
        LAP(2);
        product(s, &ly->gate_up, ly->lora[2], h, T, H, gu, ls);
        LAP(0);
        silu_mul(gu, 2 * I, a, T, I);
        LAP(2);
        product(s, &ly->down, ly->lora[3], a, T, I, d, ls);
        LAP(0);
        for (int64_t i = 0; i < (int64_t)T * H; i++) x[i] += d[i];
        LAP(2);
    }
    free(buf);
    return 0;
}

DEFINE_ISA(layer_ops_isa)
