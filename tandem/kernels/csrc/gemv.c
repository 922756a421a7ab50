/* Batch-1..4 decode GEMV for the CPU: Y (M, N) = X (M, K) . W (N, K)^T, W row-major; for more
 * rows (prefill) register tiles that sum each output in the row kernel's order (`row_tiles`;
 * bf16: the row kernel over groups of 4, `row_groups`), so every row of Y is the same bits at
 * any M.
 *
 * Decode reads every weight once per token and does two flops per weight, so it is bound by
 * memory, and the kernel is written to stream W like a plain read: each thread walks its own
 * contiguous blocks of rows front to back, one row at a time, independent accumulators per input
 * row, and widens 16-bit weights to float32 in registers (bf16 with AVX512-BF16: multiplied as
 * bf16 pairs by VDPBF16PS, no widening). Sums are float32; Y is rounded once to W's dtype.
 *
 * Measured on an AMD EPYC (Zen 4, 2 threads, Qwen3-0.6B's per-token matrices, GB/s against a
 * plain read of the same matrices): float32 with 256-bit vectors 90-100% of the read, the same
 * loop with 512-bit vectors 75-85%; two rows at a time (two streams per thread) 60-65%, software
 * prefetch 55-70%. bf16 at 40+ GB/s: VDPBF16PS 512-bit 90-93%, 256-bit unpack 84-89%,
 * zero-extend + shift 74-82%. So the path is AVX2 + FMA (every x86-64 CPU of the last decade),
 * plus VDPBF16PS for bf16 where the CPU has it.
 *
 * Partition: the N rows split into blocks of CHUNK_ROWS contiguous rows, handed to the `nthreads`
 * threads on demand (each block one sequential stream; static halves measured the same, and a
 * thread that starts late takes fewer blocks). Each Y element is one row's dot product, so no
 * thread writes another's outputs and the result does not depend on the thread count.
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
/* bf16 rows: one 256-bit load is 16 weights; unpacking its 16-bit halves against zero makes
 * two float32 vectors with no lane crossing, lanes [0-3, 8-11] and [4-7, 12-15] of the block
 * (fewer and cheaper µops than zero-extend + shift: at 40+ GB/s the conversion, not memory,
 * bounded the GEMV). X comes permuted to match (`permute_bf16_x`); the tail is in order. */
static inline __attribute__((always_inline)) void rows_bf16(
    const float *x, const uint16_t *w, const float *bias, void *y, int64_t N, int64_t K,
    int64_t r0, int64_t r1, const int M, int dt) {
    const int64_t kv = K / 32 * 32;
    const __m256i z = _mm256_setzero_si256();
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *wr = w + r * K;
        vec a0[MAX_ROWS], a1[MAX_ROWS], a2[MAX_ROWS], a3[MAX_ROWS];
        for (int m = 0; m < M; m++) a0[m] = a1[m] = a2[m] = a3[m] = VZERO();
        for (int64_t j = 0; j < kv; j += 32) {
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(wr + j));
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(wr + j + 16));
            vec w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v0));
            vec w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v0));
            vec w2 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v1));
            vec w3 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v1));
            for (int m = 0; m < M; m++) {
                const float *xm = x + m * K + j;
                a0[m] = VFMA(w0, VLOAD(xm), a0[m]);
                a1[m] = VFMA(w1, VLOAD(xm + 8), a1[m]);
                a2[m] = VFMA(w2, VLOAD(xm + 16), a2[m]);
                a3[m] = VFMA(w3, VLOAD(xm + 24), a3[m]);
            }
        }
        for (int m = 0; m < M; m++) {
            float s = VSUM(VADD(VADD(a0[m], a1[m]), VADD(a2[m], a3[m])));
            for (int64_t j = kv; j < K; j++) s += load1(wr, j, dt) * x[m * K + j];
            if (bias) s += bias[r];
            store1(y, m * N + r, s, dt);
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* bf16 rows on CPUs with AVX512-BF16: VDPBF16PS multiplies 32 bf16 weight/input pairs and adds
 * each pair's two products into 16 float32 sums in one instruction, reading X as stored (bf16),
 * no conversion at all. Measured on Zen 4: 90-93% of a plain read, the 256-bit unpack path
 * 84-89%, the zero-extend path 74-82%. (Like every AVX-512 BF16 op it treats denormal inputs as
 * zero; bf16 weights and activations are never that small in practice.) */
#define HAVE_DPBF16 1
static inline __attribute__((always_inline)) void rows_bf16dp(
    const uint16_t *x, const uint16_t *w, const float *bias, void *y, int64_t N, int64_t K,
    int64_t r0, int64_t r1, const int M, int dt) {
    const int64_t kv = K / 64 * 64;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *wr = w + r * K;
        __m512 a0[MAX_ROWS], a1[MAX_ROWS];
        for (int m = 0; m < M; m++) a0[m] = a1[m] = _mm512_setzero_ps();
        for (int64_t j = 0; j < kv; j += 64) {
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + j);
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + j + 32);
            for (int m = 0; m < M; m++) {
                const uint16_t *xm = x + m * K + j;
                a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_loadu_si512(xm));
                a1[m] = _mm512_dpbf16_ps(a1[m], w1, (__m512bh)_mm512_loadu_si512(xm + 32));
            }
        }
        for (int m = 0; m < M; m++) {
            float s = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
            for (int64_t j = kv; j < K; j++) s += load1(wr, j, dt) * bf16_to_f32(x[m * K + j]);
            if (bias) s += bias[r];
            store1(y, m * N + r, s, dt);
        }
    }
}
#else
#define HAVE_DPBF16 0
#endif

