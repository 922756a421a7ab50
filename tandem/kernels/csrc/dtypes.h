/* The three element types tandem's CPU kernels take, and scalar conversions to and from float32
 * with PyTorch's rounding (round to nearest even; NaN stays NaN). */
#ifndef TANDEM_DTYPES_H
#define TANDEM_DTYPES_H
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#if defined(__F16C__)
#define HAVE_F16 1
#else
#define HAVE_F16 0
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if HAVE_F16
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t f32_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#endif

static inline float load1(const void *w, int64_t i, int dt) {
    if (dt == DT_F32) return ((const float *)w)[i];
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)w)[i]);
#if HAVE_F16
    return f16_to_f32(((const uint16_t *)w)[i]);
#else
    return 0.0f;
#endif
}

static inline void store1(void *y, int64_t i, float v, int dt) {
    if (dt == DT_F32) ((float *)y)[i] = v;
    else if (dt == DT_BF16) ((uint16_t *)y)[i] = f32_to_bf16(v);
#if HAVE_F16
    else ((uint16_t *)y)[i] = f32_to_f16(v);
#endif
}

#if defined(__AVX2__)
/* Eight elements of dtype `dt` from p + i as float32 lanes. */
static inline __m256 load8(const void *p, int64_t i, int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
#if HAVE_F16
    if (dt == DT_F16) return _mm256_cvtph_ps(h);
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The bf16 bits of eight float32 lanes (round to nearest even, NaN stays NaN), in the high
 * halves of 32-bit lanes. */
static inline __m256i bf16_bits8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    __m256i q = _mm256_or_si256(u, _mm256_set1_epi32(0x400000)); /* quiet NaN */
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(q), nan));
    return _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
}

/* Eight float32 lanes rounded to dtype `dt` and back: the values a tensor of that dtype holds. */
static inline __m256 round8(__m256 v, int dt) {
    if (dt == DT_BF16) return _mm256_castsi256_ps(bf16_bits8(v));
#if HAVE_F16
    if (dt == DT_F16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#endif
    return v;
}

/* Stores eight float32 lanes at p + i as dtype `dt`, rounded. */
static inline void store8(void *p, int64_t i, __m256 v, int dt) {
    if (dt == DT_F32) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    __m128i h;
#if HAVE_F16
    if (dt == DT_F16) {
        h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
        return;
    }
#endif
    __m256i b = _mm256_srli_epi32(bf16_bits8(v), 16);
    h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
}

/* Sum of the eight lanes. */
static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

/* x rounded to dtype `dt` and back: the value a tensor of that dtype would hold. */
static inline float round_to(float v, int dt) {
    if (dt == DT_BF16) return bf16_to_f32(f32_to_bf16(v));
#if HAVE_F16
    if (dt == DT_F16) return f16_to_f32(f32_to_f16(v));
#endif
    return v;
}
#endif
