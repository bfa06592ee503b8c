/* The native decoder step of the Llama family: one call runs every layer of a pass over N ragged rows
 * (RMS norm, 8-bit activations, integer-dot q/k/v, rope, K/V written into the pool, paged attention, o, the
 * gated MLP, residuals, the final norm) inside one OpenMP parallel region, a barrier between stages. Also the
 * standalone pieces the model needs beside it: the lm head's matmul, embedding rows, repacking GGUF blocks.
 *
 * Float32 throughout (the pool may hold bfloat16); every stage computes a row from that row's inputs alone in
 * one fixed order (qmatmul.h, attention.h), so a row's bits do not depend on the rest of its pass.
 * Built once per ISA variant by pie_runtime/models/native_lib.py: -DPIE_AVX512VNNI, -DPIE_AVXVNNI or plain AVX2. */
#include <omp.h>
#include <stddef.h>
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
#define STAGES(X) X(setup) X(norm1) X(qkv) X(rope_kv) X(attention) X(quant_attn) X(o) X(norm2) X(gate_up) X(act) \
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

/* 8-bit: q (n, k) int8, d (n, k / 32) float16. On VNNI the values are stored + 128 (the kernel's m = -128 d). */
void pie_pack_q8(const int8_t *q, const uint16_t *d, long n, long k, uint8_t *out) {
    const long nb = k / QK, rb = record_bytes(WQ8);
#pragma omp parallel for schedule(static)
    for (long g = 0; g < (n + 7) / 8; g++)
        for (long b = 0; b < nb; b++) {
            uint8_t *rec = out + (g * nb + b) * rb;
            uint16_t *dm = (uint16_t *)(rec + values_bytes(WQ8));
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
                dm[o] = d[row * nb + b];
            }
        }
}

/* Rows `ids` of a packed weight, dequantized (float32, k values each): an embedding table shared with a tied
 * lm head is kept once. */
void pie_dequant_rows(const uint8_t *data, int32_t kind, long n, long k, const int64_t *ids, long count, float *out) {
    const long nb = k / QK, rb = record_bytes(kind), vb = values_bytes(kind);
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
            const float dw = _cvtsh_ss(dm[o]);
            const float mw = kind == WQ4 ? _cvtsh_ss(dm[8 + o]) : PIE_VNNI ? -128.0f * dw : 0.0f;
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
    const long nb = k / QK, rb = record_bytes(kind), vb = values_bytes(kind), chunks = vb / 32;
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
            if (kind == WQ4) tdm[8 + o] = sdm[8 + src_o];
        }
    }
}

/* ---- the lm head and other standalone matmuls ------------------------------------------------------------ */

long pie_qmatmul_scratch(long m, long k) { return m * k + 4 * m * (k / QK) * (long)sizeof(float) + 64; }

/* y (m, n) = x (m, k) float32 @ w.T; `scratch` of pie_qmatmul_scratch bytes. */
void pie_qmatmul(const uint8_t *data, int32_t kind, long n, long k, const float *x, long m, float *y, uint8_t *scratch) {
    QWeight w = {data, kind, (int32_t)n, (int32_t)k};
    float *ds = (float *)scratch;
    QAct a = {(int8_t *)(ds + 4 * m * (k / QK)), ds, ds + m * (k / QK), (int32_t *)(ds + 2 * m * (k / QK)), k};
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

enum { ACT_SILU, ACT_GELU_TANH }; /* the gated MLP's activation: SiLU (Llama), tanh-approximated GELU (Gemma) */

typedef struct { /* one layer's recipe beside its matmuls (the Llama family and Gemma 3 share the stages) */
    const float *attn_norm;       /* RMS norm (x * w: a (1 + w) form is folded in at load) before attention */
    const float *attn_post_norm;  /* of attention's output before the residual add (Gemma 3), or NULL */
    const float *ff_norm;         /* before the MLP */
    const float *ff_post_norm;    /* of the MLP's output before the residual add (Gemma 3), or NULL */
    const float *q_norm, *k_norm; /* per-head RMS norms of q and k before rope (Qwen3, Gemma 3), or NULL */
    int64_t kv_slots;             /* slots per head of the layer's pool */
    int32_t act;                  /* ACT_SILU or ACT_GELU_TANH */
    int32_t rope;                 /* its rope table: a row of PieModel.inv_freq */
    int32_t layout;               /* its attention group: which of the pass's layouts (page tables, window) */
    int32_t pad;
} PieLayer;

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, inter, kv_bf16, n_ropes;
    float eps;
    float attn_scalar;            /* scores scaled by attn_scalar^-1/2: head_dim, or query_pre_attn_scalar */
    const uint8_t *const *w[4];   /* per layer: qkv, o, gate_up, down (packed) */
    const int32_t *kinds;         /* (layers, 4) their WQ4 / WQ8 */
    const float *const *qkv_bias; /* per layer, or NULL */
    const float *const *o_bias;   /* per layer, or NULL */
    const PieLayer *layer;        /* (layers) recipes */
    const float *final_norm;
    const float *inv_freq;                 /* (n_ropes, head_dim / 2) rope tables */
    void *const *k_cache, *const *v_cache; /* per layer: (kv_heads, kv_slots, head_dim) */
} PieModel;

