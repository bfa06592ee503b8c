/* Paged attention in place: a query row attends the keys it may see straight from the pool's pages, through
 * its sequence's page table, with no gather copy.
 *
 * What a row sees is a list of sequence indices in increasing order: every index below `limit` (the rows
 * before it, or before its tree window) and then its `extras` (a tree row's ancestors inside the window, itself
 * last): its path, positions increasing along it. A sliding layer's layout drops the keys at the front of that
 * list that left its window (row_skip: a query at position p keeps the keys at positions q with p - q < W,
 * counted by the caller), so only the window's keys are listed and read, however the rows are stored.
 * Index j of a sequence lives in slot pages[j / page_size] * page_size + j % page_size; each row's slots are
 * listed once a pass per layout (they are the same for every layer and head that reads the layout). A row's result is a function of its
 * query and of that list's keys and values alone: the same bits whatever the batch, the chunking of a prompt,
 * where in a window its ancestors sit, or which thread runs it.
 *
 * The unit of work is one row and one key head with the G query heads that share it (grouped-query attention):
 * each key and value row is read and widened to float32 once for the G heads. In this order:
 *   scores  s_hj = (q_h . k_j) * log2(e) / sqrt(D): 8 lanes (16 with AVX-512, then folded to 8) accumulated
 *           over the head's dimensions, then the lanes summed by one fixed tree (keys go 8 at a time, and the tree treats each alike)
 *   softmax m_h = max_j s_hj (exact), p_hj = 2^(s_hj - m_h) (elementwise), l_h = sum_j p_hj in list order
 *   values  o_h = (sum_j p_hj v_j) / l_h, accumulated key by key in list order. */
#ifndef PIE_ATTENTION_H
#define PIE_ATTENTION_H

#include <stdlib.h>

#include "simd.h"

typedef struct {
    const void *k, *v; /* this layer's pool: (kv_heads, slots, head_dim), float32 or bfloat16 */
    int32_t bf16;      /* the pool's element type */
    long slots;        /* slots per head */
} KVLayer;

typedef struct {                /* where every row of a pass sits for one attention group of layers (built once a
                                 * pass, shared by the group's layers: its page tables, its window) */
    const int32_t *row_seg;     /* (N,) the row's segment */
    const int32_t *row_limit;   /* (N,) it sees sequence indices 0 .. limit-1 */
    const int32_t *row_extra;   /* (N + 1,) offsets into extras: the row's extra indices */
    const int32_t *extras;      /* extra sequence indices, ascending per row */
    const int32_t *seg_pages;   /* (segments + 1,) offsets into pages */
    const int32_t *pages;       /* physical page ids of every segment's table */
    const int64_t *write_slots; /* (N,) the slot each row's K/V is written to */
    const int32_t *row_skip;    /* (N,) keys at the front of the row's list its window drops, or NULL: none */
    int32_t page_size;
    int32_t max_keys; /* the most keys a row's list holds (before its window) */
} PassLayout;

#define MAX_HEAD_DIM 256

typedef struct { /* each row's visible slots, in order: row r's are slots[off[r] .. off[r + 1]) */
    int64_t *off;
    int32_t *slots;
} RowSlots;

/* The first key of row r's list that its window keeps (0: the whole list). */
INLINE long row_first_key(const PassLayout *p, long r) { return p->row_skip ? p->row_skip[r] : 0; }

/* Keys row r sees: its list from row_first_key on. */
INLINE long row_keys(const PassLayout *p, long r) {
    return p->row_limit[r] + p->row_extra[r + 1] - p->row_extra[r] - row_first_key(p, r);
}

/* The sequence index of key i of row r's list (the window's first key is i = 0). */
INLINE long key_index(const PassLayout *p, long r, long i) {
    const long j = row_first_key(p, r) + i, limit = p->row_limit[r];
    return j < limit ? j : p->extras[p->row_extra[r] + j - limit];
}

/* Row r's slots: the prefix page by page from the window's first key, then its extras. Only the pages the
 * window reaches are read. */
static void list_slots(const PassLayout *p, long r, int32_t *out) {
    const int32_t *pages = p->pages + p->seg_pages[p->row_seg[r]];
    const long limit = p->row_limit[r], ps = p->page_size, first = row_first_key(p, r);
    long i = 0;
    for (long j = first; j < limit;) {
        const int32_t base = (int32_t)(pages[j / ps] * ps);
        for (long o = j % ps; o < ps && j < limit; o++, j++) out[i++] = base + (int32_t)o;
    }
    for (long e = p->row_extra[r] + (first > limit ? first - limit : 0); e < p->row_extra[r + 1]; e++) {
        const long j = p->extras[e];
        out[i++] = (int32_t)(pages[j / ps] * ps + j % ps);
    }
}

