/* The prefill driver gemm_dense512.c (AVX-512) and gemm_dense256.c (AVX2) share: Y (M, N) =
 * X (M, K) . W (N, K)^T for float32 X and dense weights (F32, F16, BF16), W given as `nparts`
 * parts stacked along N. Each part's rows go in chunks of WCH (fewer where WCH rows pass
 * AHEAD_BYTES), numbered across the parts; each thread takes its own contiguous run of chunks
 * front to back, then the others' last ones (runs.h), and runs a chunk (cache-resident) against
 * every tile of GM rows of X (`chunk_any`), the next chunk of its run prefetched to L2
 * meanwhile. Every output is one row of W against one row of X, so the result does not depend
 * on the thread count or on which thread took which chunk.
 *
 * X is first copied to a 64-byte boundary with rows LDX(K) = K + 16 floats apart: at a
 * power-of-two K, rows K floats apart all fall in the same L1 sets, and a tile's 6 rows of X
 * and its rows of W (8 streams on an 8-way L1) evict each other (the skew alone, AVX2 tiles on a
 * Zen 3, 2 threads: 1.15-1.2x F32 at K = 1024 and 3072; BF16 unchanged). The copy is M * K
 * floats, against N * M * K multiply-adds.
 *
 * Reading the next chunk ahead: without it a chunk's first tile of X meets each cache line of
 * W as a miss (on one thread the GEMM ran 1.6-1.9x faster at M = 128 than at M = 12, more tiles
 * sharing that first read). With it, AVX2 tiles on a Zen 3: one thread 1.56x at M = 12 and 1.2x
 * at M = 64; 2 threads at M = 64, F32 1.17x at K = 1024 and 1.05x at K = 2048-3072, BF16
 * 0.99-1.10x (against chunks handed out one at a time, nothing read ahead).
 *
 * The including file defines first: GN, GM (<= 6), WCH; `chunk_steps(K, rows)`, how many times
 * its chunk of `rows` rows (a multiple of GN) calls `ahead_some` for one tile of X; and the
 * always-inline
 * chunk(t, w, rb, nrows, x, ldx, K, out, mm, ahead), which writes out[r][m] (float [WCH][GM])
 * for the nrows (<= WCH) rows of W of type t at w (rb bytes apart) against mm rows of X at x
 * (ldx floats apart). Returns -2 where a part is not dense (the caller runs another kernel), -1
 * for arguments out of range or no memory, else 0. */
#ifndef TANDEM_DENSE_DRIVE_H
#define TANDEM_DENSE_DRIVE_H

#include <string.h>

#include "runs.h"

#define LDX(K) ((K) + 16)
/* a chunk's rows at most (the next chunk read ahead into L2 beside X's rows): 64, 96 and 192 KB
 * measured 0.90, 1.03 and 1.05x on F32 at K = 3072 (16 rows), the same at K = 1024 */
#define AHEAD_BYTES (192 << 10)

/* one chunk at literal sizes (mm 1..GM, one type), so the compiler keeps the accumulators in
 * registers */
