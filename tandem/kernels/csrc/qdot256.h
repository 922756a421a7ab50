/* The 256-bit kernels of the quantized GEMV (AVX2 + FMA + F16C; VPDPBUSD where the CPU has
 * AVX-VNNI or AVX512-VNNI): one row of W against the M quantized rows of X (natural layout,
 * qx.h), per block of 32 one integer dot and one multiply-add per row. Included by qgemv.c. */
#ifndef TANDEM_QDOT256_H
#define TANDEM_QDOT256_H
#include "canon.h"
#include "qx.h"
#include "quant.h"

enum { QMAX_ROWS = 4 };

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
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

/* The 32-element block types (on AVX2 Q8_0; the 4- and 5-bit ones run dot_b32_pairs), 8 blocks
 * at a time: the 8 scales d (and Q4_1/Q5_1's offsets m)
 * gathered into one vector, s * dx per block formed once per row of X, then per block one
 * integer dot and one multiply-add. Offsets: Q4_0 o = -8 d, Q5_0 o = -16 d, Q4_1 / Q5_1 o = m. */
static inline __attribute__((always_inline)) void dot_b32(const int t, const uint8_t *wr,
                                                          const xq_t *X, float *out, const int M) {
    const int64_t bytes = t == GT_Q4_0 ? 18 : t == GT_Q4_1 ? 20 : t == GT_Q5_0 ? 22 : t == GT_Q5_1 ? 24 : 34;
    const int64_t nb = X->K / 32;
    const __m256i lo4 = _mm256_set1_epi8(0x0F), z = _mm256_setzero_si256();
    __m256 acc[QMAX_ROWS], acc1[QMAX_ROWS]; /* two chains per row: the FMA latency */
    for (int m = 0; m < M; m++) acc[m] = acc1[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g += 8) {
        const int n = nb - g < 8 ? (int)(nb - g) : 8;
        const uint8_t *blk = wr + g * bytes;
        prefetch_span(blk, n * bytes);
        const __m256 d8 = load_f16x8(blk, bytes, n);
        __m256 o8 = _mm256_setzero_ps();
        if (t == GT_Q4_1 || t == GT_Q5_1) o8 = load_f16x8(blk + 2, bytes, n);
        if (t == GT_Q4_0) o8 = _mm256_mul_ps(d8, _mm256_set1_ps(-8.0f));
        if (t == GT_Q5_0) o8 = _mm256_mul_ps(d8, _mm256_set1_ps(-16.0f));
        float sc[QMAX_ROWS][8] __attribute__((aligned(32)));
        for (int m = 0; m < M; m++) {
            _mm256_store_ps(sc[m], _mm256_mul_ps(d8, _mm256_loadu_ps(X->d + m * X->nbp + g)));
            if (t != GT_Q8_0) acc[m] = _mm256_fmadd_ps(o8, _mm256_loadu_ps(X->s + m * X->nbp + g), acc[m]);
        }
        const int8_t *xg = X->nat + 32 * g;
        for (int i = 0; i < n; i++) {
            const uint8_t *b = blk + i * bytes;
            __m256i u, w = z;
            if (t == GT_Q8_0) {
                w = _mm256_loadu_si256((const __m256i *)(b + 2));
                u = _mm256_sign_epi8(w, w); /* |w| as u8; the sign goes onto x */
            } else {
                const int64_t qs = t == GT_Q4_0 ? 2 : t == GT_Q4_1 ? 4 : t == GT_Q5_0 ? 6 : 8;
                __m128i raw = _mm_loadu_si128((const __m128i *)(b + qs));
                u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), lo4);
                if (t == GT_Q5_0) u = _mm256_or_si256(u, fifth_bits(b + 2));
                if (t == GT_Q5_1) u = _mm256_or_si256(u, fifth_bits(b + 4));
            }
            for (int m = 0; m < M; m++) {
                __m256i xm = _mm256_loadu_si256((const __m256i *)(xg + m * X->K + 32 * i));
                if (t == GT_Q8_0) xm = _mm256_sign_epi8(xm, w);
                __m256 p = _mm256_cvtepi32_ps(DPBUSD(z, u, xm));
                if (i & 1)
                    acc1[m] = _mm256_fmadd_ps(p, _mm256_set1_ps(sc[m][i]), acc1[m]);
                else
                    acc[m] = _mm256_fmadd_ps(p, _mm256_set1_ps(sc[m][i]), acc[m]);
            }
        }
    }
    for (int m = 0; m < M; m++) out[m] = hsum8(_mm256_add_ps(acc[m], acc1[m]));
}

