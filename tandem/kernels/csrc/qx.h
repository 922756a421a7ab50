/* The activations of a quantized GEMV, quantized once per call (included by qgemv.c only).
 *
 * Each row of X, per block of 32: dx = max|x_i| / 127, q_i = nearest-even(x_i / dx) in int8
 * (|q_i| <= 127), so |x_i - dx q_i| <= dx / 2 (plus the float32 rounding of x_i / dx, under
 * 2^-17 dx). Alongside: the block sums of q scaled by dx (per 32 and per 16, for the weight
 * types' offsets), dx per 16 (Q6_K's 16-element scales) and dx repeated 4 times per block (the
 * lane pattern of the interleaved 32-block kernels), and the exact integer sums of q per 32
 * and per 16 (canon.h's kernels fold the weights' offsets into their integer dots with them).
 *
 * Layouts of q, per row of K (the AVX-512 kernels read the interleaved ones):
 *   nat  natural order;
 *   i32  per group of 4 blocks of 32 (128 elements), the four low halves (elements 0-15 of each
 *        block) then the four high halves: the order of the nibbles of 4 blocks' 16-byte `qs`
 *        laid side by side. A row's last K/32 % 4 blocks stay in natural order;
 *   ik   per 128 elements (half a K-quant superblock), the sub-blocks of 32 in order 0, 2, 1, 3:
 *        a 64-byte load of Q4_K / Q5_K `qs` holds sub-blocks 0 and 2 in its low nibbles and 1, 3
 *        in its high ones;
 *   t16  per group of 16 blocks, 8 vectors of 64 bytes: vector k, bytes 4 i .. 4 i + 3 = elements
 *        4 k .. 4 k + 3 of block i (GT_Q8_0X's order, quant.h); a last partial group padded
 *        with zeros to 16 blocks (QX_T16 bytes a row).
 * A block with a NaN or an infinity gets dx = NaN (every output it touches is NaN, as the
 * float product's would be); an all-zero block dx = 0.
 */
#ifndef TANDEM_QX_H
#define TANDEM_QX_H
#include <math.h>
#include <string.h>

#include "dtypes.h"

typedef struct {
    const float *xf; /* (M, K) float32 activations (the dense kernels read these) */
    int8_t *nat, *i32, *ik, *t16;
    float *d, *s;     /* (M, nbp): dx and dx * sum(q) per block of 32 */
    float *d16, *s16; /* (M, 2 nbp): the same per 16 */
    float *d4, *s4;   /* (M, 4 nbp): dx of each block repeated 4 times, s / 4 likewise */
    int32_t *q32, *q16; /* (M, nbp), (M, 2 nbp): sum(q) per block of 32, per 16 */
    int64_t K, nbp;   /* nbp: QX_NBP(K) blocks of 32 per row, the padding zeros */
} xq_t;

/* blocks of 32 a row's arrays hold: K / 32 and at least 16 more (a full 16-block load past the
 * last block reads zeros), a multiple of 16 */
#define QX_NBP(K) ((((K) / 32 + 15) / 16 + 1) * 16)
/* bytes a row's t16 layout takes: 512 per group of 16 blocks, the last one padded */
#define QX_T16(K) (((K) / 32 + 15) / 16 * 512)
/* the floats, then the int32s, one row's scale arrays take, in units of nbp */
enum { QX_FLOATS = 14, QX_INTS = 3 };

static inline int32_t qx_hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* One row of K float32 (K a multiple of 32) into the natural layout and the scale arrays. */
static inline void qx_quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s, float *d16,
                            float *s16, float *d4, float *s4, int32_t *q32, int32_t *q16) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 a = _mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
            _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
        __m256 bad = _mm256_or_ps(
            _mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)),
            _mm256_or_ps(_mm256_cmp_ps(v2, v2, _CMP_UNORD_Q), _mm256_cmp_ps(v3, v3, _CMP_UNORD_Q)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        const float amax = _mm_cvtss_f32(m4);
        const float dd = amax / 127.0f;
        float dv = dd;
        int32_t ia = 0, ib = 0;
        const int nonfinite = _mm256_movemask_ps(bad) || !(amax <= 3.4028234663852886e38f);
        if (nonfinite || dd == 0.0f) {
            dv = nonfinite ? NAN : 0.0f;
            memset(q + 32 * b, 0, 32);
        } else {
            const __m256 dvec = _mm256_set1_ps(dd);
            __m256i k0 = _mm256_cvtps_epi32(_mm256_div_ps(v0, dvec));
            __m256i k1 = _mm256_cvtps_epi32(_mm256_div_ps(v1, dvec));
            __m256i k2 = _mm256_cvtps_epi32(_mm256_div_ps(v2, dvec));
            __m256i k3 = _mm256_cvtps_epi32(_mm256_div_ps(v3, dvec));
            ia = qx_hsum_i32(_mm256_add_epi32(k0, k1));
            ib = qx_hsum_i32(_mm256_add_epi32(k2, k3));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(k0, k1), _mm256_packs_epi32(k2, k3));
            _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm256_permutevar8x32_epi32(p, order));
        }
        d[b] = d16[2 * b] = d16[2 * b + 1] = dv;
        d4[4 * b] = d4[4 * b + 1] = d4[4 * b + 2] = d4[4 * b + 3] = dv;
        s16[2 * b] = dv * (float)ia; /* NaN for a NaN block, 0 for a zero one */
        s16[2 * b + 1] = dv * (float)ib;
        s[b] = dv * (float)(ia + ib);
        s4[4 * b] = s4[4 * b + 1] = s4[4 * b + 2] = s4[4 * b + 3] = 0.25f * s[b];
        q32[b] = ia + ib, q16[2 * b] = ia, q16[2 * b + 1] = ib;
    }
}

/* The interleaved layouts from the natural one (module comment). */
static inline void qx_interleave_row(const int8_t *nat, int64_t K, int8_t *i32, int8_t *ik) {
    const int64_t nb = K / 32;
    if (i32) {
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4)
            for (int j = 0; j < 4; j++) {
                memcpy(i32 + 32 * b + 16 * j, nat + 32 * (b + j), 16);
                memcpy(i32 + 32 * b + 64 + 16 * j, nat + 32 * (b + j) + 16, 16);
            }
        memcpy(i32 + 32 * b, nat + 32 * b, (size_t)(32 * (nb - b)));
    }
    if (ik) {
        static const int order[4] = {0, 2, 1, 3};
        for (int64_t h = 0; h + 4 <= nb; h += 4)
            for (int j = 0; j < 4; j++) memcpy(ik + 32 * (h + j), nat + 32 * (h + order[j]), 32);
    }
}

/* The t16 layout from the natural one (module comment). */
static inline void qx_t16_row(const int8_t *nat, int64_t K, int8_t *t16) {
    const int64_t nb = K / 32;
    memset(t16, 0, (size_t)QX_T16(K));
    for (int64_t b = 0; b < nb; b++)
        for (int k = 0; k < 8; k++)
            memcpy(t16 + 512 * (b / 16) + 64 * k + 4 * (b % 16), nat + 32 * b + 4 * k, 4);
}
#endif
