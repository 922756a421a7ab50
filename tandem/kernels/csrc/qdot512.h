/* The 512-bit kernels of the quantized GEMV (AVX512 F/BW/VL + VNNI), over the interleaved
 * activation layouts of qx.h. Included by qgemv.c after qdot256.h.
 *
 * Why interleaved: the integer dot of a block's low nibbles and that of its high nibbles land in
 * the same int32 lanes, so VPDPBUSD accumulates both and the float work (convert, multiply-add
 * by the block scale) is paid once per 4 blocks of 32 instead of once per block: per row of X and
 * 4 blocks, 2 integer dots + 1 convert + 2 float ops. The K-quants keep one float multiply-add
 * per sub-block (each has its own scale), two sub-blocks per 512-bit vector.
 *
 * Measured single-thread on a cache-resident row block (Xeon with AVX512-VNNI, 2.1 GHz): Q4_0
 * 2.0 -> see tests/bench figures in the module docstring of tandem/kernels/quant.py.
 */
#ifndef TANDEM_QDOT512_H
#define TANDEM_QDOT512_H
#include "qdot256.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define HAVE_Q512 1

static inline __m128 load_f16x4(const uint8_t *p, int64_t stride) {
    uint16_t h0, h1, h2, h3;
    memcpy(&h0, p, 2);
    memcpy(&h1, p + stride, 2);
    memcpy(&h2, p + 2 * stride, 2);
    memcpy(&h3, p + 3 * stride, 2);
    return _mm_cvtph_ps(_mm_setr_epi16((short)h0, (short)h1, (short)h2, (short)h3, 0, 0, 0, 0));
}

/* Four blocks' 16 bytes at p, p + stride, ... side by side. */
static inline __m512i load_qs4(const uint8_t *p, int64_t stride) {
    __m256i a = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
        _mm_loadu_si128((const __m128i *)(p + stride)), 1);
    __m256i b = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + 2 * stride))),
        _mm_loadu_si128((const __m128i *)(p + 3 * stride)), 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

/* Q5_0 / Q5_1: the fifth bits of 4 blocks (32-bit qh at p + k stride) as 0x10 bytes in the
 * interleaved order: low halves (bits 0-15 of each) in *lo, high halves in *hi. */
static inline void fifth_bits4(const uint8_t *p, int64_t stride, __m512i *lo, __m512i *hi) {
    uint64_t l = 0, h = 0;
    for (int k = 0; k < 4; k++) {
        uint32_t u;
        memcpy(&u, p + k * stride, 4);
        l |= (uint64_t)(u & 0xffff) << (16 * k);
        h |= (uint64_t)(u >> 16) << (16 * k);
    }
    const __m512i b4 = _mm512_set1_epi8(0x10);
    *lo = _mm512_or_si512(*lo, _mm512_maskz_mov_epi8((__mmask64)l, b4));
    *hi = _mm512_or_si512(*hi, _mm512_maskz_mov_epi8((__mmask64)h, b4));
}

#if defined(__AVX512VBMI__)
/* Byte i of 4 blocks' qs side by side, as an index into the two 64-byte loads at the group's
 * start (A: bytes 0-63) and its end (B: bytes 4 BYTES - 64 onward): constants after inlining. */
#define QS_AT(i) (BYTES * ((i) >> 4) + QS + ((i) & 15))
#define QS_IX(i) (char)(QS_AT(i) < 64 ? QS_AT(i) : QS_AT(i) - (4 * BYTES - 64) + 64)
#define QS_16(b)                                                                            \
    QS_IX(b + 15), QS_IX(b + 14), QS_IX(b + 13), QS_IX(b + 12), QS_IX(b + 11), QS_IX(b + 10), \
        QS_IX(b + 9), QS_IX(b + 8), QS_IX(b + 7), QS_IX(b + 6), QS_IX(b + 5), QS_IX(b + 4),  \
        QS_IX(b + 3), QS_IX(b + 2), QS_IX(b + 1), QS_IX(b)