/* xf (M, K) <- bf16 x as float32, each 16-element block of the first K/32*32 reordered to the
 * lanes rows_bf16 unpacks: [0-3, 8-11, 4-7, 12-15]; the tail in order. */
static void permute_bf16_x(const uint16_t *x, float *xf, int64_t M, int64_t K) {
    static const int order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    const int64_t kv = K / 32 * 32;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xm = x + m * K;
        float *o = xf + m * K;
        for (int64_t j = 0; j < kv; j += 16)
            for (int i = 0; i < 16; i++) o[j + i] = bf16_to_f32(xm[j + order[i]]);
        for (int64_t j = kv; j < K; j++) o[j] = bf16_to_f32(xm[j]);
    }
}
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
#if HAVE_DPBF16
        DISPATCH_M(rows_bf16dp, (const uint16_t *)x, (const uint16_t *)w, bias, y, N, K, r0, r1)
#else
        DISPATCH_M(rows_bf16, x, (const uint16_t *)w, bias, y, N, K, r0, r1)
#endif
    }
#if HAVE_F16
    else {
        DISPATCH_M(rows_f16, x, (const uint16_t *)w, bias, y, N, K, r0, r1)
    }
#endif
}

/* Prefill tiles (M > MAX_ROWS) for float32 and float16 weights: TN rows of W by TM rows of X in
 * registers, each output the row kernel's sum bit for bit. The row kernel keeps four 8-lane
 * chains a0..a3 over columns 32i + 8c .. 32i + 8c + 7 (c = 0..3) in increasing i, then
 * VSUM((a0 + a1) + (a2 + a3)), the K % 32 last columns and the bias one at a time. The chains
 * are independent, so here each is one pass over a block of TKB columns (the block's rows of W
 * and X stay in L1 for the four), carried in memory from block to block: 2 weight vectors and 6
 * of X (from panels, `pack_panels`) feed 12 fused multiply-adds per 8 columns (15 of the 16 ymm
 * registers), where the row kernel reads 4 rows of X for each weight. Zen 3, 2 threads, 64 rows
 * of X, K = 1024 / 3072: float32 1.31x / 1.33x the row kernel, float16 1.16x / 1.20x (measured
 * before X was packed, which the float32 figures include). bf16 stays
 * on the row kernel: its in-lane unpack, paid once per tile instead of once per 4 rows of X, made
 * the tiles 0.78x of it. */
enum { TN = 2, TM = 6, TKB = 256 };

/* chain c's 8 weights of row wr from the 32-column block at j, widened to float32 (exact) */
static inline __attribute__((always_inline)) vec wchain(const void *wr, int64_t j, const int c,
                                                         const int dt) {
#if HAVE_F16
    if (dt == DT_F16) return VLOAD_F16((const uint16_t *)wr + j + 8 * c);
#endif
    (void)dt;
    return VLOAD((const float *)wr + j + 8 * c);
}

