/* The native decoder step of the Llama family: one call runs every layer of a pass over N ragged rows
 * (RMS norm, 8-bit activations, integer-dot q/k/v, rope, K/V written into the pool, paged attention, o, the
 * gated MLP, residuals, the final norm) inside one OpenMP parallel region, a barrier between stages. Also the
 * standalone pieces the model needs beside it: the lm head's matmul, embedding rows, repacking GGUF blocks.
 *
 * Float32 throughout (the pool may hold bfloat16); every stage computes a row from that row's inputs alone in
 * one fixed order (qmatmul.h, attention.h), so a row's bits do not depend on the rest of its pass.
 * Built once per ISA variant by pie_runtime/models/native_lib.py: -DPIE_AVX512VNNI, -DPIE_AVXVNNI or plain AVX2. */
#include <omp.h>
#include <stdlib.h>

#include "attention.h"
#include "qmatmul.h"
#include "xweights.h"

const char *pie_variant(void) {
#ifdef PIE_AMX
    if (!amx_ready) return "avx512vnni"; /* the kernel refused the tile state: the same kernels without tiles */
#endif
    return PIE_VARIANT;
}

/* ---- stage timings (built with -DPIE_PROFILE: PIE_NATIVE_PROFILE=1) ---------------------------------------
 * Thread 0 adds the time since the previous mark to the stage just ended: a stage's own work and the wait for
 * the other threads at its barrier, which is what the pass pays for it. */
#define STAGES(X) X(setup) X(norm1) X(qkv) X(rope_kv) X(attention) X(quant_attn) X(o) X(norm2) X(gate_up) X(silu) \
    X(down) X(final_norm)
#define ENUM(s) ST_##s,
#define NAME(s) #s ","
enum { STAGES(ENUM) N_STAGES };
const char *pie_profile_names(void) { return STAGES(NAME); }
#ifdef PIE_PROFILE
static double profile[N_STAGES], profile_mark;
#define MARK(s)                                                                                                      \
    do {                                                                                                             \
        if (omp_get_thread_num() == 0) {                                                                             \
            const double now = omp_get_wtime();                                                                      \
            profile[ST_##s] += now - profile_mark;                                                                   \
            profile_mark = now;                                                                                      \
        }                                                                                                            \
    } while (0)
int pie_profile_read(double *out, int reset) {
    memcpy(out, profile, sizeof profile);
    if (reset) memset(profile, 0, sizeof profile);
    return N_STAGES;
}
#else
#define MARK(s) ((void)0)
int pie_profile_read(double *out, int reset) {
    (void)out, (void)reset;
    return 0;
}
#endif

/* ---- weights: GGUF blocks into the x8 layout (qmatmul.h) ------------------------------------------------ */

long pie_packed_bytes(int32_t kind, long n, long k) { return (n + 7) / 8 * (k / QK) * record_bytes(kind); }

/* 4-bit: q (n, k / 2), two values a byte, low nibble first (the store's form); d, m (n, k / 32) float16. */
void pie_pack_q4(const uint8_t *q, const uint16_t *d, const uint16_t *m, long n, long k, uint8_t *out) {
    const long nb = k / QK, rb = record_bytes(WQ4);
#pragma omp parallel for schedule(static)
    for (long g = 0; g < (n + 7) / 8; g++)
        for (long b = 0; b < nb; b++) {
            uint8_t *rec = out + (g * nb + b) * rb;
            uint16_t *dm = (uint16_t *)(rec + 128);
            memset(rec, 0, rb);
            for (int o = 0; o < 8; o++) {
                const long row = g * 8 + o;
                if (row >= n) continue;
                const uint8_t *src = q + row * (k / 2) + b * (QK / 2);
                uint8_t v[QK];
                for (int i = 0; i < QK / 2; i++) {
                    v[2 * i] = src[i] & 0x0f;
                    v[2 * i + 1] = src[i] >> 4;
                }
                for (int j = 0; j < 4; j++)
                    for (int t = 0; t < 4; t++)
                        rec[32 * j + 4 * o + t] = (uint8_t)(v[4 * j + t] | (v[16 + 4 * j + t] << 4));
                dm[o] = d[row * nb + b];
                dm[8 + o] = m[row * nb + b];
            }
        }
}

/* 8-bit: q (n, k) int8, d (n, k / 32) float16. On VNNI the values are stored + 128 with m = -128 d. */
void pie_pack_q8(const int8_t *q, const uint16_t *d, long n, long k, uint8_t *out) {
    const long nb = k / QK, rb = record_bytes(WQ8);
#pragma omp parallel for schedule(static)
    for (long g = 0; g < (n + 7) / 8; g++)
        for (long b = 0; b < nb; b++) {
            uint8_t *rec = out + (g * nb + b) * rb;
            uint16_t *dm = (uint16_t *)(rec + 256);
            memset(rec, 0, rb);
            for (int o = 0; o < 8; o++) {
                const long row = g * 8 + o;
                if (row >= n) continue;
                const int8_t *src = q + row * k + b * QK;
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++) {
                        const int8_t v = src[4 * j + t];
                        rec[32 * j + 4 * o + t] = PIE_VNNI ? (uint8_t)(v + 128) : (uint8_t)v;
                    }
                const uint16_t dh = d[row * nb + b];
                dm[o] = dh;
                /* -128 d in float16: the exponent moves by 7, exact for every finite d that does not overflow */
                dm[8 + o] = PIE_VNNI ? (uint16_t)_cvtss_sh(-128.0f * _cvtsh_ss(dh), 0) : 0;
            }
        }
}