/* Byte i of 16 float16 words, block i / 8's float16 at byte AT (each block's 4 times). */
#define W_AT(i, AT) (BYTES * ((i) >> 3) + (AT) + ((i) & 1))
#define W_IX(i, AT) (char)(W_AT(i, AT) < 64 ? W_AT(i, AT) : W_AT(i, AT) - (4 * BYTES - 64) + 64)
#define W_8(b, AT)                                                                           \
    W_IX(b + 7, AT), W_IX(b + 6, AT), W_IX(b + 5, AT), W_IX(b + 4, AT), W_IX(b + 3, AT),       \
        W_IX(b + 2, AT), W_IX(b + 1, AT), W_IX(b, AT)
#define W_32(AT) W_8(24, AT), W_8(16, AT), W_8(8, AT), W_8(0, AT)
#endif

/* Q4_0, Q4_1, Q5_0, Q5_1: 4 blocks per step over the i32 layout, the qs of the 4 blocks in one
 * vector (one byte permute of two loads where the CPU has AVX512-VBMI), the scale (and offset)
 * of each block spread over its 4 int32 lanes; the last K/32 % 4 blocks by the 256-bit path
 * (natural order there). Offsets o (qdot256.h): lanes carry o * s / 4, so the 4 lanes of a block
 * sum to o * s exactly (a quarter is exact). */
static inline __attribute__((always_inline)) void dot_b32_512(const int t, const uint8_t *wr,
                                                              const xq_t *X, float *out,
                                                              const int M) {
    const int64_t BYTES = t == GT_Q4_0 ? 18 : t == GT_Q4_1 ? 20 : t == GT_Q5_0 ? 22 : 24;
    const int64_t QS = t == GT_Q4_0 ? 2 : t == GT_Q4_1 ? 4 : t == GT_Q5_0 ? 6 : 8;
    const int64_t nb = X->K / 32, K = X->K, nbp = X->nbp;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), z = _mm512_setzero_si512();
#if defined(__AVX512VBMI__)
    const __m512i qs_ix = _mm512_set_epi8(QS_16(48), QS_16(32), QS_16(16), QS_16(0));
    const __m512i d_ix = _mm512_set_epi8(W_32(0), W_32(0));
    const __m512i m_ix = _mm512_set_epi8(W_32(2), W_32(2));
#else
    const __m512i expand = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
#endif
    __m512 acc[QMAX_ROWS], acco[QMAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = acco[m] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *blk = wr + b * BYTES;
        prefetch_span(blk, 4 * BYTES);
#if defined(__AVX512VBMI__)
        const __m512i A = _mm512_loadu_si512(blk), B = _mm512_loadu_si512(blk + 4 * BYTES - 64);
        const __m512i v = _mm512_permutex2var_epi8(A, qs_ix, B);
        const __m512 dz = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi8(A, d_ix, B)));
        __m512 oz;
        if (t == GT_Q4_1 || t == GT_Q5_1)
            oz = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi8(A, m_ix, B)));
#else
        const __m512i v = load_qs4(blk + QS, BYTES);
        const __m512 dz = _mm512_permutexvar_ps(expand, _mm512_castps128_ps512(load_f16x4(blk, BYTES)));
        __m512 oz;
        if (t == GT_Q4_1 || t == GT_Q5_1)
            oz = _mm512_permutexvar_ps(expand, _mm512_castps128_ps512(load_f16x4(blk + 2, BYTES)));
