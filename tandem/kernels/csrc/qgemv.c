/* Batch-1..4 decode GEMV over GGUF block-quantized weights: Y (M, N) = X (M, K) . W (N, K)^T,
 * W as stored in the file (row-major whole blocks, see quant.h), each block read once and
 * decoded in registers.
 *
 * The activations are quantized first, as llama.cpp does: each row of X, per block of 32, to
 * int8 q_i = round(x_i / dx) with dx = max|x_i| / 127 (and the block sums of q, per 32 and per
 * 16). A weight block of 32 (or a K-quant sub-block) is then unsigned integers u_i with a scale
 * and an offset, w_i = s * u_i + o (Q8_0, MXFP4: signed, o = 0, the sign moved onto x), so
 *
 *     sum_i w_i x'_i = (s * dx) * sum_i u_i q_i + o * (dx * sum_i q_i),   x'_i = dx * q_i,
 *
 * where sum_i u_i q_i is exact in int32, 8 lanes at a time (VPDPBUSD where the CPU has AVX512-
 * VNNI or AVX-VNNI, else VPMADDUBSW + VPMADDWD), and the two scale products and the sum over
 * blocks are float32, in canon.h's one order (symmetric types fold o into the integer dot), the
 * order of the prefill kernels too: a row's output is the same bits at any row count. The result differs from X . W^T only by the activation rounding,
 * |x_i - x'_i| <= dx / 2 per element, and float32 rounding (tests/unit/test_quant_gemv.py
 * states and checks the bound). The dense types (F32, F16, BF16) are widened to float32 in
 * registers and multiplied by X as given (exact up to float32 rounding). Q8_0 rows repacked at
 * load (GT_Q8_0X, quant.h) run against X's t16 layout (qx.h): the same integer dots, scales and
 * order, so the same bits as the rows before repacking, with no horizontal sums.
 *
 * Partition: each part's rows split into blocks of QCHUNK_ROWS contiguous rows, numbered across
 * the parts; decode gives each of torch's OpenMP threads one contiguous run of them (a thread
 * done early takes the others' last ones), prefill hands them out on demand. Every output is one row's dot product, so the result does not
 * depend on the thread count.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "dtypes.h"
#include "quant.h"
#include "runs.h"

#ifndef QCHUNK_ROWS
#define QCHUNK_ROWS 32
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QISA 1
#include "qdot512.h"

/* NAME(..., M): NAME##_m instantiated at each literal M (1..4, the decode rows), so each loop's
 * M is a constant. */
#define ROWS_AT_M(NAME)                                                                         \
    static void NAME(const uint8_t *w, int64_t rb, int64_t r0, int64_t r1, const xq_t *X,       \
                     const float *bias, void *y, int64_t ystride, int dt, int M) {              \
        switch (M) {                                                                            \
        case 1: NAME##_m(w, rb, r0, r1, X, bias, y, ystride, dt, 1); break;                     \
        case 2: NAME##_m(w, rb, r0, r1, X, bias, y, ystride, dt, 2); break;                     \
        case 3: NAME##_m(w, rb, r0, r1, X, bias, y, ystride, dt, 3); break;                     \
        default: NAME##_m(w, rb, r0, r1, X, bias, y, ystride, dt, 4); break;                    \
        }                                                                                       \
    }

/* The row loop of one type at a literal M: rows [r0, r1) of W, outputs at y (+ bias). */
#define DEFINE_ROWS(NAME, DOTCALL)                                                              \
    static inline __attribute__((always_inline)) void NAME##_m(                                 \
        const uint8_t *w, int64_t rb, int64_t r0, int64_t r1, const xq_t *X, const float *bias, \
        void *y, int64_t ystride, int dt, const int M) {                                        \
        float out[QMAX_ROWS];                                                                   \
        for (int64_t r = r0; r < r1; r++) {                                                     \
            DOTCALL(w + r * rb, X, out, M);                                                     \
            const float bv = bias ? bias[r] : 0.0f;                                             \
            for (int m = 0; m < M; m++) store1(y, m * ystride + r, out[m] + bv, dt);            \
        }                                                                                       \
    }                                                                                           \
    ROWS_AT_M(NAME)

