/* The 256-bit kernels of the quantized GEMV (AVX2 + FMA + F16C; VPDPBUSD where the CPU has
 * AVX-VNNI or AVX512-VNNI): one row of W against the M <= 4 quantized rows of X (qx.h), each
 * output summed in canon.h's order (so it is bit-for-bit what qgemm256.c, and the AVX-512
 * kernels, give for that row): per group of 8 blocks exact integer dots, then one convert and
 * one or two multiply-adds per row of X. Included by qgemv.c (via qdot512.h) and qgemm256.c. */
#ifndef TANDEM_QDOT256_H
#define TANDEM_QDOT256_H
#include "canon.h"
#include "qx.h"
#include "quant.h"

enum { QMAX_ROWS = 4, QMAX_NR = 4 }; /* rows of X; rows of W one multi-row decode step takes */

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_DPBUSD 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define HAVE_DPBUSD 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define HAVE_DPBUSD 0
/* u8 x s8 pairs to int16 (no saturation: |u| <= 128, |s| <= 127, 2 * 128 * 127 < 2^15), then
 * pairs of int16 to int32. */
static inline __m256i dpbusd_avx2(__m256i acc, __m256i u, __m256i s) {
    __m256i p = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#define DPBUSD(acc, u, s) dpbusd_avx2(acc, u, s)
#endif

/* Software prefetch of the weight bytes [p + QPREFETCH, + n) into L1. Measured on a Xeon (one
 * thread, a 151 MB Q4_0 matrix streamed from DRAM against a plain read of it): without, 53-57% of
 * the read; 1 KB ahead 72-78%; 2 KB 81-89%; 4 KB 87-94%; 8 KB 86-87%. The hardware prefetcher
 * alone does not run far enough ahead of a loop that spends this long per cache line. */
#ifndef QPREFETCH
#define QPREFETCH 4096
#endif
static inline void prefetch_span(const uint8_t *p, int64_t n) {
    /* inline asm: GCC's vectorizer drops __builtin_prefetch from the loops it vectorizes */
    for (int64_t i = 0; i < n; i += 64) __asm__ volatile("prefetcht0 %0" ::"m"(p[QPREFETCH + i]));
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Eight float16 scales `stride` bytes apart from p as float32 lanes; lanes >= n are 0. */
static inline __m256 load_f16x8(const uint8_t *p, int64_t stride, int n) {
    if (n == 8) {
        uint16_t h0, h1, h2, h3, h4, h5, h6, h7;
        memcpy(&h0, p, 2); memcpy(&h1, p + stride, 2); memcpy(&h2, p + 2 * stride, 2);
        memcpy(&h3, p + 3 * stride, 2); memcpy(&h4, p + 4 * stride, 2);
        memcpy(&h5, p + 5 * stride, 2); memcpy(&h6, p + 6 * stride, 2);
        memcpy(&h7, p + 7 * stride, 2);
        return _mm256_cvtph_ps(_mm_setr_epi16((short)h0, (short)h1, (short)h2, (short)h3,
                                              (short)h4, (short)h5, (short)h6, (short)h7));
    }
    uint16_t h[8] = {0};
    for (int i = 0; i < n; i++) memcpy(&h[i], p + i * stride, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* Q4_1 / Q5_1: the float16 pairs (d, m) at the start of 8 blocks `stride` bytes apart, gathered
 * as 8 words at once, as float32 lanes *d and *m. */
static inline void load_dm_f16x8(const uint8_t *p, int64_t stride, __m256 *d, __m256 *m) {
    uint32_t w[8];
    for (int i = 0; i < 8; i++) memcpy(&w[i], p + i * stride, 4);
    __m256i v = _mm256_setr_epi32((int)w[0], (int)w[1], (int)w[2], (int)w[3], (int)w[4], (int)w[5],
                                  (int)w[6], (int)w[7]);
    const __m256i dm = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4,
                                        5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, dm), _MM_SHUFFLE(3, 1, 2, 0));
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
}

/* 32 bits to 32 bytes: byte j is 0x10 where bit j is set, else 0 (Q5's fifth bit). */
static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8((__mmask32)u, _mm256_set1_epi8(0x10));
#else
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)u), shuf);
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
#endif
}

/* int32 lanes of sum u*x over the bytes of (lo, xlo) and (hi, xhi) pairwise: u unsigned, at most
 * 31 (4-5 bit quants), x int8 with |x| <= 127, so VPMADDUBSW's int16 pair sums (<= 2 * 31 * 127)
 * and their sum over the two (< 2^14) never saturate. */
