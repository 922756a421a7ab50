/* The Gated DeltaNet token mixer of the Qwen3.5 / 3.6 hybrid (tandem/models/deltanet.py), one
 * sequence's tokens in order, float32, as the recurrent form (tandem/models/delta_rule.py).
 *
 * Shapes: Hk q/k heads of dk, Hv v heads of dv (r = Hv / Hk), C = 2 Hk dk + Hv dv conv channels,
 * conv window K. A token's projections are one row P = [qkv (C) | z (Hv dv) | b (Hv) | a (Hv)]
 * (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a of the normed input). Per token:
 *
 *   conv   m_c = silu(sum_{j<K-1} w[c, j] win[c, j] + w[c, K-1] qkv_c)     per channel c;
 *          then win[c, :] <- (win[c, 1:], qkv_c): the last K-1 inputs
 *   split  q, k (Hk x dk), v (Hv x dv) = m;  q_h <- q_h / sqrt(|q_h|^2 + 1e-6) * dk^-1/2,
 *          k_h <- k_h / sqrt(|k_h|^2 + 1e-6)
 *   gates  beta_j = sigmoid(b_j),  g_j = A_j softplus(a_j + dt_j)    (A < 0: -exp(A_log))
 *   rule   per v head j, served by q/k head j % Hk (tiled: a GGUF) or j / r (grouped: HF),
 *          S_j (dk x dv): S <- e^g S;  d = beta (v_j - S^T k);  S <- S + k d^T;  o = S^T q
 *   norm   y_j = (w * (o / sqrt(mean(o^2) + eps))) * silu(z_j)          (plain w, dv)
 *
 * The v heads are independent (no reduction across them): threads split them, and the conv's
 * channels. The state and window are the sequence's own (read and written in place). tandem_deltanet_step is one decode
 * token of a whole layer in one call: rmsnorm(h) (the layer's input norm), the fused in
 * projection (one tq_linear over the four weights' parts), the mix above, out_proj; the caller
 * adds the residual, as csrc/decode_block.c's blocks leave it to it.
 *
 * Against the torch reference the sums run in another order (the conv taps, the l2 and rms
 * sums, S^T k and S^T q over dk): equal within float32 rounding, not bit for bit.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "dtypes.h"
#include "quant.h"

int tandem_rmsnorm(const void *x, int64_t x_stride, const void *w, void *y, int64_t rows,
                   int64_t dim, float eps, int dt, int nthreads);

#define DN_L2_EPS 1e-6f /* flash-linear-attention's l2norm eps (models/delta_rule.py) */

static inline float silu_f(float x) { return x / (1.0f + expf(-x)); }

static inline float softplus_f(float x) { /* torch's F.softplus: beta 1, threshold 20 */
    return x > 20.0f ? x : log1pf(expf(x));
}

/* 1 / sqrt(sum x^2 + eps) over n values */
static inline float inv_l2(const float *x, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    return 1.0f / sqrtf(s + DN_L2_EPS);
}

/* One v head's delta rule and gated norm for one token: S (dk x dv) in place, y (dv), ks (dv)
 * scratch. Two passes over S's rows, each vectorized along its dv columns: S <- e^g S while
 * ks = S^T k accumulates row by row; then S <- S + k d^T while o = S^T q accumulates. Every
 * element's arithmetic and every sum's order over i (0 to dk - 1) are the column-at-a-time
 * form's, so the result is the same bits, read at unit stride. */
static void head_step(float *S, const float *q, const float *k, const float *v, const float *z,
                      float g, float beta, const float *norm_w, float eps, float *y, float *ks,
                      int64_t dk, int64_t dv) {
    const float decay = expf(g);
    for (int64_t d = 0; d < dv; d++) ks[d] = 0.0f;
    for (int64_t i = 0; i < dk; i++) { /* S <- e^g S; ks = S^T k */
        float *Si = S + i * dv;
        const float ki = k[i];
        for (int64_t d = 0; d < dv; d++) {
            Si[d] *= decay;
            ks[d] += ki * Si[d];
        }
    }
    for (int64_t d = 0; d < dv; d++) ks[d] = (v[d] - ks[d]) * beta; /* d = beta (v - S^T k) */
    for (int64_t d = 0; d < dv; d++) y[d] = 0.0f;
    for (int64_t i = 0; i < dk; i++) { /* S += k d^T; o = S^T q, kept in y */
        float *Si = S + i * dv;
        const float ki = k[i], qi = q[i];
        for (int64_t d = 0; d < dv; d++) {
            Si[d] += ki * ks[d];
            y[d] += qi * Si[d];
        }
    }
    float ms = 0.0f;
    for (int64_t d = 0; d < dv; d++) ms += y[d] * y[d];
    const float inv = 1.0f / sqrtf(ms / (float)dv + eps);
    for (int64_t d = 0; d < dv; d++) y[d] = (norm_w[d] * (y[d] * inv)) * silu_f(z[d]);
}

#define DN_BLOCK 64 /* tokens per pass: m (DN_BLOCK x C floats) bounds the scratch */

/* T tokens of one sequence (module comment): proj (T rows of P, row stride proj_stride floats)
 * -> y (T, Hv dv); conv_w (C, K), A and dt_bias (Hv), norm_w (dv) float32; window (C, K-1) and
 * state (Hv, dk, dv) float32, updated in place. 0, or -1 for a bad shape or no memory.
 * Three passes over a block of tokens, each split over threads by what is independent: the conv
 * by channel (each its own window, its tokens in order), the l2 norms by (token, head), the
 * delta rule and gated norm by v head (each its own state, its tokens in order); so a block
 * costs three parallel regions however many tokens it holds. */
