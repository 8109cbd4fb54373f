/* KDA recurrent step on the CPU (model-spec §3.5), for decode rows and speculative verify chunks alike: a decode row is
 * a chunk of one token. Plain loops in fp32, compiled without floating-point contraction (-ffp-contract=off), so each
 * (chunk, head) gets the same arithmetic whatever the batch, the chunk lengths or the thread count: a verified token
 * gets, bit for bit, the numbers a decode step would give it.
 *
 * Per token, with qn, kn the L2-normalised query/key (q also scaled by K^-1/2), d = exp(g), S the [K, V] state:
 *   qs = (qn * d)^T S,  ks = (kn * d)^T S        (one read of S)
 *   delta = beta * (v - ks),  out = qs + (qn . kn) delta
 *   S = d * S + kn delta^T                         (one read and write of S)
 * which is S' = D S + kn delta^T and out = qn^T S' rearranged (the reference's six passes over S become two).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_DIM 1024

static void normalise(const float *x, float *out, int64_t n, float scale) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum + 1e-6f);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * scale;
}

/* q, k, g: [R, H, K]; v: [R, H, V]; beta: [R, H]; pool: [num_slots, H, K, V]; out: [R, H, V]; all fp32, contiguous.
 * Chunk s owns rows cu[s]..cu[s+1] and state slot slots[s]; after its token t < scratch_cu[s+1] - scratch_cu[s] its
 * state is also copied to slot scratch[scratch_cu[s] + t]. Returns 0; -1 when K or V exceeds MAX_DIM; -2, before
 * touching anything, when a slot is outside the pool's num_slots. */
int kda_recurrent(const float *q, const float *k, const float *v, const float *g, const float *beta, float *pool,
                  int64_t num_slots, const int64_t *slots, const int64_t *cu, const int64_t *scratch,
                  const int64_t *scratch_cu, int64_t num_chunks, int64_t H, int64_t K, int64_t V, float *out,
                  int num_threads) {
    if (K > MAX_DIM || V > MAX_DIM) return -1;
    for (int64_t s = 0; s < num_chunks; s++)
        if (slots[s] < 0 || slots[s] >= num_slots) return -2;
    for (int64_t i = 0; i < scratch_cu[num_chunks]; i++)
        if (scratch[i] < 0 || scratch[i] >= num_slots) return -2;
    const float q_scale = 1.0f / sqrtf((float)K);
    const int64_t state_size = K * V;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && num_chunks * H > 1)
    for (int64_t job = 0; job < num_chunks * H; job++) {
        const int64_t s = job / H, h = job % H;
        float qn[MAX_DIM], kn[MAX_DIM], qd[MAX_DIM], kd[MAX_DIM], decay[MAX_DIM];
        float qs[MAX_DIM], ks[MAX_DIM], delta[MAX_DIM];
        float *state = pool + (slots[s] * H + h) * state_size;
        const int64_t num_saved = scratch_cu[s + 1] - scratch_cu[s];
        for (int64_t r = cu[s], t = 0; r < cu[s + 1]; r++, t++) {
            const int64_t row = r * H + h;
            normalise(q + row * K, qn, K, q_scale);
            normalise(k + row * K, kn, K, 1.0f);
            float qk = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                decay[i] = expf(g[row * K + i]);
                qd[i] = qn[i] * decay[i];
                kd[i] = kn[i] * decay[i];
                qk += qn[i] * kn[i];
            }
            for (int64_t j = 0; j < V; j++) qs[j] = ks[j] = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                const float *srow = state + i * V;
                const float a = qd[i], b = kd[i];
                for (int64_t j = 0; j < V; j++) {
                    qs[j] += a * srow[j];
                    ks[j] += b * srow[j];
                }
            }
            const float bt = beta[row];
            float *o = out + row * V;
            for (int64_t j = 0; j < V; j++) {
                delta[j] = bt * (v[row * V + j] - ks[j]);
                o[j] = qs[j] + qk * delta[j];
            }
            for (int64_t i = 0; i < K; i++) {
                float *srow = state + i * V;
                const float d = decay[i], kk = kn[i];
                for (int64_t j = 0; j < V; j++) srow[j] = d * srow[j] + kk * delta[j];
            }
            if (t < num_saved)
                memcpy(pool + (scratch[scratch_cu[s] + t] * H + h) * state_size, state, state_size * sizeof(float));
        }
    }
    return 0;
}