static __thread float *scratch_buf;
static __thread long scratch_cap;

static float *thread_scratch(long n) {
    if (n > scratch_cap) {
        free(scratch_buf);
        scratch_cap = n < 4096 ? 4096 : n;
        scratch_buf = (float *)aligned_alloc(64, (scratch_cap * sizeof(float) + 63) / 64 * 64);
    }
    return scratch_buf;
}

/* D values of one pool row as float32 into `out` (D / 8 vectors). */
INLINE void widen_row(const void *base, int bf16, long at, const int D, float *out) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)base + at;
        for (int c = 0; c < D / 8; c++) _mm256_storeu_ps(out + 8 * c, load_bf16x8(p + 8 * c));
    } else {
        memcpy(out, (const float *)base + at, D * sizeof(float));
    }
}

/* Lane sums of 8 vectors: r[i] = ((v_i0 + v_i1) + (v_i2 + v_i3)) + ((v_i4 + v_i5) + (v_i6 + v_i7)). */
INLINE __m256 sum8(const __m256 v[8]) {
    const __m256 t01 = _mm256_hadd_ps(v[0], v[1]), t23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t45 = _mm256_hadd_ps(v[4], v[5]), t67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 a = _mm256_hadd_ps(t01, t23), b = _mm256_hadd_ps(t45, t67);
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Keys are attended in parts of KEY_PART (fixed, so that a row's arithmetic never depends on the threads or the
 * batch): a part gives each head its maximum score, its normaliser and its unnormalised sum of values, and the
 * parts of a row are combined in order. Parts let the threads share a long row (a decode step). */
#define KEY_PART 256

#define VCHUNK 32 /* value rows widened at a time (VCHUNK * D floats: within L1 for D <= 128) */
#define RUN 16    /* rows of a sequence that share one widening of their keys and values */

typedef struct { /* a run of rows attending one part of the same key list (rows of one sequence) */
    int n;                /* rows */
    const int32_t *slots; /* the part's slots (the longest row's list from the part's first key) */
    long nk[RUN];         /* keys of this part each row sees (a prefix of `slots`; 0: none) */
    const float *q[RUN];  /* each row's G query heads (D each, contiguous) */
    float *out[RUN];      /* each row's partial result: G * (D + 2) floats */
} Run;

#if defined(__AVX512F__) /* 16 lanes: half the instructions for the same arithmetic order in each lane */
typedef __m512 vecf;
#define VL 16
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vmul _mm512_mul_ps
#define vfma _mm512_fmadd_ps
#define vset1 _mm512_set1_ps
INLINE __m256 lanes8(__m512 v) { /* the 16 lanes folded to 8: lane i + lane i + 8 */
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
typedef __m256 vecf;
#define VL 8
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vmul _mm256_mul_ps
#define vfma _mm256_fmadd_ps
#define vset1 _mm256_set1_ps
INLINE __m256 lanes8(__m256 v) { return v; }
#endif

/* Scores of 8 widened keys (rows[8][D]) for HB query heads of one row: s[h * sp + t] for t < 8. The HB * 8
 * accumulators and HB query chunks stay in registers; each key chunk is loaded once for the HB heads. */
INLINE void scores8(const float *q, const float *rows, float *s, long sp, float scale, const int D, const int HB) {
    vecf acc[HB][8], qv[HB];
    for (int h = 0; h < HB; h++) qv[h] = vload(q + h * D);
    for (int t = 0; t < 8; t++) {
        const vecf k = vload(rows + t * D);
        for (int h = 0; h < HB; h++) acc[h][t] = vmul(qv[h], k);
    }
    for (int c = 1; c < D / VL; c++) {
        for (int h = 0; h < HB; h++) qv[h] = vload(q + h * D + VL * c);
        for (int t = 0; t < 8; t++) {
            const vecf k = vload(rows + t * D + VL * c);
            for (int h = 0; h < HB; h++) acc[h][t] = vfma(qv[h], k, acc[h][t]);
        }
    }
    for (int h = 0; h < HB; h++) {
        __m256 folded[8];
        for (int t = 0; t < 8; t++) folded[t] = lanes8(acc[h][t]);
        _mm256_storeu_ps(s + h * sp, _mm256_mul_ps(sum8(folded), _mm256_set1_ps(scale)));
    }
}

/* acc (HB heads of D) += sum over t < cnt of p[h * sp + t] * rows[t]: the accumulators in registers for the chunk. */
INLINE void values(const float *p, long sp, const float *rows, long cnt, float *acc, const int D, const int HB) {
    vecf a[HB][D / VL];
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < D / VL; c++) a[h][c] = vload(acc + h * D + VL * c);
    for (long t = 0; t < cnt; t++) {
        vecf w[HB];
        for (int h = 0; h < HB; h++) w[h] = vset1(p[h * sp + t]);
        for (int c = 0; c < D / VL; c++) {
            const vecf v = vload(rows + t * D + VL * c);
            for (int h = 0; h < HB; h++) a[h][c] = vfma(w[h], v, a[h][c]);
        }
    }
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < D / VL; c++) vstore(acc + h * D + VL * c, a[h][c]);
}

