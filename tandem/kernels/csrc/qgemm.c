/* Prefill over GGUF blocks (AVX-512 VNNI): Y (M, N) = X (M, K) . W (N, K)^T for many rows of X,
 * W as stored. qgemv.c calls it for M > 4 when every part is block-quantized; it returns -2 where
 * it does not apply (no AVX-512 VNNI, a dense part) and qgemv.c runs its own kernels instead.
 *
 * Why another kernel: with many rows of X the work per (weight block, row of X) decides, and the
 * decode kernels pay one convert + two float ops per 4 blocks of 32 and row. Here each thread
 * decodes a chunk of W's rows once into a transposed form, one int32 lane per block: per group
 * of 16 blocks, 8 vectors of unsigned 8-bit quants (vector k, lane i: elements 4k..4k+3 of block
 * i) and per lane the scale and offset of w = s * u + o (every type fits: Q8_0 as u = q + 128,
 * o = -128 d; MXFP4 as u = kv + 12 in 0..24, o = -12 d; a K-quant sub-block of 32 is a block;
 * Q6_K carries a second scale and offset for each block's second 16 elements). X is quantized as
 * qx.h does and transposed alike, so 16 blocks of one row of X cost 8 VPDPBUSD, 1 convert and 3
 * float ops (Q6_K: 2 converts, 6 ops). Rows past a group's last block are zero (scale 0, quants
 * 0), so partial groups need no code.
 *
 * The sums follow canon.h, as the decode kernels' do, so each output is bit-for-bit what they
 * compute for that row alone: lane i of a group holds block i, whose exact integer dot is formed
 * here on the unsigned quants u and turned into the signed one where the type is symmetric (I =
 * U - c sum q with the integer sums of X's quants: Q4_0 c = 8, Q5_0 16, Q8_0 128, MXFP4 12; Q6_K
 * per half, 32), then one multiply-add by s dx (and o (dx sum q) for the offset types). The
 * bound is the decode kernels' (quant.py). (An MXFP4 block with e >= 253, values past 2^125,
 * overflows float32 at its larger codes anyway.)
 */
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "dtypes.h"
#include "quant.h"
#include "canon.h"
#include "qx.h"

int tandem_qgemm(const void *x, const tq_part *parts, int64_t nparts, const float *bias, void *y,
                 int64_t M, int64_t K, int dt, int nthreads);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)

enum { GB = 16, MT = 8, WT = 16 }; /* blocks per group, rows of X per pass, rows of W per chunk */

typedef struct { /* one group of 16 blocks of one row of W, decoded */
    __m512i q[8];
    __m512 s0, s1, o0, o1;
} wgroup;

typedef struct { /* X quantized (qx.h) and transposed to the wgroup lane order */
    const __m512i *q;        /* (M, groups, 8) */
    const float *d, *s;      /* (M, 16 groups): dx and dx * sum(q) per block */
    const int32_t *qs;       /* (M, 16 groups): sum(q) per block */
    const int32_t *qa, *qb;  /* (M, 16 groups): sum(q) of each block's first / second 16 */
    int64_t groups;
} xt_t;

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* lane i's 16-bit value at byte `at` of its block (offsets `ix`), as float32 */
static inline __m512 gather_f16(const uint8_t *base, __m512i ix, __mmask16 live, int at) {
    __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, ix, base + at, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
}

static inline __m512i gather4(const uint8_t *base, __m512i ix, __mmask16 live, int64_t at) {
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, ix, base + at, 1);
}

/* Bit j (j < 4) of each lane's low nibble to bit 4 of byte j: the Q5 fifth bits of 4 elements. */
static inline __m512i spread4(__m512i bits) {
    const __m512i lut = _mm512_setr_epi32(
        0x00000000, 0x00000010, 0x00001000, 0x00001010, 0x00100000, 0x00100010, 0x00101000,
        0x00101010, 0x10000000, 0x10000010, 0x10001000, 0x10001010, 0x10100000, 0x10100010,
        0x10101000, 0x10101010);
    return _mm512_permutexvar_epi32(bits, lut); /* uses the low 4 bits of each lane */
}