/* int32 lanes of sum u*x over the bytes of (lo, xlo) and (hi, xhi) pairwise: u unsigned, at most
 * 31 (4-5 bit quants), x int8 with |x| <= 127, so VPMADDUBSW's int16 pair sums (<= 2 * 31 * 127)
 * and their sum over the two (< 2^14) never saturate. */
static inline __m256i dot2_u(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
    return DPBUSD(DPBUSD(_mm256_setzero_si256(), lo, xlo), hi, xhi);
#else
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

/* Q4_0, Q4_1, Q5_0, Q5_1 two blocks per step, over the i32 layout of X (qx.h): the 16 qs bytes of
 * blocks A and B side by side in one register hold A's elements 0-15 and B's 0-15 in their low
 * nibbles and elements 16-31 in their high ones, which the i32 layout puts at +0 and +64, so the
 * integer dots of both halves land in the same int32 lanes (0-3: A, 4-7: B) and the float work
 * (convert, multiply-add by [s_A x4, s_B x4]) is paid once per 2 blocks instead of once per
 * block. Per 8 blocks the 8 scales are gathered once and the offsets o * (dx sum q) are one
 * multiply-add, as in dot_b32. Measured single-thread on an AVX2 EPYC (Zen 3), a cache-resident
 * 256 x 1024 Q4_0 weight (scripts/bench/qgemv_micro.c): 1.53 -> 1.11 ns per block of 32 at 1
 * row of X, 3.46 -> 2.65 at 4. A row's last K/32 % 8 blocks go one at a time over the natural
 * layout. */
static inline __attribute__((always_inline)) void dot_b32_pairs(const int t, const uint8_t *wr,
                                                                const xq_t *X, float *out,
                                                                const int M) {
    const int64_t bytes = t == GT_Q4_0 ? 18 : t == GT_Q4_1 ? 20 : t == GT_Q5_0 ? 22 : 24;
    const int64_t qs = t == GT_Q4_0 ? 2 : t == GT_Q4_1 ? 4 : t == GT_Q5_0 ? 6 : 8;
    const int has_m = t == GT_Q4_1 || t == GT_Q5_1, five = t == GT_Q5_0 || t == GT_Q5_1;
    const float ofs = t == GT_Q4_0 ? -8.0f : -16.0f; /* o = ofs * d for Q4_0 / Q5_0 */
    const int64_t nb = X->K / 32, n8 = nb / 8 * 8;
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    const __m256i ix[4] = {
        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
        _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
    __m256 acc[QMAX_ROWS], acc1[QMAX_ROWS]; /* two chains per row: the FMA latency */
    float tail[QMAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = acc1[m] = _mm256_setzero_ps(), tail[m] = 0.0f;
    for (int64_t g = 0; g < n8; g += 8) {
        const uint8_t *blk = wr + g * bytes;
        prefetch_span(blk, 8 * bytes);
        const __m256 d8 = load_f16x8(blk, bytes, 8);
        const __m256 o8 = has_m ? load_f16x8(blk + 2, bytes, 8) : _mm256_mul_ps(d8, _mm256_set1_ps(ofs));
        __m256 sc[QMAX_ROWS];
        for (int m = 0; m < M; m++) {
            sc[m] = _mm256_mul_ps(d8, _mm256_loadu_ps(X->d + m * X->nbp + g));
            acc1[m] = _mm256_fmadd_ps(o8, _mm256_loadu_ps(X->s + m * X->nbp + g), acc1[m]);
        }
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
            const int64_t xo = 32 * g + 128 * (j >> 1) + 32 * (j & 1); /* i32: A lo, B lo at +0 */
            for (int m = 0; m < M; m++) {
                const int8_t *xm = X->i32 + m * X->K + xo;
                const __m256 f = _mm256_cvtepi32_ps(
                    dot2_u(lo, _mm256_loadu_si256((const __m256i *)xm), hi,
                           _mm256_loadu_si256((const __m256i *)(xm + 64))));
                const __m256 sj = _mm256_permutevar8x32_ps(sc[m], ix[j]);
                if (j & 1)
                    acc1[m] = _mm256_fmadd_ps(f, sj, acc1[m]);
                else
                    acc[m] = _mm256_fmadd_ps(f, sj, acc[m]);
            }
        }
    }
    for (int64_t i = n8; i < nb; i++) { /* the last blocks, one at a time (natural layout) */
        const uint8_t *b = wr + i * bytes;
        const float d = f16(b), o = has_m ? f16(b + 2) : ofs * d;
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + qs));
        __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), lo4);
        if (five) u = _mm256_or_si256(u, fifth_bits(b + qs - 4));
        for (int m = 0; m < M; m++) {
            const __m256i xm = _mm256_loadu_si256((const __m256i *)(X->nat + m * X->K + 32 * i));
            const __m256 f = _mm256_cvtepi32_ps(DPBUSD(_mm256_setzero_si256(), u, xm));
            acc[m] = _mm256_fmadd_ps(f, _mm256_set1_ps(d * X->d[m * X->nbp + i]), acc[m]);
            tail[m] += o * X->s[m * X->nbp + i];
        }
    }
    for (int m = 0; m < M; m++) out[m] = hsum8(_mm256_add_ps(acc[m], acc1[m])) + tail[m];
}

