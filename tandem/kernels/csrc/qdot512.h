/* The 512-bit kernels of the quantized GEMV (AVX512 F/BW/VL + VNNI), over the activation
 * layouts of qx.h. Included by qgemv.c after qdot256.h.
 *
 * Every kernel sums in canon.h's order, so a row's output is the prefill kernels' (qgemm.c,
 * qgemm256.c) bit for bit: per group of 16 blocks (a K-quant: 16 sub-blocks, two superblocks)
 * the integer dots come out of VPDPBUSD as partial int32 lanes, are summed exactly into one lane
 * per block (a few integer unpacks and adds per group and row: sum4x4, sum8x2), the symmetric
 * types' offset folded in as an integer (I = U - c sum q), then one convert and one multiply-add
 * by s dx per group of 16 blocks (the offset types a second, o (dx sum q)). The scales of 16
 * blocks come in one gather. The interleaved layouts put a block's low- and high-nibble dots in
 * the same lanes (qx.h), so each 64-byte load of quants serves 4 blocks.
 */
#ifndef TANDEM_QDOT512_H
#define TANDEM_QDOT512_H
#include "qdot256.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define HAVE_Q512 1

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

/* The qs of the 4 blocks at b4 (`bytes` each, qs at byte `qs` of a block) side by side: with
 * AVX512-VBMI one byte permute (`qs_ix`, QS_16's table) of two loads, else load_qs4. */
static inline __attribute__((always_inline)) __m512i qs_of_4(const uint8_t *b4, int64_t bytes,
                                                             int64_t qs, __m512i qs_ix) {
#if defined(__AVX512VBMI__)
    (void)qs;
    return _mm512_permutex2var_epi8(_mm512_loadu_si512(b4), qs_ix,
                                    _mm512_loadu_si512(b4 + 4 * bytes - 64));
#else
    (void)qs_ix;
    return load_qs4(b4 + qs, bytes);
#endif
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
#endif

/* 4 vectors whose 128-bit lane j holds 4 partial sums of block 4k + j (vector k) -> lane i the
 * exact total of block i. */
static inline __m512i sum4x4(__m512i p0, __m512i p1, __m512i p2, __m512i p3) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(p2, p3), _mm512_unpackhi_epi32(p2, p3));
    const __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    /* c: 128-bit lane j, element k = block 4k + j */
    return _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), c);
}

/* 8 vectors, lanes 0-7 of vector k partial sums of one block ("first") and lanes 8-15 of another
 * ("second") -> lane L the exact total of: L < 4 the first block of vector L, 4-7 the second of
 * vector L - 4, 8-11 the first of vector L - 4, 12-15 the second of L - 8; then `order` moves
 * lane order[i] to lane i. */
static inline __m512i sum8x2(const __m512i v[8], __m512i order) {
    __m512i t[4];
    for (int k = 0; k < 4; k++)
        t[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
                                _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
    const __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]), _mm512_unpackhi_epi64(t[0], t[1]));
    const __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2], t[3]), _mm512_unpackhi_epi64(t[2], t[3]));
    /* u: 128-bit lane q, element k = the sum of vector k's (k + 4 for u1) 128-bit lane q */
    const __m512i w = _mm512_add_epi32(_mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_epi32(order, w);
}

static inline __mmask16 live16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

/* The 4 bytes at base + i * stride (lanes i < n; 0 elsewhere). */
static inline __m512i gather_blocks(const uint8_t *base, int64_t stride, int64_t n) {
    const __m512i ix = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)stride));
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live16(n), ix, base, 1);
}

static inline __m512 f16_lanes(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }

/* Q4_0, Q4_1, Q5_0, Q5_1: per group of 16 blocks, four 64-byte vectors of 4 blocks' qs over the
 * i32 layout (one byte permute of two loads where the CPU has AVX512-VBMI), each row's 4
 * VPDPBUSD pairs summed per block (sum4x4); the last K/32 % 4 blocks of a row (natural layout
 * there) one 256-bit dot each. Q4_0 / Q5_0 are symmetric (I = U - 8 / 16 sum q), Q4_1 / Q5_1
 * carry the offset m (canon.h). */