/* The same with a kernel that takes NR rows of W a step (out[r QMAX_ROWS + m]; the last
 * r1 - r0 % NR rows one at a time): each row's sum is the one-row kernel's, so the output does
 * not depend on NR. */
#define DEFINE_ROWS_N(NAME, DOTN, NR)                                                           \
    static inline __attribute__((always_inline)) void NAME##_m(                                 \
        const uint8_t *w, int64_t rb, int64_t r0, int64_t r1, const xq_t *X, const float *bias, \
        void *y, int64_t ystride, int dt, const int M) {                                        \
        float out[QMAX_NR * QMAX_ROWS];                                                         \
        int64_t r = r0;                                                                         \
        for (; r + (NR) <= r1; r += (NR)) {                                                     \
            DOTN(w + r * rb, rb, (NR), X, out, M);                                              \
            for (int i = 0; i < (NR); i++) {                                                    \
                const float bv = bias ? bias[r + i] : 0.0f;                                     \
                for (int m = 0; m < M; m++)                                                     \
                    store1(y, m * ystride + r + i, out[i * QMAX_ROWS + m] + bv, dt);            \
            }                                                                                   \
        }                                                                                       \
        for (; r < r1; r++) {                                                                   \
            DOTN(w + r * rb, rb, 1, X, out, M);                                                 \
            const float bv = bias ? bias[r] : 0.0f;                                             \
            for (int m = 0; m < M; m++) store1(y, m * ystride + r, out[m] + bv, dt);            \
        }                                                                                       \
    }                                                                                           \
    ROWS_AT_M(NAME)

/* rows of W a Q8_0 decode step takes on AVX-512 (dot_q8_0_512) */
#ifndef Q8_NR
#define Q8_NR 4
#endif

#if HAVE_Q512
#define DOT_Q4_0(w, X, o, M) dot_b32_512(GT_Q4_0, w, X, o, M)
#define DOT_Q4_1(w, X, o, M) dot_b32_512(GT_Q4_1, w, X, o, M)
#define DOT_Q5_0(w, X, o, M) dot_b32_512(GT_Q5_0, w, X, o, M)
#define DOT_Q5_1(w, X, o, M) dot_b32_512(GT_Q5_1, w, X, o, M)
#define DOT_Q4_K(w, X, o, M) dot_k45_512(GT_Q4_K, w, X, o, M)
#define DOT_Q5_K(w, X, o, M) dot_k45_512(GT_Q5_K, w, X, o, M)
#define DOT_Q6_K(w, X, o, M) dot_q6_k_512(w, X, o, M)
#define DOT_MXFP4(w, X, o, M) dot_mxfp4_512(w, X, o, M)
#else
#define DOT_Q4_0(w, X, o, M) dot_b32_pairs(GT_Q4_0, w, X, o, M)
#define DOT_Q4_1(w, X, o, M) dot_b32_pairs(GT_Q4_1, w, X, o, M)
#define DOT_Q5_0(w, X, o, M) dot_b32_pairs(GT_Q5_0, w, X, o, M)
#define DOT_Q5_1(w, X, o, M) dot_b32_pairs(GT_Q5_1, w, X, o, M)
#define DOT_Q8_0(w, X, o, M) dot_b32(GT_Q8_0, w, X, o, M)
#define DOT_Q4_K(w, X, o, M) dot_k45(GT_Q4_K, w, X, o, M)
#define DOT_Q5_K(w, X, o, M) dot_k45(GT_Q5_K, w, X, o, M)
#define DOT_Q6_K(w, X, o, M) dot_q6_k(w, X, o, M)
#define DOT_MXFP4(w, X, o, M) dot_mxfp4(w, X, o, M)
#endif
/* The dense types' two decode forms (tandem_dense_form): 0, two rows of W a step, each row's
 * lines prefetched ahead in software; 1, one row a step, the hardware prefetcher alone (one
 * sequential stream per thread). Same sums in the same order, so the same bits. */
