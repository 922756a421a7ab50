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
 * block of KB columns (a0's, then a1's), each chain carried in memory from one block to the
 * next; then hsum8(a0 + a1) and the K % 16 last columns one product and one add at a time, as
 * there. The widened weights are exact (a 16-bit float is a float32), so the products are the
 * same.
 *
 * Loop order (`chunk`): for each block of KB = 512 columns, every pair of the chunk's rows runs
 * both passes, so the tile's block of X (12 KB) is read from L1 by every pair rather than from
 * L2 by each (a tile of 6 rows by all of K is 24-72 KB: more than L1 at K >= 1024). On a Zen 3,
 * 2 threads, with the skewed rows of X (dense_drive.h), against each pair running all of K
 * before the next: 1.12-1.28x F32 and 1.13-1.31x BF16 at K = 2048 and 3072, 0.97-1.03x at
 * K = 1024 (blocks of 256 columns). Blocks of 512 against 256, with the read-ahead: F32
 * 1.01-1.02x, BF16 1.06-1.08x; 768 the same as 512; 1024 F32 0.91-0.95x.
 *
 * Partition (dense_drive.h, shared with the other ISA's tiles): each part's rows in chunks of
 * at most WCH, each thread's run of chunks front to back with the next one read ahead; a thread
 * runs its chunk against every tile of X rows. Every output is one row of W against one row of
 * X: the result does not depend on the thread count.
 */
#include <stdlib.h>
#include <omp.h>

#include "dtypes.h"
#include "quant.h"
#include "runs.h"

int tandem_dense_gemm256(const float *x, const tq_part *parts, int64_t nparts, const float *bias,
                         void *y, int64_t M, int64_t K, int dt, int nthreads);

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

/* rows of W and of X per tile, rows of W per chunk, columns per block */
enum { GN = 2, GM = 6, WCH = 24, KB = 512 };

/* One pass of one chain (h: a0 or a1) over columns j0, j0 + 16, ... < je: nn rows of W (w, rb
 * bytes apart) against mm rows of X (x, ldx floats apart), the chains read from and written back
 * to run[n * 2 * GM + m] (the chunk's run[r][h][m]). */
static inline __attribute__((always_inline)) void pass(const int wdt, const uint8_t *w,
                                                       int64_t rb, const float *x, int64_t ldx,
                                                       int64_t j0, int64_t je, __m256 *run,
                                                       const int nn, const int mm) {
    __m256 acc[GN][GM];
#pragma GCC unroll 2
    for (int n = 0; n < nn; n++)
#pragma GCC unroll 6
        for (int m = 0; m < mm; m++) acc[n][m] = run[n * 2 * GM + m];
    for (int64_t j = j0; j < je; j += 16) {
        __m256 wv[GN];
#pragma GCC unroll 2
        for (int n = 0; n < nn; n++) wv[n] = load8(w + n * rb, j, wdt);
#pragma GCC unroll 6
        for (int m = 0; m < mm; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * ldx + j);
            /* a register, loaded once: left alone, gcc folds the load into both rows' fmas as
             * a memory operand (14 loads a step for 12 fmas, not 8): 1.05-1.12x */
            __asm__("" : "+x"(xv));
#pragma GCC unroll 2
            for (int n = 0; n < nn; n++) acc[n][m] = _mm256_fmadd_ps(wv[n], xv, acc[n][m]);
        }
    }
#pragma GCC unroll 2
    for (int n = 0; n < nn; n++)
#pragma GCC unroll 6
        for (int m = 0; m < mm; m++) run[n * 2 * GM + m] = acc[n][m];
}

/* nrows rows of W (w, rb bytes apart) against mm rows of X (x, ldx floats apart) -> out[r][m]:
 * block by block of KB columns, every pair of the chunk's rows takes the block (both chains),
 * so the block of X (12 KB) stays in L1 while the chunk's rows stream past it. */
static inline __attribute__((always_inline)) void chunk(const int t, const uint8_t *w, int64_t rb,
                                                        int nrows, const float *x, int64_t ldx,
                                                        int64_t K, float out[WCH][GM],
                                                        const int mm, ahead_t *ahead) {
    const int wdt = t == GT_F32 ? DT_F32 : t == GT_F16 ? DT_F16 : DT_BF16;
    const int64_t kv = K / 16 * 16;
    __m256 run[WCH][2][GM]; /* dot_dense's a0 and a1 of every row, carried from block to block */
    for (int r = 0; r < nrows; r++)
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 6
            for (int m = 0; m < mm; m++) run[r][h][m] = _mm256_setzero_ps();
    for (int64_t jb = 0; jb < kv; jb += KB) {
        const int64_t je = jb + KB < kv ? jb + KB : kv;
        int r = 0;
        for (; r + GN <= nrows; r += GN) {
            ahead_some(ahead);
            for (int h = 0; h < 2; h++)
                pass(wdt, w + r * rb, rb, x, ldx, jb + 8 * h, je, &run[r][h][0], GN, mm);
        }
        for (; r < nrows; r++)
            for (int h = 0; h < 2; h++)
                pass(wdt, w + r * rb, rb, x, ldx, jb + 8 * h, je, &run[r][h][0], 1, mm);
    }
    for (int r = 0; r < nrows; r++)
#pragma GCC unroll 6
        for (int m = 0; m < mm; m++) {
            float s = hsum8(_mm256_add_ps(run[r][0][m], run[r][1][m]));
            for (int64_t j = kv; j < K; j++) s += load1(w + r * rb, j, wdt) * x[m * ldx + j];
            out[r][m] = s;
        }
}

/* ahead_some calls per tile of X: one per pair of rows and block */
static inline int64_t chunk_steps(int64_t K, int64_t rows) {
    return (K / 16 * 16 + KB - 1) / KB * (rows / GN);
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
