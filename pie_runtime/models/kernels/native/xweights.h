/* WX weights (qmatmul.h: groups of 8 outputs, each of one sub-kind and scale mode, GGUF values and scales as they
 * are) outside a matmul: rows dequantized (an embedding table kept once with a tied head) and rows selected into a
 * weight of their own (a drafter's slice of the head). The records themselves are laid out by native_linear.py
 * (numpy). */
#ifndef PIE_XWEIGHTS_H
#define PIE_XWEIGHTS_H

#include "qmatmul.h"

/* One value of output o (0..7) at position v (0..31) of a record. */
INLINE int x_value(const uint8_t *rec, int sub, int o, int v) {
    if (sub == XS16) return (int8_t)rec[32 * (v / 4) + 4 * o + v % 4];
    const uint8_t byte = rec[32 * ((v % 16) / 4) + 4 * o + v % 4];
    const int low = v < 16 ? byte & 0x0f : byte >> 4;
    if (sub == XS6) { /* value v sits in register v / 4 = 4c + i: bits 2i, 2i+1 of chunk c */
        const int j = v / 4;
        return (low | ((rec[128 + 32 * (j / 4) + 4 * o + v % 4] >> (2 * (j % 4))) & 3) << 4) - 32;
    }
    return low | (sub == XA5 ? ((rec[128 + 4 * o + v / 8] >> (v % 8)) & 1) << 4 : 0);
}

static float f16_at(const uint8_t *p, long i) {
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return _cvtsh_ss(h);
}

/* Output o's scales s0, s1 of a record (x_scales of qmatmul.h, one lane); hdr: XK's super-block header. */
static void x_scales_of(const uint8_t *rec, const uint8_t *hdr, int sub, int mode, long vb, int o, float *s0,
                        float *s1) {
    if (mode == XK) {
        *s0 = f16_at(hdr, o) * (float)(int8_t)rec[vb + o];
        *s1 = f16_at(hdr, 8 + o) * (float)(int8_t)rec[vb + 8 + o];
        return;
    }
    *s0 = f16_at(rec + vb, o);
    *s1 = mode == XDM ? f16_at(rec + vb, 8 + o) : x_signed(sub) ? *s0 : *s0 * x_offset_factor(sub);
}

/* Rows `ids` of an (n, k) WX weight as float32 (count, k): s0 q + s1, or s_half q. Ids outside 0..n-1 give zeros. */
void pie_dequant_rows_x(const uint8_t *data, long n, long k, const int64_t *ids, long count, float *out) {
    const QWeight w = {data, WX, (int32_t)n, (int32_t)k};
    const long nb = k / QK;
    for (long i = 0; i < count; i++) {
        const long row = ids[i];
        float *y = out + i * k;
        if (row < 0 || row >= n) {
            memset(y, 0, k * sizeof(float));
            continue;
        }
        int sub, mode;
        const uint8_t *rec, *hdr = NULL;
        x_group(&w, row / 8, &sub, &mode, &rec);
        const XLayout l = x_layout(sub, mode);
        const int o = (int)(row % 8);
        for (long b = 0; b < nb; b++, rec += l.rb) {
            if (b % l.per == 0) {
                hdr = rec;
                rec += l.hb;
            }
            float s0, s1;
            x_scales_of(rec, hdr, sub, mode, l.vb, o, &s0, &s1);
            for (int v = 0; v < QK; v++) {
                const float q = (float)x_value(rec, sub, o, v);
                y[b * QK + v] = x_signed(sub) ? (v < 16 ? s0 : s1) * q : s0 * q + s1;
            }
        }
    }
}

/* Bytes of the WX weight pie_select_rows_x makes of `count` rows of a weight whose groups all have `code`
 * (mode << 2 | sub). */
long pie_select_bytes_x(int32_t code, long count, long k) {
    const long groups = (count + 7) / 8;
    return groups * 8 + groups * x_group_bytes(x_layout(code & 3, code >> 2), k / QK);
}

/* Lane so of `arrays` arrays of 8 elements of `size` bytes at s, into lane o of those at t. */
static void copy_lane(uint8_t *t, const uint8_t *s, long o, long so, int arrays, int size) {
    for (int j = 0; j < arrays; j++) memcpy(t + (8 * j + o) * size, s + (8 * j + so) * size, size);
}

/* Rows `ids` (all in groups of `code`) as a WX weight of their own: the same values and scales, hence the same
 * outputs bit for bit; `out` of pie_select_bytes_x bytes. */
void pie_select_rows_x(const uint8_t *data, int32_t code, long n, long k, const int64_t *ids, long count,
                       uint8_t *out) {
    const QWeight w = {data, WX, (int32_t)n, (int32_t)k};
    const int sub = code & 3, mode = code >> 2;
    const XLayout l = x_layout(sub, mode);
    const long nb = k / QK, groups = (count + 7) / 8, gb = x_group_bytes(l, nb);
    const int scale_arrays = mode == XD ? 1 : 2, scale_size = mode == XK ? 1 : 2;
    memset(out, 0, pie_select_bytes_x(code, count, k));
    for (long g = 0; g < groups; g++) ((int64_t *)out)[g] = ((groups * 8 + g * gb) << 4) | code;
    for (long i = 0; i < count; i++) {
        int src_sub, src_mode;
        const uint8_t *s;
        x_group(&w, ids[i] / 8, &src_sub, &src_mode, &s);
        const long so = ids[i] % 8, o = i % 8;
        uint8_t *t = out + groups * 8 + (i / 8) * gb;
        for (long b = 0; b < nb; b++, s += l.rb, t += l.rb) {
            if (b % l.per == 0 && l.hb) {
                copy_lane(t, s, o, so, 2, 2);
                s += l.hb, t += l.hb;
            }
            copy_lane(t, s, o, so, (int)(l.vb / 32), 4);
            copy_lane(t + l.vb, s + l.vb, o, so, scale_arrays, scale_size);
        }
    }
}

#endif