/* chain c over columns [jb, je) of the tile: run (its sums so far) in, run out */
static inline __attribute__((always_inline)) void chain_pass(const float *xp, const char *w0,
                                                             int64_t rb, int64_t jb, int64_t je,
                                                             const int c, const int nn,
                                                             const int mm, const int dt,
                                                             vec run[TN][TM]) {
    vec acc[TN][TM];
#pragma GCC unroll 2
    for (int n = 0; n < nn; n++)
#pragma GCC unroll 6
        for (int m = 0; m < mm; m++) acc[n][m] = run[n][m];
    for (int64_t j = jb; j < je; j += 32) {
        vec wv[TN];
#pragma GCC unroll 2
        for (int n = 0; n < nn; n++) wv[n] = wchain(w0 + n * rb, j, c, dt);
#pragma GCC unroll 6
        for (int m = 0; m < mm; m++) {
            const vec xv = VLOAD(xp + (j + 8 * c) * TM + m * 8);
#pragma GCC unroll 2
            for (int n = 0; n < nn; n++) acc[n][m] = VFMA(wv[n], xv, acc[n][m]);
        }
    }
#pragma GCC unroll 2
    for (int n = 0; n < nn; n++)
#pragma GCC unroll 6
        for (int m = 0; m < mm; m++) run[n][m] = acc[n][m];
}

static inline __attribute__((always_inline)) void tile(const float *xp, const float *x,
                                                       const void *w, const float *bias, void *y,
                                                       int64_t N, int64_t K, int64_t r,
                                                       int64_t m0, const int nn, const int mm,
                                                       const int dt) {
    const int es = dt == DT_F32 ? 4 : 2;
    const int64_t kv = K / 32 * 32;
    const char *w0 = (const char *)w + r * K * es;
    vec run[4][TN][TM];
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++)
#pragma GCC unroll 2
        for (int n = 0; n < nn; n++)
#pragma GCC unroll 6
            for (int m = 0; m < mm; m++) run[c][n][m] = VZERO();
    for (int64_t jb = 0; jb < kv; jb += TKB) {
        const int64_t je = jb + TKB < kv ? jb + TKB : kv;
        /* a literal chain each (its column offset known at compile time) */
        chain_pass(xp, w0, K * es, jb, je, 0, nn, mm, dt, run[0]);
        chain_pass(xp, w0, K * es, jb, je, 1, nn, mm, dt, run[1]);
        chain_pass(xp, w0, K * es, jb, je, 2, nn, mm, dt, run[2]);
        chain_pass(xp, w0, K * es, jb, je, 3, nn, mm, dt, run[3]);
    }
#pragma GCC unroll 2
    for (int n = 0; n < nn; n++)
#pragma GCC unroll 6
        for (int m = 0; m < mm; m++) {
            const void *wr = w0 + n * K * es;
            const vec a01 = VADD(run[0][n][m], run[1][n][m]), a23 = VADD(run[2][n][m], run[3][n][m]);
            float s = VSUM(VADD(a01, a23));
            for (int64_t j = kv; j < K; j++) s += load1(wr, j, dt) * x[(m0 + m) * K + j];
            if (bias) s += bias[r + n];
            store1(y, (m0 + m) * N + r + n, s, dt);
        }
}

/* one tile at literal sizes: nn TN or 1, mm 1..TM, float32 or float16 weights */
static void tile_any(const float *xp, const float *x, const void *w, const float *bias, void *y,
                     int64_t N, int64_t K, int64_t r, int64_t m0, int nn, int mm, int dt) {
#define MM(n, d)                                                                                \
    switch (mm) {                                                                               \
    case 1: tile(xp, x, w, bias, y, N, K, r, m0, n, 1, d); break;                               \
    case 2: tile(xp, x, w, bias, y, N, K, r, m0, n, 2, d); break;                               \
    case 3: tile(xp, x, w, bias, y, N, K, r, m0, n, 3, d); break;                               \
    case 4: tile(xp, x, w, bias, y, N, K, r, m0, n, 4, d); break;                               \
    case 5: tile(xp, x, w, bias, y, N, K, r, m0, n, 5, d); break;                               \
    default: tile(xp, x, w, bias, y, N, K, r, m0, n, 6, d); break;                              \
    }
#define TYPE(d)                                                                                 \
    if (nn == TN) {                                                                             \
        MM(TN, d)                                                                               \
    } else {                                                                                    \
        MM(1, d)                                                                                \
    }
    if (dt == DT_F32) {
        TYPE(DT_F32)
    }
#if HAVE_F16
    else {
        TYPE(DT_F16)
    }
#endif
#undef TYPE
#undef MM
}