/* Rows `ids` of a packed weight, dequantized (float32, k values each): an embedding table shared with a tied
 * lm head is kept once. */
void pie_dequant_rows(const uint8_t *data, int32_t kind, long n, long k, const int64_t *ids, long count, float *out) {
    const long nb = k / QK, rb = record_bytes(kind), vb = rb - 32;
    for (long i = 0; i < count; i++) {
        const long row = ids[i], g = row / 8, o = row % 8;
        float *y = out + i * k;
        if (row < 0 || row >= n) {
            memset(y, 0, k * sizeof(float));
            continue;
        }
        for (long b = 0; b < nb; b++) {
            const uint8_t *rec = data + (g * nb + b) * rb;
            const uint16_t *dm = (const uint16_t *)(rec + vb);
            const float dw = _cvtsh_ss(dm[o]), mw = _cvtsh_ss(dm[8 + o]);
            for (int v = 0; v < QK; v++) {
                int q;
                if (kind == WQ4) {
                    const int j = (v % 16) / 4, t = v % 4;
                    const uint8_t byte = rec[32 * j + 4 * o + t];
                    q = v < 16 ? byte & 0x0f : byte >> 4;
                } else {
                    const uint8_t byte = rec[32 * (v / 4) + 4 * o + v % 4];
                    q = PIE_VNNI ? (int)byte : (int)(int8_t)byte; /* VNNI: byte = q + 128 and mw = -128 dw */
                }
                y[b * QK + v] = dw * (float)q + mw;
            }
        }
    }
}

/* Rows `ids` (count of them) of a packed weight as a packed weight of their own (a drafter's slice of the lm
 * head): the same values and scales, so the slice's outputs are the head's, bit for bit. */
void pie_select_rows(const uint8_t *data, int32_t kind, long k, const int64_t *ids, long count, uint8_t *out) {
    const long nb = k / QK, rb = record_bytes(kind), vb = rb - 32, chunks = vb / 32;
    memset(out, 0, (count + 7) / 8 * nb * rb);
    for (long i = 0; i < count; i++) {
        const long src_g = ids[i] / 8, src_o = ids[i] % 8, g = i / 8, o = i % 8;
        for (long b = 0; b < nb; b++) {
            const uint8_t *s = data + (src_g * nb + b) * rb;
            uint8_t *t = out + (g * nb + b) * rb;
            for (long j = 0; j < chunks; j++) memcpy(t + 32 * j + 4 * o, s + 32 * j + 4 * src_o, 4);
            uint16_t *tdm = (uint16_t *)(t + vb);
            const uint16_t *sdm = (const uint16_t *)(s + vb);
            tdm[o] = sdm[src_o];
            tdm[8 + o] = sdm[8 + src_o];
        }
    }
}

/* ---- the lm head and other standalone matmuls ------------------------------------------------------------ */

long pie_qmatmul_scratch(long m, long k) { return m * k + 2 * m * (k / QK) * (long)sizeof(float) + 64; }

