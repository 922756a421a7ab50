/* The prefill driver qgemm.c (AVX-512 VNNI) and qgemm256.c (AVX2) share: Y (M, N) = X (M, K) .
 * W (N, K)^T, W given as `nparts` parts stacked along N (each part's rows at its offset in N).
 * X is quantized and transposed once (`prepare`); each thread then takes chunks of WT rows of
 * one part, decodes them once (`decode_row`) and multiplies them against every tile of MT rows of
 * X (`qgemm_dot`). Every output is one row of W against one row of X, so the result does not
 * depend on the thread count.
 *
 * The including file defines first: wgroup, xt_t, MT, WT, decode_row, prepare,
 * qgemm_takes(type) (1 where its kernels take the type) and qgemm_dot(wg, X, m0, out, mt, type).
 * Returns -2 where a part does not apply (the caller runs another kernel), -1 where an
 * allocation failed, else 0. */
#ifndef TANDEM_QGEMM_DRIVE_H
#define TANDEM_QGEMM_DRIVE_H

static int qgemm_drive(const void *x, const tq_part *parts, int64_t nparts, const float *bias,
                       void *y, int64_t M, int64_t K, int dt, int nthreads) {
    if (M < 1 || K < 32 || K % 32 || nparts < 1 || nparts > 16) return -2;
    int64_t N = 0, first[17], off[16];
    first[0] = 0;
    for (int64_t p = 0; p < nparts; p++) {
        const int64_t bs = tq_block_size(parts[p].type);
        if (bs <= 1 || K % bs || parts[p].rows < 1 || !qgemm_takes(parts[p].type)) return -2;
        off[p] = N;
        N += parts[p].rows;
        first[p + 1] = first[p] + (parts[p].rows + WT - 1) / WT;
    }
    xt_t X;
    char *buf = prepare(x, M, K, dt, nthreads, &X);
    if (!buf) return -1;
    const int64_t chunks = first[nparts], G = X.groups;
    int bad = 0;
#pragma omp parallel num_threads(nthreads < 1 ? 1 : nthreads) reduction(| : bad)
    {
        wgroup *wg = (wgroup *)aligned_alloc(64, sizeof(wgroup) * (size_t)(WT * G));
        if (!wg) bad = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) {
            if (!wg) continue;
            int64_t p = 0;
            while (c >= first[p + 1]) p++;
            const tq_part *pt = &parts[p];
            const int64_t r0 = (c - first[p]) * WT, r1 = r0 + WT < pt->rows ? r0 + WT : pt->rows;
            const int64_t rb = tq_row_bytes(pt->type, K);
            for (int64_t r = r0; r < r1; r++)
                decode_row(pt->type, (const uint8_t *)pt->w + r * rb, K / 32, wg + (r - r0) * G);
            float out[MT];
            for (int64_t m0 = 0; m0 < M; m0 += MT) {
                const int mt = (int)(M - m0 < MT ? M - m0 : MT);
                for (int64_t r = r0; r < r1; r++) {
                    qgemm_dot(wg + (r - r0) * G, &X, m0, out, mt, pt->type);
                    const float bv = bias ? bias[off[p] + r] : 0.0f;
                    for (int m = 0; m < mt; m++)
                        store1(y, (m0 + m) * N + off[p] + r, out[m] + bv, dt);
                }
            }
        }
        free(wg);
    }
    free(buf);
    return bad ? -1 : 0;
}

#endif