/* X's first K / 32 * 32 columns as panels of TM rows: panel p, columns 8g..8g+7 of its rows
 * m = 0..TM-1 at xp[p TM kv + g 8 TM + 8 m] (rows past M zero, never stored), so a tile reads
 * its X as one sequential stream. Row-major, the TM rows of X sit K floats apart: at K = 1024 or
 * 3072 every one in the same L1 set (4 KB aliasing), and the float32 tiles ran at 0.82x / 0.95x
 * of their speed on panels (Zen 3). NULL on failure. */
static float *pack_panels(const float *xf, int64_t M, int64_t K) {
    const int64_t kv = K / 32 * 32, np = (M + TM - 1) / TM;
    float *xp = (float *)aligned_alloc(64, (size_t)(np * TM * kv * 4 + 63) / 64 * 64 + 64);
    if (!xp) return NULL;
    for (int64_t p = 0; p < np; p++)
        for (int64_t g = 0; g < kv / 8; g++)
            for (int m = 0; m < TM; m++) {
                float *o = xp + p * TM * kv + g * 8 * TM + 8 * m;
                const int64_t row = p * TM + m;
                for (int i = 0; i < 8; i++) o[i] = row < M ? xf[row * K + g * 8 + i] : 0.0f;
            }
    return xp;
}

/* Rows [r0, r1) of W against every row of X in tiles: each tile of X's rows passes the block
 * of W's rows while it is in cache, so W streams from memory once. */
static void row_tiles(const float *xp, const float *xf, const void *w, const float *bias, void *y,
                      int64_t M, int64_t N, int64_t K, int64_t r0, int64_t r1, int dt) {
    const int64_t kv = K / 32 * 32;
    for (int64_t m0 = 0; m0 < M; m0 += TM) {
        const int mm = M - m0 < TM ? (int)(M - m0) : TM;
        for (int64_t r = r0; r < r1;) {
            const int nn = r1 - r >= TN ? TN : 1;
            tile_any(xp + m0 * kv, xf, w, bias, y, N, K, r, m0, nn, mm, dt);
            r += nn;
        }
    }
}
#endif

/* Rows [r0, r1) of W against every row of X, MAX_ROWS rows of X at a time (the last group
 * fewer): the rows of W stay in cache while the groups pass, so W streams from memory once. Each
 * output is its row of X's own accumulators whatever the group (`rows` keeps one set per row of
 * X), so a row's result is the same bits at any M: alone in a decode step or among a prefill's. */
static void row_groups(const float *xf, const void *w, const float *bias, void *y, int64_t M,
                       int64_t N, int64_t K, int64_t r0, int64_t r1, int dt) {
    const int es = dt == DT_F32 ? 4 : 2;
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int g = M - m0 < MAX_ROWS ? (int)(M - m0) : MAX_ROWS;
        /* xf is float32 except for bf16 on VDPBF16PS, which reads X as stored */
        const float *xg = (const float *)((const char *)xf +
                                          m0 * K * (dt == DT_BF16 && HAVE_DPBF16 ? 2 : 4));
        rows(xg, w, bias, (char *)y + m0 * N * es, N, K, r0, r1, g, dt);
    }
}

/* Y (M, N) = X (M, K) . W (N, K)^T (+ bias (N), float32), X, W and Y of dtype `dt`, all
 * contiguous, any M: the decode GEMV for M <= MAX_ROWS, and for more rows (prefill) the tiles
 * over X's panels per cache-resident block of W (`row_tiles`; bf16: the row kernel over groups
 * of MAX_ROWS rows of X, `row_groups`), each output the row kernel's sum, so every row of Y is
 * the same bits whatever M (batch invariance). Returns 0, or -1 for arguments
 * this build cannot run (the caller falls back). */
