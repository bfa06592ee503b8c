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
 *     dw[8] as float16, then (4-bit only) mw[8] as float16; an 8-bit record's mw is derived (-128 dw on VNNI,
 *     0 on AVX2), so that its bytes are GGUF's Q8_0 bytes (34 for 32 weights) and no more
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

enum { WQ4 = 0, WQ8 = 1, WX = 2 }; /* WX: mixed kinds, below */

/* Bytes of one group-block record, and of its values (the float16 scales follow them). */
INLINE long values_bytes(int kind) { return kind == WQ4 ? 128 : 256; }
INLINE long record_bytes(int kind) { return values_bytes(kind) + (kind == WQ4 ? 32 : 16); }

typedef struct {
    const uint8_t *data; /* (N8 / 8, K / 32) records */
    int32_t kind, n, k;  /* WQ4, WQ8 or WX; outputs (n <= N8); inputs (a multiple of 32) */
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

/* A record's mw (8 lanes): stored (4-bit), or derived from dw (8-bit; exact: a power-of-two multiple). */
INLINE __m256 load_mw(const uint8_t *rec, int kind, __m256 dw) {
    if (kind == WQ4) return load_f16x8((const uint16_t *)(rec + values_bytes(WQ4) + 16));
    return PIE_VNNI ? _mm256_mul_ps(dw, _mm256_set1_ps(-128.0f)) : _mm256_setzero_ps();
}

/* Rows m0 .. m0+R-1 of group g's results: acc (+ bias) into y, or added to y (`add`); one order for every path. */
INLINE void store_group(const QWeight *w, long g, const __m256 *acc, long m0, int R, float *y, long ldy,
                        const float *bias, int add) {
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


/* Rows m0 .. m0+R-1 of one group of 8 outputs; `out` gets acc (+ bias), or acc added to it (`add`). */
INLINE void group_rows(const QWeight *w, long g, const QAct *a, long m0, const int R, float *y, long ldy,
                       const float *bias, int add) {
    const long nb = w->k / QK, rb = record_bytes(w->kind), vb = values_bytes(w->kind);
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
        const __m256 mw = load_mw(rec, w->kind, dw);
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
    store_group(w, g, acc, m0, R, y, ldy, bias, add);
}

#if defined(PIE_AVX512VNNI)
/* The float16 scales of groups g and g+1 (`pair`; else g and zeros) as 16 float lanes. */
INLINE __m512 load_f16x16(const uint16_t *p0, const uint16_t *p1, int pair) {
    const __m128i h0 = _mm_loadu_si128((const __m128i *)p0), h1 = pair ? _mm_loadu_si128((const __m128i *)p1) : _mm_setzero_si128();
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(h0), h1, 1));
}

/* The mw of groups g and g+1 as 16 lanes, as load_mw gives each (`pair`; else g and zeros). */
INLINE __m512 load_mw16(const uint8_t *r0, const uint8_t *r1, int kind, __m512 dw, int pair) {
    if (kind == WQ4) {
        const long vb = values_bytes(WQ4) + 16;
        return load_f16x16((const uint16_t *)(r0 + vb), (const uint16_t *)(r1 + vb), pair);
    }
    return PIE_VNNI ? _mm512_mul_ps(dw, _mm512_set1_ps(-128.0f)) : _mm512_setzero_ps();
}

/* Rows m0 .. m0+R-1 (R <= 16) of 16-lane results: lanes 0-7 to group g, lanes 8-15 to group g+1 (`pair`). */
INLINE void store_pair(const QWeight *w, long g, int pair, const __m512 *acc, long m0, int R, float *y, long ldy,
                       const float *bias, int add) {
    for (int h = 0; h <= pair; h++) {
        __m256 half[16];
        for (int r = 0; r < R; r++)
            half[r] = _mm256_castpd_ps(h ? _mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)
                                         : _mm512_castpd512_pd256(_mm512_castps_pd(acc[r])));
        store_group(w, g + h, half, m0, R, y, ldy, bias, add);
    }
}
#endif

