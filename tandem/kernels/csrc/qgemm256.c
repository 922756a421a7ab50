/* Prefill over GGUF blocks (AVX2 + FMA + F16C): Y (M, N) = X (M, K) . W (N, K)^T for many rows
 * of X, W as stored. qgemv.c calls it for M > 4 where qgemm.c (AVX-512 VNNI) does not apply; it
 * returns -2 where it does not apply either (no AVX2, a dense part, fewer than QGEMM256_MIN_ROWS
 * rows) and qgemv.c runs its own kernels instead.
 *
 * qgemm.c's design on 256-bit lanes: each thread decodes a chunk of W's rows once into a
 * transposed form, one int32 lane per block of 32 (a K-quant sub-block, a Q6_K group of 32 is a
 * block): per group of 8 blocks, 8 vectors of unsigned 8-bit quants (vector k, lane i: elements
 * 4k..4k+3 of block i) and per lane the scale (Q6_K: one per half of 16) and offset. X is
 * quantized as qx.h does and transposed alike (with each block's dx, dx sum q and exact integer
 * sums of q per 32 and per 16), and every group is then multiplied against many rows of X.
 * Without VPDPBUSD the integer dot is VPMADDUBSW (u8 x s8 pairs to int16, saturating) +
 * VPMADDWD; the int16 pair sums of several vectors are added before the one widening while they
 * cannot overflow (|x| <= 127, pair <= 2 * 127 * u_max):
 *   4-bit u <= 15:  8 vectors, <= 30480, one VPMADDWD per group and row of X;
 *   5-bit u <= 31:  4 vectors, <= 31496, two (MXFP4 too: u = kv + 12 <= 24);
 *   Q6_K  u <= 63:  2 vectors, <= 32004, four (the halves of 16 have their own scales, s0 / s1);
 *   Q8_0: signed w, |w| <= 128 as u8 with w's sign moved onto x (VPSIGNB), one per vector.
 * The float part is canon.h's, so every output is bit-for-bit what the decode kernels
 * (qdot256.h) give for that row: the symmetric types' offsets folded into the integer dot (I = U
 * - c sum q: Q4_0 c = 8, Q5_0 16, MXFP4 12, Q6_K 32 per half; Q8_0 is signed already), then per
 * group and row of X acc = fma(I, s dx, acc) (Q6_K once per half), and for the offset types
 * (Q4_1, Q5_1, Q4_K, Q5_K) acc = fma(o, dx sum q, acc); group g goes into canon.h's lanes
 * 8 (g % 2) .. + 7 (dot_tile), and canon_reduce16 sums the 16. So 8 blocks of one row of X cost
 * 8 VPMADDUBSW, 1-8 VPMADDWD, 1 convert and 2-3 float ops (Q6_K 2 converts, 4) plus 2-6 integer
 * ops for the offsets, where the decode kernels decode each weight block again for every 4 rows
 * of X. Lanes past a row's last block are zero (scale 0, quants 0, and X's dx and sums 0), so
 * partial groups need no code.
 *
 * The math is the decode kernels': the same quantized activations, exact integer dots per block,
 * then the same float32 operations in the same order, so the same bound holds (quant.py). Every
 * output is one row of W against one row of X, so the result does not depend on the thread
 * count or on how many rows of X share the call.
 */
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "dtypes.h"
#include "quant.h"

int tandem_qgemm256(const void *x, const tq_part *parts, int64_t nparts, const float *bias,
                    void *y, int64_t M, int64_t K, int dt, int nthreads);

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "qdot256.h"

#ifndef QGEMM256_MT /* 1..8; single-thread at 64 rows 8 ran Q6_K 1.65x the decode kernels, 4 1.36x */
#define QGEMM256_MT 8
#endif
/* Fewer rows of X than this run the decode kernels: decoding W costs about as much as 4-5 rows'
 * dots, and single-thread on an AVX2 build (Zen 4, the qwen3-0.6b layer shapes) the two cross
 * between 12 and 24 rows (Q4_0 0.82x at 12, 1.14x at 24; Q6_K 1.05x, 1.33x). */
#ifndef QGEMM256_MIN_ROWS
#define QGEMM256_MIN_ROWS 16
#endif
enum { GB = 8, MT = QGEMM256_MT, WT = 16 }; /* blocks per group, X rows per pass, W rows per chunk */

typedef struct { /* one group of 8 blocks of one row of W, decoded */
    __m256i q[8];
    __m256 s0, s1, o; /* s1: Q6_K's second 16 elements' scale (else s0); o: the offset (or 0) */
} wgroup;