/* y (m, n) = x (m, k) float32 @ w.T; `scratch` of pie_qmatmul_scratch bytes. */
void pie_qmatmul(const uint8_t *data, int32_t kind, long n, long k, const float *x, long m, float *y, uint8_t *scratch) {
    QWeight w = {data, kind, (int32_t)n, (int32_t)k};
    float *ds = (float *)scratch;
    QAct a = {(int8_t *)(ds + 2 * m * (k / QK)), ds, ds + m * (k / QK), k};
    const long units = n_units(&w);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (long r = 0; r < m; r++) quantize_rows(x, k, r, r + 1, &a);
#pragma omp for schedule(static)
        for (long u = 0; u < units; u++) qmatmul_unit(&w, u, &a, m, y, n, NULL, 0);
    }
}

/* ---- the decoder step ------------------------------------------------------------------------------------- */

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, inter, qk_norm, kv_bf16;
    float eps;
    int32_t pad;
    int64_t kv_slots;
    const uint8_t *const *w[4];     /* per layer: qkv, o, gate_up, down (packed) */
    const int32_t *kinds;           /* (layers, 4) their WQ4 / WQ8 */
    const float *const *qkv_bias;   /* per layer, or NULL */
    const float *const *o_bias;     /* per layer, or NULL */
    const float *const *ln1, *const *ln2, *const *q_norm, *const *k_norm; /* q/k norms: with qk_norm only */
    const float *final_norm;
    const float *inv_freq; /* (head_dim / 2,) rope */
    void *const *k_cache, *const *v_cache; /* per layer: (kv_heads, kv_slots, head_dim) */
} PieModel;

typedef struct {
    int64_t n_rows;
    const float *x; /* (N, hidden) input embeddings */
    float *out;     /* (N, hidden) final hidden states, normed */
    const int32_t *positions;
    const int64_t *write_slots;
    PassLayout layout;
    int64_t n_scores;             /* rows the attention readout reads (0: an ordinary pass, which pays nothing) */
    const int32_t *score_rows;    /* (n_scores,) their rows in the pass */
    const int64_t *score_at;      /* (n_scores,) where each one's output starts in `scores` */
    const int32_t *score_width;   /* (n_scores,) sequence indices per output row (0 .. width-1) */
    const int32_t *score_layered; /* (n_scores,) 1: one output row per layer; 0: the layers summed into one */
    float *scores;                /* zeroed by the caller; a key the row does not see stays 0 */
} PiePass;

enum { W_QKV, W_O, W_GATE_UP, W_DOWN };

INLINE long rup(long v) { return (v + 63) / 64 * 64; }

typedef struct {
    float *x, *h, *qkv, *attn, *gu, *act, *cos, *sin;
    QAct a;
} Buffers;

static long carve(const PieModel *m, long n, uint8_t *base, Buffers *b) {
    const long hd = (long)m->heads * m->head_dim, qkv = hd + 2L * m->kv_heads * m->head_dim;
    long kmax = m->hidden > hd ? m->hidden : hd;
    kmax = kmax > m->inter ? kmax : m->inter;
    const long sizes[] = {n * m->hidden, n * (m->hidden > hd ? m->hidden : hd), n * qkv, n * hd, n * 2L * m->inter,
                          n * m->inter, n * (m->head_dim / 2), n * (m->head_dim / 2), n * (kmax / QK), n * (kmax / QK)};
    float **dst[] = {&b->x, &b->h, &b->qkv, &b->attn, &b->gu, &b->act, &b->cos, &b->sin, &b->a.d, &b->a.s};
    long at = 0;
    for (int i = 0; i < 10; i++) {
        if (base) *dst[i] = (float *)(base + at);
        at += rup(sizes[i] * (long)sizeof(float));
    }
    if (base) b->a.q = (int8_t *)(base + at);
    return at + rup(n * kmax);
}

long pie_step_scratch(const PieModel *m, long n_rows) {
    Buffers b;
    return carve(m, n_rows, NULL, &b);
}

static void rmsnorm(const float *x, const float *w, long n, float eps, float *y) {
    __m256 a = _mm256_setzero_ps();
    for (long i = 0; i < n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        a = _mm256_fmadd_ps(v, v, a);
    }
    const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum(a) / (float)n + eps));
    for (long i = 0; i < n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), r), _mm256_loadu_ps(w + i)));
}

/* x (D) in place: Hugging Face's rotate-half layout, cos/sin (D / 2) for this row's position */
static void rope(float *x, const float *c, const float *s, int d) {
    const int h = d / 2;
    for (int i = 0; i < h; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + h + i);
        const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
        _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
        _mm256_storeu_ps(x + h + i, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
    }
}