static inline __attribute__((always_inline)) void dot_b32_512(const int t, const uint8_t *wr,
                                                              const xq_t *X, float *out,
                                                              const int M) {
    const int64_t BYTES = t == GT_Q4_0 ? 18 : t == GT_Q4_1 ? 20 : t == GT_Q5_0 ? 22 : 24;
    const int64_t QS = t == GT_Q4_0 ? 2 : t == GT_Q4_1 ? 4 : t == GT_Q5_0 ? 6 : 8;
    const int sym = t == GT_Q4_0 || t == GT_Q5_0, five = t == GT_Q5_0 || t == GT_Q5_1;
    const int64_t nb = X->K / 32, K = X->K, nbp = X->nbp;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), z = _mm512_setzero_si512();
#if defined(__AVX512VBMI__)
    const __m512i qs_ix = _mm512_set_epi8(QS_16(48), QS_16(32), QS_16(16), QS_16(0));
#else
    const __m512i qs_ix = _mm512_setzero_si512(); /* unused: load_qs4 */
#endif
    __m512 acc[QMAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int64_t n = nb - b0 < 16 ? nb - b0 : 16, k4 = n / 4;
        const uint8_t *blk = wr + b0 * BYTES;
        prefetch_span(blk, n * BYTES);
        const __m512i dm = gather_blocks(blk, BYTES, n);
        const __m512 sd = f16_lanes(dm), so = f16_lanes(_mm512_srli_epi32(dm, 16));
        __m512i lo[4], hi[4];
        for (int64_t k = 0; k < k4; k++) {
            const uint8_t *b4 = blk + 4 * k * BYTES;
            const __m512i v = qs_of_4(b4, BYTES, QS, qs_ix);
            lo[k] = _mm512_and_si512(v, lo4), hi[k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
            if (five) fifth_bits4(b4 + QS - 4, BYTES, &lo[k], &hi[k]);
        }
        for (int m = 0; m < M; m++) {
            __m512i p[4] = {z, z, z, z};
            for (int64_t k = 0; k < k4; k++) {
                const int8_t *xi = X->i32 + m * K + 32 * (b0 + 4 * k);
                p[k] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo[k], _mm512_loadu_si512(xi)),
                                           hi[k], _mm512_loadu_si512(xi + 64));
            }
            __m512i U = sum4x4(p[0], p[1], p[2], p[3]);
            for (int64_t i = 4 * k4; i < n; i++) { /* natural layout: the row's last blocks */
                const uint8_t *b = blk + i * BYTES;
                const __m128i raw = _mm_loadu_si128((const __m128i *)(b + QS));
                __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                                             _mm256_set1_epi8(0x0F));
                if (five) u = _mm256_or_si256(u, fifth_bits(b + QS - 4));
                const __m256i xm = _mm256_loadu_si256((const __m256i *)(X->i32 + m * K + 32 * (b0 + i)));
                U = _mm512_mask_set1_epi32(U, (__mmask16)(1u << i),
                                           qx_hsum_i32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xm)));
            }
            if (sym)
                U = _mm512_sub_epi32(U, _mm512_slli_epi32(_mm512_loadu_si512(X->q32 + m * nbp + b0),
                                                          t == GT_Q4_0 ? 3 : 4));
            const __m512 sc = _mm512_mul_ps(sd, _mm512_loadu_ps(X->d + m * nbp + b0));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(U), sc, acc[m]);
            if (!sym) acc[m] = _mm512_fmadd_ps(so, _mm512_loadu_ps(X->s + m * nbp + b0), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) out[m] = canon_reduce512(acc[m]);
}

/* MXFP4 as dot_b32_512 runs Q4_0: the 16-byte code arrays of 4 blocks side by side in one vector,
 * decoded by a byte shuffle to |kv| (the unsigned operand of VPDPBUSD) and kv's sign (bit 3 of
 * the code) moved onto x by a masked negation, so the integer dot is I = sum kv q exactly; the
 * scales 2^(e - 128) of 16 blocks formed from their exponent bytes by vector shifts (quant.h's
 * tq_e8m0_half). */
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
    const __m256i ka8 = _mm256_setr_epi8(TQ_MXFP4_ABS, TQ_MXFP4_ABS);
    const __m256i kv8 = _mm256_setr_epi8(TQ_MXFP4_KV, TQ_MXFP4_KV);
    const __m512i neg_lo = _mm512_set1_epi8(0x08), neg_hi = _mm512_set1_epi8((char)0x80);
