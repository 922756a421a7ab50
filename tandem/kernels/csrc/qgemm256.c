/* Prefill over GGUF blocks (AVX2 + FMA + F16C): Y (M, N) = X (M, K) . W (N, K)^T for many rows
 * of X, W as stored. qgemv.c calls it for M > 4 where qgemm.c (AVX-512 VNNI) does not apply; it
 * returns -2 where it does not apply either (no AVX2, a dense part, fewer than QGEMM256_MIN_ROWS
 * rows) and qgemv.c runs its own kernels instead.
 *
 * qgemm.c's design on 256-bit lanes: each thread decodes a chunk of W's rows once into a
 * transposed form, one int32 lane per block of 32 (a K-quant sub-block is a block): per group of
 * 8 blocks, 8 vectors of unsigned 8-bit quants (vector k, lane i: elements 4k..4k+3 of block i)
 * and per lane the scale and offset of w = s * u + o. X is quantized as qx.h does and
 * transposed alike, and every group is then multiplied against many rows of X. Without VPDPBUSD
 * the integer dot is VPMADDUBSW (u8 x s8 pairs to int16, saturating) + VPMADDWD; the int16 pair
 * sums of several vectors are added before the one widening while they cannot overflow
 * (|x| <= 127, pair <= 2 * 127 * u_max):
 *   4-bit u <= 15:  8 vectors, <= 30480, one VPMADDWD per group and row of X;
 *   5-bit u <= 31:  4 vectors, <= 31496, two (MXFP4 too: u = kv + 12 <= 24, o = -12 s);
 *   Q6_K  u <= 63:  2 vectors, <= 32004, four (the halves of 16 have their own scales, s0 / s1);
 *   Q8_0: signed w, |w| <= 128 as u8 with w's sign moved onto x (VPSIGNB), o = 0, one per vector.
 * So 8 blocks of one row of X cost 8 VPMADDUBSW, 1-8 VPMADDWD, 1 convert and 3 float ops (Q6_K
 * 2 converts, 6), where the decode kernels (qdot256.h) pay a convert and a multiply-add per block
 * (Q4_x, Q5_x, Q4_K, Q5_K: per 2 blocks) and decode each weight block again for every 4 rows of X. Lanes past a row's last block are
 * zero (scale 0, quants 0), so partial groups need no code.
 *
 * The math is the decode kernels': the same quantized activations, exact integer dots per block,
 * then (s dx) dot + o (dx sum q) in float32, so the same bound holds (quant.py). Every output is
 * one row of W against one row of X, so the result does not depend on the thread count.
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
    __m256 s0, s1, o0, o1; /* s1, o1: the second 16 elements' (Q6_K; else s0, o0) */
} wgroup;

typedef struct { /* X quantized (qx.h) and transposed to the wgroup lane order */
    const __m256i *q;     /* (M, groups, 8) */
    const float *d, *s;   /* (M, 8 groups): dx and dx * sum(q) per block */
    const float *sa, *sb; /* (M, 8 groups): dx * sum of each block's first / second 16 */
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

/* Group g of one row of W: its (up to) 8 blocks in natural order into u[], scales to s0..o1. */
static void decode_group(int64_t t, const uint8_t *w, int64_t g, int64_t n, __m256i u[8],
                         float s0[8], float s1[8], float o0[8], float o1[8]) {
    if (t == GT_MXFP4) { /* u = kv[code] + 12 (0..24) by a byte shuffle, s = 2^(e - 128) */
        const __m256i lut = _mm256_setr_epi8(TQ_MXFP4_U12, TQ_MXFP4_U12);
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *b = w + (g * GB + i) * 17;
            s0[i] = s1[i] = tq_e8m0_half(b[0]);
            o0[i] = o1[i] = -12.0f * s0[i]; /* o = -12 s */
            u[i] = _mm256_shuffle_epi8(lut, nibbles32(b + 1));
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
                u[i] = _mm256_loadu_si256((const __m256i *)(b + 2)); /* signed; o = 0 */
                o0[i] = 0.0f;
            } else if (t == GT_Q4_0 || t == GT_Q4_1) {
                u[i] = nibbles32(b + (t == GT_Q4_0 ? 2 : 4));
                o0[i] = t == GT_Q4_0 ? -8.0f * d : f16(b + 2);
            } else {
                const int64_t qs = t == GT_Q5_0 ? 6 : 8;
                u[i] = _mm256_or_si256(nibbles32(b + qs), fifth_bits(b + qs - 4));
                o0[i] = t == GT_Q5_0 ? -16.0f * d : f16(b + 2);
            }
            o1[i] = o0[i];
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
        for (int j = 0; j < 8; j++) s0[j] = s1[j] = d * sc[j], o0[j] = o1[j] = -dmin * sc[8 + j];
        return;
    }
    /* Q6_K, lane jj = 4 h + t: elements 128 h + 32 t .. + 31, sub-blocks of 16 2 jj, 2 jj + 1 */
    const uint8_t *b = w + g * 210;
    const float d = f16(b + 208);
    for (int h = 0; h < 2; h++)
        q6k_quants(_mm256_loadu_si256((const __m256i *)(b + 64 * h)),
                   _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32)),
                   _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)), u + 4 * h);
    for (int j = 0; j < 8; j++) {
        s0[j] = d * (float)(int8_t)b[192 + 2 * j], s1[j] = d * (float)(int8_t)b[193 + 2 * j];
        o0[j] = -32.0f * s0[j], o1[j] = -32.0f * s1[j];
    }
}

