/* WX weights (qmatmul.h: groups of 8 outputs, each of one sub-kind, GGUF values as they are) outside a matmul:
 * rows dequantized (an embedding table kept once with a tied head) and rows selected into a weight of their own
 * (a drafter's slice of the head). The records themselves are laid out by native_linear.py (numpy). */
#ifndef PIE_XWEIGHTS_H
#define PIE_XWEIGHTS_H

#include "qmatmul.h"

/* One value of output o (0..7) at position v (0..31) of a record. */
INLINE int x_value(const uint8_t *rec, int sub, int o, int v) {
    if (sub == XA4 || sub == XA5) {
        const uint8_t byte = rec[32 * ((v % 16) / 4) + 4 * o + v % 4];
        const int fifth = sub == XA5 ? ((rec[128 + 4 * o + v / 8] >> (v % 8)) & 1) << 4 : 0;
        return (v < 16 ? byte & 0x0f : byte >> 4) | fifth;
    }
    const uint8_t byte = rec[32 * (v / 4) + 4 * o + v % 4];
    return sub == XS16 ? (int)(int8_t)byte : (int)byte;
}

/* Rows `ids` of an (n, k) WX weight as float32 (count, k): dw q + mw, or d_half q. Ids outside 0..n-1 give zeros. */
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
        int sub;
        const uint8_t *rec;
        x_group(&w, row / 8, &sub, &rec);
        const int o = (int)(row % 8);
        const long rb = x_record_bytes(sub), vb = rb - 64;
        for (long b = 0; b < nb; b++, rec += rb) {
            float s0, s1;
            memcpy(&s0, rec + vb + 4 * o, 4);
            memcpy(&s1, rec + vb + 32 + 4 * o, 4);
            for (int v = 0; v < QK; v++) {
                const float q = (float)x_value(rec, sub, o, v);
                y[b * QK + v] = sub == XS16 ? (v < 16 ? s0 : s1) * q : s0 * q + s1;
            }
        }
    }
}

/* Bytes of the WX weight pie_select_rows_x makes of `count` rows of a weight whose groups are all sub-kind `sub`. */
long pie_select_bytes_x(int32_t sub, long count, long k) {
    const long groups = (count + 7) / 8;
    return groups * 8 + groups * (k / QK) * x_record_bytes(sub);
}

/* Rows `ids` (all in groups of sub-kind `sub`) as a WX weight of their own: the same values and scales, hence the
 * same outputs bit for bit; `out` of pie_select_bytes_x bytes. */
void pie_select_rows_x(const uint8_t *data, int32_t sub, long n, long k, const int64_t *ids, long count, uint8_t *out) {
    const QWeight w = {data, WX, (int32_t)n, (int32_t)k};
    const long nb = k / QK, groups = (count + 7) / 8, rb = x_record_bytes(sub), vb = rb - 64, chunks = vb / 32;
    memset(out, 0, pie_select_bytes_x(sub, count, k));
    for (long g = 0; g < groups; g++) ((int64_t *)out)[g] = ((groups * 8 + g * nb * rb) << 2) | sub;
    for (long i = 0; i < count; i++) {
        int src_sub;
        const uint8_t *s;
        x_group(&w, ids[i] / 8, &src_sub, &s);
        const long so = ids[i] % 8, o = i % 8;
        uint8_t *t = out + groups * 8 + (i / 8) * nb * rb;
        for (long b = 0; b < nb; b++, s += rb, t += rb) {
            for (long j = 0; j < chunks; j++) memcpy(t + 32 * j + 4 * o, s + 32 * j + 4 * so, 4);
            memcpy(t + vb + 4 * o, s + vb + 4 * so, 4);
            memcpy(t + vb + 32 + 4 * o, s + vb + 32 + 4 * so, 4);
        }
    }
}

#endif