#if defined(__AVX512VBMI__)
    const __m512i qs_ix = _mm512_set_epi8(QS_16(48), QS_16(32), QS_16(16), QS_16(0));
#else
    const __m512i qs_ix = _mm512_setzero_si512(); /* unused: load_qs4 */
#endif
    __m512 acc[QMAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int64_t n = nb - b0 < 16 ? nb - b0 : 16, k4 = n / 4;
        const uint8_t *blk = wr + b0 * BYTES;
        prefetch_span(blk, n * BYTES);
        const __m512 sd = _mm512_maskz_mov_ps(
            live16(n), e8m0_half16(_mm512_and_si512(gather_blocks(blk, BYTES, n), _mm512_set1_epi32(0xFF))));
        __m512i ulo[4], uhi[4];
        __mmask64 nlo[4], nhi[4];
        for (int64_t k = 0; k < k4; k++) {
            const uint8_t *b4 = blk + 4 * k * BYTES;
            const __m512i v = qs_of_4(b4, BYTES, QS, qs_ix);
            ulo[k] = _mm512_shuffle_epi8(ka, _mm512_and_si512(v, lo4));
            uhi[k] = _mm512_shuffle_epi8(ka, _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4));
            nlo[k] = _mm512_test_epi8_mask(v, neg_lo), nhi[k] = _mm512_test_epi8_mask(v, neg_hi);
        }
        for (int m = 0; m < M; m++) {
            __m512i p[4] = {z, z, z, z};
            for (int64_t k = 0; k < k4; k++) {
                const int8_t *xi = X->i32 + m * K + 32 * (b0 + 4 * k);
                const __m512i xl = _mm512_loadu_si512(xi), xh = _mm512_loadu_si512(xi + 64);
                p[k] = _mm512_dpbusd_epi32(z, ulo[k], _mm512_mask_sub_epi8(xl, nlo[k], z, xl));
                p[k] = _mm512_dpbusd_epi32(p[k], uhi[k], _mm512_mask_sub_epi8(xh, nhi[k], z, xh));
            }
            __m512i I = sum4x4(p[0], p[1], p[2], p[3]);
            for (int64_t i = 4 * k4; i < n; i++) { /* natural layout: the row's last blocks */
                const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + i * BYTES + QS));
                const __m256i c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                                                   _mm256_set1_epi8(0x0F));
                const __m256i xm = _mm256_loadu_si256((const __m256i *)(X->i32 + m * K + 32 * (b0 + i)));
                const __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_shuffle_epi8(ka8, c),
                                                      _mm256_sign_epi8(xm, _mm256_shuffle_epi8(kv8, c)));
                I = _mm512_mask_set1_epi32(I, (__mmask16)(1u << i), qx_hsum_i32(d));
            }
            const __m512 sc = _mm512_mul_ps(sd, _mm512_loadu_ps(X->d + m * nbp + b0));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), sc, acc[m]);
        }
    }
    for (int m = 0; m < M; m++) out[m] = canon_reduce512(acc[m]);
}

/* Q8_0, NR <= QMAX_NR consecutive rows of W (rb bytes apart) against the same X: 2 blocks per
 * 512-bit vector (natural layout), w + 128 (w XOR 0x80, an unsigned byte) against x, so that
 * U = sum (w + 128) q and I = U - 128 sum q (qx.h's exact q32); 8 vectors per group of 16
 * blocks summed per block (sum8x2; an odd last block alone in its vector, x zero past it). The
 * rows of a step share the group's X (still in L1) and give the core NR independent chains;
 * each row sums in canon.h's order, so its output does not depend on NR. out[r QMAX_ROWS + m]. */
