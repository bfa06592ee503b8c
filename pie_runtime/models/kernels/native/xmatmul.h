/* The WX matmul (qmatmul.h's kind WX): a weight whose groups of 8 outputs each hold one GGUF kind, its values and
 * scales as they are; included by qmatmul.h, whose x8 layout, activations and 16-lane pair path it builds on. */
#ifndef PIE_XMATMUL_H
#define PIE_XMATMUL_H

/* ---- WX: a weight of mixed kinds (GGUF's Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 and, beside them, Q4_0/Q4_1/Q8_0) ----
 * data: a header of one int64 per group of 8 outputs, (byte offset of the group's records << 4) | (scale mode << 2)
 * | sub-kind, then the records. Each group is one sub-kind and one scale mode (a fused weight's parts may differ:
 * Q4_K q/k beside a Q6_K v); its records hold the GGUF values and scales as they are, about GGUF's own bytes.
 * The values of a record (32 weights of each of the 8 outputs):
 *     XA4  4-bit values as WQ4's record                          w = dw q + mw     (Q4_0 as q + 8, Q4_1, Q4_K)
 *     XA5  XA4's low 4 bits, then the fifth bits (4 bytes an output: bit v = value v)
 *                                                                 w = dw q + mw     (Q5_0 as q + 16, Q5_1, Q5_K)
 *     XS6  6-bit values q + 32 (0..63): their low 4 bits as XA4's, then their high 2 bits as 2 chunks of 32
 *          bytes, byte 4o + t of chunk c holding at bits 2i, 2i+1 those of value 4(4c + i) + t of output o
 *          (4c + i: the value register of load_values(WQ4))       w = d_half q      (Q6_K)
 *     XS16 signed 8-bit values as WQ8's                           w = d_half q      (Q8_0)
 * then their scales, by the group's mode (s0: dw or d_lo; s1: mw or d_hi):
 *     XD   s0[8] float16; s1 = c s0 with c = -8 (XA4), -16 (XA5), or s1 = s0 (XS6, XS16)   (the kinds of 32
 *          with one scale: Q4_0, Q5_0, Q8_0)
 *     XDM  s0[8], s1[8] float16                                                          (Q4_1, Q5_1)
 *     XK   int8 a0[8], a1[8], and before every 8 records (a K-kind's super-block of 256) a header of float16
 *          D0[8], D1[8]: s0 = D0 a0, s1 = D1 a1            (Q4_K / Q5_K: d, sc, -dmin, m; Q6_K: d and its sub-scales
 *          of 16, a0 for values 0..15 of the record and a1 for 16..31)
 * Every scale is exact in float32 (a float16 times a small integer, or a power of two), and the same float32
 * value the dequantized weight uses. The signed sub-kinds' (XS6, XS16) values 0..15 of a block take d_lo and
 * 16..31 d_hi (Q6_K's sub-blocks of 16), with the integer sum of q x over each half. XS6 dots its unsigned
 * q + 32 (<= 63) with x from an accumulator started at -32 sum(x) (QAct's h), and XS16 on the VNNI variants its
 * q + 128 from -128 sum(x): the same integer with no per-row sign work. AVX2's maddubs would saturate on
 * q + 128, so there XS16 moves the sign of q onto x (|q| <= 128 and |x| <= 127: it never saturates). Every
 * variant makes the same integer sums, whichever way the values are held, and scales them in one order: the bits
 * are the same on every variant and for Q6_K held as XS6 or XS16. A row's operations never depend on the other
 * rows of a call. */
enum { XA4 = 0, XS6 = 1, XS16 = 2, XA5 = 3 }; /* sub-kinds: how the values are held */
enum { XD = 0, XDM = 1, XK = 2 };             /* scale modes */

typedef struct {
    long vb, rb;  /* bytes of a record's values, and of the whole record */
    long per, hb; /* records a super-block (XK: 8, else 1), and bytes of its header (XK: 32, else 0) */
} XLayout;