typedef struct { /* one group of 8 blocks of one row of X, quantized (qx.h), transposed alike */
    __m256i q[8];
    __m256 d, s;        /* dx and dx * sum(q) per block */
    __m256i n, na, nb;  /* sum(q) per block, per its first 16, per its second 16 */
} xgroup;

typedef struct {
    const xgroup *g; /* (M, groups) */
    int64_t groups;
} xt_t;

/* r[i] holds 8 int32 words; afterwards r[k] lane i is word k of the former r[i]. */
static inline void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);
        r[k + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);
    }
}

/* The 32 quants of a 16-byte nibble array: element i < 16 the low nibble of byte i, else the
 * high nibble of byte i - 16. */
static inline __m256i nibbles32(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

/* Group g of one row of W: its (up to) 8 blocks in natural order into u[], scales to s0, s1, o. */
static void decode_group(int64_t t, const uint8_t *w, int64_t g, int64_t n, __m256i u[8],
                         float s0[8], float s1[8], float o[8]) {
    if (t == GT_MXFP4) { /* u = kv[code] + 12 (0..24) by a byte shuffle, s = 2^(e - 128) */
        const __m256i lut = _mm256_setr_epi8(TQ_MXFP4_U12, TQ_MXFP4_U12);
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *b = w + (g * GB + i) * 17;
            s0[i] = s1[i] = tq_e8m0_half(b[0]);
            u[i] = _mm256_shuffle_epi8(lut, nibbles32(b + 1)); /* I = U - 12 sum q */
        }
        return;
    }
    if (t == GT_Q4_0 || t == GT_Q4_1 || t == GT_Q5_0 || t == GT_Q5_1 || t == GT_Q8_0) {
        const int64_t bytes = tq_block_bytes(t);
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *b = w + (g * GB + i) * bytes;
            const float d = f16(b);
            s0[i] = s1[i] = d;
            if (t == GT_Q8_0) {
                u[i] = _mm256_loadu_si256((const __m256i *)(b + 2)); /* signed: I = sum w q */
            } else if (t == GT_Q4_0 || t == GT_Q4_1) { /* Q4_0: I = U - 8 sum q */
                u[i] = nibbles32(b + (t == GT_Q4_0 ? 2 : 4));
            } else { /* Q5_0: I = U - 16 sum q */
                const int64_t qs = t == GT_Q5_0 ? 6 : 8;
                u[i] = _mm256_or_si256(nibbles32(b + qs), fifth_bits(b + qs - 4));
            }
            if (t == GT_Q4_1 || t == GT_Q5_1) o[i] = f16(b + 2);
        }
        return;
    }
    if (t == GT_Q4_K || t == GT_Q5_K) { /* group g: superblock g, lane j: sub-block j */
        const int64_t bytes = t == GT_Q4_K ? 144 : 176, qs = t == GT_Q4_K ? 16 : 48;
        const uint8_t *b = w + g * bytes;
        uint32_t sm[4];
        kquant_scales(b + 4, sm);
        const uint8_t *sc = (const uint8_t *)sm;
        const float d = f16(b), dmin = f16(b + 2);
        __m256i hb = t == GT_Q5_K ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) /* sub-blocks 2j (low nibbles), 2j + 1 (high) */
            kq_nibbles(_mm256_loadu_si256((const __m256i *)(b + qs + 32 * j)), t == GT_Q5_K, &hb,
                       &u[2 * j], &u[2 * j + 1]);
        for (int j = 0; j < 8; j++) s0[j] = s1[j] = (float)sc[j] * d, o[j] = (float)sc[8 + j] * -dmin;
        return;
    }
    /* Q6_K, lane jj = 4 h + t: elements 128 h + 32 t .. + 31, sub-blocks of 16 2 jj, 2 jj + 1 */
    const uint8_t *b = w + g * 210;
    const float d = f16(b + 208);
    for (int h = 0; h < 2; h++)
        q6k_quants(_mm256_loadu_si256((const __m256i *)(b + 64 * h)),
                   _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32)),
                   _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)), u + 4 * h);
    for (int j = 0; j < 8; j++) /* I = U - 32 sum q per 16 */
        s0[j] = d * (float)(int8_t)b[192 + 2 * j], s1[j] = d * (float)(int8_t)b[193 + 2 * j];
}