#define DOT_F32(w, rb, nr, X, o, M) dot_dense(GT_F32, w, rb, nr, 1, X, o, M)
#define DOT_F16(w, rb, nr, X, o, M) dot_dense(GT_F16, w, rb, nr, 1, X, o, M)
#define DOT_BF16(w, rb, nr, X, o, M) dot_dense(GT_BF16, w, rb, nr, 1, X, o, M)
#define DOT_F32_1(w, rb, nr, X, o, M) dot_dense(GT_F32, w, rb, nr, 0, X, o, M)
#define DOT_F16_1(w, rb, nr, X, o, M) dot_dense(GT_F16, w, rb, nr, 0, X, o, M)
#define DOT_BF16_1(w, rb, nr, X, o, M) dot_dense(GT_BF16, w, rb, nr, 0, X, o, M)
DEFINE_ROWS(rows_q4_0, DOT_Q4_0)
DEFINE_ROWS(rows_q4_1, DOT_Q4_1)
DEFINE_ROWS(rows_q5_0, DOT_Q5_0)
DEFINE_ROWS(rows_q5_1, DOT_Q5_1)
#if HAVE_Q512
DEFINE_ROWS_N(rows_q8_0, dot_q8_0_512, Q8_NR)
DEFINE_ROWS_N(rows_q8_0x, dot_q8_0x_512, Q8_NR)
#else
DEFINE_ROWS(rows_q8_0, DOT_Q8_0)
DEFINE_ROWS(rows_q8_0x, dot_q8_0x)
#endif
DEFINE_ROWS(rows_q4_k, DOT_Q4_K)
DEFINE_ROWS(rows_q5_k, DOT_Q5_K)
DEFINE_ROWS(rows_q6_k, DOT_Q6_K)
DEFINE_ROWS(rows_mxfp4, DOT_MXFP4)
DEFINE_ROWS_N(rows_f32, DOT_F32, 2)
DEFINE_ROWS_N(rows_f16, DOT_F16, 2)
DEFINE_ROWS_N(rows_bf16, DOT_BF16, 2)
DEFINE_ROWS_N(rows_f32_1, DOT_F32_1, 1)
DEFINE_ROWS_N(rows_f16_1, DOT_F16_1, 1)
DEFINE_ROWS_N(rows_bf16_1, DOT_BF16_1, 1)

/* Which decode form each dense type takes (DOT_F32's comment), per F32, F16, BF16: on a Sapphire
 * Rapids two rows with prefetch decoded a BF16 model 1.28x faster than one row without; on a Zen
 * 3 one row without decoded BF16 1.06x and F32 1.19x faster than two with (a Zen 4 GEMV read
 * 90-100% of a plain read one row at a time, 60-70% with two rows or prefetch: csrc/gemv.c). So it is timed per machine
 * (tandem/kernels/variant_choice.py) and set with tandem_dense_form before any decode. */
static int dense_form[3];

static int dense_index(int64_t t) {
    return t == GT_F32 ? 0 : t == GT_F16 ? 1 : t == GT_BF16 ? 2 : -1;
}

/* form 0 or 1 sets type t's decode form; any other value only reads it. Returns the form in
 * force, or -1 where t is not a dense type. */
int tandem_dense_form(int64_t t, int form) {
    const int i = dense_index(t);
    if (i < 0) return -1;
    if (form == 0 || form == 1) __atomic_store_n(&dense_form[i], form, __ATOMIC_RELAXED);
    return __atomic_load_n(&dense_form[i], __ATOMIC_RELAXED);
}

typedef void (*rows_fn)(const uint8_t *, int64_t, int64_t, int64_t, const xq_t *, const float *,
                        void *, int64_t, int, int);

