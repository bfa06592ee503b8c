/* Integer-dot matmuls: y = x @ w.T with w in blocks of 32 weights (GGUF's Q4_0 / Q4_1 / Q8_0 values) and x
 * quantized here to 8 bits per block of 32 (llama.cpp's Q8_1: d = max|x| / 127, q = round(x / d), s = d sum(q)).
 *
 * One block's contribution to an output is exact integer arithmetic plus two float products:
 *     sum_k (dw qw_k + mw) (dx qx_k) = (dw dx) sum_k qw_k qx_k + mw (dx sum_k qx_k)
 * (Q4_1: qw in 0..15 and mw its minimum; Q4_0: mw = -8 dw; Q8_0 on VNNI: qw + 128 as unsigned and mw = -128 dw;
 * Q8_0 on AVX2: signed qw, mw = 0, the sign moved onto x so that maddubs never saturates).
 *
 * Layout ("x8"): outputs in groups of 8, and per group and block one record of
 *     values: 4-bit: 4 chunks of 32 bytes, byte 4o + t of chunk j = value 4j + t of output o (low nibble) and
 *             value 16 + 4j + t (high nibble); 8-bit: 8 chunks of 32 bytes, byte 4o + t of chunk j = value 4j + t
 *     dw[8], mw[8] as float16
 * so that one 32-byte lane of values meets a 4-byte broadcast of x in one dpbusd, and 8 outputs accumulate in
 * 8 int32 lanes with no horizontal sum. The records of a group are contiguous: a thread streams its outputs'
 * weights in one run.
 *
 * Batch invariance: y[r, n] is the same sequence of operations whatever the number of rows, the row's place in
 * the call and the thread that computes it: block by block in order, acc = fma(float(isum), dw * dx, acc), then
 * acc = fma(mw, s, acc). Rows of a call only share the loads (that is what makes a verify window cheap). */
#ifndef PIE_QMATMUL_H
#define PIE_QMATMUL_H

#include "simd.h"

enum { WQ4 = 0, WQ8 = 1 };

/* Bytes of one group-block record. */
INLINE long record_bytes(int kind) { return (kind == WQ4 ? 128 : 256) + 32; }

typedef struct {
    const uint8_t *data; /* (N8 / 8, K / 32) records */
    int32_t kind, n, k;  /* WQ4 or WQ8; outputs (n <= N8); inputs (a multiple of 32) */
} QWeight;

typedef struct { /* M rows of 8-bit activations */
    int8_t *q;        /* (M, K) */
    float *d, *s;     /* (M, K / 32): scale and d * sum(q) */
    long k;
} QAct;

/* One row's blocks: x (K) float32 -> q, d, s. */
static void quantize_row(const float *x, long k, int8_t *q, float *d, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (long b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        const float m = hmax(amax);
        const float db = m / 127.0f;
        const __m256 id = _mm256_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
        __m256i iv[4];
        for (int i = 0; i < 4; i++)
            iv[i] = _mm256_cvtps_epi32(
                _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back */
        const __m256i p16a = _mm256_packs_epi32(iv[0], iv[1]), p16b = _mm256_packs_epi32(iv[2], iv[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), ordered);
        d[b] = db;
        s[b] = db * (float)_mm_cvtsi128_si32(t);
    }
}

static void quantize_rows(const float *x, long ldx, long m0, long m1, QAct *a) {
    for (long r = m0; r < m1; r++) quantize_row(x + r * ldx, a->k, a->q + r * a->k, a->d + r * (a->k / QK), a->s + r * (a->k / QK));
}

/* The 8 value registers of one record (unsigned bytes; 8-bit AVX2: |q|, the signs applied to x below). */
INLINE void load_values(const uint8_t *p, int kind, __m256i w[8]) {
    if (kind == WQ4) {
        const __m256i lo = _mm256_set1_epi8(0x0f);
        for (int j = 0; j < 4; j++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(p + 32 * j));
            w[j] = _mm256_and_si256(c, lo);
            w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(c, 4), lo);
        }
    } else {
        for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256((const __m256i *)(p + 32 * j));
    }
}

/* Rows m0 .. m0+R-1 of one group of 8 outputs; `out` gets acc (+ bias), or acc added to it (`add`). */
INLINE void group_rows(const QWeight *w, long g, const QAct *a, long m0, const int R, float *y, long ldy,
                       const float *bias, int add) {
    const long nb = w->k / QK, rb = record_bytes(w->kind), vb = rb - 32;
    const int signed8 = w->kind == WQ8 && !PIE_VNNI;
    __m256 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const uint8_t *rec = w->data + g * nb * rb;
    for (long b = 0; b < nb; b++, rec += rb) {
        __m256i v[8], sv[8];
        load_values(rec, w->kind, v);
        if (signed8)
            for (int j = 0; j < 8; j++) {
                sv[j] = v[j];
                v[j] = _mm256_abs_epi8(v[j]);
            }
        const __m256 dw = load_f16x8((const uint16_t *)(rec + vb));
        const __m256 mw = load_f16x8((const uint16_t *)(rec + vb + 16));
        for (int r = 0; r < R; r++) {
            const int8_t *xq = a->q + (m0 + r) * a->k + b * QK;
            __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
            for (int j = 0; j < 8; j += 2) {
                __m256i x0 = bcast4(xq + 4 * j), x1 = bcast4(xq + 4 * j + 4);
                if (signed8) {
                    x0 = _mm256_sign_epi8(x0, sv[j]);
                    x1 = _mm256_sign_epi8(x1, sv[j + 1]);
                }
                i0 = dpbusd(i0, v[j], x0);
                i1 = dpbusd(i1, v[j + 1], x1);
            }
            const long ab = (m0 + r) * nb + b;
            const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a->d[ab]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), scale, acc[r]);
            acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->s[ab]), acc[r]);
        }
    }
    const long n0 = g * 8, n = w->n - n0 < 8 ? w->n - n0 : 8;
    const __m256 bv = bias && n == 8 ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
    for (int r = 0; r < R; r++) {
        float *yr = y + (m0 + r) * ldy + n0;
        if (n == 8) { /* a whole group: one vector (+ bias, then + y) in this order, as the tail below */
            __m256 v = bias ? _mm256_add_ps(acc[r], bv) : acc[r];
            if (add) v = _mm256_add_ps(_mm256_loadu_ps(yr), v);
            _mm256_storeu_ps(yr, v);
            continue;
        }
        float o[8];
        _mm256_storeu_ps(o, acc[r]);
        for (long j = 0; j < n; j++) {
            const float v = bias ? o[j] + bias[n0 + j] : o[j];
            yr[j] = add ? yr[j] + v : v;
        }
    }
}

#define ROW_TILE 4

/* Groups g0 .. g1-1 of every row of `a` (M rows). */
static void qmatmul_groups(const QWeight *w, long g0, long g1, const QAct *a, long m, float *y, long ldy,
                           const float *bias, int add) {
    for (long g = g0; g < g1; g++) {
        long m0 = 0;
        for (; m0 + ROW_TILE <= m; m0 += ROW_TILE) group_rows(w, g, a, m0, ROW_TILE, y, ldy, bias, add);
        switch (m - m0) {
        case 3: group_rows(w, g, a, m0, 3, y, ldy, bias, add); break;
        case 2: group_rows(w, g, a, m0, 2, y, ldy, bias, add); break;
        case 1: group_rows(w, g, a, m0, 1, y, ldy, bias, add); break;
        }
    }
}

INLINE long n_groups(const QWeight *w) { return (w->n + 7) / 8; }

#endif
