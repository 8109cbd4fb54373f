/* Dense linear y = x W^T for a few rows (decode batches, speculative verify chunks) on the CPU, fp32 or bf16 weights.
 *
 * Why: PyTorch's CPU GEMMs read the weight once per row at these sizes (fp32: 2 rows cost about 2x one row, 8 rows
 * about 3x) and, on x86 CPUs without native bf16 arithmetic (AVX2-only), run bf16 at about a tenth of the fp32 rate
 * at every row count. Here a tile of outputs is read from memory once for all rows, bf16 widened to fp32 once.
 *
 * Arithmetic, the same for every row whatever the row count or thread count (so a row alone gets the bits it gets in
 * a batch of up to MAX_ROWS): x is fp32 (the caller widens bf16 activations exactly); output (r, o) keeps 8 lane sums,
 * lane l accumulating x[r, i] * W[o, i] for i = l mod 8 in ascending i with fused multiply-adds; the lanes are then
 * added as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) and the result rounded once to the output dtype. The
 * AVX2 path and the portable path compute exactly this (fmaf is exact-rounded either way).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "native_bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define MAX_ROWS 16
#define OT 8 /* outputs per tile: one weight tile read from memory once for every row */
/* Tiles of more than L1_TILE bytes are taken in blocks of KB inputs (OT x KB fp32 = 16 KiB), which stay in L1 while
 * every row pair passes them; smaller tiles (and every tile for 1-2 rows) are read whole: their rows are contiguous
 * in memory, one sequential stream. PF_AHEAD: how many blocks ahead the loop asks for the weights. */
#define KB 512
#define L1_TILE 32768
#define PF_AHEAD 2