/* One run, key head and part. Each row's arithmetic is what it would be alone (R = 1), and each head's what it
 * would be alone: the run shares only the widened key and value rows, heads only their loads. */
INLINE void attend_part(const KVLayer *kv, const Run *run, long kv_head, float scale, const int D, const int G) {
    const long sp = KEY_PART + 8; /* a head's scores, padded to whole chunks of 8 */
    const int VB = 3 * D / VL <= 24 ? 3 : 1; /* heads whose value sums fit in registers together */
    float *s = thread_scratch(RUN * G * sp + VCHUNK * D);
    float *rows = s + RUN * G * sp; /* widened key (8 at a time) or value (VCHUNK at a time) rows */
    const long head_at = kv_head * kv->slots;
    long n = 0;
    for (int r = 0; r < run->n; r++) n = run->nk[r] > n ? run->nk[r] : n;
    for (long i0 = 0; i0 < n; i0 += 8) {
        const int cnt = n - i0 < 8 ? (int)(n - i0) : 8;
        for (int t = 0; t < 8; t++) {
            if (t < cnt)
                widen_row(kv->k, kv->bf16, (head_at + run->slots[i0 + t]) * D, D, rows + t * D);
            else
                memset(rows + t * D, 0, D * sizeof(float));
        }
        for (int r = 0; r < run->n; r++) {
            if (run->nk[r] <= i0) continue;
            float *sr = s + r * G * sp + i0;
            int h = 0;
            for (; h + 3 <= G; h += 3) scores8(run->q[r] + h * D, rows, sr + h * sp, sp, scale, D, 3);
            for (; h < G; h++) scores8(run->q[r] + h * D, rows, sr + h * sp, sp, scale, D, 1);
        }
    }
    for (int r = 0; r < run->n; r++) {
        const long nr = run->nk[r], n8 = (nr + 7) / 8 * 8;
        for (int h = 0; h < G && nr > 0; h++) {
            float *sh = s + (r * G + h) * sp;
            float mx = -INFINITY;
            for (long i = 0; i < nr; i++) mx = sh[i] > mx ? sh[i] : mx;
            const __m256 vmx = _mm256_set1_ps(mx);
            __m256 sum = _mm256_setzero_ps();
            for (long i = 0; i < n8; i += 8) {
                __m256 e = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(sh + i), vmx));
                if (i + 8 > nr) { /* the keys past the row's weigh exactly nothing */
                    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nr - i)), lane);
                    e = _mm256_and_ps(e, _mm256_castsi256_ps(keep));
                }
                _mm256_storeu_ps(sh + i, e);
                sum = _mm256_add_ps(sum, e);
            }
            run->out[r][h] = mx;
            run->out[r][G + h] = hsum(sum);
            for (int i = 0; i < D; i++) run->out[r][2 * G + h * D + i] = 0.0f;
        }
    }
    for (long i0 = 0; i0 < n; i0 += VCHUNK) {
        const long cnt = n - i0 < VCHUNK ? n - i0 : VCHUNK;
        for (long t = 0; t < cnt; t++) widen_row(kv->v, kv->bf16, (head_at + run->slots[i0 + t]) * D, D, rows + t * D);
        for (int r = 0; r < run->n; r++) {
            if (run->nk[r] <= i0) continue;
            const long cr = run->nk[r] - i0 < cnt ? run->nk[r] - i0 : cnt;
            const float *pr = s + r * G * sp + i0;
            float *acc = run->out[r] + 2 * G; /* the weighted sums, chunk by chunk of values */
            int h = 0;
            if (VB == 3)
                for (; h + 3 <= G; h += 3) values(pr + h * sp, sp, rows, cr, acc + h * D, D, 3);
            for (; h < G; h++) values(pr + h * sp, sp, rows, cr, acc + h * D, D, 1);
        }
    }
}

/* A run's part for head_dim 64, 128 or 256: the shapes specialised (G heads of a key head at any G). */
static void attend_part_any(const KVLayer *kv, const Run *run, long kv_head, float scale, int d, int g) {
#define CASE(D_, G_) \
    if (d == D_ && g == G_) return attend_part(kv, run, kv_head, scale, D_, G_);
    CASE(64, 1) CASE(64, 2) CASE(64, 3) CASE(64, 4) CASE(64, 5) CASE(64, 6) CASE(64, 7) CASE(64, 8)
    CASE(128, 1) CASE(128, 2) CASE(128, 3) CASE(128, 4) CASE(128, 5) CASE(128, 6) CASE(128, 7) CASE(128, 8)
    CASE(256, 1) CASE(256, 2) CASE(256, 4) CASE(256, 8)
#undef CASE
}

