/* An 8-bit weight-only matmul for x86 CPUs with AVX2 and FMA: y = x @ w.T with w = scale * q (int8 values, one
 * bfloat16 scale an output row), x given as float32 (the caller widens bfloat16 activations), y bfloat16.
 *
 * Torch's CPU kernel reads the weight again for every row of x; this one reads a group of 32 weights once for up
 * to 4 rows and prefetches the weight ahead of the group it reads. On the default model's lm head (49,152 x 576)
 * that is 1.4 against 2.5 ms at 1 row and 2.0 against 3.2 at 4 (figures in pie_runtime/models/cpu_kernels.py).
 *
 * Batch invariance: every output y[m, n] is one dot product whose order does not depend on the number of rows M:
 * two float32 accumulators (a group's values 0-7 and 16-23 in one, 8-15 and 24-31 in the other), added at the end,
 * reduced lane by lane in a fixed order, then scaled. So row i of an M-row call equals a 1-row call bit for bit
 * (the engine's speculative verification relies on it); M only decides how many outputs run side by side.
 *
 * Threads come from OpenMP: the runtime torch has already loaded (libgomp.so.1), so torch's threads and these
 * are one pool, and torch.set_num_threads sets both. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define GROUP 32
#define ROWS 4 /* rows whose products share one read of a weight group */
/* Bytes ahead of the group being read that are asked into the cache. Without it a 1-row call of the lm head ran
 * at torch's speed (2.8 ms, about 10 GB/s); 512 bytes ahead gave 2.4 ms, 1,024 1.5, 2,048 1.3, 4,096 1.4. */
#define PREFETCH 2048

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* a NaN stays a NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Outputs n0 .. n0+NB-1 of rows m0 .. m0+R-1 (R * NB <= 4: eight accumulators, enough chains to hide the
 * FMA latency). */
INLINE void tile(const float *x, long K, long N, long m0, long n0, const int R, const int NB, const int8_t *q,
                 const uint16_t *scale, uint16_t *y) {
    __m256 a[ROWS], c[ROWS];
    for (int i = 0; i < R * NB; i++) a[i] = c[i] = _mm256_setzero_ps();
    for (long k = 0; k < K; k += GROUP) {
        for (int j = 0; j < NB; j++) {
            const int8_t *qg = q + (n0 + j) * K + k;
            _mm_prefetch((const char *)(qg + PREFETCH), _MM_HINT_T0);
            const __m128i v0 = _mm_loadu_si128((const __m128i *)qg), v1 = _mm_loadu_si128((const __m128i *)(qg + 16));
            const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
            const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)));
            const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
            const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)));
            for (int r = 0; r < R; r++) {
                const float *xr = x + (m0 + r) * K + k;
                const int i = j * R + r;
                a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, a[i]);
                c[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, c[i]);
                a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, a[i]);
                c[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, c[i]);
            }
        }
    }
    for (int j = 0; j < NB; j++)
        for (int r = 0; r < R; r++) {
            const float dot = hsum(_mm256_add_ps(a[j * R + r], c[j * R + r]));
            y[(m0 + r) * N + n0 + j] = f32_to_bf16(dot * bf16_to_f32(scale[n0 + j]));
        }
}

/* x (M, K) float32, q (N, K) int8, scale (N,) bfloat16, y (M, N) bfloat16; K a multiple of 32. Rows go in tiles
 * of 4 (one output at a time), then a tile of the 3, 2 or 1 rows left (4 / R outputs at a time). */
void pie_q8_mm(const float *x, long M, long K, const int8_t *q, const uint16_t *scale, long N, uint16_t *y) {
#pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N - N % 4; n0 += 4) {
        long m0 = 0;
        for (; m0 + 4 <= M; m0 += 4)
            for (int j = 0; j < 4; j++) tile(x, K, N, m0, n0 + j, 4, 1, q, scale, y);
        switch (M - m0) {
        case 3:
            for (int j = 0; j < 4; j++) tile(x, K, N, m0, n0 + j, 3, 1, q, scale, y);
            break;
        case 2:
            tile(x, K, N, m0, n0, 2, 2, q, scale, y);
            tile(x, K, N, m0, n0 + 2, 2, 2, q, scale, y);
            break;
        case 1:
            tile(x, K, N, m0, n0, 1, 4, q, scale, y);
            break;
        }
    }
    for (long n = N - N % 4; n < N; n++) /* the last N % 4 outputs, a row at a time */
        for (long m = 0; m < M; m++) tile(x, K, N, m, n, 1, 1, q, scale, y);
}