static inline __attribute__((always_inline)) void dot_q8_0_512(const uint8_t *w0, int64_t rb,
                                                               const int NR, const xq_t *X,
                                                               float *out, const int M) {
    const int64_t nb = X->K / 32, K = X->K, nbp = X->nbp;
    const __m512i z = _mm512_setzero_si512(), flip = _mm512_set1_epi8((char)0x80);
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    __m512 acc[QMAX_NR][QMAX_ROWS];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int64_t n = nb - b0 < 16 ? nb - b0 : 16, nv = (n + 1) / 2;
        const __mmask64 last = 2 * nv > n ? (__mmask64)0xFFFFFFFFu : ~(__mmask64)0;
        for (int r = 0; r < NR; r++) {
            const uint8_t *blk = w0 + r * rb + b0 * 34;
            prefetch_span(blk, n * 34);
            const __m512 sd = f16_lanes(gather_blocks(blk, 34, n));
            __m512i u[8];
            for (int64_t k = 0; k < nv; k++) {
                const uint8_t *b = blk + 68 * k;
                const int two = 2 * k + 1 < n;
                const __m512i w = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                    two ? _mm256_loadu_si256((const __m256i *)(b + 36)) : _mm256_setzero_si256(), 1);
                u[k] = _mm512_xor_si512(w, flip);
            }
            for (int m = 0; m < M; m++) {
                const int8_t *xm = X->nat + m * K + 32 * b0;
                __m512i p[8];
                for (int k = 0; k < 8; k++) p[k] = z;
                for (int64_t k = 0; k < nv; k++) {
                    const __m512i x = k + 1 < nv ? _mm512_loadu_si512(xm + 64 * k)
                                                 : _mm512_maskz_loadu_epi8(last, xm + 64 * k);
                    p[k] = _mm512_dpbusd_epi32(z, u[k], x);
                }
                const __m512i sq = _mm512_slli_epi32(_mm512_loadu_si512(X->q32 + m * nbp + b0), 7);
                const __m512i I = _mm512_sub_epi32(sum8x2(p, order), sq);
                const __m512 sc = _mm512_mul_ps(sd, _mm512_loadu_ps(X->d + m * nbp + b0));
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), sc, acc[r][m]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < M; m++) out[r * QMAX_ROWS + m] = canon_reduce512(acc[r][m]);
}

/* GT_Q8_0X (quant.h), NR <= QMAX_NR consecutive rows of W (rb bytes apart) against X's t16
 * layout: per group of 16 blocks and row, one 32-byte load of the 16 scales and 8 VPDPBUSD over
 * 64-byte vectors whose lane i is block i alone, so the chain leaves U (w + 128 against q) of
 * block i in lane i with no horizontal sums; I = U - 128 sum q and acc = fma(I, s dx, acc) as
 * canon.h orders it, the same bits as dot_q8_0_512 on the rows before repacking. A last partial
 * group of n blocks: its runs are 4 n bytes, loaded masked (lanes >= n: w, s 0; X's t16 0). */
static inline __attribute__((always_inline)) void dot_q8_0x_512(const uint8_t *w0, int64_t rb,
                                                                const int NR, const xq_t *X,
                                                                float *out, const int M) {
    const int64_t nb = X->K / 32, nbp = X->nbp, T = QX_T16(X->K);
    const __m512i z = _mm512_setzero_si512();
    __m512 acc[QMAX_NR][QMAX_ROWS];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int64_t n = nb - b0 < 16 ? nb - b0 : 16;
        const __mmask16 live = live16(n);
        for (int r = 0; r < NR; r++) {
            const uint8_t *row = w0 + r * rb, *qg = row + 2 * nb + 32 * b0;
            prefetch_span(row + 34 * b0, 34 * n); /* the row's share: every line once */
            const __m512 sd = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, row + 2 * b0));
            __m512i u[8];
            for (int k = 0; k < 8; k++)
                u[k] = n == 16 ? _mm512_loadu_si512(qg + 64 * k)
                               : _mm512_maskz_loadu_epi32(live, qg + 4 * n * k);
            for (int m = 0; m < M; m++) {
                const int8_t *xt = X->t16 + m * T + 32 * b0;
                __m512i a0 = z, a1 = z;
                for (int k = 0; k < 8; k += 2) {
                    a0 = _mm512_dpbusd_epi32(a0, u[k], _mm512_loadu_si512(xt + 64 * k));
                    a1 = _mm512_dpbusd_epi32(a1, u[k + 1], _mm512_loadu_si512(xt + 64 * k + 64));
                }
                const __m512i sq = _mm512_slli_epi32(_mm512_loadu_si512(X->q32 + m * nbp + b0), 7);
                const __m512i I = _mm512_sub_epi32(_mm512_add_epi32(a0, a1), sq);
                const __m512 sc = _mm512_mul_ps(sd, _mm512_loadu_ps(X->d + m * nbp + b0));
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), sc, acc[r][m]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < M; m++) out[r * QMAX_ROWS + m] = canon_reduce512(acc[r][m]);
}