static inline __m256i dot2_u(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
#if HAVE_DPBUSD
    return DPBUSD(DPBUSD(_mm256_setzero_si256(), lo, xlo), hi, xhi);
#else
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

/* dot2_u before its widening (no VPDPBUSD): int16 lanes of pair sums, for u <= 15 at most
 * 2 (2 * 15 * 127) = 7620, so four of them still add exactly in int16 (<= 30480). */
static inline __m256i dot2_u16(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
}


/* MXFP4 scales 2^(e - 128) (quant.h's tq_e8m0_half) of int32 lanes e, 8 at a time. */
static inline __m256 e8m0_half8(__m256i e) {
    const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(
        _mm256_blendv_epi8(big, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}


/* Q4_K / Q5_K's 12 bytes of packed 6-bit scales and mins (llama.cpp's get_scale_min_k4): the 8
 * scales as bytes 0-7 of u, the 8 mins as bytes 8-15. */
/* 32 bytes of Q4_K / Q5_K quants: the low nibbles (sub-block 2j) to *lo, the high nibbles
 * (sub-block 2j + 1) to *hi; for Q5_K (q5) each takes its fifth bit from bits 0 and 1 of each
 * byte of *hb, which then moves on to the next pair (shifted down 2). */
static inline __attribute__((always_inline)) void kq_nibbles(__m256i raw, int q5, __m256i *hb,
                                                             __m256i *lo, __m256i *hi) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
    *lo = _mm256_and_si256(raw, lo4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
    if (q5) { /* bit 2j of each qh byte, then bit 2j + 1, to bit 4 */
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi16(*hb, 4), b4));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_slli_epi16(*hb, 3), b4));
        *hb = _mm256_srli_epi16(*hb, 2);
    }
}

/* Q6_K: 64 bytes of low nibbles (A, B) and 32 of high bit pairs (C) of one half of a superblock
 * -> its four runs of 32 six-bit quants (0..63), in element order. */
static inline __attribute__((always_inline)) void q6k_quants(__m256i A, __m256i B, __m256i C,
                                                             __m256i q[4]) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    q[0] = _mm256_or_si256(_mm256_and_si256(A, lo4), _mm256_and_si256(_mm256_slli_epi16(C, 4), m30));
    q[1] = _mm256_or_si256(_mm256_and_si256(B, lo4), _mm256_and_si256(_mm256_slli_epi16(C, 2), m30));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), lo4), _mm256_and_si256(C, m30));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), lo4),
                           _mm256_and_si256(_mm256_srli_epi16(C, 2), m30));
}

static inline void kquant_scales(const uint8_t *p, uint32_t u[4]) {
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    memcpy(u, p, 12);
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t mins_lo = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = mins_lo;
    u[0] &= k1;
}

static inline __m256 u8x8_to_ps(const void *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* ---- canon.h's order on 256-bit lanes ----
 * Per row of X two float accumulators, lo (canon.h's lanes 0-7) and hi (lanes 8-15). The
 * blocks of 32 (K-quant sub-blocks, Q6_K groups of 32) go in groups of 8, group g / 8 even into
 * lo and odd into hi, so block b lands in lane b % 16 and each lane takes its blocks in order.
 * Per group and row of X the integer dots come out of VPDPBUSD (or VPMADDUBSW + VPMADDWD) as
 * partial sums, and rounds of VPHADDD (VPHADDW while int16 is exact, then one VPMADDWD; plus
 * one lane permutation) add them exactly into one int32 per block, block i of the group in lane
 * i; the symmetric types' offsets are folded in exactly (I = U - c sum q, qx.h's q32 / q16, or
 * signed operands), and the float work is one convert, one product s * dx and canon.h's one or
 * two FMAs per group of 8 blocks and row of X (before: a convert and a multiply-add per block or
 * pair of blocks). Lanes past a row's last block add nothing: scale 0 (and offset 0), I 0, and
 * qx.h's dx 0 there. */

/* VPHADDD(VPHADDD(v0, v1), VPHADDD(v2, v3)) of four vectors v_j whose lanes 0-3 hold partial
 * sums of block 2j and lanes 4-7 of block 2j + 1 (the pair kernels' integer dots) leaves the
 * blocks' sums in the lane order 0 2 4 6 1 3 5 7; given its two inner VPHADDDs, block i in
 * lane i. */
static inline __m256i sum_pairs(__m256i h01, __m256i h23) {
    return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h01, h23),
                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* sum_pairs of dot2_u16's int16 lanes (u <= 15), given h01 = VPHADDW(v0, v1) and h23 =
 * VPHADDW(v2, v3): one more VPHADDW (each lane 4 pair sums, exact), then one VPMADDWD widens
 * them, instead of a VPMADDWD per pair and VPHADDDs. */
static inline __m256i sum_pairs16(__m256i h01, __m256i h23) {
    return _mm256_permutevar8x32_epi32(
        _mm256_madd_epi16(_mm256_hadd_epi16(h01, h23), _mm256_set1_epi16(1)),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Pair j (0-3) of a group of 8 blocks into one row's exact block sums, as dot2_u (w16:
 * dot2_u16) gives it: an even pair waits in *v0, pair 1 leaves VPHADD(v0, v1) in *h01, pair 3
 * the group's sums in *U (sum_pairs / sum_pairs16: block i in lane i). */
static inline __attribute__((always_inline)) void fold_pair(const int j, __m256i v, const int w16,
                                                            __m256i *v0, __m256i *h01,
                                                            __m256i *U) {
    if (j % 2 == 0) {
        *v0 = v;
        return;
    }
    const __m256i h = w16 ? _mm256_hadd_epi16(*v0, v) : _mm256_hadd_epi32(*v0, v);
    if (j == 1)
        *h01 = h;
    else
        *U = w16 ? sum_pairs16(*h01, h) : sum_pairs(*h01, h);
}

/* Eight vectors p_i of 8 partial sums of block i each, given as a = VPHADDD(VPHADDD(p0, p1),
 * VPHADDD(p2, p3)) (lanes 0-3: blocks 0-3's sums over their low 4 lanes, 4-7: over their high
 * 4) and c the same of p4 .. p7: block i's sum in lane i. */
static inline __m256i sum_eight(__m256i a, __m256i c) {
    return _mm256_add_epi32(_mm256_blend_epi32(a, c, 0xF0), _mm256_permute2x128_si256(a, c, 0x21));
}

/* canon.h's first multiply-add of a group of 8 blocks and a row of X: acc + I (s dx). */
static inline __m256 canon_fma(__m256 acc, __m256i I, __m256 s, __m256 dx) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(s, dx), acc);
}