#ifdef PIE_AMX
/* AMX (Intel's tile matrix unit) for calls of several rows: per block, one TDPBSUD multiplies up to 16 rows'
 * activations (signed, R x 32) by two groups' weights (unsigned, 32 x 16, the x8 records side by side) into
 * exact int32 sums, the same integers the dpbusd path makes; the float epilogue is then the dpbusd path's,
 * lane for lane (16 lanes: two groups), so a row's bits are the same on either path and the number of rows
 * decides only the speed. Tiles: C0 C1 (R x 16 int32), A0 A1 (R x 32 bytes), B0 B1 (8 x 64 bytes): two blocks
 * in flight. Linux hands a process the tile state on request (arch_prctl); refused, the dpbusd path runs. */
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_MIN_ROWS 6 /* fewer rows: the dpbusd path is as fast (a tile multiply costs about the same at any R) */
static int amx_ready;
__attribute__((constructor)) static void amx_request(void) {
    amx_ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;
static __thread int amx_rows; /* the row count this thread's tiles are configured for (0: none yet) */

static void amx_configure(int R) {
    if (amx_rows == R) return;
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t += 3) {
        c.rows[t] = (uint8_t)R, c.colsb[t] = 64;         /* C */
        c.rows[t + 1] = (uint8_t)R, c.colsb[t + 1] = 32; /* A */
        c.rows[t + 2] = 8, c.colsb[t + 2] = 64;          /* B */
    }
    _tile_loadconfig(&c);
    amx_rows = R;
}

/* Block b of groups g and g+1 as B's 8 rows of 64 bytes: row j = value 4j + t of output o at byte 4o + t (o < 16;
 * a group past the last is zeros). */
INLINE void amx_weights(const QWeight *w, long g, long b, int pair, uint8_t *out) {
    const long nb = w->k / QK, rb = record_bytes(w->kind);
    const uint8_t *r0 = w->data + (g * nb + b) * rb, *r1 = r0 + nb * rb;
    const __m512i lo = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < (w->kind == WQ4 ? 4 : 8); j++) {
        const __m256i c0 = _mm256_loadu_si256((const __m256i *)(r0 + 32 * j));
        const __m256i c1 = pair ? _mm256_loadu_si256((const __m256i *)(r1 + 32 * j)) : _mm256_setzero_si256();
        const __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1);
        if (w->kind == WQ4) {
            _mm512_storeu_si512(out + 64 * j, _mm512_and_si512(c, lo));
            _mm512_storeu_si512(out + 64 * (j + 4), _mm512_and_si512(_mm512_srli_epi16(c, 4), lo));
        } else {
            _mm512_storeu_si512(out + 64 * j, c);
        }
    }
}

/* acc[r] (16 lanes) += block b's sums for rows m0 .. m0+R-1: as group_rows does for 8 lanes. */
INLINE void amx_epilogue(const QWeight *w, long g, long b, int pair, const QAct *a, long m0, int R,
                         const int32_t *sums, __m512 *acc) {
    const long nb = w->k / QK, rb = record_bytes(w->kind), vb = values_bytes(w->kind);
    const uint8_t *r0 = w->data + (g * nb + b) * rb, *r1 = r0 + nb * rb;
    const __m512 dw = load_f16x16((const uint16_t *)(r0 + vb), (const uint16_t *)(r1 + vb), pair);
    const __m512 mw = load_mw16(r0, r1, w->kind, dw, pair);
    for (int r = 0; r < R; r++) {
        const long ab = (m0 + r) * nb + b;
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[ab]));
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + 16 * r));
        acc[r] = _mm512_fmadd_ps(isum, scale, acc[r]);
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[ab]), acc[r]);
    }
}

#define AMX_CHUNK 8 /* blocks whose weights are laid out, multiplied, then scaled, in three passes */

/* Rows m0 .. m0+R-1 (R <= 16) of groups g and g+1 (`pair`; else g alone). A chunk of blocks goes through each
 * step before the next (lay out B, multiply, scale in block order), so that no step waits on the memory the
 * step before it has just written. */
