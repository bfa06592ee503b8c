/* The vector vocabulary the native kernels share: 256-bit AVX2 + FMA + F16C everywhere, and the one
 * instruction the ISA variants differ in, the unsigned x signed byte dot product accumulated into int32 lanes
 * (dpbusd: one AVX512-VNNI or AVX-VNNI instruction, or AVX2's maddubs + madd).
 *
 * Every float reduction here runs in one fixed order (no -ffast-math, and -ffp-contract=off, so that the
 * compiler never fuses or reorders a product and a sum on its own): a row's result depends on its own inputs
 * only, never on how many rows a call has. */
#ifndef PIE_SIMD_H
#define PIE_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define QK 32 /* values in a quantized block (weights and activations) */

#if defined(PIE_AVX512VNNI) && defined(PIE_AMX) /* AVX512-VNNI, and AMX tiles for calls of several rows */
#define PIE_VARIANT "amx"
#define PIE_VNNI 1
INLINE __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(PIE_AVX512VNNI)
#define PIE_VARIANT "avx512vnni"
#define PIE_VNNI 1
INLINE __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(PIE_AVXVNNI)
#define PIE_VARIANT "avxvnni"
#define PIE_VNNI 1
INLINE __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define PIE_VARIANT "avx2"
#define PIE_VNNI 0
/* u * s pairwise into int16 (no saturation: u <= 15 for 4-bit weights, |u| <= 128 with |s| <= 127 for the 8-bit
 * sign form), then pairs of int16 into int32 */
INLINE __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
    const __m256i p = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif

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

INLINE __m256 load_bf16x8(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INLINE __m256 load_f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

INLINE float hsum(__m256 v) { /* lanes (0+4, 1+5, 2+6, 3+7), then pairs, then the last two: one order always */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 2^x for x in [-126, 126] (clamped): 2^round(x) times a degree-7 polynomial of the rest (|f| <= 1/2, relative
 * error about 1e-8). Elementwise, so its result never depends on the lanes beside it. */
INLINE __m256 exp2_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(126.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(0.69314718055994531f)); /* f ln 2 */
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

INLINE __m256i bcast4(const int8_t *p) { /* four bytes, repeated in every 32-bit lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#endif