/* One block of 32 at b in element order (the natural layout): the unsigned operand of its
 * integer dot and the bytes whose signs go onto x (*sg), so that the dot is I exactly: Q8_0 |w|
 * (w = -128 as the byte 128) with w's signs, MXFP4 |kv| with kv's, Q4_0 / Q5_0 |v| with v's (v =
 * u - 8, u - 16); Q4_1 / Q5_1 u (and no signs). So the natural-layout path reads only X's nat,
 * d and s (qdot512.h runs it on views of X that set only those). */
static inline __attribute__((always_inline)) __m256i b32_decode(const int t, const uint8_t *b,
                                                                __m256i *sg) {
    if (t == GT_Q8_0) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 2));
        *sg = w;
        return _mm256_sign_epi8(w, w);
    }
    const int64_t qs = t == GT_MXFP4 ? 1 : t == GT_Q4_0 ? 2 : t == GT_Q4_1 ? 4 : t == GT_Q5_0 ? 6 : 8;
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + qs));
    __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    *sg = u;
    if (t == GT_MXFP4) {
        *sg = _mm256_shuffle_epi8(_mm256_setr_epi8(TQ_MXFP4_KV, TQ_MXFP4_KV), u);
        return _mm256_shuffle_epi8(_mm256_setr_epi8(TQ_MXFP4_ABS, TQ_MXFP4_ABS), u);
    }
    if (t == GT_Q5_0 || t == GT_Q5_1) u = _mm256_or_si256(u, fifth_bits(b + qs - 4));
    if (t == GT_Q4_0 || t == GT_Q5_0) {
        *sg = _mm256_sub_epi8(u, _mm256_set1_epi8(t == GT_Q4_0 ? 8 : 16));
        return _mm256_abs_epi8(*sg);
    }
    return u;
}

/* The scales s (and Q4_1 / Q5_1's offsets o = m) of the n <= 8 blocks at blk; lanes >= n 0. A
 * partial group (a row's last blocks) gathers block 0's again for the lanes past the row and
 * zeroes them, all in registers. */
static inline __attribute__((always_inline)) void b32_scales(const int t, const uint8_t *blk,
                                                             int64_t bytes, int n, __m256 *s,
                                                             __m256 *o) {
    *o = _mm256_setzero_ps();
    if (n == 8 && t != GT_MXFP4) {
        if (t == GT_Q4_1 || t == GT_Q5_1)
            load_dm_f16x8(blk, bytes, s, o);
        else
            *s = load_f16x8(blk, bytes, 8);
        return;
    }
    uint32_t w[8]; /* each block's first 4 bytes: d (and m), or MXFP4's e */
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) memcpy(&w[i], blk + (i < n ? i : 0) * bytes, 4);
    const __m256i v = _mm256_setr_epi32((int)w[0], (int)w[1], (int)w[2], (int)w[3], (int)w[4],
                                        (int)w[5], (int)w[6], (int)w[7]);
    const __m256 keep = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    if (t == GT_MXFP4) {
        *s = _mm256_and_ps(e8m0_half8(_mm256_and_si256(v, _mm256_set1_epi32(0xff))), keep);
        return;
    }
    *s = _mm256_and_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(
                           _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                   0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1)),
                           _MM_SHUFFLE(3, 1, 2, 0)))),
                       keep);
    if (t == GT_Q4_1 || t == GT_Q5_1)
        *o = _mm256_and_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(
                               _mm256_shuffle_epi8(v, _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                       2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)),
                               _MM_SHUFFLE(3, 1, 2, 0)))),
                           keep);
}

/* The integer dots I of the n <= 8 blocks at blk (blocks g .. g + n - 1; lanes >= n 0), one
 * block per VPDPBUSD over the natural layout, summed by sum_eight as they come (n < 8: a row's
 * last blocks, whatever the kernel). */
static inline __attribute__((always_inline)) void b32_dots8(const int t, const uint8_t *blk,
                                                            int64_t bytes, int64_t g, int n,
                                                            const xq_t *X, __m256i *U,
                                                            const int M) {
    /* Q8_0 with VPDPBUSD: w + 128 (w XOR 0x80) against x, I = U - 128 sum q (VPMADDUBSW
     * would saturate on 255 x 127 pairs) */
    const int off = t == GT_Q8_0 && HAVE_DPBUSD;
    const int sgn = t != GT_Q4_1 && t != GT_Q5_1 && !off;
    const __m256i z = _mm256_setzero_si256();
    __m256i p0[QMAX_ROWS], h[QMAX_ROWS], a[QMAX_ROWS];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        __m256i sg = z, u = z;
        if (i < n && off)
            u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + i * bytes + 2)),
                                 _mm256_set1_epi8((char)0x80));
        else if (i < n)
            u = b32_decode(t, blk + i * bytes, &sg);
        for (int m = 0; m < M; m++) {
            __m256i p = z;
            if (i < n) {
                __m256i xm = _mm256_loadu_si256((const __m256i *)(X->nat + m * X->K + 32 * (g + i)));
                if (sgn) xm = _mm256_sign_epi8(xm, sg);
                p = DPBUSD(z, u, xm);
            }
            if (i % 2 == 0) {
                p0[m] = p;
            } else if (i % 4 == 1) {
                h[m] = _mm256_hadd_epi32(p0[m], p);
            } else {
                const __m256i r = _mm256_hadd_epi32(h[m], _mm256_hadd_epi32(p0[m], p));
                if (i == 3)
                    a[m] = r;
                else
                    U[m] = sum_eight(a[m], r);
            }
        }
    }
    if (off) /* lanes past the row: q32's padding is 0 */
        for (int m = 0; m < M; m++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(X->q32 + m * X->nbp + g));
            U[m] = _mm256_sub_epi32(U[m], _mm256_slli_epi32(q, 7));
        }
}

