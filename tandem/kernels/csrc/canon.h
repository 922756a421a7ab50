/* The one order in which every quantized product sums its terms, so that an output is
 * bit-for-bit the same whichever kernel computes it: the decode kernels (qdot512.h, qdot256.h:
 * 1-4 rows of X), the prefill kernels (qgemm.c, qgemm256.c: any number), on AVX-512 or AVX2.
 * A row's result then does not depend on how many rows share the call (batch invariance), and
 * an AVX2 build computes what an AVX-512 build does.
 *
 * Per row of W against one row of X (quantized by qx.h: int8 q, dx per block of 32 and the
 * exact integer sums of q per 32 and per 16), 16 float32 accumulators acc[0..15], all +0.0.
 * Block b (a block of 32; a K-quant sub-block of 32, numbered 8 sb + j across the row; a Q6_K
 * group of 32, numbered 8 sb + jj) goes to lane b % 16, blocks in increasing b, and adds:
 *
 *   symmetric types, w = s * v with v a signed integer (Q4_0 v = u - 8, Q5_0 u - 16, Q8_0 q,
 *   MXFP4 kv):       acc = fma((float)I_b, s_b * dx_b, acc),        I_b = sum v q   (exact)
 *   offset types, w = s * u + o (Q4_1, Q5_1: o = m; Q4_K, Q5_K: s = d sc_j, o = -dmin m_j):
 *                    acc = fma((float)U_b, s_b * dx_b, acc)
 *                    acc = fma(o_b, sx_b, acc),                     U_b = sum u q   (exact),
 *                    sx_b = dx_b * (float)(sum q)  (qx.h's `s`)
 *   Q6_K, two halves of 16 with their own scales s = d sc (v = u - 32):
 *                    acc = fma((float)I_b0, s_b0 * dx_b, acc)
 *                    acc = fma((float)I_b1, s_b1 * dx_b, acc)
 *
 * (each s_b * dx_b one float32 product; a K-quant s = (float)sc_j * d and o = (float)m_j * -dmin,
 * Q6_K s = d * (float)sc; a lane past the row's last block adds nothing: fma(0, 0, acc) = acc,
 * and no accumulator is ever -0.0), then the 16 lanes are summed by canon_reduce16's tree and
 * the bias added. The integer sums are exact however a kernel forms them (VPDPBUSD lanes,
 * VPMADDUBSW pairs, the weights' offsets folded in afterwards: I = U - 8 sum q), so only the
 * float operations above are fixed. The dense types (F32, F16, BF16) run one kernel
 * (qdot256.h's dot_dense) for every row count. */
#ifndef TANDEM_CANON_H
#define TANDEM_CANON_H
#include <immintrin.h>

/* lanes 0-7 in lo, 8-15 in hi: (hi + lo), then its halves, then the pairs, then the two */
static inline float canon_reduce16(__m256 lo, __m256 hi) {
    const __m256 t = _mm256_add_ps(hi, lo);
    const __m128 h = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    const __m128 p = _mm_add_ps(h, _mm_shuffle_ps(h, h, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ps(p, _mm_shuffle_ps(p, p, _MM_SHUFFLE(2, 3, 0, 1))));
}

#if defined(__AVX512F__)
static inline float canon_reduce512(__m512 acc) {
    return canon_reduce16(_mm512_castps512_ps256(acc),
                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
}
#endif
#endif
