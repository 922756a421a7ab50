/* Prefill over dense weights (F32, F16, BF16) on AVX-512: Y (M, N) = X (M, K) . W (N, K)^T for
 * M > 4 rows of float32 X, W as stored (row-major, its own dtype). qgemv.c calls it where every
 * part is dense; it returns -2 without AVX-512 (qgemv.c then runs the decode kernel, 4 rows of X
 * at a time).
 *
 * Register tiles of GN = 4 rows of W by GM = 6 rows of X: per 16 columns, 4 weight vectors widened
 * to float32 and 6 of X feed 24 fused multiply-adds, so each loaded weight serves 6 rows of X and
 * each row of X 4 weights (the decode kernel reloads X for every weight row).
 *
 * Each output is the decode kernel's sum (qdot256.h dot_dense) bit for bit, so a row's result
 * does not depend on how many rows share the call (batch invariance): dot_dense keeps two 8-lane
 * accumulators, a0 over columns 16i..16i+7 and a1 over 16i+8..16i+15, one fma(w, x, a) per column
 * in increasing i; here one 16-lane accumulator whose low half is a0 and high half a1 takes the
 * same fmas lane for lane. Then hsum8(a0 + a1) and the K % 16 last columns one product and one
 * add at a time, as there. The widened weights are exact (a 16-bit float is a float32), so the
 * products are the same.
 *
 * Partition (dense_drive.h, shared with the other ISA's tiles): each part's rows in chunks of
 * WCH, handed out on demand; a thread runs its chunk against every tile of X rows. Every output
 * is one row of W against one row of X: the result does not depend on the thread count.
 */
#include <stdlib.h>
#include <omp.h>

#include "dtypes.h"
#include "quant.h"
#include "runs.h"

int tandem_dense_gemm512(const float *x, const tq_part *parts, int64_t nparts, const float *bias,
                         void *y, int64_t M, int64_t K, int dt, int nthreads);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)

enum { GN = 4, GM = 6, WCH = 16 }; /* rows of W and of X per tile, rows of W per chunk */

/* 16 weights of type t from column j, widened to float32 (exact) */
static inline __attribute__((always_inline)) __m512 wload16(const uint8_t *w, int64_t j,
                                                           const int t) {
    if (t == GT_F32) return _mm512_loadu_ps((const float *)w + j);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + j));
    if (t == GT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* BF16 */
}

/* rows r .. r + nn of W (w at row r, rb bytes per row) against rows of X at x (mm rows, ldx
 * floats apart) -> out[n][m] */
static inline __attribute__((always_inline)) void tile(const int t, const uint8_t *w, int64_t rb,
                                                       const float *x, int64_t ldx, int64_t K,
                                                       float out[WCH][GM], const int nn,
                                                       const int mm) {
    const int wdt = t == GT_F32 ? DT_F32 : t == GT_F16 ? DT_F16 : DT_BF16;
    const int64_t kv = K / 16 * 16;
    __m512 acc[GN][GM];
#pragma GCC unroll 4
    for (int n = 0; n < nn; n++)
#pragma GCC unroll 6
        for (int m = 0; m < mm; m++) acc[n][m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < kv; j += 16) {
        __m512 wv[GN];
#pragma GCC unroll 4
        for (int n = 0; n < nn; n++) wv[n] = wload16(w + n * rb, j, t);
#pragma GCC unroll 6
        for (int m = 0; m < mm; m++) {
            const __m512 xv = _mm512_loadu_ps(x + m * ldx + j);
#pragma GCC unroll 4
            for (int n = 0; n < nn; n++) acc[n][m] = _mm512_fmadd_ps(wv[n], xv, acc[n][m]);
        }
    }
#pragma GCC unroll 4
    for (int n = 0; n < nn; n++)
#pragma GCC unroll 6
        for (int m = 0; m < mm; m++) {
            const __m256 a0 = _mm512_castps512_ps256(acc[n][m]);
            const __m256 a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[n][m]), 1));
            float s = hsum8(_mm256_add_ps(a0, a1));
            for (int64_t j = kv; j < K; j++) s += load1(w + n * rb, j, wdt) * x[m * ldx + j];
            out[n][m] = s;
        }
}

/* the chunk's rows, GN at a time (one at a time where fewer are left), each tile over all of K
 * -> out[r][m] */
static inline __attribute__((always_inline)) void chunk(const int t, const uint8_t *w, int64_t rb,
                                                        int nrows, const float *x, int64_t ldx,
                                                        int64_t K, float out[WCH][GM],
                                                        const int mm, ahead_t *ahead) {
    int r = 0;
    for (; r + GN <= nrows; r += GN) {
        ahead_some(ahead);
        tile(t, w + r * rb, rb, x, ldx, K, out + r, GN, mm);
    }
    for (; r < nrows; r++) tile(t, w + r * rb, rb, x, ldx, K, out + r, 1, mm);
}

/* ahead_some calls per tile of X: one per tile of GN rows */
static inline int64_t chunk_steps(int64_t K, int64_t rows) {
    (void)K;
    return rows / GN;
}

#include "dense_drive.h"

int tandem_dense_gemm512(const float *x, const tq_part *parts, int64_t nparts, const float *bias,
                         void *y, int64_t M, int64_t K, int dt, int nthreads) {
    return dense_drive(x, parts, nparts, bias, y, M, K, dt, nthreads);
}

#else
int tandem_dense_gemm512(const float *x, const tq_part *parts, int64_t nparts, const float *bias,
                         void *y, int64_t M, int64_t K, int dt, int nthreads) {
    (void)x; (void)parts; (void)nparts; (void)bias; (void)y; (void)M; (void)K; (void)dt;
    (void)nthreads;
    return -2;
}
#endif