static rows_fn rows_for(int64_t t) {
    const int i = dense_index(t);
    if (i >= 0 && __atomic_load_n(&dense_form[i], __ATOMIC_RELAXED) == 1)
        return t == GT_F32 ? rows_f32_1 : t == GT_F16 ? rows_f16_1 : rows_bf16_1;
    switch (t) {
    case GT_Q4_0: return rows_q4_0;
    case GT_Q4_1: return rows_q4_1;
    case GT_Q5_0: return rows_q5_0;
    case GT_Q5_1: return rows_q5_1;
    case GT_Q8_0: return rows_q8_0;
    case GT_Q8_0X: return rows_q8_0x;
    case GT_Q4_K: return rows_q4_k;
    case GT_Q5_K: return rows_q5_k;
    case GT_Q6_K: return rows_q6_k;
    case GT_MXFP4: return rows_mxfp4;
    case GT_F32: return rows_f32;
    case GT_F16: return rows_f16;
    case GT_BF16: return rows_bf16;
    default: return NULL;
    }
}

/* The activations for these parts: float32 (copied when X is another dtype, and for a quantized
 * prefill when X is off a 64-byte boundary; the dense prefill copies X to its own skewed rows,
 * dense_drive.h), and quantized in the layouts the parts' kernels read, rows quantized in
 * parallel when there are many. One allocation, freed by the caller; NULL on failure. */
static char *prepare_x(const void *x, int64_t M, int64_t K, int dt, int quant, int il32, int ilk,
                       int it16, int nthreads, xq_t *X) {
    const int64_t nbp = QX_NBP(K);
    const int aligned = dt == DT_F32 && (M <= QMAX_ROWS || !quant || ((uintptr_t)x & 63) == 0);
    const size_t xf = aligned ? 0 : (size_t)(M * K) * 4;
    /* d s d16 s16 d4 s4: 1 1 2 2 4 4 floats per nbp; q32 q16: 1 2 ints */
    const size_t fl = quant ? (size_t)(M * nbp) * 4 * (QX_FLOATS + QX_INTS) : 0;
    const size_t q = quant ? (size_t)(M * K) * (1 + (il32 != 0) + (ilk != 0)) : 0;
    const size_t t16 = quant && it16 ? (size_t)(M * QX_T16(K)) : 0;
    char *buf = (char *)aligned_alloc(64, (xf + fl + q + t16 + 64) / 64 * 64);
    if (!buf) return NULL;
    *X = (xq_t){.xf = (const float *)x, .K = K, .nbp = nbp};
    float *xfb = xf ? (float *)buf : NULL;
    float *f = (float *)(buf + xf);
    int8_t *qb = (int8_t *)(buf + xf + fl);
    if (quant) {
        X->d = f, X->s = f + M * nbp, X->d16 = f + 2 * M * nbp, X->s16 = f + 4 * M * nbp;
        X->d4 = f + 6 * M * nbp, X->s4 = f + 10 * M * nbp;
        X->q32 = (int32_t *)(f + QX_FLOATS * M * nbp), X->q16 = X->q32 + M * nbp;
        X->nat = qb;
        X->i32 = il32 ? qb + M * K : NULL;
        X->ik = ilk ? qb + M * K * (1 + (il32 != 0)) : NULL;
        X->t16 = t16 ? (int8_t *)(buf + xf + fl + q) : NULL;
    }
    if (xfb) X->xf = xfb;
    const int T = M >= 16 && nthreads > 1 ? nthreads : 1;
#pragma omp parallel for num_threads(T) schedule(static) if (T > 1)
    for (int64_t m = 0; m < M; m++) {
        if (xfb)
            for (int64_t i = m * K; i < (m + 1) * K; i++) xfb[i] = load1(x, i, dt);
        if (!quant) continue;
        memset(X->d + m * nbp, 0, nbp * 4), memset(X->s + m * nbp, 0, nbp * 4);
        memset(X->d16 + 2 * m * nbp, 0, nbp * 8), memset(X->s16 + 2 * m * nbp, 0, nbp * 8);
        memset(X->d4 + 4 * m * nbp, 0, nbp * 16), memset(X->s4 + 4 * m * nbp, 0, nbp * 16);
        memset(X->q32 + m * nbp, 0, nbp * 4), memset(X->q16 + 2 * m * nbp, 0, nbp * 8);
        qx_quantize_row(X->xf + m * K, K, X->nat + m * K, X->d + m * nbp, X->s + m * nbp,
                        X->d16 + 2 * m * nbp, X->s16 + 2 * m * nbp, X->d4 + 4 * m * nbp,
                        X->s4 + 4 * m * nbp, X->q32 + m * nbp, X->q16 + 2 * m * nbp);
        qx_interleave_row(X->nat + m * K, K, il32 ? X->i32 + m * K : NULL,
                          ilk ? X->ik + m * K : NULL);
        if (X->t16) qx_t16_row(X->nat + m * K, K, X->t16 + m * QX_T16(K));
    }
    return buf;
}