int tandem_gemv(const void *x, const void *w, const float *bias, void *y, int64_t M, int64_t N,
                int64_t K, int dt, int nthreads) {
#if ISA
    if (M < 1 || N < 1 || K < 1 || dt < DT_F32 || dt > DT_F16) return -1;
    if (dt == DT_F16 && !HAVE_F16) return -1;
    float stack[MAX_ROWS * 4096];
    float *xf = (float *)x;
    if (dt == DT_F16 || (dt == DT_BF16 && !HAVE_DPBF16)) { /* X once to float32 (exact) */
        xf = M * K <= MAX_ROWS * 4096 ? stack : (float *)malloc((size_t)(M * K) * sizeof(float));
        if (!xf) return -1;
        if (dt == DT_BF16)
            permute_bf16_x((const uint16_t *)x, xf, M, K);
        else
            for (int64_t i = 0; i < M * K; i++) xf[i] = load1(x, i, dt);
    }
    /* prefill: the tiles for float32 and float16 weights */
    float *xp = NULL;
    if (M > MAX_ROWS && dt != DT_BF16) {
        xp = pack_panels(xf, M, K);
        if (!xp) {
            if (xf != (float *)x && xf != stack) free(xf);
            return -1;
        }
    }
    int T = nthreads < 1 ? 1 : nthreads;
    if (N * K * (M > MAX_ROWS ? M / MAX_ROWS : 1) < (1 << 16)) T = 1; /* too small to wake the team */
    if (T == 1) {
        if (xp)
            row_tiles(xp, xf, w, bias, y, M, N, K, 0, N, dt);
        else
            row_groups(xf, w, bias, y, M, N, K, 0, N, dt);
    } else {
        const int64_t chunk = CHUNK_ROWS; /* dynamic: a thread that starts late takes less */
#pragma omp parallel for num_threads(T) schedule(dynamic, 1)
        for (int64_t c = 0; c < (N + chunk - 1) / chunk; c++) {
            int64_t r1 = (c + 1) * chunk < N ? (c + 1) * chunk : N;
            if (xp)
                row_tiles(xp, xf, w, bias, y, M, N, K, c * chunk, r1, dt);
            else
                row_groups(xf, w, bias, y, M, N, K, c * chunk, r1, dt);
        }
    }
    free(xp);
    if (xf != (float *)x && xf != stack) free(xf);
    return 0;
#else
    (void)x; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)dt; (void)nthreads;
    return -1;
#endif
}

/* Reads `nbytes` at p (rounded down to 32-byte blocks) with 256-bit loads, contiguous blocks
 * split over `nthreads` threads, and returns the XOR of everything read (so the loads cannot be
 * elided). The read-bandwidth ceiling the benchmarks compare the GEMV with: on CPUs where
 * torch's `sum` runs 512-bit loads that stream slower (Zen 4), it reads faster than `sum`. */
uint64_t tandem_stream_read(const void *p, int64_t nbytes, int nthreads) {
    const int64_t blocks = nbytes / 128;
    uint64_t out = 0;
#if ISA
#pragma omp parallel num_threads(nthreads < 1 ? 1 : nthreads) reduction(^ : out)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const __m256i *b = (const __m256i *)p;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = blocks * t / nt; i < blocks * (t + 1) / nt; i++) {
            a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(b + 4 * i));
            a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(b + 4 * i + 1));
            a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(b + 4 * i + 2));
            a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(b + 4 * i + 3));
        }
        __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
        out ^= (uint64_t)_mm256_extract_epi64(a, 0) ^ (uint64_t)_mm256_extract_epi64(a, 1) ^
               (uint64_t)_mm256_extract_epi64(a, 2) ^ (uint64_t)_mm256_extract_epi64(a, 3);
    }
#else
    (void)p; (void)nthreads; (void)blocks;
#endif
    return out;
}

/* Evicts [p, p + nbytes) from every level of the cache hierarchy: CLFLUSH on each 64-byte line
 * (SSE2, so every x86-64; a clean line is dropped, a dirty one written back first), then a fence,
 * so the next read of those bytes comes from DRAM. What decode reads of a model larger than the
 * last-level cache; tandem/kernels/variant_choice.py evicts its sample before each timed pass. */
void tandem_evict(const void *p, int64_t nbytes) {
#if defined(__x86_64__) || defined(__i386__)
    const char *end = (const char *)p + (nbytes > 0 ? nbytes : 0);
    for (const char *c = (const char *)((uintptr_t)p & ~(uintptr_t)63); c < end; c += 64)
        _mm_clflush(c);
    _mm_mfence();
#else
    (void)p; (void)nbytes;
#endif
}