#endif
        if (t == GT_Q4_0) oz = _mm512_mul_ps(dz, _mm512_set1_ps(-8.0f));
        if (t == GT_Q5_0) oz = _mm512_mul_ps(dz, _mm512_set1_ps(-16.0f));
        __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        if (t == GT_Q5_0 || t == GT_Q5_1) fifth_bits4(blk + QS - 4, BYTES, &lo, &hi);
        for (int m = 0; m < M; m++) {
            const int8_t *xi = X->i32 + m * K + 32 * b;
            __m512i p = _mm512_dpbusd_epi32(z, lo, _mm512_loadu_si512(xi));
            p = _mm512_dpbusd_epi32(p, hi, _mm512_loadu_si512(xi + 64));
            const __m512 sc = _mm512_mul_ps(dz, _mm512_loadu_ps(X->d4 + m * 4 * nbp + 4 * b));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[m]);
            acco[m] = _mm512_fmadd_ps(oz, _mm512_loadu_ps(X->s4 + m * 4 * nbp + 4 * b), acco[m]);
        }
    }
    float tail[QMAX_ROWS] = {0};
    if (b < nb) /* the last K/32 % 4 blocks, natural order: the 256-bit kernel, row by row */
        for (int m = 0; m < M; m++) {
            xq_t Xm = *X;
            Xm.K = K - 32 * b;
            Xm.nat = X->i32 + m * K + 32 * b;
            Xm.d = X->d + m * nbp + b, Xm.s = X->s + m * nbp + b;
            dot_b32(t, wr + b * BYTES, &Xm, tail + m, 1);
        }
    for (int m = 0; m < M; m++)
        out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acco[m])) + tail[m];
}

/* MXFP4 as dot_b32_512 runs Q4_0: 4 blocks per step over the i32 layout, their 16-byte code
 * arrays side by side in one vector (one byte permute of two loads with AVX512-VBMI), the codes
 * decoded by a byte shuffle to |kv| (the unsigned operand of VPDPBUSD) and kv's sign (bit 3 of
 * the code) moved onto x by a masked negation, so the integer dot is sum kv q exactly and there
 * is no offset term. The scale 2^(e - 128) of each block spread over its 4 int32 lanes, formed
 * from the exponent bytes by vector shifts (quant.h's tq_e8m0_half). The last K/32 % 4 blocks by
 * the 256-bit path (natural order there). */
static inline __m512 e8m0_half16(__m512i e) {
    const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    return _mm512_castsi512_ps(
        _mm512_mask_sllv_epi32(big, small, _mm512_set1_epi32(0x00200000), e));
}

static inline __attribute__((always_inline)) void dot_mxfp4_512(const uint8_t *wr, const xq_t *X,
                                                                float *out, const int M) {
    const int64_t BYTES = 17, QS = 1;
    const int64_t nb = X->K / 32, K = X->K, nbp = X->nbp;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), z = _mm512_setzero_si512();
    const __m512i ka = _mm512_broadcast_i32x4(_mm_setr_epi8(TQ_MXFP4_ABS));
    const __m512i neg_lo = _mm512_set1_epi8(0x08), neg_hi = _mm512_set1_epi8((char)0x80);
#if defined(__AVX512VBMI__)
    const __m512i qs_ix = _mm512_set_epi8(QS_16(48), QS_16(32), QS_16(16), QS_16(0));
    /* byte 4 l of int32 lane l: block l / 4's exponent (bytes 0, 17, 34, 51 of the first load) */
    const __m512i e_ix =
        _mm512_set_epi32(51, 51, 51, 51, 34, 34, 34, 34, 17, 17, 17, 17, 0, 0, 0, 0);
#else
    const __m512i expand = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