int tandem_deltanet_mix(const float *proj, int64_t proj_stride, int64_t T, const float *conv_w,
                        const float *A, const float *dt_bias, const float *norm_w, float eps,
                        float *window, float *state, float *y, int64_t Hk, int64_t Hv,
                        int64_t dk, int64_t dv, int64_t K, int tiled, int nthreads) {
    if (T < 1 || Hk < 1 || Hv < 1 || Hv % Hk || dk < 1 || dv < 1 || K < 2) return -1;
    const int64_t C = 2 * Hk * dk + Hv * dv, W = K - 1, r = Hv / Hk;
    if (proj_stride < C + Hv * dv + 2 * Hv) return -1;
    const int64_t nb = T < DN_BLOCK ? T : DN_BLOCK;
    /* m (nb, C), then ks (Hv, dv): each v head's S^T k */
    float *m = (float *)malloc((size_t)(nb * C + Hv * dv) * sizeof(float));
    if (!m) return -1;
    float *ks = m + nb * C;
    const float qscale = 1.0f / sqrtf((float)dk);
    for (int64_t t0 = 0; t0 < T; t0 += nb) {
        const int64_t n = T - t0 < nb ? T - t0 : nb;
        const float *p0 = proj + t0 * proj_stride;
#pragma omp parallel for if (n * C * K >= 4096) num_threads(nthreads)
        for (int64_t c = 0; c < C; c++) { /* the conv, channel c over the block's tokens */
            float *win = window + c * W;
            const float *w = conv_w + c * K;
            for (int64_t t = 0; t < n; t++) {
                const float x = p0[t * proj_stride + c];
                float s = 0.0f;
                for (int64_t j = 0; j < W; j++) s += w[j] * win[j];
                s += w[W] * x;
                m[t * C + c] = silu_f(s);
                for (int64_t j = 0; j + 1 < W; j++) win[j] = win[j + 1];
                win[W - 1] = x;
            }
        }
#pragma omp parallel for if (n * C >= 4096) num_threads(nthreads)
        for (int64_t th = 0; th < n * 2 * Hk; th++) { /* q heads then k heads, l2-normed */
            const int64_t t = th / (2 * Hk), h = th % (2 * Hk);
            float *x = m + t * C + h * dk;
            const float s = inv_l2(x, dk) * (h < Hk ? qscale : 1.0f);
            for (int64_t i = 0; i < dk; i++) x[i] *= s;
        }
#pragma omp parallel for if (n * Hv * dk * dv >= 16384) num_threads(nthreads)
        for (int64_t j = 0; j < Hv; j++) { /* v head j over the block's tokens */
            const int64_t h = tiled ? j % Hk : j / r;
            for (int64_t t = 0; t < n; t++) {
                const float *p = p0 + t * proj_stride, *mt = m + t * C;
                const float *z = p + C, *b = z + Hv * dv, *a = b + Hv;
                const float beta = 1.0f / (1.0f + expf(-b[j]));
                const float g = A[j] * softplus_f(a[j] + dt_bias[j]);
                head_step(state + j * dk * dv, mt + h * dk, mt + Hk * dk + h * dk,
                          mt + 2 * Hk * dk + j * dv, z + j * dv, g, beta, norm_w, eps,
                          y + (t0 + t) * Hv * dv + j * dv, ks + j * dv, dk, dv);
            }
        }
    }
    free(m);
    return 0;
}

/* One decode token through a whole DeltaNet mixer, float32: h (D) -> out (D) =
 * out_proj(mix(in_proj(rmsnorm(h) * in_norm))) (module comment); in_l: (C + Hv dv + 2 Hv, D),
 * out_l: (D, Hv dv), eps the input norm's, norm_eps the gated norm's. */
int tandem_deltanet_step(const float *h, const float *in_norm, float eps, const tq_linear *in_l,
                         const tq_linear *out_l, const float *conv_w, const float *A,
                         const float *dt_bias, const float *norm_w, float norm_eps, float *window,
                         float *state, float *out, int64_t D, int64_t Hk, int64_t Hv, int64_t dk,
                         int64_t dv, int64_t K, int tiled, int nthreads) {
    if (D < 1 || Hk < 1 || Hv < 1 || dk < 1 || dv < 1) return -1;
    const int64_t P = 2 * Hk * dk + 2 * Hv * dv + 2 * Hv;
    float *buf = (float *)malloc((size_t)(D + P + Hv * dv) * sizeof(float));
    if (!buf) return -1;
    float *xn = buf, *p = xn + D, *y = p + P;
    int rc = tandem_rmsnorm(h, D, in_norm, xn, 1, D, eps, DT_F32, nthreads);
    if (!rc) rc = tandem_linear1(in_l, xn, p, P, D, DT_F32, nthreads);
    if (!rc)
        rc = tandem_deltanet_mix(p, P, 1, conv_w, A, dt_bias, norm_w, norm_eps, window, state, y,
                                 Hk, Hv, dk, dv, K, tiled, nthreads);
    if (!rc) rc = tandem_linear1(out_l, y, out, D, Hv * dv, DT_F32, nthreads);
    free(buf);
    return rc;
}