/* One row of W (nb blocks of 32, or K-quant sub-blocks) into `out` (ceil(nb / 8) groups). */
static void decode_row(int64_t t, const uint8_t *w, int64_t nb, wgroup *out) {
    for (int64_t g = 0; g * GB < nb; g++) {
        const int64_t n = nb - g * GB < GB ? nb - g * GB : GB;
        __m256i u[8];
        float s0[8] = {0}, s1[8] = {0}, o0[8] = {0}, o1[8] = {0};
        for (int i = 0; i < 8; i++) u[i] = _mm256_setzero_si256();
        decode_group(t, w, g, n, u, s0, s1, o0, o1);
        transpose8(u);
        for (int k = 0; k < 8; k++) out[g].q[k] = u[k];
        out[g].s0 = _mm256_loadu_ps(s0), out[g].s1 = _mm256_loadu_ps(s1);
        out[g].o0 = _mm256_loadu_ps(o0), out[g].o1 = _mm256_loadu_ps(o1);
    }
}

enum { K4 = 4, K5 = 5, K6 = 6, K8 = 8 }; /* the integer-dot kinds of the module comment */

static inline __m256i mb(__m256i u, const __m256i *x) {
    return _mm256_maddubs_epi16(u, _mm256_load_si256(x));
}

/* One row of W (decoded) against rows m0 .. m0 + mt of X: out[m]. */
static inline __attribute__((always_inline)) void dot_tile(const wgroup *wg, const xt_t *X,
                                                           int64_t m0, float *out, const int mt,
                                                           const int kind) {
    const int64_t G = X->groups;
    const __m256i one = _mm256_set1_epi16(1);
    __m256 acc[8]; /* mt <= 8, a literal: registers */
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const wgroup *w = wg + g;
        __m256i wq[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++)
            wq[k] = kind == K8 ? _mm256_abs_epi8(w->q[k]) : w->q[k];
#pragma GCC unroll 8
        for (int m = 0; m < mt; m++) {
            const __m256i *xq = X->q + ((m0 + m) * G + g) * 8;
            const int64_t at = (m0 + m) * G * GB + g * GB;
            const __m256 dx = _mm256_loadu_ps(X->d + at);
            if (kind == K6) {
                __m256i p0 = _mm256_madd_epi16(_mm256_add_epi16(mb(wq[0], xq), mb(wq[1], xq + 1)), one);
                __m256i p1 = _mm256_madd_epi16(_mm256_add_epi16(mb(wq[4], xq + 4), mb(wq[5], xq + 5)), one);
                p0 = _mm256_add_epi32(p0, _mm256_madd_epi16(_mm256_add_epi16(mb(wq[2], xq + 2), mb(wq[3], xq + 3)), one));
                p1 = _mm256_add_epi32(p1, _mm256_madd_epi16(_mm256_add_epi16(mb(wq[6], xq + 6), mb(wq[7], xq + 7)), one));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_mul_ps(w->s0, dx), acc[m]);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_mul_ps(w->s1, dx), acc[m]);
                acc[m] = _mm256_fmadd_ps(w->o0, _mm256_loadu_ps(X->sa + at), acc[m]);
                acc[m] = _mm256_fmadd_ps(w->o1, _mm256_loadu_ps(X->sb + at), acc[m]);
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
                __m256i c = _mm256_add_epi16(mb(wq[2], xq + 2), mb(wq[3], xq + 3));
                a = _mm256_add_epi16(a, _mm256_add_epi16(mb(wq[4], xq + 4), mb(wq[5], xq + 5)));
                c = _mm256_add_epi16(c, _mm256_add_epi16(mb(wq[6], xq + 6), mb(wq[7], xq + 7)));
                p = _mm256_madd_epi16(_mm256_add_epi16(a, c), one);
            } else {
                __m256i a = _mm256_add_epi16(mb(wq[0], xq), mb(wq[1], xq + 1));
                __m256i c = _mm256_add_epi16(mb(wq[4], xq + 4), mb(wq[5], xq + 5));
                a = _mm256_add_epi16(a, _mm256_add_epi16(mb(wq[2], xq + 2), mb(wq[3], xq + 3)));
                c = _mm256_add_epi16(c, _mm256_add_epi16(mb(wq[6], xq + 6), mb(wq[7], xq + 7)));
                p = _mm256_add_epi32(_mm256_madd_epi16(a, one), _mm256_madd_epi16(c, one));
            }
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(w->s0, dx), acc[m]);
            if (kind != K8) acc[m] = _mm256_fmadd_ps(w->o0, _mm256_loadu_ps(X->s + at), acc[m]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) out[m] = hsum8(acc[m]);
}

