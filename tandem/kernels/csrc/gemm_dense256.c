/* Prefill over dense weights (F32, F16, BF16) on AVX2 + FMA: Y (M, N) = X (M, K) . W (N, K)^T
 * for M > 4 rows of float32 X, W as stored (row-major, its own dtype). qgemv.c calls it where
 * every part is dense and gemm_dense512.c does not apply (a build without AVX-512); it returns
 * -2 without AVX2 (qgemv.c then runs the decode kernel, 4 rows of X at a time, which reads each
 * weight again for every 4 rows and converts a BF16 weight for each).
 *
 * Register tiles of GN = 2 rows of W by GM = 6 rows of X: per 8 columns, 2 weight vectors
 * widened to float32 and 6 of X feed 12 fused multiply-adds (12 accumulators + 2 + 1 of the 16
 * ymm registers), so each loaded weight serves 6 rows of X and each row of X 2 weights. (3 by 4
 * measured 0.7-0.85x of this on a Zen 3: its 16 live registers spill.)
 *
 * Each output is the decode kernel's sum (qdot256.h dot_dense) bit for bit, so a row's result
 * does not depend on how many rows share the call (batch invariance): dot_dense keeps two 8-lane
 * accumulators, a0 over columns 16i..16i+7 and a1 over 16i+8..16i+15, one fma(w, x, a) per
 * column in increasing i. The two are independent chains, so here they are two passes over each
 * block of KB columns (a0's, then a1's, the block's rows of W and X in L1 for both: 6 KB of X
 * and 1-2 KB of W), each chain carried in memory from one block to the next; then hsum8(a0 + a1)
 * and the K % 16 last columns one product and one add at a time, as there. The widened weights
 * are exact (a 16-bit float is a float32), so the products are the same. Blocks of 256 columns
 * against none: 1.45x at K = 3072, the same at K = 1024 (Zen 3, 2 threads, BF16 and F32).
 *
 * Partition (dense_drive.h, shared with the other ISA's tiles): each part's rows in chunks of
 * WCH, handed out on demand; a thread runs its chunk against every tile of X rows. Every output
 * is one row of W against one row of X: the result does not depend on the thread count.
 */
#include <stdlib.h>
#include <omp.h>

#include "dtypes.h"
#include "quant.h"

int tandem_dense_gemm256(const float *x, const tq_part *parts, int64_t nparts, const float *bias,
                         void *y, int64_t M, int64_t K, int dt, int nthreads);

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

/* rows of W and of X per tile, rows of W per chunk, columns per block */
enum { GN = 2, GM = 6, WCH = 24, KB = 256 };

/* rows r .. r + nn of W (w at row r, rb bytes per row) against rows of X at x (mm rows, K
 * apart) -> out[n][m] */
static inline __attribute__((always_inline)) void tile(const int t, const uint8_t *w, int64_t rb,
                                                       const float *x, int64_t K,
                                                       float out[GN][GM], const int nn,
                                                       const int mm) {
    const int wdt = t == GT_F32 ? DT_F32 : t == GT_F16 ? DT_F16 : DT_BF16;
    const int64_t kv = K / 16 * 16;
    __m256 run[2][GN][GM]; /* dot_dense's a0 and a1, carried from one block of KB columns on */
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
        for (int n = 0; n < nn; n++)
#pragma GCC unroll 6
            for (int m = 0; m < mm; m++) run[h][n][m] = _mm256_setzero_ps();
    for (int64_t jb = 0; jb < kv; jb += KB) {
        const int64_t je = jb + KB < kv ? jb + KB : kv;
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256 acc[GN][GM];
#pragma GCC unroll 2
            for (int n = 0; n < nn; n++)
#pragma GCC unroll 6
                for (int m = 0; m < mm; m++) acc[n][m] = run[h][n][m];
            for (int64_t j = jb + 8 * h; j < je; j += 16) {
                __m256 wv[GN];
#pragma GCC unroll 2
                for (int n = 0; n < nn; n++) wv[n] = load8(w + n * rb, j, wdt);
#pragma GCC unroll 6
                for (int m = 0; m < mm; m++) {
                    const __m256 xv = _mm256_loadu_ps(x + m * K + j);
#pragma GCC unroll 2
                    for (int n = 0; n < nn; n++)
                        acc[n][m] = _mm256_fmadd_ps(wv[n], xv, acc[n][m]);
                }
            }
#pragma GCC unroll 2
            for (int n = 0; n < nn; n++)
#pragma GCC unroll 6
                for (int m = 0; m < mm; m++) run[h][n][m] = acc[n][m];
        }
    }
#pragma GCC unroll 2
    for (int n = 0; n < nn; n++)
#pragma GCC unroll 6
        for (int m = 0; m < mm; m++) {
            float s = hsum8(_mm256_add_ps(run[0][n][m], run[1][n][m]));
            for (int64_t j = kv; j < K; j++) s += load1(w + n * rb, j, wdt) * x[m * K + j];
            out[n][m] = s;
        }
}

#include "dense_drive.h"

int tandem_dense_gemm256(const float *x, const tq_part *parts, int64_t nparts, const float *bias,
                         void *y, int64_t M, int64_t K, int dt, int nthreads) {
    return dense_drive(x, parts, nparts, bias, y, M, K, dt, nthreads);
}

#else
int tandem_dense_gemm256(const float *x, const tq_part *parts, int64_t nparts, const float *bias,
                         void *y, int64_t M, int64_t K, int dt, int nthreads) {
    (void)x; (void)parts; (void)nparts; (void)bias; (void)y; (void)M; (void)K; (void)dt;
    (void)nthreads;
    return -2;
}
#endif