static void store_kv(void *cache, int bf16, long slots, long head, long slot, const float *v, int d) {
    const long at = (head * slots + slot) * d;
    if (bf16) {
        uint16_t *p = (uint16_t *)cache + at;
        for (int i = 0; i < d; i++) p[i] = f32_to_bf16(v[i]);
    } else {
        memcpy((float *)cache + at, v, d * sizeof(float));
    }
}

/* q heads rotated in place; k heads normed (qk_norm) and rotated, then k and v written to the pool */
static void rope_and_write(const PieModel *m, int l, const PiePass *p, const Buffers *b, long r) {
    const int d = m->head_dim, hq = m->heads, hk = m->kv_heads;
    float *row = b->qkv + r * ((long)(hq + 2 * hk) * d);
    const float *c = b->cos + r * (d / 2), *s = b->sin + r * (d / 2);
    for (int h = 0; h < hq + hk; h++) {
        float *x = row + (long)h * d;
        if (m->qk_norm) rmsnorm(x, h < hq ? m->q_norm[l] : m->k_norm[l], d, m->eps, x);
        rope(x, c, s, d);
    }
    for (int h = 0; h < hk; h++) {
        store_kv(m->k_cache[l], m->kv_bf16, m->kv_slots, h, p->write_slots[r], row + (long)(hq + h) * d, d);
        store_kv(m->v_cache[l], m->kv_bf16, m->kv_slots, h, p->write_slots[r], row + (long)(hq + hk + h) * d, d);
    }
}

/* Parts of KEY_PART keys row r's attention takes (at least one). */
static long row_parts(const RowSlots *rs, long r) {
    const long parts = (rs->off[r + 1] - rs->off[r] + KEY_PART - 1) / KEY_PART;
    return parts > 0 ? parts : 1;
}