#define DEFINE_DOT(KIND)                                                                       \
    static void dot_rows_##KIND(const wgroup *wg, const xt_t *X, int64_t m0, float *out,       \
                                int mt) {                                                      \
        switch (mt) { /* mt <= MT */                                                           \
        case 1: dot_tile(wg, X, m0, out, 1, KIND); break;                                      \
        case 2: dot_tile(wg, X, m0, out, 2, KIND); break;                                      \
        case 3: dot_tile(wg, X, m0, out, 3, KIND); break;                                      \
        case 4: dot_tile(wg, X, m0, out, 4, KIND); break;                                      \
        case 5: dot_tile(wg, X, m0, out, 5, KIND); break;                                      \
        case 6: dot_tile(wg, X, m0, out, 6, KIND); break;                                      \
        case 7: dot_tile(wg, X, m0, out, 7, KIND); break;                                      \
        default: dot_tile(wg, X, m0, out, 8, KIND); break;                                     \
        }                                                                                      \
    }
DEFINE_DOT(K4)
DEFINE_DOT(K5)
DEFINE_DOT(K6)
DEFINE_DOT(K8)
#undef DEFINE_DOT

typedef void (*dot_fn)(const wgroup *, const xt_t *, int64_t, float *, int);

static dot_fn dot_for(int64_t t) {
    switch (t) {
    case GT_Q4_0: case GT_Q4_1: case GT_Q4_K: return dot_rows_K4;
    case GT_Q5_0: case GT_Q5_1: case GT_Q5_K: case GT_MXFP4: return dot_rows_K5; /* u <= 24 */
    case GT_Q6_K: return dot_rows_K6;
    case GT_Q8_0: return dot_rows_K8;
    default: return NULL;
    }
}

/* X (M, K) -> the transposed quantized form (one allocation, freed by the caller). */
static char *prepare(const void *x, int64_t M, int64_t K, int dt, int nthreads, xt_t *X) {
    const int64_t nb = K / 32, G = (nb + GB - 1) / GB, nbp = QX_NBP(K);
    const size_t qt = (size_t)(M * G) * 256, fl = (size_t)(M * G * GB) * 4 * 4;
    const size_t row = (size_t)K * 4 + (size_t)K + (size_t)nbp * 4 * (QX_FLOATS + QX_INTS); /* per-thread scratch */
    char *buf = (char *)aligned_alloc(64, (qt + fl + 64) / 64 * 64);
    if (!buf) return NULL;
    memset(buf + qt, 0, fl);
    float *d = (float *)(buf + qt), *s = d + M * G * GB, *sa = s + M * G * GB, *sb = sa + M * G * GB;
    *X = (xt_t){.q = (const __m256i *)buf, .d = d, .s = s, .sa = sa, .sb = sb, .groups = G};
    int bad = 0;
    const int T = M >= 16 && nthreads > 1 ? nthreads : 1;
#pragma omp parallel num_threads(T) reduction(| : bad) if (T > 1)
    {
        char *scratch = (char *)aligned_alloc(64, (row + 63) / 64 * 64);
        if (!scratch) bad = 1;
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
            __m256i *t = (__m256i *)(buf + (size_t)(m * G) * 256); /* (G, 8) */
            for (int64_t g = 0; g < G; g++) {
                __m256i r[8];
                for (int64_t i = 0; i < GB; i++)
                    r[i] = g * GB + i < nb ? _mm256_loadu_si256((const __m256i *)(q + 32 * (g * GB + i)))
                                           : _mm256_setzero_si256();
                transpose8(r);
                for (int k = 0; k < 8; k++) _mm256_store_si256(t + g * 8 + k, r[k]);
            }
            for (int64_t b = 0; b < nb; b++) {
                const int64_t at = m * G * GB + b;
                d[at] = f[b], s[at] = f[nbp + b];
                sa[at] = f[4 * nbp + 2 * b], sb[at] = f[4 * nbp + 2 * b + 1];
            }
        }
        free(scratch);
    }
    if (bad) {
        free(buf);
        return NULL;
    }
    return buf;
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