/* MXFP4 scales 2^(e - 128) (quant.h's tq_e8m0_half) of int32 lanes e. */
static inline __m512 e8m0_half16(__m512i e) {
    const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    return _mm512_castsi512_ps(
        _mm512_mask_sllv_epi32(big, small, _mm512_set1_epi32(0x00200000), e));
}

/* One row of W (nb blocks of 32, or K-quant sub-blocks) into `out` (ceil(nb / 16) groups). */
static void decode_row(int64_t t, const uint8_t *w, int64_t nb, wgroup *out) {
    const __m512i m4 = _mm512_set1_epi32(0x0F0F0F0F), lane = _mm512_setr_epi32(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t g = 0; g * GB < nb; g++) {
        const int64_t n = nb - g * GB < GB ? nb - g * GB : GB;
        const __mmask16 live = (__mmask16)((1u << n) - 1);
        wgroup *o = out + g;
        if (t == GT_Q8_0X) { /* transposed already (quant.h): u = w + 128, o = -128 d */
            const uint8_t *qg = w + 2 * nb + 512 * g;
            const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, w + 2 * GB * g));
            o->s0 = o->s1 = d;
            for (int k = 0; k < 8; k++)
                o->q[k] = n == GB ? _mm512_loadu_si512(qg + 64 * k)
                                  : _mm512_maskz_loadu_epi32(live, qg + 4 * n * k);
            o->o0 = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
            continue;
        }
        if (t == GT_MXFP4) { /* u = kv[code] + 12 by a byte shuffle, s = 2^(e - 128), o = -12 s */
            const uint8_t *base = w + g * GB * 17;
            const __m512i ix = _mm512_mullo_epi32(lane, _mm512_set1_epi32(17));
            const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(TQ_MXFP4_U12));
            const __m512i e = _mm512_and_si512(gather4(base, ix, live, 0), _mm512_set1_epi32(0xFF));
            const __m512 d = _mm512_maskz_mov_ps(live, e8m0_half16(e));
            o->s0 = o->s1 = d;
            o->o0 = o->o1 = _mm512_mul_ps(d, _mm512_set1_ps(-12.0f));
            for (int k = 0; k < 4; k++) {
                const __m512i v = gather4(base, ix, live, 1 + 4 * k);
                const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, m4));
                const __m512i hi =
                    _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi32(v, 4), m4));
                o->q[k] = _mm512_maskz_mov_epi32(live, lo); /* lanes past the row: u = 0 */
                o->q[4 + k] = _mm512_maskz_mov_epi32(live, hi);
            }
            continue;
        }
        if (t == GT_Q4_0 || t == GT_Q4_1 || t == GT_Q5_0 || t == GT_Q5_1 || t == GT_Q8_0) {
            const int bytes = t == GT_Q4_0 ? 18 : t == GT_Q4_1 ? 20 : t == GT_Q5_0 ? 22
                              : t == GT_Q5_1 ? 24 : 34;
            const int qs = t == GT_Q4_0 ? 2 : t == GT_Q4_1 ? 4 : t == GT_Q5_0 ? 6 : t == GT_Q5_1 ? 8 : 2;
            const uint8_t *base = w + g * GB * bytes;
            const __m512i ix = _mm512_mullo_epi32(lane, _mm512_set1_epi32(bytes));
            const __m512 d = gather_f16(base, ix, live, 0);
            o->s0 = o->s1 = d;
            if (t == GT_Q8_0) {
                for (int k = 0; k < 8; k++)
                    o->q[k] = _mm512_xor_si512(gather4(base, ix, live, qs + 4 * k),
                                               _mm512_maskz_set1_epi32(live, (int)0x80808080));
                o->o0 = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
            } else {
                for (int k = 0; k < 4; k++) {
                    __m512i v = gather4(base, ix, live, qs + 4 * k);
                    o->q[k] = _mm512_and_si512(v, m4);
                    o->q[4 + k] = _mm512_and_si512(_mm512_srli_epi32(v, 4), m4);
                }
                if (t == GT_Q5_0 || t == GT_Q5_1) { /* element 4k + j: bit 4k + j of qh */
                    const __m512i qh = gather4(base, ix, live, qs - 4);
                    for (int k = 0; k < 8; k++)
                        o->q[k] = _mm512_or_si512(o->q[k], _mm512_maskz_mov_epi32(
                            live, spread4(_mm512_srli_epi32(qh, 4 * k))));
                }
                if (t == GT_Q4_1 || t == GT_Q5_1) o->o0 = gather_f16(base, ix, live, 2);
                else o->o0 = _mm512_mul_ps(d, _mm512_set1_ps(t == GT_Q4_0 ? -8.0f : -16.0f));
            }
            o->o1 = o->o0;
            continue;
        }
        /* K-quants: lane i is sub-block j = i % 8 of superblock 2 g + i / 8 */
        const __m512i sub = _mm512_and_si512(lane, _mm512_set1_epi32(7));
        const __m512i sup = _mm512_srli_epi32(lane, 3);
        float s0[GB] = {0}, s1[GB] = {0}, o0[GB] = {0}, o1[GB] = {0};
        if (t == GT_Q4_K || t == GT_Q5_K) {
            const int bytes = t == GT_Q4_K ? 144 : 176, qs = t == GT_Q4_K ? 16 : 48;
            const uint8_t *base = w + g * 2 * bytes;
            for (int64_t i = 0; i < n; i += 8) {
                const uint8_t *b = base + (i / 8) * bytes;
                uint8_t sm[16];
                const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
                uint32_t u[4];
                memcpy(u, b + 4, 12); /* llama.cpp's get_scale_min_k4, 4 at a time */
                u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
                const uint32_t lo = u[1] & k1;
                u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
                u[2] = lo;
                u[0] &= k1;
                memcpy(sm, u, 16);
                const float dd = h2f(b), dm = h2f(b + 2);
                for (int j = 0; j < 8; j++)
                    s0[i + j] = s1[i + j] = dd * sm[j], o0[i + j] = o1[i + j] = -dm * sm[8 + j];
            }
            /* quants of sub-block j: the low (j even) or high nibbles of qs chunk j / 2 */
            const __m512i ix = _mm512_add_epi32(
                _mm512_mullo_epi32(sup, _mm512_set1_epi32(bytes)),
                _mm512_add_epi32(_mm512_set1_epi32(qs), _mm512_slli_epi32(_mm512_srli_epi32(sub, 1), 5)));
            const __m512i sh = _mm512_slli_epi32(_mm512_and_si512(sub, _mm512_set1_epi32(1)), 2);
            const __m512i hx = _mm512_add_epi32(_mm512_mullo_epi32(sup, _mm512_set1_epi32(bytes)),
                                                _mm512_set1_epi32(16));
            for (int k = 0; k < 8; k++) {
                o->q[k] = _mm512_and_si512(_mm512_srlv_epi32(gather4(base, ix, live, 4 * k), sh), m4);
                if (t == GT_Q5_K) { /* bit j of qh byte i: the fifth bit of element i */
                    __m512i h = _mm512_srlv_epi32(gather4(base, hx, live, 4 * k), sub);
                    h = _mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x01010101)), 4);
                    o->q[k] = _mm512_or_si512(o->q[k], h);
                }
            }
        } else { /* Q6_K: lane i is group jj = 4 h + t of 32 (elements 128 h + 32 t ..) */
            const uint8_t *base = w + g * 2 * 210;
            for (int64_t i = 0; i < n; i += 8) {
                const uint8_t *b = base + (i / 8) * 210;
                const float dd = h2f(b + 208);
                for (int jj = 0; jj < 8; jj++) {
                    const int hh = jj / 4, tt = jj % 4;
                    s0[i + jj] = dd * (float)(int8_t)b[192 + 8 * hh + 2 * tt];
                    s1[i + jj] = dd * (float)(int8_t)b[192 + 8 * hh + 2 * tt + 1];
                    o0[i + jj] = -32.0f * s0[i + jj], o1[i + jj] = -32.0f * s1[i + jj];
                }
            }
            const __m512i hh = _mm512_srli_epi32(sub, 2), tt = _mm512_and_si512(sub, _mm512_set1_epi32(3));
            const __m512i sb = _mm512_mullo_epi32(sup, _mm512_set1_epi32(210));
            const __m512i ix = _mm512_add_epi32(sb, _mm512_add_epi32(
                _mm512_slli_epi32(hh, 6), _mm512_slli_epi32(_mm512_and_si512(tt, _mm512_set1_epi32(1)), 5)));
            const __m512i sh = _mm512_slli_epi32(_mm512_srli_epi32(tt, 1), 2);
            const __m512i hx = _mm512_add_epi32(sb, _mm512_add_epi32(_mm512_set1_epi32(128),
                                                                     _mm512_slli_epi32(hh, 5)));
            const __m512i hs = _mm512_slli_epi32(tt, 1);
            for (int k = 0; k < 8; k++) {
                __m512i lo4 = _mm512_and_si512(_mm512_srlv_epi32(gather4(base, ix, live, 4 * k), sh), m4);
                __m512i hi2 = _mm512_srlv_epi32(gather4(base, hx, live, 4 * k), hs);
                hi2 = _mm512_slli_epi32(_mm512_and_si512(hi2, _mm512_set1_epi32(0x03030303)), 4);
                o->q[k] = _mm512_or_si512(lo4, hi2);
            }
        }
        o->s0 = _mm512_loadu_ps(s0), o->s1 = _mm512_loadu_ps(s1);
        o->o0 = _mm512_loadu_ps(o0), o->o1 = _mm512_loadu_ps(o1);
    }
}