static void chunk_any(const int t, const uint8_t *w, int64_t rb, int nrows, const float *x,
                      int64_t ldx, int64_t K, float out[WCH][GM], int mm, ahead_t *ahead) {
#define MM(t_)                                                                                     \
    switch (mm) {                                                                                  \
    case 1: chunk(t_, w, rb, nrows, x, ldx, K, out, 1, ahead); break;                              \
    case 2: chunk(t_, w, rb, nrows, x, ldx, K, out, 2, ahead); break;                              \
    case 3: chunk(t_, w, rb, nrows, x, ldx, K, out, 3, ahead); break;                              \
    case 4: chunk(t_, w, rb, nrows, x, ldx, K, out, 4, ahead); break;                              \
    case 5: chunk(t_, w, rb, nrows, x, ldx, K, out, 5, ahead); break;                              \
    default: chunk(t_, w, rb, nrows, x, ldx, K, out, GM, ahead); break;                            \
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

/* chunk c's part (returned), its first row *r0 and one past its last *r1 in that part: chunks of
 * wch rows, numbered across the parts (part p's from first[p]) */
static inline int64_t chunk_rows(int64_t c, const tq_part *parts, const int64_t *first,
                                 int64_t wch, int64_t *r0, int64_t *r1) {
    int64_t p = 0;
    while (c >= first[p + 1]) p++;
    *r0 = (c - first[p]) * wch;
    *r1 = *r0 + wch < parts[p].rows ? *r0 + wch : parts[p].rows;
    return p;
}

static int dense_drive(const float *x, const tq_part *parts, int64_t nparts, const float *bias,
                       void *y, int64_t M, int64_t K, int dt, int nthreads) {
    if (M < 1 || K < 1 || nparts < 1 || nparts > 16) return -1;
    int64_t N = 0, first[17], off[16];
    first[0] = 0;
    /* rows a chunk: WCH, fewer where that many rows would pass AHEAD_BYTES */
    int64_t wbytes = 0;
    for (int64_t p = 0; p < nparts; p++) {
        const int64_t b = tq_row_bytes((int)parts[p].type, K);
        wbytes = b > wbytes ? b : wbytes;
    }
    int64_t wch = wbytes * WCH <= AHEAD_BYTES ? WCH : AHEAD_BYTES / wbytes / GN * GN;
    if (wch < GN) wch = GN;
    for (int64_t p = 0; p < nparts; p++) {
        const int64_t t = parts[p].type;
        if ((t != GT_F32 && t != GT_F16 && t != GT_BF16) || parts[p].rows < 1 || !parts[p].w)
            return -2;
        off[p] = N;
        N += parts[p].rows;
        first[p + 1] = first[p] + (parts[p].rows + wch - 1) / wch;
    }
    const int64_t ldx = LDX(K);
    float *xp = (float *)aligned_alloc(64, ((size_t)(M * ldx) * 4 + 63) / 64 * 64);
    if (!xp) return -1;
    for (int64_t m = 0; m < M; m++) memcpy(xp + m * ldx, x + m * K, (size_t)K * 4);
    const int64_t chunks = first[nparts];
    const int T = nthreads < 1 || chunks < 2 ? 1 : nthreads;
    qrun *runs = runs_new(chunks, T);
    if (!runs) {
        free(xp);
        return -1;
    }
    const int64_t steps = (M + GM - 1) / GM * chunk_steps(K, wch); /* ahead_some calls a chunk */
#pragma omp parallel num_threads(T) if (T > 1)
    {
        const int tid = omp_get_thread_num();
        float out[WCH][GM];
        for (int k = 0; k < T; k++) /* its own run from the front, then the others' backs */
            for (int64_t c; (c = claim(&runs[(tid + k) % T], k == 0)) >= 0;) {
                int64_t r0, r1;
                const int64_t p = chunk_rows(c, parts, first, wch, &r0, &r1);
                const tq_part *pt = &parts[p];
                const int t = (int)pt->type;
                const int64_t rb = tq_row_bytes(t, K);
                /* the chunk this thread takes next: its run's next from the front, or the
                 * back's next from the back (a hint: another thread may take it) */
                const int64_t n = k == 0 ? c + 1 : c - 1;
                ahead_t ahead = {NULL, NULL, 0};
                if (n >= 0 && n < chunks) {
                    int64_t s0, s1;
                    const tq_part *pn = &parts[chunk_rows(n, parts, first, wch, &s0, &s1)];
                    const int64_t nrb = tq_row_bytes((int)pn->type, K);
                    ahead = ahead_of((const uint8_t *)pn->w + s0 * nrb, (s1 - s0) * nrb, steps);
                }
                for (int64_t m0 = 0; m0 < M; m0 += GM) {
                    const int mm = (int)(M - m0 < GM ? M - m0 : GM);
                    chunk_any(t, (const uint8_t *)pt->w + r0 * rb, rb, (int)(r1 - r0),
                              xp + m0 * ldx, ldx, K, out, mm, &ahead);
                    for (int64_t r = r0; r < r1; r++) {
                        const float bv = bias ? bias[off[p] + r] : 0.0f;
                        for (int m = 0; m < mm; m++)
                            store1(y, (m0 + m) * N + off[p] + r, out[r - r0][m] + bv, dt);
                    }
                }
            }
    }
    free(runs);
    free(xp);
    return 0;
}

#endif