/* X's rows [g, g + 4) as a view (the kernels step rows by K and nbp). */
static xq_t x_rows(const xq_t *X, int64_t g) {
    xq_t v = *X;
    const int64_t K = X->K, nbp = X->nbp;
    v.xf = X->xf + g * K;
    if (X->nat) {
        v.nat = X->nat + g * K;
        v.i32 = X->i32 ? X->i32 + g * K : NULL;
        v.ik = X->ik ? X->ik + g * K : NULL;
        v.t16 = X->t16 ? X->t16 + g * QX_T16(K) : NULL;
        v.d = X->d + g * nbp, v.s = X->s + g * nbp;
        v.d16 = X->d16 + 2 * g * nbp, v.s16 = X->s16 + 2 * g * nbp;
        v.d4 = X->d4 + 4 * g * nbp, v.s4 = X->s4 + 4 * g * nbp;
        v.q32 = X->q32 + g * nbp, v.q16 = X->q16 + 2 * g * nbp;
    }
    return v;
}

/* Chunk c (QCHUNK_ROWS rows of one part, numbered across the parts) against every group of 4
 * rows of X. */
static void run_chunk(int64_t c, const tq_part *parts, const int64_t *first_chunk,
                      const int64_t *off, const xq_t *X, const float *bias, void *y, int64_t M,
                      int64_t N, int64_t K, int dt) {
    const int es = dt == DT_F32 ? 4 : 2;
    int64_t p = 0;
    while (c >= first_chunk[p + 1]) p++;
    const tq_part *pt = &parts[p];
    const int64_t r0 = (c - first_chunk[p]) * QCHUNK_ROWS;
    const int64_t r1 = r0 + QCHUNK_ROWS < pt->rows ? r0 + QCHUNK_ROWS : pt->rows;
    const rows_fn fn = rows_for(pt->type);
    for (int64_t g = 0; g < M; g += QMAX_ROWS) {
        const xq_t Xg = x_rows(X, g);
        fn((const uint8_t *)pt->w, tq_row_bytes(pt->type, K), r0, r1, &Xg,
           bias ? bias + off[p] : NULL, (char *)y + (g * N + off[p]) * es, N, dt,
           (int)(M - g < QMAX_ROWS ? M - g : QMAX_ROWS));
    }
}
#endif /* QISA */

int tandem_qgemm(const void *x, const tq_part *parts, int64_t nparts, const float *bias, void *y,
                 int64_t M, int64_t K, int dt, int nthreads);
int tandem_qgemm256(const void *x, const tq_part *parts, int64_t nparts, const float *bias,
                    void *y, int64_t M, int64_t K, int dt, int nthreads);
int tandem_dense_gemm512(const float *x, const tq_part *parts, int64_t nparts, const float *bias,
                         void *y, int64_t M, int64_t K, int dt, int nthreads);
int tandem_dense_gemm256(const float *x, const tq_part *parts, int64_t nparts, const float *bias,
                         void *y, int64_t M, int64_t K, int dt, int nthreads);

/* Which prefill kernel takes a call whose parts are all K-quants: 1 the AVX2 one (qgemm256.c),
 * 0 the AVX-512 one (qgemm.c); -1 not chosen yet. Whole-model prefill on a Zen 4 (AMD, 512-bit
 * operations on 256-bit units, slow gathers): qgemm256.c 1.09-1.14x on Q4_K_M; on a Sapphire
 * Rapids (Intel): qgemm.c 1.2-1.3x on Q4_K, Q5_K and Q6_K. So by vendor unless a caller sets it
 * (tandem_kquant_prefill). */