static void amx_rows_of(const QWeight *w, long g, int pair, const QAct *a, long m0, int R, float *y, long ldy,
                        const float *bias, int add) {
    const long nb = w->k / QK;
    __attribute__((aligned(64))) uint8_t wb[AMX_CHUNK][512];
    __attribute__((aligned(64))) int32_t sums[AMX_CHUNK][16 * 16];
    __m512 acc[16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    amx_configure(R);
    const int8_t *x = a->q + m0 * a->k;
    for (long b0 = 0; b0 < nb; b0 += AMX_CHUNK) {
        const int cnt = nb - b0 < AMX_CHUNK ? (int)(nb - b0) : AMX_CHUNK;
        for (int i = 0; i < cnt; i++) amx_weights(w, g, b0 + i, pair, wb[i]);
        int i = 0;
        for (; i + 2 <= cnt; i += 2) {
            _tile_zero(0);
            _tile_zero(3);
            _tile_loadd(1, x + (b0 + i) * QK, a->k);
            _tile_loadd(2, wb[i], 64);
            _tile_loadd(4, x + (b0 + i + 1) * QK, a->k);
            _tile_loadd(5, wb[i + 1], 64);
            _tile_dpbsud(0, 1, 2);
            _tile_dpbsud(3, 4, 5);
            _tile_stored(0, sums[i], 64);
            _tile_stored(3, sums[i + 1], 64);
        }
        if (i < cnt) {
            _tile_zero(0);
            _tile_loadd(1, x + (b0 + i) * QK, a->k);
            _tile_loadd(2, wb[i], 64);
            _tile_dpbsud(0, 1, 2);
            _tile_stored(0, sums[i], 64);
        }
        for (i = 0; i < cnt; i++) amx_epilogue(w, g, b0 + i, pair, a, m0, R, sums[i], acc);
    }
    store_pair(w, g, pair, acc, m0, R, y, ldy, bias, add);
}
#endif

#define ROW_TILE 4

#if defined(PIE_AVX512VNNI)
#define PAIR_TILE 8 /* rows a pair of groups takes at once: its 16 lanes of values unpacked once for them */
/* Fewer rows take the 8-lane path, as fast or faster there (docs/performance.md, "Pass cost by rows"). */
#define PAIR_MIN_ROWS 4

/* One record's values for groups g (low 256 bits) and g+1 (high), as load_values gives each. */
INLINE void load_values_pair(const uint8_t *p0, const uint8_t *p1, int kind, __m512i w[8]) {
    const __m512i lo = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < (kind == WQ4 ? 4 : 8); j++) {
        const __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p0 + 32 * j))),
                                             _mm256_loadu_si256((const __m256i *)(p1 + 32 * j)), 1);
        if (kind == WQ4) {
            w[j] = _mm512_and_si512(c, lo);
            w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), lo);
        } else {
            w[j] = c;
        }
    }
}

/* Rows m0 .. m0+R-1 of groups g and g+1 (both whole records) at once, in 16 lanes: lane for lane the
 * operations of group_rows (the same dpbusd sums, then the same scale, cvt and two fmas in the same order),
 * so the bits are group_rows' and only the work per row shrinks: one broadcast, one dpbusd and one epilogue
 * serve 16 outputs instead of 8. */
INLINE void pair_rows(const QWeight *w, long g, const QAct *a, long m0, const int R, float *y, long ldy,
                      const float *bias, int add) {
    const long nb = w->k / QK, rb = record_bytes(w->kind), vb = values_bytes(w->kind);
    __m512 acc[PAIR_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *r0 = w->data + g * nb * rb, *r1 = r0 + nb * rb;
    for (long b = 0; b < nb; b++, r0 += rb, r1 += rb) {
        __m512i v[8];
        load_values_pair(r0, r1, w->kind, v);
        const __m512 dw = load_f16x16((const uint16_t *)(r0 + vb), (const uint16_t *)(r1 + vb), 1);
        const __m512 mw = load_mw16(r0, r1, w->kind, dw, 1);
        for (int r = 0; r < R; r++) {
            const int8_t *xq = a->q + (m0 + r) * a->k + b * QK;
            __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                int32_t x0, x1;
                memcpy(&x0, xq + 4 * j, 4);
                memcpy(&x1, xq + 4 * j + 4, 4);
                i0 = _mm512_dpbusd_epi32(i0, v[j], _mm512_set1_epi32(x0));
                i1 = _mm512_dpbusd_epi32(i1, v[j + 1], _mm512_set1_epi32(x1));
            }
            const long ab = (m0 + r) * nb + b;
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[ab]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[ab]), acc[r]);
        }
    }
    store_pair(w, g, 1, acc, m0, R, y, ldy, bias, add);
}