#endif
    __m512 acc[QMAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *blk = wr + b * BYTES;
        prefetch_span(blk, 4 * BYTES);
#if defined(__AVX512VBMI__)
        const __m512i A = _mm512_loadu_si512(blk), B = _mm512_loadu_si512(blk + 4 * BYTES - 64);
        const __m512i v = _mm512_permutex2var_epi8(A, qs_ix, B);
        const __m512i e = _mm512_maskz_permutexvar_epi8((__mmask64)0x1111111111111111ull, e_ix, A);
#else
        const __m512i v = load_qs4(blk + QS, BYTES);
        const __m512i e = _mm512_permutexvar_epi32(
            expand, _mm512_castsi128_si512(_mm_setr_epi32(blk[0], blk[17], blk[34], blk[51])));
#endif
        const __m512 dz = e8m0_half16(e);
        const __m512i ulo = _mm512_shuffle_epi8(ka, _mm512_and_si512(v, lo4));
        const __m512i uhi = _mm512_shuffle_epi8(ka, _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4));
        const __mmask64 nlo = _mm512_test_epi8_mask(v, neg_lo);
        const __mmask64 nhi = _mm512_test_epi8_mask(v, neg_hi);
        for (int m = 0; m < M; m++) {
            const int8_t *xi = X->i32 + m * K + 32 * b;
            const __m512i xl = _mm512_loadu_si512(xi), xh = _mm512_loadu_si512(xi + 64);
            __m512i p = _mm512_dpbusd_epi32(z, ulo, _mm512_mask_sub_epi8(xl, nlo, z, xl));
            p = _mm512_dpbusd_epi32(p, uhi, _mm512_mask_sub_epi8(xh, nhi, z, xh));
            const __m512 sc = _mm512_mul_ps(dz, _mm512_loadu_ps(X->d4 + m * 4 * nbp + 4 * b));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[m]);
        }
    }
    float tail[QMAX_ROWS] = {0};
    if (b < nb) /* the last K/32 % 4 blocks, natural order: the 256-bit kernel, row by row */
        for (int m = 0; m < M; m++) {
            xq_t Xm = *X;
            Xm.K = K - 32 * b;
            Xm.nat = X->i32 + m * K + 32 * b;
            Xm.d = X->d + m * nbp + b;
            dot_mxfp4(wr + b * BYTES, &Xm, tail + m, 1);
        }
    for (int m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]) + tail[m];
}

/* Q8_0: 2 blocks per 512-bit vector (natural layout), |w| against x with w's sign; the 8
 * scales of a group of 8 blocks formed once per row, spread 8 lanes per block by a permute. */
static inline __attribute__((always_inline)) void dot_q8_0_512(const uint8_t *wr, const xq_t *X,
                                                               float *out, const int M) {
    const int64_t nb = X->K / 32, K = X->K, nbp = X->nbp;
    const __m512i z = _mm512_setzero_si512();
    __m512 acc[QMAX_ROWS], acc1[QMAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = acc1[m] = _mm512_setzero_ps();
    float tail[QMAX_ROWS] = {0};
    for (int64_t g = 0; g < nb; g += 8) {
        const int n = nb - g < 8 ? (int)(nb - g) : 8;
        const uint8_t *blk = wr + g * 34;
        prefetch_span(blk, n * 34);
        const __m256 d8 = load_f16x8(blk, 34, n);
        __m512 sc[QMAX_ROWS];
        for (int m = 0; m < M; m++)
            sc[m] = _mm512_castps256_ps512(_mm256_mul_ps(d8, _mm256_loadu_ps(X->d + m * nbp + g)));
        int i = 0;
        for (; i + 2 <= n; i += 2) {
            const uint8_t *b = blk + 34 * i;
            const __m512i w = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                _mm256_loadu_si256((const __m256i *)(b + 36)), 1);
            const __m512i u = _mm512_abs_epi8(w);
            const __mmask64 neg = _mm512_movepi8_mask(w);
            const __m512i idx = _mm512_setr_epi32(i, i, i, i, i, i, i, i, i + 1, i + 1, i + 1,
                                                  i + 1, i + 1, i + 1, i + 1, i + 1);
            for (int m = 0; m < M; m++) {
                __m512i x = _mm512_loadu_si512(X->nat + m * K + 32 * (g + i));
                x = _mm512_mask_sub_epi8(x, neg, z, x);
                const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, u, x));
                const __m512 s = _mm512_permutexvar_ps(idx, sc[m]);
                if (i & 2) acc1[m] = _mm512_fmadd_ps(p, s, acc1[m]);
                else acc[m] = _mm512_fmadd_ps(p, s, acc[m]);
            }
        }
        if (i < n) { /* an odd last block */
            const uint8_t *b = blk + 34 * i;
            const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 2));
            const __m256i u = _mm256_sign_epi8(w, w);
            const float dw = f16(b);
            for (int m = 0; m < M; m++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(X->nat + m * K + 32 * (g + i)));
                __m256i p = DPBUSD(_mm256_setzero_si256(), u, _mm256_sign_epi8(x, w));
                tail[m] += hsum8(_mm256_mul_ps(_mm256_cvtepi32_ps(p),
                                               _mm256_set1_ps(dw * X->d[m * nbp + g + i])));
            }
        }
    }
    for (int m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc1[m])) + tail[m];
}