typedef struct {
    int64_t n_rows;
    const float *x; /* (N, hidden) input embeddings */
    float *out;     /* (N, hidden) final hidden states, normed */
    const int32_t *positions;
    const PassLayout *layouts;    /* (n_layouts) the pass's attention groups: a layer reads its recipe's */
    int64_t n_layouts;
    int64_t n_scores;             /* rows the attention readout reads (0: an ordinary pass, which pays nothing) */
    const int32_t *score_rows;    /* (n_scores,) their rows in the pass */
    const int64_t *score_at;      /* (n_scores,) where each one's output starts in `scores` */
    const int32_t *score_width;   /* (n_scores,) sequence indices per output row (0 .. width-1) */
    const int32_t *score_layered; /* (n_scores,) 1: one output row per layer; 0: the layers summed into one */
    float *scores;                /* zeroed by the caller; a key the row does not see stays 0 */
} PiePass;

/* The structs' sizes and field offsets as this compiler lays them out, read by the Python side at load and
 * compared with its ctypes copies (native_model.py), so that a copy cannot drift silently. */
typedef struct {
    const char *name;
    long at;
} FieldAt;
#define AT(T, f) {#T "." #f, (long)offsetof(T, f)}
#define SIZE(T) {#T, (long)sizeof(T)}
static const FieldAt struct_layout[] = {
    SIZE(PassLayout), AT(PassLayout, row_seg), AT(PassLayout, row_limit), AT(PassLayout, row_extra),
    AT(PassLayout, extras), AT(PassLayout, seg_pages), AT(PassLayout, pages), AT(PassLayout, write_slots),
    AT(PassLayout, row_skip), AT(PassLayout, page_size), AT(PassLayout, max_keys),
    SIZE(PieLayer), AT(PieLayer, attn_norm), AT(PieLayer, attn_post_norm), AT(PieLayer, ff_norm),
    AT(PieLayer, ff_post_norm), AT(PieLayer, q_norm), AT(PieLayer, k_norm), AT(PieLayer, kv_slots),
    AT(PieLayer, act), AT(PieLayer, rope), AT(PieLayer, layout), AT(PieLayer, pad),
    SIZE(PieModel), AT(PieModel, layers), AT(PieModel, hidden), AT(PieModel, heads), AT(PieModel, kv_heads),
    AT(PieModel, head_dim), AT(PieModel, inter), AT(PieModel, kv_bf16), AT(PieModel, n_ropes), AT(PieModel, eps),
    AT(PieModel, attn_scalar), AT(PieModel, w), AT(PieModel, kinds), AT(PieModel, qkv_bias), AT(PieModel, o_bias),
    AT(PieModel, layer), AT(PieModel, final_norm), AT(PieModel, inv_freq), AT(PieModel, k_cache),
    AT(PieModel, v_cache),
    SIZE(PiePass), AT(PiePass, n_rows), AT(PiePass, x), AT(PiePass, out), AT(PiePass, positions),
    AT(PiePass, layouts), AT(PiePass, n_layouts), AT(PiePass, n_scores), AT(PiePass, score_rows),
    AT(PiePass, score_at), AT(PiePass, score_width), AT(PiePass, score_layered), AT(PiePass, scores),
};
#undef AT
#undef SIZE

/* Entry i of the layout table: its name ("Struct" for the size, "Struct.field" for an offset) and value; -1
 * past the end. */
long pie_struct_layout(long i, const char **name) {
    if (i < 0 || i >= (long)(sizeof struct_layout / sizeof struct_layout[0])) return -1;
    *name = struct_layout[i].name;
    return struct_layout[i].at;
}