/* Every row of `a` for groups g and g+1, a tile of rows at a time. */
static void pair_all_rows(const QWeight *w, long g, const QAct *a, long m, float *y, long ldy, const float *bias,
                          int add) {
    long m0 = 0;
    for (; m0 + PAIR_TILE <= m; m0 += PAIR_TILE) pair_rows(w, g, a, m0, PAIR_TILE, y, ldy, bias, add);
    switch (m - m0) { /* constant tile sizes: the accumulators stay in registers */
    case 7: pair_rows(w, g, a, m0, 7, y, ldy, bias, add); break;
    case 6: pair_rows(w, g, a, m0, 6, y, ldy, bias, add); break;
    case 5: pair_rows(w, g, a, m0, 5, y, ldy, bias, add); break;
    case 4: pair_rows(w, g, a, m0, 4, y, ldy, bias, add); break;
    case 3: pair_rows(w, g, a, m0, 3, y, ldy, bias, add); break;
    case 2: pair_rows(w, g, a, m0, 2, y, ldy, bias, add); break;
    case 1: pair_rows(w, g, a, m0, 1, y, ldy, bias, add); break;
    }
}
#endif

/* Groups g0 .. g1-1 of every row of `a` (M rows). */
static void qmatmul_groups(const QWeight *w, long g0, long g1, const QAct *a, long m, float *y, long ldy,
                           const float *bias, int add) {
#ifdef PIE_AMX
    if (amx_ready && m >= AMX_MIN_ROWS) {
        for (long g = g0; g < g1; g += 2)
            for (long m0 = 0; m0 < m; m0 += 16)
                amx_rows_of(w, g, g + 1 < g1, a, m0, m - m0 < 16 ? (int)(m - m0) : 16, y, ldy, bias, add);
        return;
    }
#endif
    for (long g = g0; g < g1; g++) {
#if defined(PIE_AVX512VNNI)
        if (g + 1 < g1 && m >= PAIR_MIN_ROWS) { /* two groups in 16 lanes (pair_rows): the same bits, less work */
            pair_all_rows(w, g, a, m, y, ldy, bias, add);
            g++;
            continue;
        }
#endif
        long m0 = 0;
        for (; m0 + ROW_TILE <= m; m0 += ROW_TILE) group_rows(w, g, a, m0, ROW_TILE, y, ldy, bias, add);
        switch (m - m0) {
        case 3: group_rows(w, g, a, m0, 3, y, ldy, bias, add); break;
        case 2: group_rows(w, g, a, m0, 2, y, ldy, bias, add); break;
        case 1: group_rows(w, g, a, m0, 1, y, ldy, bias, add); break;
        }
    }
}

/* ---- WX: a weight of mixed kinds (GGUF's Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 and, beside them, Q4_0/Q4_1/Q8_0) ----
 * data: a header of one int64 per group of 8 outputs, (byte offset of the group's records << 4) | (scale mode << 2)
 * | sub-kind, then the records. Each group is one sub-kind and one scale mode (a fused weight's parts may differ:
 * Q4_K q/k beside a Q6_K v); its records hold the GGUF values and scales as they are, about GGUF's own bytes.
 * The values of a record (32 weights of each of the 8 outputs):
 *     XA4  4-bit values as WQ4's record                          w = dw q + mw     (Q4_0 as q + 8, Q4_1, Q4_K)
 *     XA5  XA4's low 4 bits, then the fifth bits (4 bytes an output: bit v = value v)
 *                                                                 w = dw q + mw     (Q5_0 as q + 16, Q5_1, Q5_K)
 *     XA8  8-bit values (0..255) as WQ8's                         w = dw q + mw     (none at present)
 *     XS16 signed 8-bit values as WQ8's                           w = d_half q      (Q8_0, Q6_K)
 * then their scales, by the group's mode (s0: dw or d_lo; s1: mw or d_hi):
 *     XD   s0[8] float16; s1 = c s0 with c = -8 (XA4), -16 (XA5), -128 (XA8), or s1 = s0 (XS16)   (the kinds of 32
 *          with one scale: Q4_0, Q5_0, Q8_0)
 *     XDM  s0[8], s1[8] float16                                                          (Q4_1, Q5_1)
 *     XK   int8 a0[8], a1[8], and before every 8 records (a K-kind's super-block of 256) a header of float16
 *          D0[8], D1[8]: s0 = D0 a0, s1 = D1 a1            (Q4_K / Q5_K: d, sc, -dmin, m; Q6_K: d and its sub-scales
 *          of 16, a0 for values 0..15 of the record and a1 for 16..31)
 * Every scale is exact in float32 (a float16 times a small integer, or a power of two), and the same float32
 * value the dequantized weight uses. XS16's values 0..15 of a block take d_lo and 16..31 d_hi (Q6_K's sub-blocks
 * of 16); the sign moves onto x as on AVX2's Q8_0 (|q| <= 128 and |x| <= 127: maddubs never saturates), on every
 * variant, so its integer sums and hence its bits are the same on every variant. A row's operations never depend
 * on the other rows of a call. */
