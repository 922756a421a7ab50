/* Batch-1..4 decode GEMV for the CPU: Y (M, N) = X (M, K) . W (N, K)^T, W row-major.
 *
 * Decode reads every weight once per token and does two flops per weight, so it is bound by
 * memory, and the kernel is written to stream W like a plain read: each thread walks its own
 * contiguous block of rows front to back, one row at a time, four independent 8-lane
 * accumulators per input row, and converts 16-bit weights to float32 in registers. X is
 * converted to float32 once per call; sums are float32; Y is rounded once to W's dtype.
 *
 * Measured on an AMD EPYC (Zen 4, 2 threads, Qwen3-0.6B's per-token matrices, GB/s against a
 * plain read of the same matrices): 256-bit vectors stream 90-100% of the read, the same loop
 * with 512-bit vectors 75-85% (float32) and 85% (bf16 converted in registers); two rows at a
 * time (two streams per thread) 60-65%, software prefetch 55-70%. So the one path is AVX2 + FMA,
 * which also runs on every x86-64 CPU of the last decade.
 *
 * Partition: the N rows split into `nthreads` contiguous blocks, block t = [N t / T, N (t+1) / T).
 * Each Y element is one row's dot product, so no thread writes another's outputs and the result
 * does not depend on the thread count.
 *
 * Built by tandem/models/native.py with the host's C compiler (-O3 -march=native -fopenmp) after
 * torch is loaded, so `libgomp.so.1` resolves to the OpenMP runtime torch already uses and the
 * kernel shares torch's worker threads instead of starting a second pool.
 */
#include <stdlib.h>
#include <omp.h>

#include "dtypes.h"

enum { MAX_ROWS = 4 };
#ifndef CHUNK_ROWS
#define CHUNK_ROWS 64
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define ISA 256
#define LANES 8
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
static inline float vsum256(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#define VSUM(a) vsum256(a)
#define VLOAD_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#if defined(__F16C__)
#define VLOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#endif
#else
#define ISA 0
#endif

/* The vector width this build runs (256), or 0 without AVX2 + FMA (the caller must not use it). */
int tandem_gemv_isa(void) { return ISA; }

#if ISA
/* One weight dtype's row loop: rows [r0, r1) of W against the M float32 rows of x. */
#define ROWS_KERNEL(NAME, T, VLOADW)                                                            \
    static inline __attribute__((always_inline)) void NAME(                                    \
        const float *x, const T *w, const float *bias, void *y, int64_t N, int64_t K,          \
        int64_t r0, int64_t r1, const int M, int dt) {                                         \
        const int64_t kv = K / (4 * LANES) * (4 * LANES);                                      \
        for (int64_t r = r0; r < r1; r++) {                                                    \
            const T *wr = w + r * K;                                                           \
            vec a0[MAX_ROWS], a1[MAX_ROWS], a2[MAX_ROWS], a3[MAX_ROWS];                        \
            for (int m = 0; m < M; m++) a0[m] = a1[m] = a2[m] = a3[m] = VZERO();               \
            for (int64_t j = 0; j < kv; j += 4 * LANES) {                                      \
                vec w0 = VLOADW(wr + j), w1 = VLOADW(wr + j + LANES);                          \
                vec w2 = VLOADW(wr + j + 2 * LANES), w3 = VLOADW(wr + j + 3 * LANES);          \
                for (int m = 0; m < M; m++) {                                                  \
                    const float *xm = x + m * K + j;                                           \
                    a0[m] = VFMA(w0, VLOAD(xm), a0[m]);                                        \
                    a1[m] = VFMA(w1, VLOAD(xm + LANES), a1[m]);                                \
                    a2[m] = VFMA(w2, VLOAD(xm + 2 * LANES), a2[m]);                            \
                    a3[m] = VFMA(w3, VLOAD(xm + 3 * LANES), a3[m]);                            \
                }                                                                              \
            }                                                                                  \
            for (int m = 0; m < M; m++) {                                                      \
                float s = VSUM(VADD(VADD(a0[m], a1[m]), VADD(a2[m], a3[m])));                  \
                for (int64_t j = kv; j < K; j++) s += load1(wr, j, dt) * x[m * K + j];         \
                if (bias) s += bias[r];                                                        \
                store1(y, m * N + r, s, dt);                                                   \
            }                                                                                  \
        }                                                                                      \
    }

ROWS_KERNEL(rows_f32, float, VLOAD)
ROWS_KERNEL(rows_bf16, uint16_t, VLOAD_BF16)
#if HAVE_F16
ROWS_KERNEL(rows_f16, uint16_t, VLOAD_F16)
#endif

/* A literal M per call, so the compiler unrolls the accumulator loops into registers. */
#define DISPATCH_M(FN, ...)                 \
    switch (M) {                            \
    case 1: FN(__VA_ARGS__, 1, dt); break;  \
    case 2: FN(__VA_ARGS__, 2, dt); break;  \
    case 3: FN(__VA_ARGS__, 3, dt); break;  \
    default: FN(__VA_ARGS__, 4, dt); break; \
    }

static void rows(const float *x, const void *w, const float *bias, void *y, int64_t N, int64_t K,
                 int64_t r0, int64_t r1, int M, int dt) {
    if (dt == DT_F32) {
        DISPATCH_M(rows_f32, x, (const float *)w, bias, y, N, K, r0, r1)
    } else if (dt == DT_BF16) {
        DISPATCH_M(rows_bf16, x, (const uint16_t *)w, bias, y, N, K, r0, r1)
    }
#if HAVE_F16
    else {
        DISPATCH_M(rows_f16, x, (const uint16_t *)w, bias, y, N, K, r0, r1)
    }
#endif
}
#endif

/* Y (M, N) = X (M, K) . W (N, K)^T (+ bias (N), float32), X, W and Y of dtype `dt`, all
 * contiguous. Returns 0, or -1 for arguments this build cannot run (the caller falls back). */
int tandem_gemv(const void *x, const void *w, const float *bias, void *y, int64_t M, int64_t N,
                int64_t K, int dt, int nthreads) {
#if ISA
    if (M < 1 || M > MAX_ROWS || N < 1 || K < 1 || dt < DT_F32 || dt > DT_F16) return -1;
    if (dt == DT_F16 && !HAVE_F16) return -1;
    float stack[MAX_ROWS * 4096];
    float *xf = (float *)x;
    if (dt != DT_F32) { /* X once to float32 (exact: bf16 and f16 are subsets) */
        xf = M * K <= MAX_ROWS * 4096 ? stack : (float *)malloc((size_t)(M * K) * sizeof(float));
        if (!xf) return -1;
        for (int64_t i = 0; i < M * K; i++) xf[i] = load1(x, i, dt);
    }
    int T = nthreads < 1 ? 1 : nthreads;
    if (N * K < (1 << 16)) T = 1; /* too small to be worth waking the team */
    if (T == 1) {
        rows(xf, w, bias, y, N, K, 0, N, (int)M, dt);
    } else {
        const int64_t chunk = CHUNK_ROWS;
#pragma omp parallel for num_threads(T) schedule(dynamic, 1)
        for (int64_t c = 0; c < (N + chunk - 1) / chunk; c++) {
            int64_t r1 = (c + 1) * chunk < N ? (c + 1) * chunk : N;
            rows(xf, w, bias, y, N, K, c * chunk, r1, (int)M, dt);
        }
    }
    if (xf != (float *)x && xf != stack) free(xf);
    return 0;
#else
    (void)x; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)dt; (void)nthreads;
    return -1;
#endif
}