/* Q4_0, Q4_1, Q5_0, Q5_1 two blocks per step over the i32 layout of X (qx.h): the 16 qs bytes
 * of blocks A and B side by side in one register hold A's elements 0-15 and B's 0-15 in their
 * low nibbles and elements 16-31 in their high ones, which the i32 layout puts at +0 and +64,
 * so one integer dot (two VPDPBUSD) gives both blocks' partial sums (lanes 0-3: A, 4-7: B);
 * MXFP4 likewise with |kv| by a byte shuffle (VPSHUFB) as the unsigned operand and kv's sign
 * (bit 3 of the code) moved onto x by VPSIGNB, so sum |kv| sign(kv) q = sum kv q exactly. The
 * MXFP4 sign needs no decode: bit 7 of each byte of raw << 4 is bit 3 of its low code, bit 7 of
 * raw that of its high one, and a byte whose code is 0 or 8 may sign x any way (|kv| = 0).
 * |kv| <= 12, so dot2_u's VPMADDUBSW bound holds. The 4 pairs' dots of 8 whole blocks summed
 * by sum_pairs (sum_pairs16 where u <= 15 and there is no VPDPBUSD) as they come, into I: U, or
 * U - 8 sum q (Q4_0), U - 16 sum q (Q5_0). The pairing itself, measured single-thread on an AVX2
 * EPYC (Zen 3) before canon.h's order, a cache-resident 256 x 1024 Q4_0 weight
 * (scripts/bench/qgemv_micro.c): 1.53 -> 1.11 ns per block of 32 at 1 row of X, 3.46 -> 2.65
 * at 4. */
static inline __attribute__((always_inline)) void b32_pair_dots8(const int t, const uint8_t *blk,
                                                                 int64_t bytes, int64_t g,
                                                                 const xq_t *X, __m256i *U,
                                                                 const int M) {
    const int64_t qs = t == GT_MXFP4 ? 1 : t == GT_Q4_0 ? 2 : t == GT_Q4_1 ? 4 : t == GT_Q5_0 ? 6 : 8;
    const int five = t == GT_Q5_0 || t == GT_Q5_1, mx = t == GT_MXFP4;
    const int w16 = !HAVE_DPBUSD && !five; /* u <= 15: sum_pairs16 */
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    const __m256i ka = _mm256_setr_epi8(TQ_MXFP4_ABS, TQ_MXFP4_ABS);
    __m256i v0[QMAX_ROWS], h01[QMAX_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) { /* blocks g + 2j (A) and g + 2j + 1 (B) */
        const uint8_t *a = blk + 2 * j * bytes, *b = a + bytes;
        const __m256i raw = _mm256_loadu2_m128i((const __m128i *)(b + qs), (const __m128i *)(a + qs));
        __m256i lo = _mm256_and_si256(raw, lo4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
        if (five) { /* fifth bits: elements 0-15 of A and B, then 16-31 */
            uint32_t ha, hb;
            memcpy(&ha, a + qs - 4, 4), memcpy(&hb, b + qs - 4, 4);
            const uint32_t l = (ha & 0xffffu) | hb << 16, h = ha >> 16 | (hb & 0xffff0000u);
            lo = _mm256_or_si256(lo, fifth_bits((const uint8_t *)&l));
            hi = _mm256_or_si256(hi, fifth_bits((const uint8_t *)&h));
        }
        const __m256i slo = _mm256_slli_epi16(raw, 4); /* MXFP4's signs: bit 7 */
        if (mx) lo = _mm256_shuffle_epi8(ka, lo), hi = _mm256_shuffle_epi8(ka, hi);
        const int64_t xo = 32 * g + 128 * (j >> 1) + 32 * (j & 1); /* i32: A lo, B lo at +0 */
        for (int m = 0; m < M; m++) {
            const int8_t *xm = X->i32 + m * X->K + xo;
            __m256i xl = _mm256_loadu_si256((const __m256i *)xm);
            __m256i xh = _mm256_loadu_si256((const __m256i *)(xm + 64));
            if (mx) xl = _mm256_sign_epi8(xl, slo), xh = _mm256_sign_epi8(xh, raw);
            fold_pair(j, w16 ? dot2_u16(lo, xl, hi, xh) : dot2_u(lo, xl, hi, xh), w16, &v0[m],
                      &h01[m], &U[m]);
        }
    }
    if (t == GT_Q4_0 || t == GT_Q5_0)
        for (int m = 0; m < M; m++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(X->q32 + m * X->nbp + g));
            U[m] = _mm256_sub_epi32(U[m], _mm256_slli_epi32(q, t == GT_Q4_0 ? 3 : 4));
        }
}