enum { XA4 = 0, XA8 = 1, XS16 = 2, XA5 = 3 }; /* sub-kinds: how the values are held */
enum { XD = 0, XDM = 1, XK = 2 };             /* scale modes */

typedef struct {
    long vb, rb;  /* bytes of a record's values, and of the whole record */
    long per, hb; /* records a super-block (XK: 8, else 1), and bytes of its header (XK: 32, else 0) */
} XLayout;

INLINE XLayout x_layout(int sub, int mode) {
    XLayout l;
    l.vb = sub == XA4 ? 128 : sub == XA5 ? 160 : 256;
    l.rb = l.vb + (mode == XDM ? 32 : 16);
    l.per = mode == XK ? 8 : 1;
    l.hb = mode == XK ? 32 : 0;
    return l;
}

/* Bytes of one group's records, nb blocks (XK: a multiple of 8). */
INLINE long x_group_bytes(XLayout l, long nb) { return nb * l.rb + nb / l.per * l.hb; }

INLINE float x_offset_factor(int sub) { return sub == XA4 ? -8.0f : sub == XA5 ? -16.0f : -128.0f; }

INLINE void x_group(const QWeight *w, long g, int *sub, int *mode, const uint8_t **rec) {
    const int64_t h = ((const int64_t *)w->data)[g];
    *sub = (int)(h & 3);
    *mode = (int)((h >> 2) & 3);
    *rec = w->data + (h >> 4);
}

/* A record's scales s0, s1 (8 lanes); d0, d1: XK's super-block header as floats. */
INLINE void x_scales(const uint8_t *rec, int sub, int mode, long vb, __m256 d0, __m256 d1, __m256 *s0, __m256 *s1) {
    if (mode == XK) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(rec + vb));
        *s0 = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)));
        *s1 = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))));
        return;
    }
    *s0 = load_f16x8((const uint16_t *)(rec + vb));
    if (mode == XDM)
        *s1 = load_f16x8((const uint16_t *)(rec + vb + 16));
    else
        *s1 = sub == XS16 ? *s0 : _mm256_mul_ps(*s0, _mm256_set1_ps(x_offset_factor(sub)));
}

/* XA5: ORs each value's fifth bit (16) into the 8 value registers of load_values(WQ4). Chunk j's byte 4o + t is
 * value 4j + t of output o, whose bit sits at bit 4j + t of output o's 32-bit word: shift the words right by
 * 4j, spread byte 0 of each word over its 4 bytes, and test bit t of byte t. */
INLINE void or_fifth_bits(const uint8_t *plane, __m256i w[8]) {
    const __m256i words = _mm256_loadu_si256((const __m256i *)plane);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4,
                                            8, 8, 8, 8, 12, 12, 12, 12);
    const __m256i bit = _mm256_set1_epi32(0x08040201), sixteen = _mm256_set1_epi8(16);
    for (int j = 0; j < 8; j++) {
        const __m256i b = _mm256_shuffle_epi8(_mm256_srli_epi32(words, 4 * j), spread);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
        w[j] = _mm256_or_si256(w[j], _mm256_and_si256(set, sixteen));
    }
}

/* A record's 8 value registers as dpbusd takes them (unsigned; XS16: |q|, the signs in sv). */
INLINE void x_values(const uint8_t *rec, int sub, __m256i v[8], __m256i sv[8]) {
    load_values(rec, sub == XA4 || sub == XA5 ? WQ4 : WQ8, v);
    if (sub == XA5) or_fifth_bits(rec + 128, v);
    if (sub == XS16)
        for (int j = 0; j < 8; j++) {
            sv[j] = v[j];
            v[j] = _mm256_abs_epi8(v[j]);
        }
}