/* A row's parts (n_parts of them, G heads each) combined in order → out (G heads of D):
 * o_h = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p, M the parts' maximum. One part: acc / l. */
static void combine_parts(const float *parts, long n_parts, int d, int g, float *out) {
    const long stride = (long)g * (d + 2);
    for (int h = 0; h < g; h++) {
        float mx = -INFINITY;
        for (long p = 0; p < n_parts; p++) mx = parts[p * stride + h] > mx ? parts[p * stride + h] : mx;
        float l = 0.0f;
        for (long p = 0; p < n_parts; p++) l += exp2f(parts[p * stride + h] - mx) * parts[p * stride + g + h];
        float *o = out + h * d;
        for (int c = 0; c < d; c++) o[c] = 0.0f;
        for (long p = 0; p < n_parts; p++) {
            const float w = exp2f(parts[p * stride + h] - mx);
            const float *acc = parts + p * stride + 2 * g + h * d;
            for (int c = 0; c < d; c++) o[c] += w * acc[c];
        }
        const float inv = 1.0f / l;
        for (int c = 0; c < d; c++) o[c] *= inv;
    }
}

/* The attention readout, only on passes that ask for it (so an ordinary pass pays nothing): head h's probability
 * of each of a row's nk keys, 2^(s_hj - M_h) / L_h (8 keys at a time), with s_hj recomputed as the attention
 * computed it (scores8: a head's arithmetic does not depend on the heads beside it) and M_h, L_h the row's maximum
 * and normaliser over its parts (formed as combine_parts forms them); summed over the G heads of one key head, in
 * head order, into out[j]. A function of the row's query and keys alone, like the attention itself. */
INLINE void head_mass(const KVLayer *kv, long kv_head, const int32_t *slots, long nk, const float *q,
                      const float *parts, long n_parts, float scale, float *out, const int D, const int G) {
    float rows[8 * MAX_HEAD_DIM], s[8 * 8], mx[8], inv[8];
    const long stride = (long)G * (D + 2), head_at = kv_head * kv->slots;
    for (int h = 0; h < G; h++) {
        mx[h] = -INFINITY;
        for (long p = 0; p < n_parts; p++) mx[h] = parts[p * stride + h] > mx[h] ? parts[p * stride + h] : mx[h];
        float l = 0.0f;
        for (long p = 0; p < n_parts; p++) l += exp2f(parts[p * stride + h] - mx[h]) * parts[p * stride + G + h];
        inv[h] = 1.0f / l;
    }
    for (long i0 = 0; i0 < nk; i0 += 8) {
        const int cnt = nk - i0 < 8 ? (int)(nk - i0) : 8;
        for (int t = 0; t < 8; t++) {
            if (t < cnt)
                widen_row(kv->k, kv->bf16, (head_at + slots[i0 + t]) * D, D, rows + t * D);
            else
                memset(rows + t * D, 0, D * sizeof(float));
        }
        int h = 0; /* three heads a call where they fit, as the attention does: the same arithmetic per head */
        for (; h + 3 <= G; h += 3) scores8(q + h * D, rows, s + h * 8, 8, scale, D, 3);
        for (; h < G; h++) scores8(q + h * D, rows, s + h * 8, 8, scale, D, 1);
        __m256 acc = _mm256_setzero_ps(); /* the 8 keys' mass, the heads added in order */
        for (h = 0; h < G; h++) {
            const __m256 e = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + h * 8), _mm256_set1_ps(mx[h])));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(e, _mm256_set1_ps(inv[h])));
        }
        _mm256_storeu_ps(s, acc);
        for (int t = 0; t < cnt; t++) out[i0 + t] = s[t];
    }
}

/* head_mass for head_dim 64, 128 or 256 (G <= 8 heads a key head, as attend_part_any). */
static void head_mass_any(const KVLayer *kv, long kv_head, const int32_t *slots, long nk, const float *q,
                          const float *parts, long n_parts, float scale, float *out, int d, int g) {
    if (d == 64) head_mass(kv, kv_head, slots, nk, q, parts, n_parts, scale, out, 64, g);
    if (d == 128) head_mass(kv, kv_head, slots, nk, q, parts, n_parts, scale, out, 128, g);
    if (d == 256) head_mass(kv, kv_head, slots, nk, q, parts, n_parts, scale, out, 256, g);
}

#endif