/* One group of the n <= 8 blocks at blocks g .. g + n - 1 of a row into acc (lo or hi) of each
 * row of X: acc = fma(I, s dx, acc), then for Q4_1 / Q5_1 acc = fma(m, dx sum q, acc). */
static inline __attribute__((always_inline)) void b32_group(const int t, const int pairs,
                                                            const uint8_t *blk, int64_t bytes,
                                                            int64_t g, int n, const xq_t *X,
                                                            __m256 *acc, const int M) {
    prefetch_span(blk, n * bytes);
    __m256 s, o;
    b32_scales(t, blk, bytes, n, &s, &o);
    __m256i I[QMAX_ROWS];
    if (pairs && n == 8)
        b32_pair_dots8(t, blk, bytes, g, X, I, M);
    else
        b32_dots8(t, blk, bytes, g, n, X, I, M);
    for (int m = 0; m < M; m++) {
        const int64_t at = m * X->nbp + g;
        acc[m] = canon_fma(acc[m], I[m], s, _mm256_loadu_ps(X->d + at));
        if (t == GT_Q4_1 || t == GT_Q5_1)
            acc[m] = _mm256_fmadd_ps(o, _mm256_loadu_ps(X->s + at), acc[m]);
    }
}

/* The 32-element block types, canon.h's order (module section above), groups of 8 blocks
 * alternately into lo and hi. pairs: the integer dots two blocks per step over the i32 layout
 * (Q4_0, Q4_1, Q5_0, Q5_1, MXFP4; b32_pair_dots8), else one block per step over the natural
 * one (Q8_0; b32_dots8). A row's last K/32 % 8 blocks (a partial group) go one at a time over
 * the natural layout (b32_dots8 with n < 8). Measured single-thread on a Sapphire Rapids Xeon
 * built -march=haswell (no VNNI), cache-resident 2048 x 2048, time against the kernels before
 * canon.h's order (per block or pair a convert and a multiply-add, 8 lanes), 1 / 4 rows of X:
 * Q4_0 0.95x / 0.88x, Q4_1 0.86x / 0.87x, Q8_0 0.98x / 0.85x; 2880 x 2880 (a partial group of
 * 2 blocks per row): Q4_0 1.00x / 0.93x, Q5_0 1.03x / 0.91x, MXFP4 1.04x / 1.03x. */
static inline __attribute__((always_inline)) void dot_b32_any(const int t, const int pairs,
                                                              const uint8_t *wr, const xq_t *X,
                                                              float *out, const int M) {
    const int64_t bytes = tq_block_bytes(t), nb = X->K / 32;
    __m256 lo[QMAX_ROWS], hi[QMAX_ROWS];
    for (int m = 0; m < M; m++) lo[m] = hi[m] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= nb; g += 16) { /* whole pairs of groups: straight-line code */
        b32_group(t, pairs, wr + g * bytes, bytes, g, 8, X, lo, M);
        b32_group(t, pairs, wr + (g + 8) * bytes, bytes, g + 8, 8, X, hi, M);
    }
    if (g < nb) b32_group(t, pairs, wr + g * bytes, bytes, g, nb - g < 8 ? (int)(nb - g) : 8, X, lo, M);
    if (g + 8 < nb) b32_group(t, pairs, wr + (g + 8) * bytes, bytes, g + 8, (int)(nb - g - 8), X, hi, M);
    for (int m = 0; m < M; m++) out[m] = canon_reduce16(lo[m], hi[m]);
}

/* Q8_0 (and any 32-element type) one block per integer dot over the natural layout. */
static inline __attribute__((always_inline)) void dot_b32(const int t, const uint8_t *wr,
                                                          const xq_t *X, float *out, const int M) {
    dot_b32_any(t, 0, wr, X, out, M);
}

/* Q4_0, Q4_1, Q5_0, Q5_1 two blocks per integer dot over the i32 layout. */
static inline __attribute__((always_inline)) void dot_b32_pairs(const int t, const uint8_t *wr,
                                                                const xq_t *X, float *out,
                                                                const int M) {
    dot_b32_any(t, 1, wr, X, out, M);
}

/* MXFP4 (17-byte blocks: E8M0 byte e, 16 bytes of 4-bit codes, w = 2^(e - 128) kv[code]) as
 * dot_b32_pairs runs Q4_0, signed (I = sum kv q, no offset). Against Q4_0 (2880 x 2880, the
 * Sapphire Rapids built -march=haswell, one thread): 1 row 1.35x its time, 4 rows 1.25x, 64 rows
 * (qgemm256.c) 1.0x; the difference is the VPSIGNBs per row and the |kv| shuffles (an offset
 * form, u = kv + 12 and I = U - 12 sum q, saves the signs but its u <= 24 leaves the int16
 * reduction of sum_pairs16). */
static inline __attribute__((always_inline)) void dot_mxfp4(const uint8_t *wr, const xq_t *X,
                                                            float *out, const int M) {
    dot_b32_any(GT_MXFP4, 1, wr, X, out, M);
}

