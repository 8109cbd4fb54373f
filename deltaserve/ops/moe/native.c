/* Routed SiLU-GLU experts on the CPU for a few tokens (decode rows, speculative verify chunks): the reference's math
 * (`ops/moe/ref.py` `moe_experts`) without its per-expert op overhead. Plain loops compiled without floating-point
 * contraction (-ffp-contract=off): a (token, expert) pair gets the same arithmetic whatever else is in the batch or
 * the thread count, so a verified token gets, bit for bit, the numbers its decode step would give it.
 *
 * Per pair (token t, expert e, combine weight w), in the activations' dtype as the reference rounds (bf16: after each
 * GEMM, after SiLU, after the product, after weighting, after each add; fp32: no rounding):
 *   gu = W13[e] x_t,  h = silu(gu[:I]) * gu[I:],  y = W2[e] h,  out_t += w * y
 * with out_t summed over t's pairs in ascending expert order (the reference's order), from zero. Dot products keep
 * LANES partial sums (lane l sums elements i = l mod LANES), added pairwise in a fixed order at the end: vectorisable
 * without reassociation (two AVX2 accumulators in flight), and the same for every row.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "native_bf16.h"

#define LANES 16
#define MAX_TOP_K 64

static inline float finish(float *acc) { /* the partial sums, in a fixed order (pairwise halving) */
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) acc[l] += acc[l + width];
    return acc[0];
}

/* dot(W row of n values, x fp32) for an fp32 or bf16 weight row. */
static float dot_f32(const float *w, const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += w[i + l] * x[i + l];
    for (int l = 0; i < n; i++, l++) acc[l] += w[i] * x[i];
    return finish(acc);
}

static float dot_bf16(const uint16_t *w, const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += bf16_to_f32(w[i + l]) * x[i + l];
    for (int l = 0; i < n; i++, l++) acc[l] += bf16_to_f32(w[i]) * x[i];
    return finish(acc);
}

static inline float row_dot(const void *w, int64_t row, int64_t n, const float *x, int bf16) {
    return bf16 ? dot_bf16((const uint16_t *)w + row * n, x, n) : dot_f32((const float *)w + row * n, x, n);
}

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* x: [T, D]; w13: [E, 2I, D]; w2: [E, D, I] (the activations' dtype, contiguous); topk_w: [T, K] fp32; topk_ids:
 * [T, K] int64 (-1: skip the pair); pair_out: [T * K, D] and scratch: [num_threads, D + 3I] fp32 scratch; out: [T, D]
 * in the activations' dtype (bf16 as uint16). bf16: activations and weights are bf16; fp32_combine: pairs summed in fp32 (K3), else each add rounded.
 * Returns 0; -1 when K exceeds MAX_TOP_K; -2, before touching anything, when an id is outside [-1, E). */
int moe_experts_silu(const void *x, const void *w13, const void *w2, const float *topk_w, const int64_t *topk_ids,
                     int64_t T, int64_t K, int64_t E, int64_t D, int64_t I, int bf16, int fp32_combine,
                     float *pair_out, float *scratch, void *out, int num_threads) {
    if (K > MAX_TOP_K) return -1;
    for (int64_t p = 0; p < T * K; p++)
        if (topk_ids[p] < -1 || topk_ids[p] >= E) return -2;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && T * K > 1)
    {
        float *xt = scratch + omp_get_thread_num() * (D + 3 * I);
        float *gu = xt + D, *h = gu + 2 * I;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < T * K; p++) {
            const int64_t e = topk_ids[p], t = p / K;
            float *y = pair_out + p * D;
            if (e < 0) continue;
            for (int64_t i = 0; i < D; i++) xt[i] = load(x, t * D + i, bf16);
            const void *we13 = bf16 ? (const void *)((const uint16_t *)w13 + e * 2 * I * D)
                                    : (const void *)((const float *)w13 + e * 2 * I * D);
            const void *we2 = bf16 ? (const void *)((const uint16_t *)w2 + e * D * I)
                                   : (const void *)((const float *)w2 + e * D * I);
            for (int64_t j = 0; j < 2 * I; j++) {
                const float v = row_dot(we13, j, D, xt, bf16);
                gu[j] = bf16 ? bf16_round(v) : v;
            }
            for (int64_t j = 0; j < I; j++) {
                const float g = gu[j];
                float s = g / (1.0f + expf(-g));
                if (bf16) s = bf16_round(s);
                const float v = s * gu[I + j];
                h[j] = bf16 ? bf16_round(v) : v;
            }
            const float w = topk_w[p];
            for (int64_t j = 0; j < D; j++) {
                float v = row_dot(we2, j, I, h, bf16);
                if (bf16) v = bf16_round(v);
                v *= w; /* the weighted output in fp32, as the reference's promoted product */
                y[j] = (bf16 && !fp32_combine) ? bf16_round(v) : v;
            }
        }
    }
    /* the combine: per token, its pairs in ascending expert order (K is small: selection by repeated minimum) */
    for (int64_t t = 0; t < T; t++) {
        int64_t order[MAX_TOP_K];
        int64_t n = 0;
        for (int64_t j = 0; j < K; j++)
            if (topk_ids[t * K + j] >= 0) order[n++] = j;
        for (int64_t a = 1; a < n; a++) { /* insertion sort by expert id (ids of a token are distinct) */
            const int64_t v = order[a];
            int64_t b = a;
            for (; b > 0 && topk_ids[t * K + order[b - 1]] > topk_ids[t * K + v]; b--) order[b] = order[b - 1];
            order[b] = v;
        }
        for (int64_t i = 0; i < D; i++) {
            float acc = 0.0f;
            for (int64_t a = 0; a < n; a++) {
                acc += pair_out[(t * K + order[a]) * D + i];
                if (bf16 && !fp32_combine) acc = bf16_round(acc);
            }
            if (bf16) {
                const float r = bf16_round(acc);
                uint32_t u;
                memcpy(&u, &r, sizeof u);
                ((uint16_t *)out)[t * D + i] = (uint16_t)(u >> 16);
            } else {
                ((float *)out)[t * D + i] = acc;
            }
        }
    }
    return 0;
}