/* One row of W (nb blocks of 32, or K-quant sub-blocks) into `out` (ceil(nb / 8) groups). */
static void decode_row(int64_t t, const uint8_t *w, int64_t nb, wgroup *out) {
    for (int64_t g = 0; g * GB < nb; g++) {
        const int64_t n = nb - g * GB < GB ? nb - g * GB : GB;
        if (t == GT_Q8_0X) { /* transposed already (quant.h): half g % 2 of group g / 2, signed */
            const int64_t n16 = nb - 16 * (g / 2) < 16 ? nb - 16 * (g / 2) : 16;
            const uint8_t *qg = w + 2 * nb + 512 * (g / 2) + 32 * (g % 2);
            const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            for (int k = 0; k < 8; k++) {
                const uint8_t *p = qg + 4 * n16 * k;
                const __m256i v = n == 8 ? _mm256_loadu_si256((const __m256i *)p)
                                         : _mm256_maskload_epi32((const int *)p, live);
                out[g].q[k] = _mm256_and_si256(_mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)), live);
            }
            uint16_t sh[8] = {0};
            memcpy(sh, w + 2 * GB * g, (size_t)(2 * n));
            out[g].s0 = out[g].s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sh));
            out[g].o = _mm256_setzero_ps();
            continue;
        }
        __m256i u[8];
        float s0[8] = {0}, s1[8] = {0}, o[8] = {0};
        for (int i = 0; i < 8; i++) u[i] = _mm256_setzero_si256();
        decode_group(t, w, g, n, u, s0, s1, o);
        transpose8(u);
        for (int k = 0; k < 8; k++) out[g].q[k] = u[k];
        out[g].s0 = _mm256_loadu_ps(s0), out[g].s1 = _mm256_loadu_ps(s1);
        out[g].o = _mm256_loadu_ps(o);
    }
}

enum { K4 = 4, K5 = 5, K6 = 6, K8 = 8 }; /* the integer-dot kinds of the module comment */

static inline __m256i mb(__m256i u, const __m256i *x) {
    return _mm256_maddubs_epi16(u, _mm256_load_si256(x));
}

/* I = U - c n per lane (c = 8, 12, 16, 32: shifts) */
static inline __m256i fold(__m256i U, const __m256i q, const int c) {
    if (c == 12) return _mm256_sub_epi32(U, _mm256_add_epi32(_mm256_slli_epi32(q, 3), _mm256_slli_epi32(q, 2)));
    return _mm256_sub_epi32(U, _mm256_slli_epi32(q, c == 8 ? 3 : c == 16 ? 4 : 5));
}

/* The groups g = h, h + 2, h + 4, ... of one row of W (decoded) against rows m0 .. m0 + mt of
 * X into acc[m], from +0: canon.h's lanes 0-7 (h = 0) or 8-15 (h = 1) of each. c: the symmetric
 * types' offset folded into the integer dot, I = U - c sum q (Q4_0 8, Q5_0 16, MXFP4 12; Q6_K 32
 * per 16), then acc = fma(I, s dx, acc); c = 0: I = U (Q8_0, signed); c < 0: the offset types,
 * acc = fma(U, s dx, acc), acc = fma(o, dx sum q, acc). */