static int kq_avx2 = -1;

static int kq_default(void) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
    return b == 0x68747541u; /* "Auth"enticAMD */
}

/* choice 0 or 1 sets kq_avx2; any other value only reads it. Returns the setting in force. */
int tandem_kquant_prefill(int choice) {
    if (choice == 0 || choice == 1) __atomic_store_n(&kq_avx2, choice, __ATOMIC_RELAXED);
    int v = __atomic_load_n(&kq_avx2, __ATOMIC_RELAXED);
    if (v < 0) {
        v = kq_default();
        __atomic_store_n(&kq_avx2, v, __ATOMIC_RELAXED);
    }
    return v;
}

/* Routes: the build of these kernels (another ISA variant's library, tandem/kernels/library.py)
 * that multiplies a call whose every part is of ggml type t, per shape class (0: decode, M <= 4
 * rows; 1: prefill), as the timing chose it (tandem/kernels/variant_choice.py); NULL: this
 * build. A routed call runs whole in the other build (its own activation layout and threads),
 * so its result is that build's bits. Set once from Python before any call reads them. */
enum { TQ_ROUTE_TYPES = 64 };
typedef int (*tq_qgemv_fn)(const void *, const tq_part *, int64_t, const float *, void *,
                           int64_t, int64_t, int, int);
static tq_qgemv_fn tq_routes[2][TQ_ROUTE_TYPES];

int tandem_qgemv_route(int cls, int64_t type, tq_qgemv_fn fn) {
    if (cls < 0 || cls > 1 || type < 0 || type >= TQ_ROUTE_TYPES) return -1;
    tq_routes[cls][type] = fn;
    return 0;
}

/* The route of type t in class cls (NULL: this build, or arguments out of range). */
void *tandem_qgemv_routed(int cls, int64_t type) {
    if (cls < 0 || cls > 1 || type < 0 || type >= TQ_ROUTE_TYPES) return NULL;
    return (void *)tq_routes[cls][type];
}

/* The build every part's type routes to, or NULL (parts of types routed apart: this build). */
static tq_qgemv_fn route_of(const tq_part *parts, int64_t nparts, int64_t M) {
    const int cls = M > 4; /* QMAX_ROWS */
    tq_qgemv_fn f = NULL;
    for (int64_t p = 0; p < nparts; p++) {
        const int64_t t = parts[p].type;
        if (t < 0 || t >= TQ_ROUTE_TYPES) return NULL;
        if (!tq_routes[cls][t] || (p && tq_routes[cls][t] != f)) return NULL;
        f = tq_routes[cls][t];
    }
    return f;
}

