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
    int32_t *h;       /* (M, K / 16): -32 sum(q) of each half block (XS6's offset, xmatmul.h) */
    long k;
} QAct;

INLINE int32_t sum_epi32(__m256i v) { /* one order always */
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}

/* One row's blocks: x (K) float32 -> q, d, s, h. */
static void quantize_row(const float *x, long k, int8_t *q, float *d, float *s, int32_t *h) {
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
        const int32_t lo = sum_epi32(_mm256_add_epi32(iv[0], iv[1])), hi = sum_epi32(_mm256_add_epi32(iv[2], iv[3]));
        h[2 * b] = -32 * lo;
        h[2 * b + 1] = -32 * hi;
        /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back */
        const __m256i p16a = _mm256_packs_epi32(iv[0], iv[1]), p16b = _mm256_packs_epi32(iv[2], iv[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), ordered);
        d[b] = db;
        s[b] = db * (float)(lo + hi);
    }
}

static void quantize_rows(const float *x, long ldx, long m0, long m1, QAct *a) {
    const long nb = a->k / QK;
    for (long r = m0; r < m1; r++) quantize_row(x + r * ldx, a->k, a->q + r * a->k, a->d + r * nb, a->s + r * nb, a->h + 2 * r * nb);
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

#define ROW_TILE 4 /* rows a group of 8 outputs takes at once (ROWS_IN_TILES_OF_4) */

/* CALL(m0, R) over rows 0 .. m-1: whole tiles of 8 (or 4) rows, then the rest in one call of a constant R, so
 * that each call's accumulators stay in registers. The multi-row loops of both matmuls (below, xmatmul.h). */
#define ROWS_IN_TILES_OF_8(m, CALL)                                                                                 \
    do {                                                                                                            \
        long m0_ = 0;                                                                                               \
        for (; m0_ + 8 <= (m); m0_ += 8) CALL(m0_, 8);                                                              \
        switch ((m) - m0_) {                                                                                        \
        case 7: CALL(m0_, 7); break;                                                                                \
        case 6: CALL(m0_, 6); break;                                                                                \
        case 5: CALL(m0_, 5); break;                                                                                \
        case 4: CALL(m0_, 4); break;                                                                                \
        case 3: CALL(m0_, 3); break;                                                                                \
        case 2: CALL(m0_, 2); break;                                                                                \
        case 1: CALL(m0_, 1); break;                                                                                \
        }                                                                                                           \
    } while (0)
#define ROWS_IN_TILES_OF_4(m, CALL)                                                                                 \
    do {                                                                                                            \
        long m0_ = 0;                                                                                               \
        for (; m0_ + 4 <= (m); m0_ += 4) CALL(m0_, 4);                                                              \
        switch ((m) - m0_) {                                                                                        \
        case 3: CALL(m0_, 3); break;                                                                                \
        case 2: CALL(m0_, 2); break;                                                                                \
        case 1: CALL(m0_, 1); break;                                                                                \
        }                                                                                                           \
    } while (0)

#if defined(PIE_AVX512VNNI)
#define PAIR_TILE 8 /* rows a pair of groups takes at once (ROWS_IN_TILES_OF_8): its 16 lanes of values unpacked
                      * once for them */
_Static_assert(PAIR_TILE == 8 && ROW_TILE == 4, "the tile loops ROWS_IN_TILES_OF_8 / _4 are these tiles");
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
#define PAIR_ROWS(M0, R) pair_rows(w, g, a, M0, R, y, ldy, bias, add)
    ROWS_IN_TILES_OF_8(m, PAIR_ROWS);
#undef PAIR_ROWS
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
#define GROUP_ROWS(M0, R) group_rows(w, g, a, M0, R, y, ldy, bias, add)
        ROWS_IN_TILES_OF_4(m, GROUP_ROWS);
#undef GROUP_ROWS
    }
}

#include "xmatmul.h" /* WX: mixed GGUF kinds (x_groups) */

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