static inline __attribute__((always_inline)) void tile_pass(const wgroup *wg, const xt_t *X,
                                                            int64_t m0, __m256 *acc, const int mt,
                                                            const int kind, const int c,
                                                            const int h) {
    const int64_t G = X->groups;
    const __m256i one = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = h; g < G; g += 2) {
        const wgroup *w = wg + g;
        __m256i wq[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++)
            wq[k] = kind == K8 ? _mm256_abs_epi8(w->q[k]) : w->q[k];
#pragma GCC unroll 8
        for (int m = 0; m < mt; m++) {
            const xgroup *x = X->g + (m0 + m) * G + g;
            const __m256i *xq = x->q;
            const __m256 dx = x->d;
            if (kind == K6) {
                __m256i p0 = _mm256_madd_epi16(_mm256_add_epi16(mb(wq[0], xq), mb(wq[1], xq + 1)), one);
                __m256i p1 = _mm256_madd_epi16(_mm256_add_epi16(mb(wq[4], xq + 4), mb(wq[5], xq + 5)), one);
                p0 = _mm256_add_epi32(p0, _mm256_madd_epi16(_mm256_add_epi16(mb(wq[2], xq + 2), mb(wq[3], xq + 3)), one));
                p1 = _mm256_add_epi32(p1, _mm256_madd_epi16(_mm256_add_epi16(mb(wq[6], xq + 6), mb(wq[7], xq + 7)), one));
                p0 = fold(p0, x->na, 32);
                p1 = fold(p1, x->nb, 32);
                acc[m] = canon_fma(acc[m], p0, w->s0, dx);
                acc[m] = canon_fma(acc[m], p1, w->s1, dx);
                continue;
            }
            __m256i p;
            if (kind == K8) {
                p = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    const __m256i xs = _mm256_sign_epi8(_mm256_load_si256(xq + k), w->q[k]);
                    p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(wq[k], xs), one));
                }
            } else if (kind == K4) {
                __m256i a = _mm256_add_epi16(mb(wq[0], xq), mb(wq[1], xq + 1));
                __m256i b = _mm256_add_epi16(mb(wq[2], xq + 2), mb(wq[3], xq + 3));
                a = _mm256_add_epi16(a, _mm256_add_epi16(mb(wq[4], xq + 4), mb(wq[5], xq + 5)));
                b = _mm256_add_epi16(b, _mm256_add_epi16(mb(wq[6], xq + 6), mb(wq[7], xq + 7)));
                p = _mm256_madd_epi16(_mm256_add_epi16(a, b), one);
            } else {
                __m256i a = _mm256_add_epi16(mb(wq[0], xq), mb(wq[1], xq + 1));
                __m256i b = _mm256_add_epi16(mb(wq[4], xq + 4), mb(wq[5], xq + 5));
                a = _mm256_add_epi16(a, _mm256_add_epi16(mb(wq[2], xq + 2), mb(wq[3], xq + 3)));
                b = _mm256_add_epi16(b, _mm256_add_epi16(mb(wq[6], xq + 6), mb(wq[7], xq + 7)));
                p = _mm256_add_epi32(_mm256_madd_epi16(a, one), _mm256_madd_epi16(b, one));
            }
            if (c > 0) p = fold(p, x->n, c);
            acc[m] = canon_fma(acc[m], p, w->s0, dx);
            if (c < 0) acc[m] = _mm256_fmadd_ps(w->o, x->s, acc[m]);
        }
    }
}

/* One row of W (decoded) against rows m0 .. m0 + mt of X: out[m], in canon.h's order. Lane i of
 * group g is block 8 g + i, canon.h's lane 8 (g % 2) + i: the even groups go into one
 * accumulator per row of X (lo), then the odd ones into another (hi), each lane in block order,
 * and canon_reduce16(lo, hi). */
static inline __attribute__((always_inline)) void dot_tile(const wgroup *wg, const xt_t *X,
                                                           int64_t m0, float *out, const int mt,
                                                           const int kind, const int c) {
    __m256 lo[8], hi[8]; /* mt <= 8, a literal */
    tile_pass(wg, X, m0, lo, mt, kind, c, 0);
    tile_pass(wg, X, m0, hi, mt, kind, c, 1);
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) out[m] = canon_reduce16(lo[m], hi[m]);
}

#define DEFINE_DOT(NAME, KIND, C)                                                              \
    static void dot_rows_##NAME(const wgroup *wg, const xt_t *X, int64_t m0, float *out,       \
                                int mt) {                                                      \
        switch (mt) { /* mt <= MT */                                                           \
        case 1: dot_tile(wg, X, m0, out, 1, KIND, C); break;                                   \
        case 2: dot_tile(wg, X, m0, out, 2, KIND, C); break;                                   \
        case 3: dot_tile(wg, X, m0, out, 3, KIND, C); break;                                   \
        case 4: dot_tile(wg, X, m0, out, 4, KIND, C); break;                                   \
        case 5: dot_tile(wg, X, m0, out, 5, KIND, C); break;                                   \
        case 6: dot_tile(wg, X, m0, out, 6, KIND, C); break;                                   \
        case 7: dot_tile(wg, X, m0, out, 7, KIND, C); break;                                   \
        default: dot_tile(wg, X, m0, out, 8, KIND, C); break;                                  \
        }                                                                                      \
    }
DEFINE_DOT(q4_0, K4, 8)
DEFINE_DOT(q4_1, K4, -1) /* Q4_1, Q4_K */
DEFINE_DOT(q5_0, K5, 16)
DEFINE_DOT(q5_1, K5, -1) /* Q5_1, Q5_K */
DEFINE_DOT(mxfp4, K5, 12) /* u = kv + 12 <= 24 */
DEFINE_DOT(q6_k, K6, 32)
DEFINE_DOT(q8_0, K8, 0)
#undef DEFINE_DOT

typedef void (*dot_fn)(const wgroup *, const xt_t *, int64_t, float *, int);