INLINE XLayout x_layout(int sub, int mode) {
    XLayout l;
    l.vb = sub == XA4 ? 128 : sub == XA5 ? 160 : sub == XS6 ? 192 : 256;
    l.rb = l.vb + (mode == XDM ? 32 : 16);
    l.per = mode == XK ? 8 : 1;
    l.hb = mode == XK ? 32 : 0;
    return l;
}

/* Bytes of one group's records, nb blocks (XK: a multiple of 8). */
INLINE long x_group_bytes(XLayout l, long nb) { return nb * l.rb + nb / l.per * l.hb; }

/* The sub-kinds whose values are signed, scaled per 16 with no offset (w = d_half q). */
INLINE int x_signed(int sub) { return sub == XS6 || sub == XS16; }

INLINE float x_offset_factor(int sub) { return sub == XA4 ? -8.0f : -16.0f; } /* XA4, XA5 in mode XD */

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
        *s1 = x_signed(sub) ? *s0 : _mm256_mul_ps(*s0, _mm256_set1_ps(x_offset_factor(sub)));
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

/* XS6: ORs the high 2 bits (16, 32) into the 8 registers of load_values(WQ4), giving q + 32: those of register
 * 4c + i are bits 2i, 2i+1 of chunk c of the plane; each byte shifted on its own (the 16-bit shifts' bits
 * crossing from the next byte are masked off). */
INLINE void or_high_two_bits(const uint8_t *plane, __m256i w[8]) {
    const __m256i mask = _mm256_set1_epi8(0x30);
    for (int c = 0; c < 2; c++) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(plane + 32 * c));
        const __m256i hi[4] = {_mm256_slli_epi16(h, 4), _mm256_slli_epi16(h, 2), h, _mm256_srli_epi16(h, 2)};
        for (int i = 0; i < 4; i++) w[4 * c + i] = _mm256_or_si256(w[4 * c + i], _mm256_and_si256(hi[i], mask));
    }
}

/* A record's 8 value registers as dpbusd takes them (unsigned: XS6 q + 32; XS16 q + 128 on VNNI, else |q| with
 * the signs in sv). */
INLINE void x_values(const uint8_t *rec, int sub, __m256i v[8], __m256i sv[8]) {
    load_values(rec, sub == XS16 ? WQ8 : WQ4, v);
    if (sub == XA5) or_fifth_bits(rec + 128, v);
    if (sub == XS6) or_high_two_bits(rec + 128, v);
    if (sub == XS16 && PIE_VNNI)
        for (int j = 0; j < 8; j++) v[j] = _mm256_xor_si256(v[j], _mm256_set1_epi8((char)0x80));
    if (sub == XS16 && !PIE_VNNI)
        for (int j = 0; j < 8; j++) {
            sv[j] = v[j];
            v[j] = _mm256_abs_epi8(v[j]);
        }
}

/* -c sum(x) of half block i (2 ab + 0 or 1) of QAct a, where the values are held as q + c (XS6: c = 32; XS16 on
 * VNNI: 128), else 0: what a half block's integer dot starts from. */
