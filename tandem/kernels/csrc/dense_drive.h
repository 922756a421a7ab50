/* The prefill driver gemm_dense512.c (AVX-512) and gemm_dense256.c (AVX2) share: Y (M, N) =
 * X (M, K) . W (N, K)^T for float32 X and dense weights (F32, F16, BF16), W given as `nparts`
 * parts stacked along N. Each part's rows go in chunks of WCH, handed out on demand; a thread
 * runs its chunk (cache-resident) against every tile of GM rows of X (`chunk_any`). Every output
 * is one row of W against one row of X, so the result does not depend on the thread count.
 *
 * X is first copied to a 64-byte boundary with rows LDX(K) = K + 16 floats apart: at a
 * power-of-two K, rows K floats apart all fall in the same L1 sets, and a tile's 6 rows of X
 * and its rows of W (8 streams on an 8-way L1) evict each other (the skew alone, AVX2 tiles on a
 * Zen 3, 2 threads: 1.15-1.2x F32 at K = 1024 and 3072; BF16 the same). The copy is M * K floats, against N * M * K multiply-adds.
 *
 * The including file defines first: GN, GM (<= 6), WCH and the always-inline
 * chunk(t, w, rb, nrows, x, ldx, K, out, mm), which writes out[r][m] (float [WCH][GM]) for the
 * nrows (<= WCH) rows of W of type t at w (rb bytes apart) against mm rows of X at x (ldx
 * floats apart). Returns -2 where a part is not dense (the caller runs another kernel), -1 for
 * arguments out of range or no memory, else 0. */
#ifndef TANDEM_DENSE_DRIVE_H
#define TANDEM_DENSE_DRIVE_H

#include <string.h>

#define LDX(K) ((K) + 16)

/* one chunk at literal sizes (mm 1..GM, one type), so the compiler keeps the accumulators in
 * registers */
static void chunk_any(const int t, const uint8_t *w, int64_t rb, int nrows, const float *x,
                      int64_t ldx, int64_t K, float out[WCH][GM], int mm) {
#define MM(t_)                                                                                  \
    switch (mm) {                                                                               \
    case 1: chunk(t_, w, rb, nrows, x, ldx, K, out, 1); break;                                  \
    case 2: chunk(t_, w, rb, nrows, x, ldx, K, out, 2); break;                                  \
    case 3: chunk(t_, w, rb, nrows, x, ldx, K, out, 3); break;                                  \
    case 4: chunk(t_, w, rb, nrows, x, ldx, K, out, 4); break;                                  \
    case 5: chunk(t_, w, rb, nrows, x, ldx, K, out, 5); break;                                  \
    default: chunk(t_, w, rb, nrows, x, ldx, K, out, GM); break;                                \
    }
    if (t == GT_F32) {
        MM(GT_F32)
    } else if (t == GT_F16) {
        MM(GT_F16)
    } else {
        MM(GT_BF16)
    }
#undef MM
}

static int dense_drive(const float *x, const tq_part *parts, int64_t nparts, const float *bias,
                       void *y, int64_t M, int64_t K, int dt, int nthreads) {
    if (M < 1 || K < 1 || nparts < 1 || nparts > 16) return -1;
    int64_t N = 0, first[17], off[16];
    first[0] = 0;
    for (int64_t p = 0; p < nparts; p++) {
        const int64_t t = parts[p].type;
        if ((t != GT_F32 && t != GT_F16 && t != GT_BF16) || parts[p].rows < 1 || !parts[p].w)
            return -2;
        off[p] = N;
        N += parts[p].rows;
        first[p + 1] = first[p] + (parts[p].rows + WCH - 1) / WCH;
    }
    const int64_t ldx = LDX(K);
    float *xp = (float *)aligned_alloc(64, ((size_t)(M * ldx) * 4 + 63) / 64 * 64);
    if (!xp) return -1;
    for (int64_t m = 0; m < M; m++) memcpy(xp + m * ldx, x + m * K, (size_t)K * 4);
    const int64_t chunks = first[nparts];
    const int T = nthreads < 1 || chunks < 2 ? 1 : nthreads;
#pragma omp parallel for num_threads(T) schedule(dynamic, 1) if (T > 1)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t p = 0;
        while (c >= first[p + 1]) p++;
        const tq_part *pt = &parts[p];
        const int t = (int)pt->type;
        const int64_t rb = tq_row_bytes(t, K);
        const int64_t r0 = (c - first[p]) * WCH, r1 = r0 + WCH < pt->rows ? r0 + WCH : pt->rows;
        float out[WCH][GM];
        for (int64_t m0 = 0; m0 < M; m0 += GM) {
            const int mm = (int)(M - m0 < GM ? M - m0 : GM);
            chunk_any(t, (const uint8_t *)pt->w + r0 * rb, rb, (int)(r1 - r0), xp + m0 * ldx, ldx,
                      K, out, mm);
            for (int64_t r = r0; r < r1; r++) {
                const float bv = bias ? bias[off[p] + r] : 0.0f;
                for (int m = 0; m < mm; m++)
                    store1(y, (m0 + m) * N + off[p] + r, out[r - r0][m] + bv, dt);
            }
        }
    }
    free(xp);
    return 0;
}

#endif