/* GT_Q8_0X (quant.h) against X's t16 layout, 256 bits at a time: per group of 16 blocks its
 * halves (blocks 0-7 into lo, 8-15 into hi, canon.h's lanes), each 8 integer dots over 32-byte
 * vectors whose lane i is block i alone, so the chain leaves block i's exact dot in lane i: with
 * VPDPBUSD U = sum (w + 128) q and I = U - 128 sum q; without, w = byte XOR 0x80 signed and
 * VPMADDUBSW of |w| against q with w's signs (pairs <= 2 128 127, exact) then VPMADDWD, I =
 * sum w q. Then acc = fma(I, s dx, acc): the same bits as dot_b32 on the rows before repacking. A
 * half of nh < 8 live blocks loads its runs (4 n bytes apart) masked; a half with none adds
 * nothing and is skipped, as dot_b32_any skips it. */
static inline __attribute__((always_inline)) void dot_q8_0x(const uint8_t *wr, const xq_t *X,
                                                            float *out, const int M) {
    const int64_t nb = X->K / 32, nbp = X->nbp, T = QX_T16(X->K);
    const __m256i z = _mm256_setzero_si256(), flip = _mm256_set1_epi8((char)0x80);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 acc[2][QMAX_ROWS];
    for (int m = 0; m < M; m++) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int64_t n = nb - b0 < 16 ? nb - b0 : 16;
        const uint8_t *qg = wr + 2 * nb + 32 * b0;
        prefetch_span(wr + 34 * b0, 34 * n); /* the row's share: every line once */
        for (int h = 0; h < 2; h++) {
            const int64_t nh = n - 8 * h < 8 ? n - 8 * h : 8;
            if (nh <= 0) break;
            const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nh), lane);
            __m128i sh = _mm_setzero_si128();
            if (nh == 8)
                sh = _mm_loadu_si128((const __m128i *)(wr + 2 * (b0 + 8 * h)));
            else
                memcpy(&sh, wr + 2 * (b0 + 8 * h), (size_t)(2 * nh));
            const __m256 sd = _mm256_cvtph_ps(sh);
            __m256i u[8];
            for (int k = 0; k < 8; k++) {
                const uint8_t *p = qg + 4 * n * k + 32 * h;
                u[k] = nh == 8 ? _mm256_loadu_si256((const __m256i *)p)
                               : _mm256_maskload_epi32((const int *)p, live);
#if !HAVE_DPBUSD
                u[k] = _mm256_xor_si256(u[k], flip); /* signed w */
#endif
            }
            for (int m = 0; m < M; m++) {
                const int8_t *xt = X->t16 + m * T + 32 * b0 + 32 * h;
                __m256i a0 = z, a1 = z;
                for (int k = 0; k < 8; k += 2) {
                    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xt + 64 * k));
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xt + 64 * k + 64));
#if HAVE_DPBUSD
                    a0 = DPBUSD(a0, u[k], x0), a1 = DPBUSD(a1, u[k + 1], x1);
#else
                    const __m256i one = _mm256_set1_epi16(1);
                    a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(
                        _mm256_abs_epi8(u[k]), _mm256_sign_epi8(x0, u[k])), one));
                    a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_maddubs_epi16(
                        _mm256_abs_epi8(u[k + 1]), _mm256_sign_epi8(x1, u[k + 1])), one));
#endif
                }
                __m256i I = _mm256_add_epi32(a0, a1);
#if HAVE_DPBUSD
                const __m256i q = _mm256_loadu_si256((const __m256i *)(X->q32 + m * nbp + b0 + 8 * h));
                I = _mm256_sub_epi32(I, _mm256_slli_epi32(q, 7));
#endif
                acc[h][m] = canon_fma(acc[h][m], I, sd, _mm256_loadu_ps(X->d + m * nbp + b0 + 8 * h));
            }
        }
    }
    (void)flip;
    for (int m = 0; m < M; m++) out[m] = canon_reduce16(acc[0][m], acc[1][m]);
}

/* Q4_K / Q5_K superblock sb (one group of 8 sub-blocks, lane j: sub-block j) into acc of each
 * row of X: the 32 qs bytes of sub-blocks 2j (low nibbles) and 2j + 1 (high) rearranged, by two
 * 128-bit lane swaps, into [2j elements 0-15 | 2j+1 elements 0-15] and [elements 16-31 of
 * both], against the i32 layout of X (qx.h), so one integer dot gives both sub-blocks' partial
 * sums (lanes 0-3, 4-7), summed by sum_pairs (Q4_K without VPDPBUSD: sum_pairs16); then acc =
 * fma(U, (sc_j d) dx, acc) and acc = fma(m_j (-dmin), dx sum q, acc). The pairing, measured
 * single-thread on an AVX2 EPYC (Zen 3) before canon.h's order against one sub-block at a time,
 * a cache-resident 256 x 1024 Q4_K weight (scripts/bench/qgemv_micro.c): 11.4 -> 11.0 ns per
 * superblock at 1 row of X, 26.3 -> 24.0 at 4; the scale decode is ~3 ns of the 11. */