INLINE int32_t x_start(const QAct *a, long i, int sub) {
    return sub == XS6 ? a->h[i] : sub == XS16 && PIE_VNNI ? 4 * a->h[i] : 0;
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
            const long ab = (m0 + r) * nb + b;
            /* sum (q + c) x - c sum x = sum q x, for each half */
            __m256i i0 = _mm256_set1_epi32(x_start(a, 2 * ab, sub)), i1 = _mm256_setzero_si256();
            __m256i h0 = _mm256_set1_epi32(x_start(a, 2 * ab + 1, sub)), h1 = _mm256_setzero_si256();
            for (int j = 0; j < 4; j += 2) { /* values 0..15: chunks 0-3; 16..31: chunks 4-7 */
                __m256i x0 = bcast4(xq + 4 * j), x1 = bcast4(xq + 4 * j + 4);
                __m256i y0 = bcast4(xq + 16 + 4 * j), y1 = bcast4(xq + 16 + 4 * j + 4);
                if (sub == XS16 && !PIE_VNNI) {
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
            const __m256 dx = _mm256_set1_ps(a->d[ab]);
            if (x_signed(sub)) {
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
    case XS6 * 4 + XK: CALL(XS6, XK); break;                                                                         \
    case XS16 * 4 + XD: CALL(XS16, XD); break;                                                                       \
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

/* The value registers of groups g (low 256 bits) and g+1 (high) as x_values gives each (a VNNI variant). */
INLINE void x_values_pair(const uint8_t *p0, const uint8_t *p1, int sub, __m512i v[8]) {
    load_values_pair(p0, p1, sub == XS16 ? WQ8 : WQ4, v);
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
    if (sub == XS6) { /* or_high_two_bits on 16 lanes */
        const __m512i mask = _mm512_set1_epi8(0x30);
        for (int c = 0; c < 2; c++) {
            const __m512i h = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p0 + 128 + 32 * c))),
                _mm256_loadu_si256((const __m256i *)(p1 + 128 + 32 * c)), 1);
            const __m512i hi[4] = {_mm512_slli_epi16(h, 4), _mm512_slli_epi16(h, 2), h, _mm512_srli_epi16(h, 2)};
            for (int i = 0; i < 4; i++)
                v[4 * c + i] = _mm512_ternarylogic_epi32(v[4 * c + i], hi[i], mask, 0xf8); /* v | (hi & mask) */
        }
    }
    if (sub == XS16)
        for (int j = 0; j < 8; j++) v[j] = _mm512_xor_si512(v[j], _mm512_set1_epi8((char)0x80));
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
        x_values_pair(r0, r1, sub, v);
        __m256 s00, s01, s10, s11;
        x_scales(r0, sub, mode, l.vb, d00, d01, &s00, &s01);
        x_scales(r1, sub, mode, l.vb, d10, d11, &s10, &s11);
        const __m512 s0 = join_ps(s00, s10), s1 = join_ps(s01, s11);
        for (int r = 0; r < R; r++) {
            const int8_t *xq = a->q + (m0 + r) * a->k + b * QK;
            const long ab = (m0 + r) * nb + b;
            __m512i i0 = _mm512_set1_epi32(x_start(a, 2 * ab, sub)), i1 = zero;
            __m512i h0 = _mm512_set1_epi32(x_start(a, 2 * ab + 1, sub)), h1 = zero;
            for (int j = 0; j < 4; j += 2) {
                int32_t q4[4];
                memcpy(q4, xq + 4 * j, 8);
                memcpy(q4 + 2, xq + 16 + 4 * j, 8);
                const __m512i x0 = _mm512_set1_epi32(q4[0]), x1 = _mm512_set1_epi32(q4[1]);
                const __m512i y0 = _mm512_set1_epi32(q4[2]), y1 = _mm512_set1_epi32(q4[3]);
                i0 = _mm512_dpbusd_epi32(i0, v[j], x0);
                i1 = _mm512_dpbusd_epi32(i1, v[j + 1], x1);
                h0 = _mm512_dpbusd_epi32(h0, v[j + 4], y0);
                h1 = _mm512_dpbusd_epi32(h1, v[j + 5], y1);
            }
            const __m512 dx = _mm512_set1_ps(a->d[ab]);
            if (x_signed(sub)) {
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
#define X_PAIR_TILE(M0, R) x_pair_group_rows(w, g, a, M0, R, y, ldy, bias, add)
    ROWS_IN_TILES_OF_8(m, X_PAIR_TILE);
#undef X_PAIR_TILE
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
#define X_GROUP_TILE(M0, R) x_group_rows(w, g, a, M0, R, y, ldy, bias, add)
        ROWS_IN_TILES_OF_4(m, X_GROUP_TILE);
#undef X_GROUP_TILE
    }
}

#endif