int tandem_qgemv(const void *x, const tq_part *parts, int64_t nparts, const float *bias, void *y,
                 int64_t M, int64_t K, int dt, int nthreads) {
    if (parts && nparts >= 1 && nparts <= 16) {
        const tq_qgemv_fn routed = route_of(parts, nparts, M);
        if (routed && routed != tandem_qgemv)
            return routed(x, parts, nparts, bias, y, M, K, dt, nthreads);
    }
#if QISA
    if (M < 1 || K < 1 || nparts < 1 || nparts > 16 || dt < DT_F32 || dt > DT_F16) return -1;
    if (dt == DT_F16 && !HAVE_F16) return -1;
    if (M > QMAX_ROWS) { /* prefill: the transposed-weight kernels where they apply */
        /* AVX-512 VNNI first (qgemm.c), except where every part is a K-quant and
         * tandem_kquant_prefill says the AVX2 kernel (qgemm256.c) decodes their superblocks
         * faster on this CPU (Q4_0 0.96x and Q8_0 0.75x there even on a Zen 4) */
        int kq = tandem_kquant_prefill(-1);
        for (int64_t p = 0; p < nparts; p++)
            kq &= parts[p].type == GT_Q4_K || parts[p].type == GT_Q5_K || parts[p].type == GT_Q6_K;
        int rc = kq ? tandem_qgemm256(x, parts, nparts, bias, y, M, K, dt, nthreads)
                    : tandem_qgemm(x, parts, nparts, bias, y, M, K, dt, nthreads);
        if (rc == -2)
            rc = kq ? tandem_qgemm(x, parts, nparts, bias, y, M, K, dt, nthreads)
                    : tandem_qgemm256(x, parts, nparts, bias, y, M, K, dt, nthreads);
        if (rc != -2) return rc;
    }
    int64_t N = 0, first_chunk[17], off[16];
    int quant = 0, il32 = 0, ilk = 0, it16 = 0;
    first_chunk[0] = 0;
    for (int64_t p = 0; p < nparts; p++) {
        const int64_t t = parts[p].type, bs = tq_block_size(t);
        if (bs == 0 || K % bs || parts[p].rows < 1 || !parts[p].w) return -1;
        quant |= bs > 1;
        il32 |= t == GT_Q4_0 || t == GT_Q4_1 || t == GT_Q5_0 || t == GT_Q5_1 || t == GT_MXFP4 ||
                (!HAVE_Q512 && (t == GT_Q4_K || t == GT_Q5_K)); /* the pair kernels */
        ilk |= HAVE_Q512 && (t == GT_Q4_K || t == GT_Q5_K);
        it16 |= t == GT_Q8_0X;
        off[p] = N;
        N += parts[p].rows;
        first_chunk[p + 1] = first_chunk[p] + (parts[p].rows + QCHUNK_ROWS - 1) / QCHUNK_ROWS;
    }
    if (quant && K % 32) return -1;
    xq_t X;
    char *buf = prepare_x(x, M, K, dt, quant, il32, ilk, it16, nthreads, &X);
    if (!buf) return -1;
    const int64_t chunks = first_chunk[nparts];
    int T = nthreads < 1 ? 1 : nthreads;
    if (N * K * M < (1 << 15) || chunks < 2) T = 1;
    if (!quant && M > QMAX_ROWS) { /* prefill over dense parts: gemm_dense512.c's tiles, else
                                    * (no AVX-512 in this build) gemm_dense256.c's */
        int rc = tandem_dense_gemm512(X.xf, parts, nparts, bias, y, M, K, dt, T);
        if (rc == -2) rc = tandem_dense_gemm256(X.xf, parts, nparts, bias, y, M, K, dt, T);
        if (rc != -2) {
            free(buf);
            return rc;
        }
    }
    /* decode (M <= 4): each thread streams its own contiguous run of chunks front to back, so
     * its software prefetch (qdot256.h) runs ahead into rows it reads next (handed out one chunk
     * at a time, every chunk would start with QPREFETCH bytes not yet prefetched); a thread done
     * early takes the other runs' last chunks, so a descheduled thread does not stall the call.
     * Prefill: each thread takes a block of W rows (cache-resident) at a time and runs it
     * against every group of 4 rows of X, so W is read from memory once however many rows X
     * has. */
    if (M <= QMAX_ROWS) {
        qrun *runs = runs_new(chunks, T);
        if (!runs) {
            free(buf);
            return -1;
        }
#pragma omp parallel num_threads(T) if (T > 1)
        {
            const int t = omp_get_thread_num();
            for (int k = 0; k < T; k++) /* its own run from the front, then the others' backs */
                for (int64_t c; (c = claim(&runs[(t + k) % T], k == 0)) >= 0;)
                    run_chunk(c, parts, first_chunk, off, &X, bias, y, M, N, K, dt);
        }
        free(runs);
    } else {
#pragma omp parallel for num_threads(T) schedule(dynamic, 1) if (T > 1)
        for (int64_t c = 0; c < chunks; c++)
            run_chunk(c, parts, first_chunk, off, &X, bias, y, M, N, K, dt);
    }
    free(buf);
    return 0;
#else
    (void)x; (void)parts; (void)nparts; (void)bias; (void)y; (void)M; (void)K; (void)dt;
    (void)nthreads;
    return -1;
#endif
}
