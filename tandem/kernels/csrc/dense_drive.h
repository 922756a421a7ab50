/* The prefill driver gemm_dense512.c (AVX-512) and gemm_dense256.c (AVX2) share: Y (M, N) =
 * X (M, K) . W (N, K)^T for float32 X and dense weights (F32, F16, BF16), W given as `nparts`
 * parts stacked along N. Each part's rows go in chunks of WCH, handed out on demand; a thread
 * runs its chunk (cache-resident) against every tile of GM rows of X, GN rows of W at a time
 * (`tile_any`, 1 row where fewer than GN are left). Every output is one row of W against one row
 * of X, so the result does not depend on the thread count.
 *
 * The including file defines first: GN, GM (<= 6), WCH and the always-inline
 * tile(t, w, rb, x, K, out, nn, mm), which writes out[n][m] (float [GN][GM]) for nn rows of W
 * of type t at w (rb bytes apart) and mm rows of X at x (K apart). Returns -2 where a part is
 * not dense (the caller runs another kernel), -1 for arguments out of range, else 0. */
#ifndef TANDEM_DENSE_DRIVE_H
#define TANDEM_DENSE_DRIVE_H

/* one tile at literal sizes (nn GN or 1, mm 1..GM, one type), so the compiler keeps the
 * accumulators in registers */
static void tile_any(const int t, const uint8_t *w, int64_t rb, const float *x, int64_t K,
                     float out[GN][GM], int nn, int mm) {
#define MM(n, t_)                                                                               \
    switch (mm) {                                                                               \
    case 1: tile(t_, w, rb, x, K, out, n, 1); break;                                            \
    case 2: tile(t_, w, rb, x, K, out, n, 2); break;                                            \
    case 3: tile(t_, w, rb, x, K, out, n, 3); break;                                            \
    case 4: tile(t_, w, rb, x, K, out, n, 4); break;                                            \
    case 5: tile(t_, w, rb, x, K, out, n, 5); break;                                            \
    default: tile(t_, w, rb, x, K, out, n, GM); break;                                          \
    }
#define TYPE(t_)                                                                                \
    if (nn == GN) {                                                                             \
        MM(GN, t_)                                                                              \
    } else {                                                                                    \
        MM(1, t_)                                                                               \
    }
    if (t == GT_F32) {
        TYPE(GT_F32)
    } else if (t == GT_F16) {
        TYPE(GT_F16)
    } else {
        TYPE(GT_BF16)
    }
#undef TYPE
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
        float out[GN][GM];
        for (int64_t m0 = 0; m0 < M; m0 += GM) {
            const int mm = (int)(M - m0 < GM ? M - m0 : GM);
            for (int64_t r = r0; r < r1;) {
                const int nn = r1 - r >= GN ? GN : 1;
                tile_any(t, (const uint8_t *)pt->w + r * rb, rb, x + m0 * K, K, out, nn, mm);
                for (int n = 0; n < nn; n++) {
                    const float bv = bias ? bias[off[p] + r + n] : 0.0f;
                    for (int m = 0; m < mm; m++)
                        store1(y, (m0 + m) * N + off[p] + r + n, out[n][m] + bv, dt);
                }
                r += nn;
            }
        }
    }
    return 0;
}

#endif