/* Kinds of canon.h sums: the offset types (two multiply-adds per block), the symmetric ones
 * (their offset c sum q folded into the integer dot: c = 8, 16, 128, 12), Q6_K's two halves. */
enum { K_OFFSET, K_SYM8, K_SYM16, K_SYM128, K_SYM12, K_Q6K };

static inline __m512i times_c(__m512i q, const int kind) { /* c sum q, exactly */
    switch (kind) {
    case K_SYM8: return _mm512_slli_epi32(q, 3);
    case K_SYM16: return _mm512_slli_epi32(q, 4);
    case K_SYM128: return _mm512_slli_epi32(q, 7);
    case K_SYM12: return _mm512_add_epi32(_mm512_slli_epi32(q, 3), _mm512_slli_epi32(q, 2));
    default: return _mm512_slli_epi32(q, 5); /* Q6_K: 32 */
    }
}

/* One row of W (decoded) against rows m0 .. m0 + mt of X: out[m], canon.h's order. */
static inline __attribute__((always_inline)) void dot_tile(const wgroup *wg, const xt_t *X,
                                                           int64_t m0, float *out, const int mt,
                                                           const int kind) {
    const int64_t G = X->groups;
    __m512 acc[MT]; /* one accumulator per row: lane i, block i of each group (registers) */
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    const __m512i z = _mm512_setzero_si512();
    for (int64_t g = 0; g < G; g++) {
        const wgroup *w = wg + g;
#pragma GCC unroll 8 /* fully: the accumulators must live in registers */
        for (int m = 0; m < mt; m++) {
            const __m512i *xq = X->q + ((m0 + m) * G + g) * 8;
            const int64_t at = (m0 + m) * G * GB + g * GB;
            const __m512 dx = _mm512_loadu_ps(X->d + at);
            if (kind != K_Q6K) {
                __m512i p = _mm512_dpbusd_epi32(z, w->q[0], xq[0]);
                for (int k = 1; k < 8; k++) p = _mm512_dpbusd_epi32(p, w->q[k], xq[k]);
                if (kind != K_OFFSET)
                    p = _mm512_sub_epi32(p, times_c(_mm512_loadu_si512(X->qs + at), kind));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(w->s0, dx), acc[m]);
                if (kind == K_OFFSET)
                    acc[m] = _mm512_fmadd_ps(w->o0, _mm512_loadu_ps(X->s + at), acc[m]);
            } else {
                __m512i p0 = _mm512_dpbusd_epi32(z, w->q[0], xq[0]);
                __m512i p1 = _mm512_dpbusd_epi32(z, w->q[4], xq[4]);
                for (int k = 1; k < 4; k++) {
                    p0 = _mm512_dpbusd_epi32(p0, w->q[k], xq[k]);
                    p1 = _mm512_dpbusd_epi32(p1, w->q[4 + k], xq[4 + k]);
                }
                p0 = _mm512_sub_epi32(p0, times_c(_mm512_loadu_si512(X->qa + at), kind));
                p1 = _mm512_sub_epi32(p1, times_c(_mm512_loadu_si512(X->qb + at), kind));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(w->s0, dx), acc[m]);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_mul_ps(w->s1, dx), acc[m]);
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) out[m] = canon_reduce512(acc[m]);
}