/* Q4_K / Q5_K over the ik layout: per 128 elements one 64-byte load of qs, sub-blocks 4c and
 * 4c + 2 in its low nibbles, 4c + 1 and 4c + 3 in its high ones. */
static inline __attribute__((always_inline)) void dot_k45_512(const int t, const uint8_t *wr,
                                                              const xq_t *X, float *out,
                                                              const int M) {
    const int64_t bytes = t == GT_Q4_K ? 144 : 176, qs_at = t == GT_Q4_K ? 16 : 48;
    const int64_t nsb = X->K / 256, K = X->K, nbp = X->nbp;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10);
    const __m512i z = _mm512_setzero_si512();
    const __m512i idx[2][2] = {
        {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
         _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3)},
        {_mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6),
         _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7)}};
    /* Q5_K: bit k of a qh byte to bit 4; per 256-bit half the sub-block's k (after >> 4c) */
    const __m512i shl_lo = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);
    const __m512i shl_hi = _mm512_setr_epi64(3, 3, 3, 3, 1, 1, 1, 1);
    const __m512i cnt_lo = _mm512_or_si512(shl_lo, _mm512_slli_epi64(shl_lo, 16));
    const __m512i cnt_hi = _mm512_or_si512(shl_hi, _mm512_slli_epi64(shl_hi, 16));
    const __m512i cnt_lo16 = _mm512_or_si512(cnt_lo, _mm512_slli_epi64(cnt_lo, 32));
    const __m512i cnt_hi16 = _mm512_or_si512(cnt_hi, _mm512_slli_epi64(cnt_hi, 32));
    __m512 acc[QMAX_ROWS], acc1[QMAX_ROWS];
    __m256 acco[QMAX_ROWS];
    for (int m = 0; m < M; m++)
        acc[m] = acc1[m] = _mm512_setzero_ps(), acco[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = wr + sb * bytes;
        prefetch_span(b, bytes);
        uint32_t u[4];
        kquant_scales(b + 4, u);
        const __m256 dsc = _mm256_mul_ps(u8x8_to_ps(u), _mm256_set1_ps(f16(b)));
        const __m256 dmn = _mm256_mul_ps(u8x8_to_ps(u + 2), _mm256_set1_ps(-f16(b + 2)));
        __m512 sc[QMAX_ROWS];
        for (int m = 0; m < M; m++) {
            sc[m] = _mm512_castps256_ps512(
                _mm256_mul_ps(dsc, _mm256_loadu_ps(X->d + m * nbp + 8 * sb)));
            acco[m] = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(X->s + m * nbp + 8 * sb), acco[m]);
        }
        __m512i hz = z;
        if (t == GT_Q5_K)
            hz = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
        for (int c = 0; c < 2; c++) {
            const __m512i v = _mm512_loadu_si512(b + qs_at + 64 * c);
            __m512i lo = _mm512_and_si512(v, lo4);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
            if (t == GT_Q5_K) {
                const __m512i h = c ? _mm512_srli_epi16(hz, 4) : hz;
                lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_sllv_epi16(h, cnt_lo16), b4));
                hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_sllv_epi16(h, cnt_hi16), b4));
            }
            for (int m = 0; m < M; m++) {
                const int8_t *x = X->ik + m * K + 256 * sb + 128 * c;
                __m512i p0 = _mm512_dpbusd_epi32(z, lo, _mm512_loadu_si512(x));
                __m512i p1 = _mm512_dpbusd_epi32(z, hi, _mm512_loadu_si512(x + 64));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0),
                                         _mm512_permutexvar_ps(idx[c][0], sc[m]), acc[m]);
                acc1[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1),
                                          _mm512_permutexvar_ps(idx[c][1], sc[m]), acc1[m]);
            }
        }
    }
    for (int m = 0; m < M; m++)
        out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc1[m])) + hsum8(acco[m]);
}