INLINE void x_rows(const uint8_t *rec, const int sub, const int mode, long nb, const QAct *a, long m0, const int R,
                   __m256 *acc) {
    const XLayout l = x_layout(sub, mode);
    __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++, rec += l.rb) {
        if (mode == XK && b % 8 == 0) { /* a super-block's header */
            d0 = load_f16x8((const uint16_t *)rec);
            d1 = load_f16x8((const uint16_t *)(rec + 16));
            rec += l.hb;
        }
        __m256i v[8], sv[8];
        __m256 s0, s1;
        x_values(rec, sub, v, sv);
        x_scales(rec, sub, mode, l.vb, d0, d1, &s0, &s1);
        for (int r = 0; r < R; r++) {
            const int8_t *xq = a->q + (m0 + r) * a->k + b * QK;
            __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
            __m256i h0 = _mm256_setzero_si256(), h1 = _mm256_setzero_si256();
            for (int j = 0; j < 4; j += 2) { /* values 0..15: chunks 0-3; 16..31: chunks 4-7 */
                __m256i x0 = bcast4(xq + 4 * j), x1 = bcast4(xq + 4 * j + 4);
                __m256i y0 = bcast4(xq + 16 + 4 * j), y1 = bcast4(xq + 16 + 4 * j + 4);
                if (sub == XS16) {
                    x0 = _mm256_sign_epi8(x0, sv[j]);
                    x1 = _mm256_sign_epi8(x1, sv[j + 1]);
                    y0 = _mm256_sign_epi8(y0, sv[j + 4]);
                    y1 = _mm256_sign_epi8(y1, sv[j + 5]);
                }
                i0 = dpbusd(i0, v[j], x0);
                i1 = dpbusd(i1, v[j + 1], x1);
                h0 = dpbusd(h0, v[j + 4], y0);
                h1 = dpbusd(h1, v[j + 5], y1);
            }
            const long ab = (m0 + r) * nb + b;
            const __m256 dx = _mm256_set1_ps(a->d[ab]);
            if (sub == XS16) {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), _mm256_mul_ps(s0, dx), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(h0, h1)), _mm256_mul_ps(s1, dx), acc[r]);
            } else {
                const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(h0, h1));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(s0, dx), acc[r]);
                acc[r] = _mm256_fmadd_ps(s1, _mm256_set1_ps(a->s[ab]), acc[r]);
            }
        }
    }
}

/* CALL(sub, mode) with constant arguments for the pairs the packer makes (each its own loop), else as they are. */
#define X_DISPATCH(sub, mode, CALL)                                                                                  \
    switch ((sub) * 4 + (mode)) {                                                                                    \
    case XA4 * 4 + XD: CALL(XA4, XD); break;                                                                         \
    case XA4 * 4 + XDM: CALL(XA4, XDM); break;                                                                       \
    case XA4 * 4 + XK: CALL(XA4, XK); break;                                                                         \
    case XA5 * 4 + XD: CALL(XA5, XD); break;                                                                         \
    case XA5 * 4 + XDM: CALL(XA5, XDM); break;                                                                       \
    case XA5 * 4 + XK: CALL(XA5, XK); break;                                                                         \
    case XS16 * 4 + XD: CALL(XS16, XD); break;                                                                       \
    case XS16 * 4 + XK: CALL(XS16, XK); break;                                                                       \
    default: CALL(sub, mode); break;                                                                                 \
    }

/* Rows m0 .. m0+R-1 of WX group g. */
INLINE void x_group_rows(const QWeight *w, long g, const QAct *a, long m0, const int R, float *y, long ldy,
                         const float *bias, int add) {
    int sub, mode;
    const uint8_t *rec;
    x_group(w, g, &sub, &mode, &rec);
    __m256 acc[ROW_TILE];
    const long nb = w->k / QK;
#define X_ROWS(S, M) x_rows(rec, S, M, nb, a, m0, R, acc)
    X_DISPATCH(sub, mode, X_ROWS)
#undef X_ROWS
    store_group(w, g, acc, m0, R, y, ldy, bias, add);
}

#if defined(PIE_AVX512VNNI)
INLINE __m512 join_ps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* The value registers of groups g (low 256 bits) and g+1 (high) as x_values gives each; XS16: |q| in v and the
 * sign of q in neg (the lanes whose x is negated: the same products as _mm256_sign_epi8's, |q| being 0 where
 * sign_epi8 zeroes x). */