/* MXFP4 scales 2^(e - 128) (quant.h's tq_e8m0_half) of int32 lanes e, 8 at a time. */
static inline __m256 e8m0_half8(__m256i e) {
    const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(
        _mm256_blendv_epi8(big, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

/* MXFP4 (17-byte blocks: E8M0 byte e, 16 bytes of 4-bit codes, w = 2^(e - 128) kv[code]), as
 * dot_b32_pairs runs Q4_0: two blocks per step over the i32 layout, the codes of both side by
 * side, |kv| by a byte shuffle (VPSHUFB) as the unsigned operand and kv's sign (bit 3 of the
 * code) moved onto x by VPSIGNB, so sum |kv| sign(kv) q = sum kv q exactly and there is no
 * offset term (o = 0, a = w). The sign needs no decode: bit 7 of each byte of raw << 4 is bit 3
 * of its low code, bit 7 of raw that of its high one, and a byte whose code is 0 or 8 may sign x
 * any way (its |kv| is 0). |kv| <= 12, so dot2_u's VPMADDUBSW bound holds. Per 8 blocks the 8
 * scales are formed once (vector shifts of the exponent bytes). A row's last K/32 % 8 blocks go
 * one at a time over the natural layout. Against Q4_0 (2880 x 2880, a Sapphire Rapids built
 * -march=haswell, one thread): 1 row 1.3x its time, 4 rows 1.2x, 64 rows (qgemm256.c) 1.0x;
 * the two VPSIGNB per row (an offset form u = kv + 12, o = -12 s, saves them but loses a = w). */
static inline __attribute__((always_inline)) void dot_mxfp4(const uint8_t *wr, const xq_t *X,
                                                            float *out, const int M) {
    const int64_t nb = X->K / 32, n8 = nb / 8 * 8;
    const __m256i lo4 = _mm256_set1_epi8(0x0F), z = _mm256_setzero_si256();
    const __m256i kv = _mm256_setr_epi8(TQ_MXFP4_KV, TQ_MXFP4_KV);
    const __m256i ka = _mm256_setr_epi8(TQ_MXFP4_ABS, TQ_MXFP4_ABS);
    const __m256i ix[4] = {
        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
        _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
    __m256 acc[QMAX_ROWS], acc1[QMAX_ROWS]; /* two chains per row: the FMA latency */
    for (int m = 0; m < M; m++) acc[m] = acc1[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < n8; g += 8) {
        const uint8_t *blk = wr + g * 17;
        prefetch_span(blk, 8 * 17);
        const __m256 d8 = e8m0_half8(_mm256_setr_epi32(blk[0], blk[17], blk[34], blk[51], blk[68],
                                                       blk[85], blk[102], blk[119]));
        __m256 sc[QMAX_ROWS];
        for (int m = 0; m < M; m++)
            sc[m] = _mm256_mul_ps(d8, _mm256_loadu_ps(X->d + m * X->nbp + g));
        for (int j = 0; j < 4; j++) { /* blocks g + 2j (A) and g + 2j + 1 (B) */
            const uint8_t *a = blk + 2 * j * 17, *b = a + 17;
            const __m256i raw =
                _mm256_loadu2_m128i((const __m128i *)(b + 1), (const __m128i *)(a + 1));
            const __m256i ulo = _mm256_shuffle_epi8(ka, _mm256_and_si256(raw, lo4));
            const __m256i uhi =
                _mm256_shuffle_epi8(ka, _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4));
            const __m256i slo = _mm256_slli_epi16(raw, 4); /* signs: bit 7 (module comment) */
            const int64_t xo = 32 * g + 128 * (j >> 1) + 32 * (j & 1); /* i32: A lo, B lo at +0 */
            for (int m = 0; m < M; m++) {
                const int8_t *xm = X->i32 + m * X->K + xo;
                const __m256i xl = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xm), slo);
                const __m256i xh =
                    _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xm + 64)), raw);
                const __m256 f = _mm256_cvtepi32_ps(dot2_u(ulo, xl, uhi, xh));
                const __m256 sj = _mm256_permutevar8x32_ps(sc[m], ix[j]);
                if (j & 1)
                    acc1[m] = _mm256_fmadd_ps(f, sj, acc1[m]);
                else
                    acc[m] = _mm256_fmadd_ps(f, sj, acc[m]);
            }
        }
    }
    for (int64_t i = n8; i < nb; i++) { /* the last blocks, one at a time (natural layout) */
        const uint8_t *b = wr + i * 17;
        const float d = tq_e8m0_half(b[0]);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 1));
        const __m256i c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), lo4);
        const __m256i u = _mm256_shuffle_epi8(ka, c), sg = _mm256_shuffle_epi8(kv, c);
        for (int m = 0; m < M; m++) {
            const __m256i xm = _mm256_loadu_si256((const __m256i *)(X->nat + m * X->K + 32 * i));
            const __m256 f = _mm256_cvtepi32_ps(DPBUSD(z, u, _mm256_sign_epi8(xm, sg)));
            acc[m] = _mm256_fmadd_ps(f, _mm256_set1_ps(d * X->d[m * X->nbp + i]), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) out[m] = hsum8(_mm256_add_ps(acc[m], acc1[m]));
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

/* Q4_K (t == GT_Q4_K) and Q5_K: superblocks of 256 = 8 sub-blocks of 32, w = (d sc_j) u - (dmin
 * m_j). Byte 32 j + i of qs holds element 64 j + i (low nibble) and 64 j + 32 + i (high); Q5_K's
 * qh byte i holds the fifth bit of element 32 k + i in bit k. The float work is paid once per
 * two sub-blocks, as in dot_b32_pairs: the 32 qs bytes of sub-blocks 2j (low nibbles) and
 * 2j + 1 (high) rearranged, by two 128-bit lane swaps, into [2j elements 0-15 | 2j+1 elements
 * 0-15] and [elements 16-31 of both], against the i32 layout of X (qx.h), so one convert and
 * one multiply-add by [s_2j x4, s_2j+1 x4] serve both. Measured single-thread on an AVX2 EPYC
 * (Zen 3) against one sub-block at a time, a cache-resident 256 x 1024 Q4_K weight
 * (scripts/bench/qgemv_micro.c): 11.4 -> 11.0 ns per superblock at 1 row of X, 26.3 -> 24.0 at
 * 4; the scale decode is ~3 ns of the 11. */
static inline __attribute__((always_inline)) void dot_k45(const int t, const uint8_t *wr,
                                                                const xq_t *X, float *out,
                                                                const int M) {
    const int64_t bytes = t == GT_Q4_K ? 144 : 176, qs_at = t == GT_Q4_K ? 16 : 48;
    const int64_t nsb = X->K / 256;
    const __m256i ix[4] = {
        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
        _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
    __m256 acc[QMAX_ROWS], acc1[QMAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = acc1[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = wr + sb * bytes;
        prefetch_span(b, bytes);
        uint32_t u[4];
        kquant_scales(b + 4, u);
        const __m256 dsc = _mm256_mul_ps(u8x8_to_ps(u), _mm256_set1_ps(f16(b)));
        const __m256 dmn = _mm256_mul_ps(u8x8_to_ps(u + 2), _mm256_set1_ps(-f16(b + 2)));
        __m256 sc[QMAX_ROWS];
        for (int m = 0; m < M; m++) {
            sc[m] = _mm256_mul_ps(dsc, _mm256_loadu_ps(X->d + m * X->nbp + 8 * sb));
            acc1[m] = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(X->s + m * X->nbp + 8 * sb), acc1[m]);
        }
        __m256i hb = _mm256_setzero_si256();
        if (t == GT_Q5_K) hb = _mm256_loadu_si256((const __m256i *)(b + 16));
        for (int j = 0; j < 4; j++) {
            __m256i lo, hi;
            kq_nibbles(_mm256_loadu_si256((const __m256i *)(b + qs_at + 32 * j)), t == GT_Q5_K,
                       &hb, &lo, &hi);
            const __m256i w0 = _mm256_permute2x128_si256(lo, hi, 0x20); /* elements 0-15 */
            const __m256i w1 = _mm256_permute2x128_si256(lo, hi, 0x31); /* elements 16-31 */
            const int64_t xo = 256 * sb + 128 * (j >> 1) + 32 * (j & 1);
            for (int m = 0; m < M; m++) {
                const int8_t *xm = X->i32 + m * X->K + xo;
                const __m256 f = _mm256_cvtepi32_ps(
                    dot2_u(w0, _mm256_loadu_si256((const __m256i *)xm), w1,
                           _mm256_loadu_si256((const __m256i *)(xm + 64))));
                const __m256 sj = _mm256_permutevar8x32_ps(sc[m], ix[j]);
                if (j & 1)
                    acc1[m] = _mm256_fmadd_ps(f, sj, acc1[m]);
                else
                    acc[m] = _mm256_fmadd_ps(f, sj, acc[m]);
            }
        }
    }
    for (int m = 0; m < M; m++) out[m] = hsum8(_mm256_add_ps(acc[m], acc1[m]));
}

/* Q6_K: superblocks of 256 = 16 sub-blocks of 16, w = (d sc_j)(u - 32), u 6 bits: the low 4 of
 * element 128 h + 32 t + i in ql[64 h + 32 (t % 2) + i] (low nibble for t < 2, high else), the
 * high 2 in bits 2t, 2t + 1 of qh[32 h + i]. One group of 32 is two sub-blocks: its integer dot
 * lanes 0-3 hold the first 16 elements, lanes 4-7 the second. */
static inline __attribute__((always_inline)) void dot_q6_k(const uint8_t *wr, const xq_t *X,
                                                           float *out, const int M) {
    const int64_t nsb = X->K / 256;
    const __m256i z = _mm256_setzero_si256();
    const __m256i idx[4] = {
        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
        _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
    __m256 acc[QMAX_ROWS], acc1[QMAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = acc1[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = wr + sb * 210;
        prefetch_span(b, 210);
        const __m256 d = _mm256_set1_ps(f16(b + 208));
        const __m256 dsc[2] = {
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 192))))),
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 200)))))};
        __m256 sc[QMAX_ROWS][2];
        for (int m = 0; m < M; m++) {
            const float *d16 = X->d16 + m * 2 * X->nbp + 16 * sb, *s16 = X->s16 + m * 2 * X->nbp + 16 * sb;
            for (int h = 0; h < 2; h++) {
                sc[m][h] = _mm256_mul_ps(dsc[h], _mm256_loadu_ps(d16 + 8 * h));
                acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dsc[h], _mm256_set1_ps(-32.0f)),
                                         _mm256_loadu_ps(s16 + 8 * h), acc[m]);
            }
        }
        const int8_t *xs = X->nat + 256 * sb;
        for (int h = 0; h < 2; h++) {
            __m256i A = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            __m256i B = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            __m256i C = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            __m256i q[4];
            q6k_quants(A, B, C, q);
            for (int tg = 0; tg < 4; tg++)
                for (int m = 0; m < M; m++) {
                    const int8_t *xm = xs + m * X->K + 128 * h + 32 * tg;
                    __m256i p = DPBUSD(z, q[tg], _mm256_loadu_si256((const __m256i *)xm));
                    __m256 s = _mm256_permutevar8x32_ps(sc[m][h], idx[tg]);
                    if (tg & 1)
                        acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc1[m]);
                    else
                        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[m]);
                }
        }
    }
    for (int m = 0; m < M; m++) out[m] = hsum8(_mm256_add_ps(acc[m], acc1[m]));
}

/* Dense rows (F32, F16, BF16) against the float32 X: widened in registers, exact products. */
static inline __attribute__((always_inline)) void dot_dense(const int t, const uint8_t *wr,
                                                            const xq_t *X, float *out, const int M) {
    const int64_t K = X->K, kv = K / 16 * 16;
    const int dt = t == GT_F32 ? DT_F32 : t == GT_F16 ? DT_F16 : DT_BF16;
    __m256 a0[QMAX_ROWS], a1[QMAX_ROWS];
    for (int m = 0; m < M; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    for (int64_t j = 0; j < kv; j += 16) {
        __m256 w0 = load8(wr, j, dt), w1 = load8(wr, j + 8, dt);
        for (int m = 0; m < M; m++) {
            a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(X->xf + m * K + j), a0[m]);
            a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(X->xf + m * K + j + 8), a1[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        float s = hsum8(_mm256_add_ps(a0[m], a1[m]));
        for (int64_t j = kv; j < K; j++) s += load1(wr, j, dt) * X->xf[m * K + j];
        out[m] = s;
    }
}

#endif