static inline __attribute__((always_inline)) void k45_group(const int t, const uint8_t *b,
                                                            int64_t sb, const xq_t *X,
                                                            __m256 *acc, const int M) {
    const int64_t bytes = t == GT_Q4_K ? 144 : 176, qs_at = t == GT_Q4_K ? 16 : 48;
    prefetch_span(b, bytes);
    uint32_t u[4];
    kquant_scales(b + 4, u);
    const __m256 dsc = _mm256_mul_ps(u8x8_to_ps(u), _mm256_set1_ps(f16(b)));
    const __m256 dmn = _mm256_mul_ps(u8x8_to_ps(u + 2), _mm256_set1_ps(-f16(b + 2)));
    __m256i hb = _mm256_setzero_si256();
    if (t == GT_Q5_K) hb = _mm256_loadu_si256((const __m256i *)(b + 16));
    __m256i v0[QMAX_ROWS], h01[QMAX_ROWS], U[QMAX_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m256i lo, hi;
        kq_nibbles(_mm256_loadu_si256((const __m256i *)(b + qs_at + 32 * j)), t == GT_Q5_K, &hb,
                   &lo, &hi);
        const __m256i w0 = _mm256_permute2x128_si256(lo, hi, 0x20); /* elements 0-15 */
        const __m256i w1 = _mm256_permute2x128_si256(lo, hi, 0x31); /* elements 16-31 */
        const int64_t xo = 256 * sb + 128 * (j >> 1) + 32 * (j & 1);
        for (int m = 0; m < M; m++) {
            const int8_t *xm = X->i32 + m * X->K + xo;
            const __m256i xl = _mm256_loadu_si256((const __m256i *)xm);
            const __m256i xh = _mm256_loadu_si256((const __m256i *)(xm + 64));
            const int w16 = !HAVE_DPBUSD && t == GT_Q4_K; /* u <= 15: sum_pairs16 */
            fold_pair(j, w16 ? dot2_u16(w0, xl, w1, xh) : dot2_u(w0, xl, w1, xh), w16, &v0[m],
                      &h01[m], &U[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        const int64_t at = m * X->nbp + 8 * sb;
        acc[m] = canon_fma(acc[m], U[m], dsc, _mm256_loadu_ps(X->d + at));
        acc[m] = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(X->s + at), acc[m]);
    }
}

/* Q4_K (t == GT_Q4_K) and Q5_K: superblocks of 256 = 8 sub-blocks of 32, w = (d sc_j) u - (dmin
 * m_j). Byte 32 j + i of qs holds element 64 j + i (low nibble) and 64 j + 32 + i (high); Q5_K's
 * qh byte i holds the fifth bit of element 32 k + i in bit k. One superblock is one group of 8
 * (k45_group), superblocks alternately into lo and hi (canon.h: sub-block 8 sb + j in lane
 * (8 sb + j) % 16). */
static inline __attribute__((always_inline)) void dot_k45(const int t, const uint8_t *wr,
                                                          const xq_t *X, float *out, const int M) {
    const int64_t bytes = t == GT_Q4_K ? 144 : 176, nsb = X->K / 256;
    __m256 lo[QMAX_ROWS], hi[QMAX_ROWS];
    for (int m = 0; m < M; m++) lo[m] = hi[m] = _mm256_setzero_ps();
    int64_t sb = 0;
    for (; sb + 2 <= nsb; sb += 2) {
        k45_group(t, wr + sb * bytes, sb, X, lo, M);
        k45_group(t, wr + (sb + 1) * bytes, sb + 1, X, hi, M);
    }
    if (sb < nsb) k45_group(t, wr + sb * bytes, sb, X, lo, M);
    for (int m = 0; m < M; m++) out[m] = canon_reduce16(lo[m], hi[m]);
}

/* Q6_K superblock sb (one group of 8 groups of 32, lane jj: elements 32 jj .. + 31, its
 * sub-blocks of 16 2 jj and 2 jj + 1) into acc of each row of X. Per half h the four integer
 * dots (lanes 0-3: a group's first 16 elements, 4-7: its second 16) summed by two VPHADDD
 * rounds into [first-16 sums of groups 4h .. 4h + 3 | second-16 sums], the offsets folded in
 * (I = U - 32 sum q per 16: qx.h's q16 of those groups, even then odd by one VPERMD), the two
 * halves' vectors regrouped into I0 (first 16s of the 8 groups) and I1 (second 16s); then acc =
 * fma(I0, (d sc_2jj) dx, acc), acc = fma(I1, (d sc_2jj+1) dx, acc). */
static inline __attribute__((always_inline)) void q6k_group(const uint8_t *b, int64_t sb,
                                                            const xq_t *X, __m256 *acc,
                                                            const int M) {
    const __m256i z = _mm256_setzero_si256(), eo = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    prefetch_span(b, 210);
    const __m256 d = _mm256_set1_ps(f16(b + 208));
    const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(b + 192)),
                                        _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m256 s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    const __m256 s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    __m256i p0[QMAX_ROWS], h[QMAX_ROWS], A[QMAX_ROWS][2];
    const int8_t *xs = X->nat + 256 * sb;
#pragma GCC unroll 2
    for (int hf = 0; hf < 2; hf++) {
        __m256i q[4];
        q6k_quants(_mm256_loadu_si256((const __m256i *)(b + 64 * hf)),
                   _mm256_loadu_si256((const __m256i *)(b + 64 * hf + 32)),
                   _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * hf)), q);
#pragma GCC unroll 4
        for (int tg = 0; tg < 4; tg++)
            for (int m = 0; m < M; m++) {
                const __m256i xm =
                    _mm256_loadu_si256((const __m256i *)(xs + m * X->K + 128 * hf + 32 * tg));
                if (!HAVE_DPBUSD) { /* int16 pair sums <= 2 * 63 * 127: two add exactly */
                    const __m256i p = _mm256_maddubs_epi16(q[tg], xm), one = _mm256_set1_epi16(1);
                    if (tg % 2 == 0)
                        p0[m] = p;
                    else if (tg == 1)
                        h[m] = _mm256_madd_epi16(_mm256_hadd_epi16(p0[m], p), one);
                    else
                        A[m][hf] = _mm256_hadd_epi32(h[m], _mm256_madd_epi16(_mm256_hadd_epi16(p0[m], p), one));
                    continue;
                }
                const __m256i p = DPBUSD(z, q[tg], xm);
                if (tg % 2 == 0)
                    p0[m] = p;
                else if (tg == 1)
                    h[m] = _mm256_hadd_epi32(p0[m], p);
                else
                    A[m][hf] = _mm256_hadd_epi32(h[m], _mm256_hadd_epi32(p0[m], p));
            }
    }
    for (int m = 0; m < M; m++) {
        const int32_t *q16 = X->q16 + 2 * m * X->nbp + 16 * sb;
        const __m256i a0 = _mm256_sub_epi32(
            A[m][0], _mm256_slli_epi32(_mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)q16), eo), 5));
        const __m256i a1 = _mm256_sub_epi32(
            A[m][1], _mm256_slli_epi32(_mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(q16 + 8)), eo), 5));
        const __m256 dx = _mm256_loadu_ps(X->d + m * X->nbp + 8 * sb);
        acc[m] = canon_fma(acc[m], _mm256_permute2x128_si256(a0, a1, 0x20), s0, dx);
        acc[m] = canon_fma(acc[m], _mm256_permute2x128_si256(a0, a1, 0x31), s1, dx);
    }
}