static dot_fn dot_for(int64_t t) {
    switch (t) {
    case GT_Q4_0: return dot_rows_q4_0;
    case GT_Q4_1: case GT_Q4_K: return dot_rows_q4_1;
    case GT_Q5_0: return dot_rows_q5_0;
    case GT_Q5_1: case GT_Q5_K: return dot_rows_q5_1;
    case GT_MXFP4: return dot_rows_mxfp4;
    case GT_Q6_K: return dot_rows_q6_k;
    case GT_Q8_0: case GT_Q8_0X: return dot_rows_q8_0;
    default: return NULL;
    }
}

/* X (M, K) -> the transposed quantized form (one allocation, freed by the caller). */
static char *prepare(const void *x, int64_t M, int64_t K, int dt, int nthreads, xt_t *X) {
    const int64_t nb = K / 32, G = (nb + GB - 1) / GB, nbp = QX_NBP(K);
    const size_t row = (size_t)K * 4 + (size_t)K + (size_t)nbp * 4 * (QX_FLOATS + QX_INTS); /* per-thread scratch */
    xgroup *xg = (xgroup *)aligned_alloc(64, ((size_t)(M * G) * sizeof(xgroup) + 63) / 64 * 64);
    if (!xg) return NULL;
    *X = (xt_t){.g = xg, .groups = G};
    int bad = 0;
    const int T = M >= 16 && nthreads > 1 ? nthreads : 1;
#pragma omp parallel num_threads(T) reduction(| : bad) if (T > 1)
    {
        char *scratch = (char *)aligned_alloc(64, (row + 63) / 64 * 64);
        if (!scratch) bad = 1;
        else memset(scratch, 0, row); /* the padding past a row's last block stays 0 */
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            if (!scratch) continue;
            float *xf = (float *)scratch;
            int8_t *q = (int8_t *)(xf + K);
            float *f = (float *)(q + K); /* qx_quantize_row's d s d16 s16 d4 s4 */
            for (int64_t i = 0; i < K; i++) xf[i] = load1(x, m * K + i, dt);
            int32_t *qi = (int32_t *)(f + QX_FLOATS * nbp);
            qx_quantize_row(xf, K, q, f, f + nbp, f + 2 * nbp, f + 4 * nbp, f + 6 * nbp, f + 10 * nbp,
                            qi, qi + nbp);
            for (int64_t g = 0; g < G; g++) {
                xgroup *t = xg + m * G + g;
                __m256i r[8];
                for (int64_t i = 0; i < GB; i++)
                    r[i] = g * GB + i < nb ? _mm256_loadu_si256((const __m256i *)(q + 32 * (g * GB + i)))
                                           : _mm256_setzero_si256();
                transpose8(r);
                for (int k = 0; k < 8; k++) t->q[k] = r[k];
                /* qx_quantize_row's arrays are zero past the last block (nbp >= nb + 16) */
                t->d = _mm256_loadu_ps(f + g * GB), t->s = _mm256_loadu_ps(f + nbp + g * GB);
                const __m256i ab0 = _mm256_loadu_si256((const __m256i *)(qi + nbp + 2 * g * GB));
                const __m256i ab1 = _mm256_loadu_si256((const __m256i *)(qi + nbp + 2 * g * GB + 8));
                const __m256i eo = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
                const __m256i e0 = _mm256_permutevar8x32_epi32(ab0, eo), e1 = _mm256_permutevar8x32_epi32(ab1, eo);
                t->n = _mm256_loadu_si256((const __m256i *)(qi + g * GB));
                t->na = _mm256_permute2x128_si256(e0, e1, 0x20);
                t->nb = _mm256_permute2x128_si256(e0, e1, 0x31);
            }
        }
        free(scratch);
    }
    if (bad) {
        free(xg);
        return NULL;
    }
    return (char *)xg;
}

/* qgemm_drive.h's hooks: the types dot_for knows */
static inline int qgemm_takes(int64_t t) { return dot_for(t) != NULL; }
static inline void qgemm_dot(const wgroup *wg, const xt_t *X, int64_t m0, float *out, int mt,
                             int64_t t) {
    dot_for(t)(wg, X, m0, out, mt);
}

#include "qgemm_drive.h"
#endif

int tandem_qgemm256(const void *x, const tq_part *parts, int64_t nparts, const float *bias,
                    void *y, int64_t M, int64_t K, int dt, int nthreads) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (M < QGEMM256_MIN_ROWS) return -2;
    return qgemm_drive(x, parts, nparts, bias, y, M, K, dt, nthreads);
#else
    (void)x; (void)parts; (void)nparts; (void)bias; (void)y; (void)M; (void)K; (void)dt;
    (void)nthreads;
    return -2;
#endif
}