INLINE void x_values_pair(const uint8_t *p0, const uint8_t *p1, int sub, __m512i v[8], __mmask64 neg[8]) {
    load_values_pair(p0, p1, sub == XA4 || sub == XA5 ? WQ4 : WQ8, v);
    if (sub == XA5) { /* or_fifth_bits on 16 lanes: the fifth bit (16) added to a value below 16 */
        const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p0 + 128))),
                                                 _mm256_loadu_si256((const __m256i *)(p1 + 128)), 1);
        const __m512i spread = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
        const __m512i bit = _mm512_set1_epi32(0x08040201), sixteen = _mm512_set1_epi8(16);
        for (int j = 0; j < 8; j++) {
            const __m512i b = _mm512_shuffle_epi8(_mm512_srli_epi32(words, 4 * j), spread);
            v[j] = _mm512_mask_add_epi8(v[j], _mm512_test_epi8_mask(b, bit), v[j], sixteen);
        }
    }
    if (sub == XS16)
        for (int j = 0; j < 8; j++) {
            neg[j] = _mm512_movepi8_mask(v[j]);
            v[j] = _mm512_abs_epi8(v[j]);
        }
}

/* Rows m0 .. m0+R-1 of WX groups g and g+1 (records r0, r1; one sub-kind and mode) in 16 lanes: lane for lane
 * x_rows' operations (the same int32 sums, then the same scale products and fmas in the same order), so the bits
 * are x_rows' and only the work per row shrinks (pair_rows does the same for WQ4 / WQ8). */
INLINE void x_pair_rows(const uint8_t *r0, const uint8_t *r1, const int sub, const int mode, long nb, const QAct *a,
                        long m0, const int R, __m512 *acc) {
    const XLayout l = x_layout(sub, mode);
    const __m512i zero = _mm512_setzero_si512();
    __m256 d00 = _mm256_setzero_ps(), d01 = d00, d10 = d00, d11 = d00;
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++, r0 += l.rb, r1 += l.rb) {
        if (mode == XK && b % 8 == 0) {
            d00 = load_f16x8((const uint16_t *)r0), d01 = load_f16x8((const uint16_t *)(r0 + 16));
            d10 = load_f16x8((const uint16_t *)r1), d11 = load_f16x8((const uint16_t *)(r1 + 16));
            r0 += l.hb, r1 += l.hb;
        }
        __m512i v[8];
        __mmask64 neg[8];
        x_values_pair(r0, r1, sub, v, neg);
        __m256 s00, s01, s10, s11;
        x_scales(r0, sub, mode, l.vb, d00, d01, &s00, &s01);
        x_scales(r1, sub, mode, l.vb, d10, d11, &s10, &s11);
        const __m512 s0 = join_ps(s00, s10), s1 = join_ps(s01, s11);
        for (int r = 0; r < R; r++) {
            const int8_t *xq = a->q + (m0 + r) * a->k + b * QK;
            __m512i i0 = zero, i1 = zero, h0 = zero, h1 = zero;
            for (int j = 0; j < 4; j += 2) {
                int32_t q4[4];
                memcpy(q4, xq + 4 * j, 8);
                memcpy(q4 + 2, xq + 16 + 4 * j, 8);
                __m512i x0 = _mm512_set1_epi32(q4[0]), x1 = _mm512_set1_epi32(q4[1]);
                __m512i y0 = _mm512_set1_epi32(q4[2]), y1 = _mm512_set1_epi32(q4[3]);
                if (sub == XS16) {
                    x0 = _mm512_mask_sub_epi8(x0, neg[j], zero, x0);
                    x1 = _mm512_mask_sub_epi8(x1, neg[j + 1], zero, x1);
                    y0 = _mm512_mask_sub_epi8(y0, neg[j + 4], zero, y0);
                    y1 = _mm512_mask_sub_epi8(y1, neg[j + 5], zero, y1);
                }
                i0 = _mm512_dpbusd_epi32(i0, v[j], x0);
                i1 = _mm512_dpbusd_epi32(i1, v[j + 1], x1);
                h0 = _mm512_dpbusd_epi32(h0, v[j + 4], y0);
                h1 = _mm512_dpbusd_epi32(h1, v[j + 5], y1);
            }
            const long ab = (m0 + r) * nb + b;
            const __m512 dx = _mm512_set1_ps(a->d[ab]);
            if (sub == XS16) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), _mm512_mul_ps(s0, dx), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(h0, h1)), _mm512_mul_ps(s1, dx), acc[r]);
            } else {
                const __m512i isum = _mm512_add_epi32(_mm512_add_epi32(i0, i1), _mm512_add_epi32(h0, h1));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s0, dx), acc[r]);
                acc[r] = _mm512_fmadd_ps(s1, _mm512_set1_ps(a->s[ab]), acc[r]);
            }
        }
    }
}