static void silu_mul_row(const float *gu, long inter, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), nl2e = _mm256_set1_ps(-1.4426950408889634f);
    for (long i = 0; i < inter; i += 8) {
        const __m256 g = _mm256_loadu_ps(gu + i), u = _mm256_loadu_ps(gu + inter + i);
        const __m256 e = exp2_ps(_mm256_mul_ps(g, nl2e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
    }
}

INLINE QWeight layer_weight(const PieModel *m, int l, int which, long n, long k) {
    QWeight w = {m->w[which][l], m->kinds[4 * l + which], (int32_t)n, (int32_t)k};
    return w;
}

/* One layer's attention readout, inside the step's parallel region: each read row's mass per key head (head_mass)
 * into `mass`, then the key heads added in order and the sum added into the row's output at the keys' sequence
 * indices: this layer's output row, or the one summed over the layers (layer by layer, in order). */
static void attention_mass(const PieModel *m, const PiePass *p, int l, const KVLayer *kv, const RowSlots *rs,
                           const int64_t *row_first, const float *partials, const float *qkv, float *mass, float scale) {
    const long d = m->head_dim, kvhs = m->kv_heads, width = p->layout.max_keys + 1L;
    const long qkv_n = (long)m->heads * d + 2L * kvhs * d, part_floats = (long)(m->heads / kvhs) * (d + 2);
#pragma omp for schedule(static)
    for (long u = 0; u < p->n_scores * kvhs; u++) {
        const long r = p->score_rows[u / kvhs], kvh = u % kvhs;
        const long per_row = (row_first[r + 1] - row_first[r]) / kvhs;
        head_mass_any(kv, kvh, rs->slots + rs->off[r], rs->off[r + 1] - rs->off[r],
                      qkv + r * qkv_n + kvh * (m->heads / kvhs) * d, partials + (row_first[r] + kvh * per_row) * part_floats,
                      per_row, scale, mass + u * width, (int)d, m->heads / kvhs);
    }
#pragma omp for schedule(static)
    for (long i = 0; i < p->n_scores; i++) {
        const long r = p->score_rows[i], nk = rs->off[r + 1] - rs->off[r], limit = p->layout.row_limit[r];
        float *out = p->scores + p->score_at[i] + (p->score_layered[i] ? (long)l * p->score_width[i] : 0);
        for (long j = 0; j < nk; j++) {
            float v = 0.0f; /* the layer's mass first, so the summed output is the per-layer rows added in order */
            for (long kvh = 0; kvh < kvhs; kvh++) v += mass[(i * kvhs + kvh) * width + j];
            out[j < limit ? j : p->layout.extras[p->layout.row_extra[r] + j - limit]] += v;
        }
    }
}

void pie_decoder_step(const PieModel *m, const PiePass *p, uint8_t *scratch) {
    const long n = p->n_rows, hidden = m->hidden, d = m->head_dim;
    const long hd = (long)m->heads * d, qkv_n = hd + 2L * m->kv_heads * d, inter = m->inter;
    const float scale = 1.4426950408889634f / sqrtf((float)d);
    const int per_kv = m->heads / m->kv_heads;
    Buffers b;
    carve(m, n, scratch, &b);
    memcpy(b.x, p->x, n * hidden * sizeof(float));
    /* each row's visible slots, listed once for every layer and head */
    RowSlots rs;
    rs.off = (int64_t *)malloc((n + 1) * sizeof(int64_t));
    rs.off[0] = 0;
    for (long r = 0; r < n; r++) rs.off[r + 1] = rs.off[r] + row_keys(&p->layout, r);
    rs.slots = (int32_t *)malloc((rs.off[n] + 1) * sizeof(int32_t));
    /* attention's work: runs of rows that share a key list (consecutive rows of one sequence outside a tree
     * window, at most RUN), each run by key head and part of KEY_PART keys. A row's partial results sit at
     * row_first[r] + key head * its parts + part. */
    int64_t *row_first = (int64_t *)malloc((n + 1) * sizeof(int64_t));
    int32_t *run_first = (int32_t *)malloc((n + 1) * sizeof(int32_t));
    long runs = 0;
    row_first[0] = 0;
    for (long r = 0; r < n; r++) {
        row_first[r + 1] = row_first[r] + row_parts(&rs, r) * m->kv_heads;
        const int plain = p->layout.row_extra[r + 1] == p->layout.row_extra[r];
        const int joins = r > 0 && plain && r - run_first[runs - 1] < RUN &&
                          p->layout.row_seg[r] == p->layout.row_seg[r - 1] &&
                          p->layout.row_extra[r] == p->layout.row_extra[r - 1];
        if (!joins) run_first[runs++] = (int32_t)r;
    }
    run_first[runs] = (int32_t)n;
    long units = 0;
    for (long u = 0; u < runs; u++) units += row_parts(&rs, run_first[u + 1] - 1) * m->kv_heads;
    int32_t *unit = (int32_t *)malloc((3 * units + 1) * sizeof(int32_t)); /* (run, key head, part) of each unit */
    units = 0;
    for (long u = 0; u < runs; u++) {
        const long parts = row_parts(&rs, run_first[u + 1] - 1);
        for (long kvh = 0; kvh < m->kv_heads; kvh++)
            for (long part = 0; part < parts; part++, units++) {
                unit[3 * units] = (int32_t)u;
                unit[3 * units + 1] = (int32_t)kvh;
                unit[3 * units + 2] = (int32_t)part;
            }
    }
    const long part_floats = (long)per_kv * (d + 2);
    float *partials = (float *)malloc((row_first[n] * part_floats + 1) * sizeof(float));
    float *mass = p->n_scores ? (float *)malloc(p->n_scores * m->kv_heads * (p->layout.max_keys + 1L) * sizeof(float))
                              : NULL;
#pragma omp parallel
    {
#ifdef PIE_PROFILE
        if (omp_get_thread_num() == 0) profile_mark = omp_get_wtime();
#endif
#pragma omp for schedule(static)
        for (long r = 0; r < n; r++) list_slots(&p->layout, r, rs.slots + rs.off[r]);
#pragma omp for schedule(static)
        for (long r = 0; r < n; r++)
            for (long i = 0; i < d / 2; i++) {
                const float f = (float)p->positions[r] * m->inv_freq[i];
                b.cos[r * (d / 2) + i] = cosf(f);
                b.sin[r * (d / 2) + i] = sinf(f);
            }
        MARK(setup);
        for (int l = 0; l < m->layers; l++) {
            const QWeight wqkv = layer_weight(m, l, W_QKV, qkv_n, hidden), wo = layer_weight(m, l, W_O, hidden, hd);
            const QWeight wgu = layer_weight(m, l, W_GATE_UP, 2 * inter, hidden);
            const QWeight wdown = layer_weight(m, l, W_DOWN, hidden, inter);
            const KVLayer kv = {m->k_cache[l], m->v_cache[l], m->kv_bf16, m->kv_slots};
            QAct a = b.a;
            a.k = hidden;
#pragma omp for schedule(static)
            for (long r = 0; r < n; r++) {
                rmsnorm(b.x + r * hidden, m->ln1[l], hidden, m->eps, b.h + r * hidden);
                quantize_rows(b.h, hidden, r, r + 1, &a);
            }
            MARK(norm1);
#pragma omp for schedule(static)
            for (long u = 0; u < n_units(&wqkv); u++)
                qmatmul_unit(&wqkv, u, &a, n, b.qkv, qkv_n, m->qkv_bias ? m->qkv_bias[l] : NULL, 0);
            MARK(qkv);
#pragma omp for schedule(static)
            for (long r = 0; r < n; r++) rope_and_write(m, l, p, &b, r);
            MARK(rope_kv);
#pragma omp for schedule(static, 1)
            for (long i = 0; i < units; i++) {
                const long u = unit[3 * i], kvh = unit[3 * i + 1], part = unit[3 * i + 2], k0 = part * KEY_PART;
                const long last = run_first[u + 1] - 1;
                Run run = {(int)(run_first[u + 1] - run_first[u]), rs.slots + rs.off[last] + k0, {0}, {0}, {0}};
                for (int j = 0; j < run.n; j++) {
                    const long r = run_first[u] + j, nk = rs.off[r + 1] - rs.off[r] - k0;
                    run.nk[j] = nk <= 0 ? 0 : nk < KEY_PART ? nk : KEY_PART;
                    run.q[j] = b.qkv + r * qkv_n + kvh * per_kv * d;
                    run.out[j] = partials + (row_first[r] + kvh * row_parts(&rs, r) + part) * part_floats;
                }
                attend_part_any(&kv, &run, kvh, scale, (int)d, per_kv);
            }
#pragma omp for schedule(static)
            for (long u = 0; u < n * m->kv_heads; u++) {
                const long r = u / m->kv_heads, kvh = u % m->kv_heads;
                const long per_row = (row_first[r + 1] - row_first[r]) / m->kv_heads;
                combine_parts(partials + (row_first[r] + kvh * per_row) * part_floats, per_row, (int)d, per_kv,
                              b.attn + r * hd + kvh * per_kv * d);
            }
            if (p->n_scores) attention_mass(m, p, l, &kv, &rs, row_first, partials, b.qkv, mass, scale);
            MARK(attention);
            a.k = hd;
#pragma omp for schedule(static)
            for (long r = 0; r < n; r++) quantize_rows(b.attn, hd, r, r + 1, &a);
            MARK(quant_attn);
#pragma omp for schedule(static)
            for (long u = 0; u < n_units(&wo); u++)
                qmatmul_unit(&wo, u, &a, n, b.x, hidden, m->o_bias ? m->o_bias[l] : NULL, 1);
            MARK(o);
            a.k = hidden;
#pragma omp for schedule(static)
            for (long r = 0; r < n; r++) {
                rmsnorm(b.x + r * hidden, m->ln2[l], hidden, m->eps, b.h + r * hidden);
                quantize_rows(b.h, hidden, r, r + 1, &a);
            }
            MARK(norm2);
#pragma omp for schedule(static)
            for (long u = 0; u < n_units(&wgu); u++)
                qmatmul_unit(&wgu, u, &a, n, b.gu, 2 * inter, NULL, 0);
            MARK(gate_up);
            a.k = inter;
#pragma omp for schedule(static)
            for (long r = 0; r < n; r++) {
                silu_mul_row(b.gu + r * 2 * inter, inter, b.act + r * inter);
                quantize_rows(b.act, inter, r, r + 1, &a);
            }
            MARK(silu);
#pragma omp for schedule(static)
            for (long u = 0; u < n_units(&wdown); u++)
                qmatmul_unit(&wdown, u, &a, n, b.x, hidden, NULL, 1);
            MARK(down);
        }
#pragma omp for schedule(static)
        for (long r = 0; r < n; r++) rmsnorm(b.x + r * hidden, m->final_norm, hidden, m->eps, p->out + r * hidden);
        MARK(final_norm);
    }
    free(rs.off);
    free(rs.slots);
    free(row_first);
    free(run_first);
    free(unit);
    free(partials);
    free(mass);
}