static inline float reduce8(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

#ifdef HAVE_AVX2
static inline __m256 load_f32(const void *p, int64_t i) { return _mm256_loadu_ps((const float *)p + i); }
static inline __m256 load_bf16(const void *p, int64_t i) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* Keeps a loaded vector in a register: without it the compiler folds the load into every multiply-add that uses it,
 * loading each weight vector once per row, and the loop becomes bound by loads instead of multiply-adds. */
#define PIN(v) __asm__("" : "+x"(v))

/* The lane sums of rows [0, nr) x the OT outputs of a tile over inputs [0, n) of one block: acc[r][o][8] continues
 * from what it holds; w[o] points at the block's weights of output o (fp32 or bf16, LOAD), x[r] at row r's block.
 * Eight independent multiply-add chains in flight either way (two rows x four outputs, or one row x eight): fewer
 * leave the loop waiting on the multiply-add latency. Every output's lanes see the same operations in both. */
#define TILE_BLOCK(NAME, LOAD)                                                                                        \
    static void NAME(float (*acc)[OT][8], const float *const *x, int nr, const void *const *w, int64_t n) {        \
        int r = 0;                                                                                                    \
        for (; r + 2 <= nr; r += 2)                                                                                   \
            for (int h = 0; h < OT; h += 4) {                                                                         \
                float *c0 = acc[r][h], *c1 = acc[r + 1][h];                                                           \
                __m256 a00 = _mm256_loadu_ps(c0), a01 = _mm256_loadu_ps(c0 + 8);                                      \
                __m256 a02 = _mm256_loadu_ps(c0 + 16), a03 = _mm256_loadu_ps(c0 + 24);                                \
                __m256 a10 = _mm256_loadu_ps(c1), a11 = _mm256_loadu_ps(c1 + 8);                                      \
                __m256 a12 = _mm256_loadu_ps(c1 + 16), a13 = _mm256_loadu_ps(c1 + 24);                                \
                const float *x0 = x[r], *x1 = x[r + 1];                                                               \
                const void *p0 = w[h], *p1 = w[h + 1], *p2 = w[h + 2], *p3 = w[h + 3];                                \
                for (int64_t i = 0; i < n; i += 8) {                                                                  \
                    __m256 w0 = LOAD(p0, i), w1 = LOAD(p1, i), w2 = LOAD(p2, i), w3 = LOAD(p3, i);                    \
                    PIN(w0); PIN(w1); PIN(w2); PIN(w3);                                                               \
                    __m256 v0 = _mm256_loadu_ps(x0 + i), v1 = _mm256_loadu_ps(x1 + i);                                \
                    PIN(v0); PIN(v1);                                                                                 \
                    a00 = _mm256_fmadd_ps(v0, w0, a00); a01 = _mm256_fmadd_ps(v0, w1, a01);                           \
                    a02 = _mm256_fmadd_ps(v0, w2, a02); a03 = _mm256_fmadd_ps(v0, w3, a03);                           \
                    a10 = _mm256_fmadd_ps(v1, w0, a10); a11 = _mm256_fmadd_ps(v1, w1, a11);                           \
                    a12 = _mm256_fmadd_ps(v1, w2, a12); a13 = _mm256_fmadd_ps(v1, w3, a13);                           \
                }                                                                                                     \
                _mm256_storeu_ps(c0, a00); _mm256_storeu_ps(c0 + 8, a01);                                             \
                _mm256_storeu_ps(c0 + 16, a02); _mm256_storeu_ps(c0 + 24, a03);                                       \
                _mm256_storeu_ps(c1, a10); _mm256_storeu_ps(c1 + 8, a11);                                             \
                _mm256_storeu_ps(c1 + 16, a12); _mm256_storeu_ps(c1 + 24, a13);                                       \
            }                                                                                                         \
        for (; r < nr; r++) {                                                                                         \
            float *c = acc[r][0];                                                                                     \
            __m256 a0 = _mm256_loadu_ps(c), a1 = _mm256_loadu_ps(c + 8), a2 = _mm256_loadu_ps(c + 16);                \
            __m256 a3 = _mm256_loadu_ps(c + 24), a4 = _mm256_loadu_ps(c + 32), a5 = _mm256_loadu_ps(c + 40);          \
            __m256 a6 = _mm256_loadu_ps(c + 48), a7 = _mm256_loadu_ps(c + 56);                                        \
            const float *x0 = x[r];                                                                                   \
            for (int64_t i = 0; i < n; i += 8) {                                                                      \
                __m256 v0 = _mm256_loadu_ps(x0 + i);                                                                  \
                PIN(v0);                                                                                              \
                a0 = _mm256_fmadd_ps(v0, LOAD(w[0], i), a0); a1 = _mm256_fmadd_ps(v0, LOAD(w[1], i), a1);             \
                a2 = _mm256_fmadd_ps(v0, LOAD(w[2], i), a2); a3 = _mm256_fmadd_ps(v0, LOAD(w[3], i), a3);             \
                a4 = _mm256_fmadd_ps(v0, LOAD(w[4], i), a4); a5 = _mm256_fmadd_ps(v0, LOAD(w[5], i), a5);             \
                a6 = _mm256_fmadd_ps(v0, LOAD(w[6], i), a6); a7 = _mm256_fmadd_ps(v0, LOAD(w[7], i), a7);             \
            }                                                                                                         \
            _mm256_storeu_ps(c, a0); _mm256_storeu_ps(c + 8, a1); _mm256_storeu_ps(c + 16, a2);                       \
            _mm256_storeu_ps(c + 24, a3); _mm256_storeu_ps(c + 32, a4); _mm256_storeu_ps(c + 40, a5);                 \
            _mm256_storeu_ps(c + 48, a6); _mm256_storeu_ps(c + 56, a7);                                               \
        }                                                                                                             \
    }
TILE_BLOCK(tile_f32, load_f32)
TILE_BLOCK(tile_bf16, load_bf16)
#endif

static inline float weight(const void *w, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* tile_f32 / tile_bf16 for any tile width, portably (a partial last tile; CPUs without AVX2 and FMA). */
static void tile_any(float (*acc)[OT][8], const float *const *x, int nr, const void *const *w, int no, int64_t n,
                     int bf16) {
    for (int r = 0; r < nr; r++)
        for (int o = 0; o < no; o++)
            for (int64_t i = 0; i < n; i += 8)
                for (int l = 0; l < 8; l++) acc[r][o][l] = fmaf(x[r][i + l], weight(w[o], i + l, bf16), acc[r][o][l]);
}

/* Ask for the weight block PF_AHEAD blocks after (tile t, inputs from k0), in the order the loop takes them (a tile's
 * inputs, then the next tile's): a tile's rows are OT separate streams, which the hardware prefetchers follow too
 * late on their own, bf16 ones especially. */
static inline void prefetch_ahead(const void *w, int64_t t, int64_t k0, int64_t kb, int64_t K, int64_t N, int bf16) {
    int64_t blocks = (K + kb - 1) / kb, b = t * blocks + k0 / kb + PF_AHEAD;
    int64_t o0 = b / blocks * OT, k = b % blocks * kb;
    int64_t n = K - k < kb ? K - k : kb, es = bf16 ? 2 : 4;
    for (int64_t o = o0; o < o0 + OT && o < N; o++) {
        const char *row = (const char *)w + (o * K + k) * es;
        for (int64_t c = 0; c < n * es; c += 64) __builtin_prefetch(row + c);
    }
}

/* x: [M, K] fp32; w: [N, K] fp32 or bf16 (uint16); y: [M, N] in w's dtype. K a multiple of 8, M <= MAX_ROWS.
 * Returns 0; -1 for a shape this kernel does not take (nothing written). */
int linear_rows(const float *x, const void *w, void *y, int64_t M, int64_t K, int64_t N, int bf16, int num_threads) {
    if (M < 1 || M > MAX_ROWS || K % 8 || N < 1) return -1;
    int64_t tiles = (N + OT - 1) / OT;
    /* inputs per block (see KB) */
    int64_t kb = (M <= 2 || OT * K * (bf16 ? 2 : 4) <= L1_TILE) ? K : KB;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; t++) {
        float acc[MAX_ROWS][OT][8];
        const void *wp[OT];
        const float *xp[MAX_ROWS];
        int64_t o0 = t * OT;
        int no = (int)(N - o0 < OT ? N - o0 : OT);
        memset(acc, 0, sizeof acc);
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
            int64_t n = K - k0 < kb ? K - k0 : kb;
            prefetch_ahead(w, t, k0, kb, K, N, bf16);
            for (int o = 0; o < no; o++)
                wp[o] = bf16 ? (const void *)((const uint16_t *)w + (o0 + o) * K + k0)
                             : (const void *)((const float *)w + (o0 + o) * K + k0);
            for (int r = 0; r < M; r++) xp[r] = x + r * K + k0;
#ifdef HAVE_AVX2
            if (no == OT)
                (bf16 ? tile_bf16 : tile_f32)(acc, xp, (int)M, wp, n);
            else
#endif
                tile_any(acc, xp, (int)M, wp, no, n, bf16);
        }
        for (int r = 0; r < M; r++)
            for (int o = 0; o < no; o++) {
                float s = reduce8(acc[r][o]);
                if (bf16)
                    ((uint16_t *)y)[r * N + o0 + o] = f32_to_bf16(s);
                else
                    ((float *)y)[r * N + o0 + o] = s;
            }
    }
    return 0;
}
