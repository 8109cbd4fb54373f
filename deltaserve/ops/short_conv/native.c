/* Causal short convolution on the CPU for decode rows and speculative verify chunks alike (a decode row is a chunk of
 * one token): plain fp32 loops compiled without floating-point contraction, so a verified token gets, bit for bit,
 * the numbers a decode step would give it, whatever the batch or the chunk lengths.
 *
 * Chunk s continues the window of slot slots[s] (W-1 previous inputs per channel, oldest first): its extended input
 * stream is e = [window; x rows], and token t's output is sum_j e[t + j] * w[j] over the W taps, oldest first (the
 * products and sums in fp32), rounded to bf16 when the weight is bf16 (as the reference rounds to the weight's dtype),
 * then SiLU in fp32 (rounded again for a bf16 weight). The activation is here, not in torch, because torch's SiLU
 * takes a vector path and a scalar path that differ in the last bit, and which elements take which depends on the
 * batch: in the kernel every element takes the same path. The window after token t is
 * e[t+1 .. t+W-1]: written to scratch slot scratch[scratch_cu[s] + t] for t < scratch_cu[s+1] - scratch_cu[s], and
 * after the last token to the chunk's own slot.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_bf16.h"

#define MAX_WIDTH 16


/* x: [R, C] fp32; weight_t: [W, C] fp32 (the weight transposed: taps as rows); pool: [num_slots, C, W-1], fp32
 * (pool_bf16 = 0) or bf16 (1), contiguous; out: [R, C] fp32; weight_bf16: round as for a bf16 weight; silu: apply it. The x values must be exact in the pool's dtype (the
 * caller checks). Loops run over channels innermost (vectorised; each channel's sum is the same whatever the width
 * of the vector). Returns 0; -1 when W is out of range or memory runs out; -2, before touching anything, when a
 * slot is outside the pool's num_slots. */
int short_conv_step(const float *x, const float *weight_t, void *pool, int pool_bf16, int64_t num_slots,
                    const int64_t *slots, const int64_t *cu, const int64_t *scratch, const int64_t *scratch_cu,
                    int64_t num_chunks, int64_t C, int64_t W, float *out, int weight_bf16, int silu) {
    if (W > MAX_WIDTH || W < 1) return -1;
    for (int64_t s = 0; s < num_chunks; s++)
        if (slots[s] < 0 || slots[s] >= num_slots) return -2;
    for (int64_t i = 0; i < scratch_cu[num_chunks]; i++)
        if (scratch[i] < 0 || scratch[i] >= num_slots) return -2;
    const int64_t state_len = W - 1;
    float *pool_f = (float *)pool;
    uint16_t *pool_h = (uint16_t *)pool;
    for (int64_t s = 0; s < num_chunks; s++) {
        const int64_t n = cu[s + 1] - cu[s], num_saved = scratch_cu[s + 1] - scratch_cu[s];
        /* The chunk's extended stream [window; x rows], time first. */
        float *e = malloc((size_t)(state_len + n) * (size_t)C * sizeof(float));
        if (e == NULL) return -1;
        const int64_t base = slots[s] * C * state_len;
        for (int64_t c = 0; c < C; c++)
            for (int64_t j = 0; j < state_len; j++)
                e[j * C + c] = pool_bf16 ? bf16_to_f32(pool_h[base + c * state_len + j]) : pool_f[base + c * state_len + j];
        memcpy(e + state_len * C, x + cu[s] * C, (size_t)(n * C) * sizeof(float));
        for (int64_t t = 0; t < n; t++) {
            float *o = out + (cu[s] + t) * C;
            const float *e0 = e + t * C;
            for (int64_t c = 0; c < C; c++) o[c] = e0[c] * weight_t[c];
            for (int64_t j = 1; j < W; j++) {
                const float *ej = e + (t + j) * C, *wj = weight_t + j * C;
                for (int64_t c = 0; c < C; c++) o[c] = o[c] + ej[c] * wj[c];
            }
            if (weight_bf16)
                for (int64_t c = 0; c < C; c++) o[c] = bf16_round(o[c]);
            if (silu)
                for (int64_t c = 0; c < C; c++) o[c] = weight_bf16 ? bf16_round(o[c] / (1.0f + expf(-o[c])))
                                                                   : o[c] / (1.0f + expf(-o[c]));
        }
        /* The window after token t is stream entries t+1 .. t+W-1: to its scratch slot, and after the last token to
         * the chunk's own slot (read above, so written last). */
        for (int64_t t = 0; t < n; t++) {
            for (int pass = 0; pass < 2; pass++) {
                int64_t dst;
                if (pass == 0 && t < num_saved) dst = scratch[scratch_cu[s] + t] * C * state_len;
                else if (pass == 1 && t == n - 1) dst = base;
                else continue;
                for (int64_t c = 0; c < C; c++)
                    for (int64_t j = 0; j < state_len; j++) {
                        const float value = e[(t + 1 + j) * C + c];
                        if (pool_bf16) pool_h[dst + c * state_len + j] = f32_to_bf16(value);
                        else pool_f[dst + c * state_len + j] = value;
                    }
            }
        }
        free(e);
    }
    return 0;
}