/* Q6_K: superblocks of 256 = 16 sub-blocks of 16, w = (d sc_j)(u - 32), u 6 bits: the low 4 of
 * element 128 h + 32 t + i in ql[64 h + 32 (t % 2) + i] (low nibble for t < 2, high else), the
 * high 2 in bits 2t, 2t + 1 of qh[32 h + i]. One superblock is one group of 8 (q6k_group),
 * superblocks alternately into lo and hi. */
static inline __attribute__((always_inline)) void dot_q6_k(const uint8_t *wr, const xq_t *X,
                                                           float *out, const int M) {
    const int64_t nsb = X->K / 256;
    __m256 lo[QMAX_ROWS], hi[QMAX_ROWS];
    for (int m = 0; m < M; m++) lo[m] = hi[m] = _mm256_setzero_ps();
    int64_t sb = 0;
    for (; sb + 2 <= nsb; sb += 2) {
        q6k_group(wr + sb * 210, sb, X, lo, M);
        q6k_group(wr + (sb + 1) * 210, sb + 1, X, hi, M);
    }
    if (sb < nsb) q6k_group(wr + sb * 210, sb, X, lo, M);
    for (int m = 0; m < M; m++) out[m] = canon_reduce16(lo[m], hi[m]);
}

/* Dense rows (F32, F16, BF16) against the float32 X: widened in registers, exact products.
 * NR <= QMAX_NR consecutive rows of W (rb bytes apart) a step, sharing each load of X and giving
 * the core 2 NR independent chains per row of X; each row sums in the same order (two 8-lane
 * accumulators over j, then hsum8 and the tail) whatever NR, so its output does not depend on
 * NR, nor on PF: each row's next lines prefetched QPREFETCH bytes ahead (PF 1) or left to the
 * hardware prefetcher (PF 0). out[r QMAX_ROWS + m]. */
static inline __attribute__((always_inline)) void dot_dense(const int t, const uint8_t *w0,
                                                            int64_t rb, const int NR, const int PF,
                                                            const xq_t *X, float *out, const int M) {
    const int64_t K = X->K, kv = K / 16 * 16;
    const int dt = t == GT_F32 ? DT_F32 : t == GT_F16 ? DT_F16 : DT_BF16;
    const int64_t es = t == GT_F32 ? 4 : 2;
    __m256 a0[QMAX_NR][QMAX_ROWS], a1[QMAX_NR][QMAX_ROWS];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < M; m++) a0[r][m] = a1[r][m] = _mm256_setzero_ps();
    for (int64_t j = 0; j < kv; j += 16) {
        const int line = ((j * es) & 63) == 0; /* a new 64-byte line of each row: prefetch */
        for (int r = 0; r < NR; r++) {
            const uint8_t *wr = w0 + r * rb;
            if (PF && line) prefetch_span(wr + j * es, 1);
            const __m256 w0v = load8(wr, j, dt), w1v = load8(wr, j + 8, dt);
            for (int m = 0; m < M; m++) {
                a0[r][m] = _mm256_fmadd_ps(w0v, _mm256_loadu_ps(X->xf + m * K + j), a0[r][m]);
                a1[r][m] = _mm256_fmadd_ps(w1v, _mm256_loadu_ps(X->xf + m * K + j + 8), a1[r][m]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < M; m++) {
            const uint8_t *wr = w0 + r * rb;
            float s = hsum8(_mm256_add_ps(a0[r][m], a1[r][m]));
            for (int64_t j = kv; j < K; j++) s += load1(wr, j, dt) * X->xf[m * K + j];
            out[r * QMAX_ROWS + m] = s;
        }
}

#endif
