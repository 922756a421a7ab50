/* The quantized GEMV's arithmetic rate: one thread, one random (N, K) weight of one ggml type
 * against M rows of X, the row kernel of csrc/qgemv.c called directly (no allocation, no
 * threads), best of REPS calls. A small N keeps W in cache (the kernel's own speed); a large one
 * streams it from memory. Built against any checkout's csrc/, so two builds compare side by side:
 *
 *   gcc -O3 -march=native -fopenmp -ffp-contract=off -I CSRC -o qgemv_micro \
 *       scripts/bench/qgemv_micro.c -lm
 *   ./qgemv_micro N K TYPE REPS [M]      (TYPE: ggml id, 2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K)
 *
 * Prints GB/s of weight bytes and ns per block. Every float16 scale is 2^-7, the quants random.
 */
#include <stdio.h>
#include <time.h>

#include "qgemv.c"

int tandem_qgemm(const void *x, const tq_part *parts, int64_t nparts, const float *bias, void *y,
                 int64_t M, int64_t K, int dt, int nthreads) {
    (void)x, (void)parts, (void)nparts, (void)bias, (void)y, (void)M, (void)K, (void)dt;
    (void)nthreads;
    return -2;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint64_t state = 88172645463325252ull;
static uint8_t rand8(void) { /* xorshift64 */
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return (uint8_t)state;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s N K TYPE REPS [M]\n", argv[0]);
        return 2;
    }
    const int64_t N = atoll(argv[1]), K = atoll(argv[2]);
    const int type = atoi(argv[3]), reps = atoi(argv[4]), M = argc > 5 ? atoi(argv[5]) : 1;
    const int64_t rb = tq_row_bytes(type, K), bb = tq_block_bytes(type), nblk = N * rb / bb;
    uint8_t *w = aligned_alloc(64, (size_t)((N * rb + 63) / 64 * 64 + QPREFETCH + 64));
    float *x = malloc((size_t)(M * K) * 4), *y = malloc((size_t)(M * N) * 4);
    rows_fn fn = rows_for(type);
    if (!w || !x || !y || !fn || M < 1 || M > QMAX_ROWS) return 2;
    for (int64_t i = 0; i < N * rb; i++) w[i] = rand8();
    const uint16_t h = 0x2000; /* 2^-7 */
    for (int64_t b = 0; b < nblk; b++) { /* d (and Q4_1/Q5_1 m, K-quant dmin) finite */
        uint8_t *p = w + b * bb;
        memcpy(type == GT_Q6_K ? p + 208 : p, &h, 2);
        if (type == GT_Q4_1 || type == GT_Q5_1 || type == GT_Q4_K || type == GT_Q5_K)
            memcpy(p + 2, &h, 2);
    }
    for (int64_t i = 0; i < M * K; i++) x[i] = (float)((int)rand8() - 128) / 37.0f;
    xq_t X;
    char *buf = prepare_x(x, M, K, DT_F32, 1, 1, 1, 1, &X);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        fn(w, rb, 0, N, &X, NULL, y, N, DT_F32, M);
        const double t = now() - t0;
        best = t < best ? t : best;
    }
    printf("type %d N %ld K %ld M %d: %.2f GB/s, %.2f ns per block (y[0] %g)\n", type, (long)N,
           (long)K, M, (double)(N * rb) / best / 1e9, best * 1e9 / (double)nblk, y[0]);
    free(buf), free(w), free(x), free(y);
    return 0;
}