INLINE void x_pair_group_rows(const QWeight *w, long g, const QAct *a, long m0, const int R, float *y, long ldy,
                              const float *bias, int add) {
    int sub, mode;
    const uint8_t *r0, *r1;
    x_group(w, g, &sub, &mode, &r0);
    x_group(w, g + 1, &sub, &mode, &r1);
    __m512 acc[PAIR_TILE];
    const long nb = w->k / QK;
#define X_PAIR_ROWS(S, M) x_pair_rows(r0, r1, S, M, nb, a, m0, R, acc)
    X_DISPATCH(sub, mode, X_PAIR_ROWS)
#undef X_PAIR_ROWS
    store_pair(w, g, 1, acc, m0, R, y, ldy, bias, add);
}

/* Every row of `a` for WX groups g and g+1, a tile of rows at a time. */
static void x_pair_all_rows(const QWeight *w, long g, const QAct *a, long m, float *y, long ldy, const float *bias,
                            int add) {
    long m0 = 0;
    for (; m0 + PAIR_TILE <= m; m0 += PAIR_TILE) x_pair_group_rows(w, g, a, m0, PAIR_TILE, y, ldy, bias, add);
    switch (m - m0) {
    case 7: x_pair_group_rows(w, g, a, m0, 7, y, ldy, bias, add); break;
    case 6: x_pair_group_rows(w, g, a, m0, 6, y, ldy, bias, add); break;
    case 5: x_pair_group_rows(w, g, a, m0, 5, y, ldy, bias, add); break;
    case 4: x_pair_group_rows(w, g, a, m0, 4, y, ldy, bias, add); break;
    case 3: x_pair_group_rows(w, g, a, m0, 3, y, ldy, bias, add); break;
    case 2: x_pair_group_rows(w, g, a, m0, 2, y, ldy, bias, add); break;
    case 1: x_pair_group_rows(w, g, a, m0, 1, y, ldy, bias, add); break;
    }
}
#endif

INLINE int x_code(const QWeight *w, long g) { return (int)(((const int64_t *)w->data)[g] & 15); }

static void x_groups(const QWeight *w, long g0, long g1, const QAct *a, long m, float *y, long ldy,
                     const float *bias, int add) {
    for (long g = g0; g < g1; g++) {
#if defined(PIE_AVX512VNNI)
        /* 16 lanes at any row count: a WX record's unpacking (fifth bits, scales) is then shared by 16 outputs */
        if (g + 1 < g1 && x_code(w, g) == x_code(w, g + 1)) {
            x_pair_all_rows(w, g, a, m, y, ldy, bias, add);
            g++;
            continue;
        }
#endif
        long m0 = 0;
        for (; m0 + ROW_TILE <= m; m0 += ROW_TILE) x_group_rows(w, g, a, m0, ROW_TILE, y, ldy, bias, add);
        switch (m - m0) {
        case 3: x_group_rows(w, g, a, m0, 3, y, ldy, bias, add); break;
        case 2: x_group_rows(w, g, a, m0, 2, y, ldy, bias, add); break;
        case 1: x_group_rows(w, g, a, m0, 1, y, ldy, bias, add); break;
        }
    }
}

INLINE long n_groups(const QWeight *w) { return (w->n + 7) / 8; }

/* The unit of a matmul's work split across threads: two groups (16 outputs), which the AMX path takes at once. */
INLINE long n_units(const QWeight *w) { return (n_groups(w) + 1) / 2; }

INLINE void qmatmul_unit(const QWeight *w, long u, const QAct *a, long m, float *y, long ldy, const float *bias,
                         int add) {
    const long g1 = 2 * u + 2 < n_groups(w) ? 2 * u + 2 : n_groups(w);
    if (w->kind == WX) {
        x_groups(w, 2 * u, g1, a, m, y, ldy, bias, add);
        return;
    }
    qmatmul_groups(w, 2 * u, g1, a, m, y, ldy, bias, add);
}

#endif