/* Q4_K / Q5_K over the ik layout, per group of two superblocks (16 sub-blocks): per 128 elements
 * one 64-byte load of qs, sub-blocks 4c and 4c + 2 in its low nibbles, 4c + 1 and 4c + 3 in its
 * high ones; each row's 8 VPDPBUSD summed per sub-block (sum8x2). */
static inline __attribute__((always_inline)) void dot_k45_512(const int t, const uint8_t *wr,
                                                              const xq_t *X, float *out,
                                                              const int M) {
    const int64_t bytes = t == GT_Q4_K ? 144 : 176, qs_at = t == GT_Q4_K ? 16 : 48;
    const int64_t nsb = X->K / 256, K = X->K, nbp = X->nbp;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10);
    const __m512i z = _mm512_setzero_si512();
    const __m512i order = _mm512_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    /* Q5_K: bit k of a qh byte to bit 4; per 256-bit half the sub-block's k (after >> 4c) */
    const __m512i shl_lo = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);
    const __m512i shl_hi = _mm512_setr_epi64(3, 3, 3, 3, 1, 1, 1, 1);
    const __m512i cnt_lo = _mm512_or_si512(shl_lo, _mm512_slli_epi64(shl_lo, 16));
    const __m512i cnt_hi = _mm512_or_si512(shl_hi, _mm512_slli_epi64(shl_hi, 16));
    const __m512i cnt_lo16 = _mm512_or_si512(cnt_lo, _mm512_slli_epi64(cnt_lo, 32));
    const __m512i cnt_hi16 = _mm512_or_si512(cnt_hi, _mm512_slli_epi64(cnt_hi, 32));
    __m512 acc[QMAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < nsb; s0 += 2) {
        const int ns = nsb - s0 < 2 ? 1 : 2;
        __m256 dsc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, dmn[2] = {dsc[0], dsc[1]};
        __m512i lo[4], hi[4];
        for (int k = 0; k < 4; k++) lo[k] = hi[k] = z;
        for (int h = 0; h < ns; h++) {
            const uint8_t *b = wr + (s0 + h) * bytes;
            prefetch_span(b, bytes);
            uint32_t u[4];
            kquant_scales(b + 4, u);
            dsc[h] = _mm256_mul_ps(u8x8_to_ps(u), _mm256_set1_ps(f16(b)));
            dmn[h] = _mm256_mul_ps(u8x8_to_ps(u + 2), _mm256_set1_ps(-f16(b + 2)));
            __m512i hz = z;
            if (t == GT_Q5_K) hz = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
            for (int c = 0; c < 2; c++) {
                const __m512i v = _mm512_loadu_si512(b + qs_at + 64 * c);
                __m512i l = _mm512_and_si512(v, lo4), g = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                if (t == GT_Q5_K) {
                    const __m512i hh = c ? _mm512_srli_epi16(hz, 4) : hz;
                    l = _mm512_or_si512(l, _mm512_and_si512(_mm512_sllv_epi16(hh, cnt_lo16), b4));
                    g = _mm512_or_si512(g, _mm512_and_si512(_mm512_sllv_epi16(hh, cnt_hi16), b4));
                }
                lo[2 * h + c] = l, hi[2 * h + c] = g;
            }
        }
        const __m512 S = _mm512_insertf32x8(_mm512_castps256_ps512(dsc[0]), dsc[1], 1);
        const __m512 O = _mm512_insertf32x8(_mm512_castps256_ps512(dmn[0]), dmn[1], 1);
        for (int m = 0; m < M; m++) {
            __m512i p[8];
            for (int k = 0; k < 8; k++) p[k] = z;
            for (int h = 0; h < ns; h++)
                for (int c = 0; c < 2; c++) {
                    const int8_t *x = X->ik + m * K + 256 * (s0 + h) + 128 * c;
                    p[4 * h + 2 * c] = _mm512_dpbusd_epi32(z, lo[2 * h + c], _mm512_loadu_si512(x));
                    p[4 * h + 2 * c + 1] = _mm512_dpbusd_epi32(z, hi[2 * h + c], _mm512_loadu_si512(x + 64));
                }
            const __m512i U = sum8x2(p, order);
            const int64_t at = m * nbp + 8 * s0;
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(U), _mm512_mul_ps(S, _mm512_loadu_ps(X->d + at)), acc[m]);
            acc[m] = _mm512_fmadd_ps(O, _mm512_loadu_ps(X->s + at), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) out[m] = canon_reduce512(acc[m]);
}