/* Q6_K (natural layout): per half superblock one 64-byte load of ql (groups t0 | t1 in its low
 * nibbles, t2 | t3 in its high ones) and 32 bytes of qh, broadcast and shifted per half. */
static inline __attribute__((always_inline)) void dot_q6_k_512(const uint8_t *wr, const xq_t *X,
                                                               float *out, const int M) {
    const int64_t nsb = X->K / 256, K = X->K, nbp = X->nbp;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i z = _mm512_setzero_si512();
    const __m512i shl = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);
    const __m512i shr = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    const __m512i c1 = _mm512_or_si512(shl, _mm512_slli_epi64(shl, 16));
    const __m512i c2 = _mm512_or_si512(shr, _mm512_slli_epi64(shr, 16));
    const __m512i cnt_l = _mm512_or_si512(c1, _mm512_slli_epi64(c1, 32));
    const __m512i cnt_r = _mm512_or_si512(c2, _mm512_slli_epi64(c2, 32));
    const __m512i idx[4] = {
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
        _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
        _mm512_setr_epi32(8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11),
        _mm512_setr_epi32(12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15)};
    __m512 acc[QMAX_ROWS], acc1[QMAX_ROWS], acco[QMAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = acc1[m] = acco[m] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = wr + sb * 210;
        prefetch_span(b, 210);
        const __m512 dsc = _mm512_mul_ps(
            _mm512_set1_ps(f16(b + 208)),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
        const __m512 doff = _mm512_mul_ps(dsc, _mm512_set1_ps(-32.0f));
        __m512 sc[QMAX_ROWS];
        for (int m = 0; m < M; m++) {
            sc[m] = _mm512_mul_ps(dsc, _mm512_loadu_ps(X->d16 + m * 2 * nbp + 16 * sb));
            acco[m] = _mm512_fmadd_ps(doff, _mm512_loadu_ps(X->s16 + m * 2 * nbp + 16 * sb), acco[m]);
        }
        for (int h = 0; h < 2; h++) {
            const __m512i A = _mm512_loadu_si512(b + 64 * h);
            const __m512i C = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
            const __m512i lo = _mm512_or_si512(_mm512_and_si512(A, lo4),
                                               _mm512_and_si512(_mm512_sllv_epi16(C, cnt_l), m30));
            const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(A, 4), lo4),
                                               _mm512_and_si512(_mm512_srlv_epi16(C, cnt_r), m30));
            for (int m = 0; m < M; m++) {
                const int8_t *x = X->nat + m * K + 256 * sb + 128 * h;
                __m512i p0 = _mm512_dpbusd_epi32(z, lo, _mm512_loadu_si512(x));
                __m512i p1 = _mm512_dpbusd_epi32(z, hi, _mm512_loadu_si512(x + 64));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0),
                                         _mm512_permutexvar_ps(idx[2 * h], sc[m]), acc[m]);
                acc1[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1),
                                          _mm512_permutexvar_ps(idx[2 * h + 1], sc[m]), acc1[m]);
            }
        }
    }
    for (int m = 0; m < M; m++)
        out[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m], acc1[m]), acco[m]));
}
#else
#define HAVE_Q512 0
#endif
#endif