static void dot_rows(const wgroup *wg, const xt_t *X, int64_t m0, float *out, int mt, int kind) {
#define TILE(n, k)                                                                              \
    case n: dot_tile(wg, X, m0, out, n, k); break;
#define KIND(k)                                                                                 \
    case k:                                                                                     \
        switch (mt) { TILE(1, k) TILE(2, k) TILE(3, k) TILE(4, k) TILE(5, k) TILE(6, k)         \
                      TILE(7, k) default: TILE(8, k) }                                          \
        break;
    switch (kind) { KIND(K_OFFSET) KIND(K_SYM8) KIND(K_SYM16) KIND(K_SYM128) KIND(K_SYM12)
                    default: KIND(K_Q6K) }
#undef KIND
#undef TILE
}

/* X (M, K) -> the transposed quantized form (one allocation, freed by the caller). */
static char *prepare(const void *x, int64_t M, int64_t K, int dt, int nthreads, xt_t *X) {
    const int64_t nb = K / 32, G = (nb + GB - 1) / GB, nbp = QX_NBP(K);
    const size_t qt = (size_t)(M * G) * 512, fl = (size_t)(M * G * GB) * 4 * 7; /* 4 f, 3 i */
    const size_t row = (size_t)K * 4 + (size_t)K + (size_t)nbp * 4 * (QX_FLOATS + QX_INTS); /* per-thread scratch */
    char *buf = (char *)aligned_alloc(64, (qt + fl + 64) / 64 * 64);
    if (!buf) return NULL;
    memset(buf + qt, 0, fl);
    float *d = (float *)(buf + qt), *s = d + M * G * GB;
    int32_t *qs = (int32_t *)(s + M * G * GB), *qa = qs + M * G * GB, *qb = qa + M * G * GB;
    *X = (xt_t){.q = (const __m512i *)buf, .d = d, .s = s, .qs = qs, .qa = qa, .qb = qb, .groups = G};
    int bad = 0;
#pragma omp parallel num_threads(nthreads < 1 ? 1 : nthreads) reduction(| : bad)
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
            int32_t *t = (int32_t *)(buf + (size_t)(m * G) * 512); /* (G, 8, 16) int32 */
            memset(t, 0, (size_t)G * 512);
            for (int64_t b = 0; b < nb; b++) {
                const int64_t g = b / GB, i = b % GB, at = m * G * GB + b;
                for (int k = 0; k < 8; k++) memcpy(t + (g * 8 + k) * GB + i, q + 32 * b + 4 * k, 4);
                d[at] = f[b], s[at] = f[nbp + b];
                qs[at] = qi[b], qa[at] = qi[nbp + 2 * b], qb[at] = qi[nbp + 2 * b + 1];
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

/* qgemm_drive.h's hooks: every block type, each its kind of canon.h sum */
static inline int qgemm_takes(int64_t t) { (void)t; return 1; }
static inline void qgemm_dot(const wgroup *wg, const xt_t *X, int64_t m0, float *out, int mt,
                             int64_t t) {
    const int kind = t == GT_Q4_0 ? K_SYM8 : t == GT_Q5_0 ? K_SYM16
                     : t == GT_Q8_0 || t == GT_Q8_0X ? K_SYM128
                     : t == GT_MXFP4 ? K_SYM12 : t == GT_Q6_K ? K_Q6K : K_OFFSET;
    dot_rows(wg, X, m0, out, mt, kind);
}

#include "qgemm_drive.h"
#endif

int tandem_qgemm(const void *x, const tq_part *parts, int64_t nparts, const float *bias, void *y,
                 int64_t M, int64_t K, int dt, int nthreads) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
    return qgemm_drive(x, parts, nparts, bias, y, M, K, dt, nthreads);
#else
    (void)x; (void)parts; (void)nparts; (void)bias; (void)y; (void)M; (void)K; (void)dt;
    (void)nthreads;
    return -2;
#endif
}