enum { W_QKV, W_O, W_GATE_UP, W_DOWN };

INLINE long rup(long v) { return (v + 63) / 64 * 64; }

typedef struct {
    float *x, *h, *qkv, *attn, *gu, *act, *cos, *sin; /* cos, sin: (n_ropes, N, head_dim / 2) */
    long n;
    QAct a;
} Buffers;

static long carve(const PieModel *m, long n, uint8_t *base, Buffers *b) {
    const long hd = (long)m->heads * m->head_dim, qkv = hd + 2L * m->kv_heads * m->head_dim;
    const long rope = (long)m->n_ropes * n * (m->head_dim / 2);
    long kmax = m->hidden > hd ? m->hidden : hd;
    kmax = kmax > m->inter ? kmax : m->inter;
    const long sizes[] = {n * m->hidden, n * (m->hidden > hd ? m->hidden : hd), n * qkv, n * hd, n * 2L * m->inter,
                          n * m->inter, rope, rope, n * (kmax / QK), n * (kmax / QK)};
    float **dst[] = {&b->x, &b->h, &b->qkv, &b->attn, &b->gu, &b->act, &b->cos, &b->sin, &b->a.d, &b->a.s};
    long at = 0;
    for (int i = 0; i < 10; i++) {
        if (base) *dst[i] = (float *)(base + at);
        at += rup(sizes[i] * (long)sizeof(float));
    }
    if (base) b->a.h = (int32_t *)(base + at);
    at += rup(2 * n * (kmax / QK) * (long)sizeof(int32_t));
    if (base) b->a.q = (int8_t *)(base + at);
    b->n = n;
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

/* x += rmsnorm(y) (a sandwich norm: a block's output normed before it joins the residual); y is overwritten. */
static void norm_add(float *y, const float *w, long n, float eps, float *x) {
    rmsnorm(y, w, n, eps, y);
    for (long i = 0; i < n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
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

/* q heads normed (with q norms) and rotated in place; k heads too, then k and v written to the pool at the
 * layout's write slots, with the layer's rope table */
static void rope_and_write(const PieModel *m, int l, const int64_t *write_slots, const Buffers *b, long r) {
    const PieLayer *L = m->layer + l;
    const int d = m->head_dim, hq = m->heads, hk = m->kv_heads;
    float *row = b->qkv + r * ((long)(hq + 2 * hk) * d);
    const long at = ((long)L->rope * b->n + r) * (d / 2);
    const float *c = b->cos + at, *s = b->sin + at;
    for (int h = 0; h < hq + hk; h++) {
        float *x = row + (long)h * d;
        const float *norm = h < hq ? L->q_norm : L->k_norm;
        if (norm) rmsnorm(x, norm, d, m->eps, x);
        rope(x, c, s, d);
    }
    for (int h = 0; h < hk; h++) {
        store_kv(m->k_cache[l], m->kv_bf16, L->kv_slots, h, write_slots[r], row + (long)(hq + h) * d, d);
        store_kv(m->v_cache[l], m->kv_bf16, L->kv_slots, h, write_slots[r], row + (long)(hq + hk + h) * d, d);
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

/* tanh-approximated GELU, 0.5 g (1 + tanh(y)) with y = sqrt(2 / pi) (g + 0.044715 g^3), written as
 * g / (1 + e^(-2y)) (the same function), times the up half. */
static void gelu_tanh_mul_row(const float *gu, long inter, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), c3 = _mm256_set1_ps(0.044715f);
    const __m256 k = _mm256_set1_ps(-2.302208198144325f); /* -2 sqrt(2 / pi) log2(e) */
    for (long i = 0; i < inter; i += 8) {
        const __m256 g = _mm256_loadu_ps(gu + i), u = _mm256_loadu_ps(gu + inter + i);
        const __m256 inner = _mm256_add_ps(g, _mm256_mul_ps(c3, _mm256_mul_ps(_mm256_mul_ps(g, g), g)));
        const __m256 e = exp2_ps(_mm256_mul_ps(inner, k));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
    }
}

INLINE QWeight layer_weight(const PieModel *m, int l, int which, long n, long k) {
    QWeight w = {m->w[which][l], m->kinds[4 * l + which], (int32_t)n, (int32_t)k};
    return w;
}

typedef struct { /* one layout's attention work for a pass: laid out once, run by each layer that reads it */
    const PassLayout *lay;
    RowSlots rs;
    int64_t *row_first; /* row r's partial results sit at row_first[r] + key head * its parts + part */
    int32_t *run_first; /* (runs + 1) first row of each run of rows that share a key list */
    int32_t *unit;      /* (run, key head, part) of each unit */
    long runs, units;
} Plan;

/* Runs of rows that share a key list (consecutive rows of one sequence outside a tree window whose lists start
 * at the same key, at most RUN), each run by key head and part of KEY_PART keys. The slots are listed later,
 * inside the parallel region. */
static void plan_layout(const PieModel *m, const PassLayout *lay, long n, Plan *pl) {
    pl->lay = lay;
    pl->rs.off = (int64_t *)malloc((n + 1) * sizeof(int64_t));
    pl->rs.off[0] = 0;
    for (long r = 0; r < n; r++) pl->rs.off[r + 1] = pl->rs.off[r] + row_keys(lay, r);
    pl->rs.slots = (int32_t *)malloc((pl->rs.off[n] + 1) * sizeof(int32_t));
    pl->row_first = (int64_t *)malloc((n + 1) * sizeof(int64_t));
    pl->run_first = (int32_t *)malloc((n + 1) * sizeof(int32_t));
    long runs = 0;
    pl->row_first[0] = 0;
    for (long r = 0; r < n; r++) {
        pl->row_first[r + 1] = pl->row_first[r] + row_parts(&pl->rs, r) * m->kv_heads;
        const int plain = lay->row_extra[r + 1] == lay->row_extra[r];
        const int joins = r > 0 && plain && r - pl->run_first[runs - 1] < RUN && lay->row_seg[r] == lay->row_seg[r - 1] &&
                          lay->row_extra[r] == lay->row_extra[r - 1] && row_first_key(lay, r) == row_first_key(lay, r - 1);
        if (!joins) pl->run_first[runs++] = (int32_t)r;
    }
    pl->run_first[runs] = (int32_t)n;
    long units = 0;
    for (long u = 0; u < runs; u++) units += row_parts(&pl->rs, pl->run_first[u + 1] - 1) * m->kv_heads;
    pl->unit = (int32_t *)malloc((3 * units + 1) * sizeof(int32_t));
    units = 0;
    for (long u = 0; u < runs; u++) {
        const long parts = row_parts(&pl->rs, pl->run_first[u + 1] - 1);
        for (long kvh = 0; kvh < m->kv_heads; kvh++)
            for (long part = 0; part < parts; part++, units++) {
                pl->unit[3 * units] = (int32_t)u;
                pl->unit[3 * units + 1] = (int32_t)kvh;
                pl->unit[3 * units + 2] = (int32_t)part;
            }
    }
    pl->runs = runs;
    pl->units = units;
}

static void free_plan(Plan *pl) {
    free(pl->rs.off);
    free(pl->rs.slots);
    free(pl->row_first);
    free(pl->run_first);
    free(pl->unit);
}

/* One layer's attention inside the step's parallel region: the units' parts, then each row's parts combined. */
static void attend_layer(const PieModel *m, const Plan *pl, const KVLayer *kv, const float *qkv, float *partials,
                         float *attn, float scale) {
    const long d = m->head_dim, hd = (long)m->heads * d, qkv_n = hd + 2L * m->kv_heads * d;
    const int per_kv = m->heads / m->kv_heads;
    const long part_floats = (long)per_kv * (d + 2), rows = pl->run_first[pl->runs];
#pragma omp for schedule(static, 1)
    for (long i = 0; i < pl->units; i++) {
        const long u = pl->unit[3 * i], kvh = pl->unit[3 * i + 1], part = pl->unit[3 * i + 2], k0 = part * KEY_PART;
        const long last = pl->run_first[u + 1] - 1;
        Run run = {(int)(pl->run_first[u + 1] - pl->run_first[u]), pl->rs.slots + pl->rs.off[last] + k0, {0}, {0}, {0}};
        for (int j = 0; j < run.n; j++) {
            const long r = pl->run_first[u] + j, nk = pl->rs.off[r + 1] - pl->rs.off[r] - k0;
            run.nk[j] = nk <= 0 ? 0 : nk < KEY_PART ? nk : KEY_PART;
            run.q[j] = qkv + r * qkv_n + kvh * per_kv * d;
            run.out[j] = partials + (pl->row_first[r] + kvh * row_parts(&pl->rs, r) + part) * part_floats;
        }
        attend_part_any(kv, &run, kvh, scale, (int)d, per_kv);
    }
#pragma omp for schedule(static)
    for (long u = 0; u < rows * m->kv_heads; u++) {
        const long r = u / m->kv_heads, kvh = u % m->kv_heads;
        const long per_row = (pl->row_first[r + 1] - pl->row_first[r]) / m->kv_heads;
        combine_parts(partials + (pl->row_first[r] + kvh * per_row) * part_floats, per_row, (int)d, per_kv,
                      attn + r * hd + kvh * per_kv * d);
    }
}

/* One layer's attention readout, inside the step's parallel region: each read row's mass per key head (head_mass)
 * into `mass` (rows of `width`), then the key heads added in order and the sum added into the row's output at
 * the keys' sequence indices: this layer's output row, or the one summed over the layers (layer by layer, in
 * order). Only the keys the layer's window keeps get any. */
static void attention_mass(const PieModel *m, const PiePass *p, int l, const KVLayer *kv, const Plan *pl,
                           const float *partials, const float *qkv, float *mass, long width, float scale) {
    const RowSlots *rs = &pl->rs;
    const long d = m->head_dim, kvhs = m->kv_heads;
    const long qkv_n = (long)m->heads * d + 2L * kvhs * d, part_floats = (long)(m->heads / kvhs) * (d + 2);
#pragma omp for schedule(static)
    for (long u = 0; u < p->n_scores * kvhs; u++) {
        const long r = p->score_rows[u / kvhs], kvh = u % kvhs;
        const long per_row = (pl->row_first[r + 1] - pl->row_first[r]) / kvhs;
        head_mass_any(kv, kvh, rs->slots + rs->off[r], rs->off[r + 1] - rs->off[r],
                      qkv + r * qkv_n + kvh * (m->heads / kvhs) * d,
                      partials + (pl->row_first[r] + kvh * per_row) * part_floats, per_row, scale, mass + u * width,
                      (int)d, m->heads / kvhs);
    }
#pragma omp for schedule(static)
    for (long i = 0; i < p->n_scores; i++) {
        const long r = p->score_rows[i], nk = rs->off[r + 1] - rs->off[r];
        float *out = p->scores + p->score_at[i] + (p->score_layered[i] ? (long)l * p->score_width[i] : 0);
        for (long j = 0; j < nk; j++) {
            float v = 0.0f; /* the layer's mass first, so the summed output is the per-layer rows added in order */
            for (long kvh = 0; kvh < kvhs; kvh++) v += mass[(i * kvhs + kvh) * width + j];
            out[key_index(pl->lay, r, j)] += v;
        }
    }
}

/* The residual stream's norm before a block, and the norm's output quantized for the block's matmul. */
static void norm_rows(const float *x, const float *w, long n, long hidden, float eps, float *h, QAct *a) {
#pragma omp for schedule(static)
    for (long r = 0; r < n; r++) {
        rmsnorm(x + r * hidden, w, hidden, eps, h + r * hidden);
        quantize_rows(h, hidden, r, r + 1, a);
    }
}

/* A block's output projection: added into the residual stream x, or (a sandwich norm) written to y, normed
 * and then added. */
static void project_add(const QWeight *w, const QAct *a, long n, const float *bias, const float *post, float eps,
                        float *y, float *x) {
    const long hidden = w->n;
#pragma omp for schedule(static)
    for (long u = 0; u < n_units(w); u++) qmatmul_unit(w, u, a, n, post ? y : x, hidden, bias, post == NULL);
    if (post == NULL) return;
#pragma omp for schedule(static)
    for (long r = 0; r < n; r++) norm_add(y + r * hidden, post, hidden, eps, x + r * hidden);
}

void pie_decoder_step(const PieModel *m, const PiePass *p, uint8_t *scratch) {
    const long n = p->n_rows, hidden = m->hidden, d = m->head_dim;
    const long hd = (long)m->heads * d, qkv_n = hd + 2L * m->kv_heads * d, inter = m->inter;
    const float scale = 1.4426950408889634f / sqrtf(m->attn_scalar);
    Buffers b;
    carve(m, n, scratch, &b);
    memcpy(b.x, p->x, n * hidden * sizeof(float));
    Plan *plans = (Plan *)malloc(p->n_layouts * sizeof(Plan));
    long partial_rows = 0, width = 1;
    for (long i = 0; i < p->n_layouts; i++) {
        plan_layout(m, p->layouts + i, n, plans + i);
        partial_rows = plans[i].row_first[n] > partial_rows ? plans[i].row_first[n] : partial_rows;
        width = p->layouts[i].max_keys + 1L > width ? p->layouts[i].max_keys + 1L : width;
    }
    float *partials = (float *)malloc((partial_rows * (m->heads / m->kv_heads) * (d + 2) + 1) * sizeof(float));
    float *mass = p->n_scores ? (float *)malloc(p->n_scores * m->kv_heads * width * sizeof(float)) : NULL;
#pragma omp parallel
    {
#ifdef PIE_PROFILE
        if (omp_get_thread_num() == 0) profile_mark = omp_get_wtime();
#endif
        for (long i = 0; i < p->n_layouts; i++) {
#pragma omp for schedule(static)
            for (long r = 0; r < n; r++) list_slots(plans[i].lay, r, plans[i].rs.slots + plans[i].rs.off[r]);
        }
#pragma omp for schedule(static)
        for (long r = 0; r < n; r++)
            for (long t = 0; t < m->n_ropes; t++)
                for (long i = 0; i < d / 2; i++) {
                    const float f = (float)p->positions[r] * m->inv_freq[t * (d / 2) + i];
                    b.cos[(t * n + r) * (d / 2) + i] = cosf(f);
                    b.sin[(t * n + r) * (d / 2) + i] = sinf(f);
                }
        MARK(setup);
        for (int l = 0; l < m->layers; l++) {
            const PieLayer *L = m->layer + l;
            const Plan *pl = plans + L->layout;
            const QWeight wqkv = layer_weight(m, l, W_QKV, qkv_n, hidden), wo = layer_weight(m, l, W_O, hidden, hd);
            const QWeight wgu = layer_weight(m, l, W_GATE_UP, 2 * inter, hidden);
            const QWeight wdown = layer_weight(m, l, W_DOWN, hidden, inter);
            const KVLayer kv = {m->k_cache[l], m->v_cache[l], m->kv_bf16, L->kv_slots};
            QAct a = b.a;
            a.k = hidden;
            norm_rows(b.x, L->attn_norm, n, hidden, m->eps, b.h, &a);
            MARK(norm1);
#pragma omp for schedule(static)
            for (long u = 0; u < n_units(&wqkv); u++)
                qmatmul_unit(&wqkv, u, &a, n, b.qkv, qkv_n, m->qkv_bias ? m->qkv_bias[l] : NULL, 0);
            MARK(qkv);
#pragma omp for schedule(static)
            for (long r = 0; r < n; r++) rope_and_write(m, l, pl->lay->write_slots, &b, r);
            MARK(rope_kv);
            attend_layer(m, pl, &kv, b.qkv, partials, b.attn, scale);
            if (p->n_scores) attention_mass(m, p, l, &kv, pl, partials, b.qkv, mass, width, scale);
            MARK(attention);
            a.k = hd;
#pragma omp for schedule(static)
            for (long r = 0; r < n; r++) quantize_rows(b.attn, hd, r, r + 1, &a);
            MARK(quant_attn);
            project_add(&wo, &a, n, m->o_bias ? m->o_bias[l] : NULL, L->attn_post_norm, m->eps, b.h, b.x);
            MARK(o);
            a.k = hidden;
            norm_rows(b.x, L->ff_norm, n, hidden, m->eps, b.h, &a);
            MARK(norm2);
#pragma omp for schedule(static)
            for (long u = 0; u < n_units(&wgu); u++)
                qmatmul_unit(&wgu, u, &a, n, b.gu, 2 * inter, NULL, 0);
            MARK(gate_up);
            a.k = inter;
#pragma omp for schedule(static)
            for (long r = 0; r < n; r++) {
                if (L->act == ACT_GELU_TANH)
                    gelu_tanh_mul_row(b.gu + r * 2 * inter, inter, b.act + r * inter);
                else
                    silu_mul_row(b.gu + r * 2 * inter, inter, b.act + r * inter);
                quantize_rows(b.act, inter, r, r + 1, &a);
            }
            MARK(act);
            project_add(&wdown, &a, n, NULL, L->ff_post_norm, m->eps, b.h, b.x);
            MARK(down);
        }
#pragma omp for schedule(static)
        for (long r = 0; r < n; r++) rmsnorm(b.x + r * hidden, m->final_norm, hidden, m->eps, p->out + r * hidden);
        MARK(final_norm);
    }
    for (long i = 0; i < p->n_layouts; i++) free_plan(plans + i);
    free(plans);
    free(partials);
    free(mass);
}