/* Q6_K (natural layout), per group of two superblocks (16 groups of 32): per half superblock one
 * 64-byte load of ql (groups t0 | t1 in its low nibbles, t2 | t3 in its high ones) and 32 bytes
 * of qh, broadcast and shifted per half; each row's 4 VPDPBUSD per superblock summed per 16
 * elements (sum4x4), the first and second halves of each group of 32 apart, each with its own
 * scale, I = U - 32 sum q. */
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
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m512 acc[QMAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < nsb; s0 += 2) {
        const int ns = nsb - s0 < 2 ? 1 : 2;
        __m512 dsc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        __m512i lo[4], hi[4];
        for (int k = 0; k < 4; k++) lo[k] = hi[k] = z;
        for (int s = 0; s < ns; s++) {
            const uint8_t *b = wr + (s0 + s) * 210;
            prefetch_span(b, 210);
            dsc[s] = _mm512_mul_ps(
                _mm512_set1_ps(f16(b + 208)),
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
            for (int h = 0; h < 2; h++) {
                const __m512i A = _mm512_loadu_si512(b + 64 * h);
                const __m512i C = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
                lo[2 * s + h] = _mm512_or_si512(_mm512_and_si512(A, lo4),
                                                _mm512_and_si512(_mm512_sllv_epi16(C, cnt_l), m30));
                hi[2 * s + h] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(A, 4), lo4),
                                                _mm512_and_si512(_mm512_srlv_epi16(C, cnt_r), m30));
            }
        }
        /* lane i: group i's first (second) half scale d sc */
        const __m512 Sf = _mm512_permutex2var_ps(dsc[0], even, dsc[1]);
        const __m512 Ss = _mm512_permutex2var_ps(dsc[0], odd, dsc[1]);
        for (int m = 0; m < M; m++) {
            __m512i U[2] = {z, z};
            for (int s = 0; s < ns; s++) {
                const int8_t *x = X->nat + m * K + 256 * (s0 + s);
                __m512i p[4];
                for (int h = 0; h < 2; h++) {
                    p[2 * h] = _mm512_dpbusd_epi32(z, lo[2 * s + h], _mm512_loadu_si512(x + 128 * h));
                    p[2 * h + 1] = _mm512_dpbusd_epi32(z, hi[2 * s + h], _mm512_loadu_si512(x + 128 * h + 64));
                }
                U[s] = sum4x4(p[0], p[1], p[2], p[3]); /* lane 2jj + k: group jj's half k */
            }
            const int32_t *q16 = X->q16 + m * 2 * nbp + 16 * s0;
            const __m512i qa = _mm512_loadu_si512(q16), qb = _mm512_loadu_si512(q16 + 16);
            const __m512i If = _mm512_sub_epi32(_mm512_permutex2var_epi32(U[0], even, U[1]),
                                                _mm512_slli_epi32(_mm512_permutex2var_epi32(qa, even, qb), 5));
            const __m512i Is = _mm512_sub_epi32(_mm512_permutex2var_epi32(U[0], odd, U[1]),
                                                _mm512_slli_epi32(_mm512_permutex2var_epi32(qa, odd, qb), 5));
            const __m512 dx = _mm512_loadu_ps(X->d + m * nbp + 8 * s0);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(If), _mm512_mul_ps(Sf, dx), acc[m]);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Is), _mm512_mul_ps(Ss, dx), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) out[m] = canon_reduce512(acc[m]);
}
#else
#define HAVE_Q512 0
#endif
#endif
