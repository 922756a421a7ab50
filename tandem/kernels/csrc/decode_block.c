/* A decoder layer's two halves for one decode token (one sequence, one new position), each one
 * call: the ops of gemv.c and decode_ops.c chained in C, so that between the weight streams no
 * Python runs. At batch 1 that interpreter time, paid with caches the last weight stream just
 * evicted, was 10-15 ms of a 55 ms bf16 Qwen3-0.6B token.
 *
 *   attention half:  a = o_proj(attend(rope(qk_norm(split(qkv_proj(rmsnorm(h)))))), cache)
 *                    with this token's k and v written into the cache at `pos` first
 *   MLP half:        m = down_proj(act(gate) * up),  [gate, up] = gate_up_proj(rmsnorm(h)),
 *                    act silu, or gelu_tanh (Gemma)
 *
 * The caller adds the residual (h + a, then h + m), as layers.py does. Each step is the
 * function the per-op path calls, with the same roundings, so this path and the per-op path
 * give the same result bit for bit.
 */
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "quant.h"

int tandem_gemv(const void *x, const void *w, const float *bias, void *y, int64_t M, int64_t N,
                int64_t K, int dt, int nthreads);
int tandem_rmsnorm(const void *x, int64_t x_stride, const void *w, void *y, int64_t rows,
                   int64_t dim, float eps, int dt, int nthreads);
int tandem_norm_rope(void *x, int64_t rows, int64_t heads, int64_t hd, int64_t row_stride,
                     const void *w, float eps, const void *cos, const void *sin, int pairs, int dt,
                     int nthreads);
int tandem_silu_mul(const void *gu, void *y, int64_t rows, int64_t inter, int dt, int nthreads);
int tandem_gelu_tanh_mul(const void *gu, void *y, int64_t rows, int64_t inter, int dt,
                         int nthreads);
int tandem_decode_attention(const void *q, int64_t q_stride, const void *k, const int64_t *ks,
                            const void *v, const int64_t *vs, void *out, int64_t B, int64_t G,
                            int64_t R, int64_t S, int64_t hd, float scale, int dt, int nthreads);
int tandem_step_attention(const void *q, const int64_t *qs, const void *k, const int64_t *ks,
                          const void *v, const int64_t *vs, void *out, int64_t B, int64_t T,
                          int64_t G, int64_t R, const int64_t *starts, const int64_t *lens,
                          int64_t window, const float *sinks, int64_t hd, float scale, int dt,
                          int nthreads);

/* quant.h: y (N) = L x (K) for one row, dense or quantized; -1 if L's parts do not make N rows. */
int tandem_linear1(const tq_linear *L, const void *x, void *y, int64_t N, int64_t K, int dt,
                   int nthreads) {
    if (!L->parts) return tandem_gemv(x, L->w, L->bias, y, 1, N, K, dt, nthreads);
    int64_t rows = 0;
    for (int64_t p = 0; p < L->nparts; p++) rows += L->parts[p].rows;
    if (rows != N) return -1;
    return tandem_qgemv(x, L->parts, L->nparts, L->bias, y, 1, K, dt, nthreads);
}

/* h (D) -> out (D), all of dtype dt. qkv: (H*hd + 2*G*hd, D) = [W_q; W_k; W_v] (quant.h's
 * tq_linear: dense of dtype dt or GGUF parts, bias float32 or NULL); o: (D, H*hd); q_norm /
 * k_norm (hd) or NULL; cos, sin (hd) for this position; `pairs` the q/k rows' RoPE layout
 * (decode_ops.c tandem_norm_rope's); the layer's cache for this sequence's slot: element
 * (g, s, d) of k at k_cache + g*kv_strides[0] + s*kv_strides[1] + d (v likewise); keys 0..pos
 * are attended, pos being written here, with scores scaled by `scale`; tandem_attention_block_ws
 * attends only keys max(0, pos - window + 1)..pos (window 0: all) and joins each head's sink
 * logit (`sinks`, float32 (H), or NULL) to its softmax (decode_ops.c's step attention; gpt-oss). */
int tandem_attention_block_ws(const void *h, const void *norm_w, float eps,
                              const tq_linear *qkv_l, const void *q_norm, const void *k_norm,
                              float qk_eps, const void *cos, const void *sin, int pairs,
                              void *k_cache, void *v_cache, const int64_t *kv_strides, int64_t pos,
                              int64_t window, const float *sinks, const tq_linear *o_l, void *out,
                              int64_t D, int64_t H, int64_t G, int64_t hd, float scale, int dt,
                              int nthreads) {
    if (D < 1 || H < 1 || G < 1 || H % G || hd < 2 || pos < 0 || window < 0) return -1;
    const int es = dt == DT_F32 ? 4 : 2;
    const int64_t width = (H + 2 * G) * hd;
    char *buf = (char *)malloc((size_t)(D + width + H * hd) * es);
    if (!buf) return -1;
    char *xn = buf, *qkv = xn + D * es, *att = qkv + width * es;
    char *q = qkv, *k = q + H * hd * es, *v = k + G * hd * es;
    int rc = tandem_rmsnorm(h, D, norm_w, xn, 1, D, eps, dt, nthreads);
    if (!rc) rc = tandem_linear1(qkv_l, xn, qkv, width, D, dt, nthreads);
    if (!rc) rc = tandem_norm_rope(q, 1, H, hd, width, q_norm, qk_eps, cos, sin, pairs, dt, nthreads);
    if (!rc) rc = tandem_norm_rope(k, 1, G, hd, width, k_norm, qk_eps, cos, sin, pairs, dt, nthreads);
    if (!rc) {
        for (int64_t g = 0; g < G; g++) { /* this token's key and value rows into the cache */
            int64_t off = (g * kv_strides[0] + pos * kv_strides[1]) * es;
            memcpy((char *)k_cache + off, k + g * hd * es, (size_t)(hd * es));
            memcpy((char *)v_cache + off, v + g * hd * es, (size_t)(hd * es));
        }
        const int64_t ks[3] = {0, kv_strides[0], kv_strides[1]};
        if (window == 0 && !sinks) {
            rc = tandem_decode_attention(q, width, k_cache, ks, v_cache, ks, att, 1, G, H / G,
                                         pos + 1, hd, scale, dt, nthreads);
        } else {
            const int64_t qs[2] = {0, width}, lens[1] = {1};
            rc = tandem_step_attention(q, qs, k_cache, ks, v_cache, ks, att, 1, 1, G, H / G, &pos,
                                       lens, window, sinks, hd, scale, dt, nthreads);
        }
    }
    if (!rc) rc = tandem_linear1(o_l, att, out, D, H * hd, dt, nthreads);
    free(buf);
    return rc;
}

int tandem_attention_block(const void *h, const void *norm_w, float eps, const tq_linear *qkv_l,
                           const void *q_norm, const void *k_norm, float qk_eps, const void *cos,
                           const void *sin, int pairs, void *k_cache, void *v_cache,
                           const int64_t *kv_strides, int64_t pos, const tq_linear *o_l,
                           void *out, int64_t D, int64_t H, int64_t G, int64_t hd, float scale,
                           int dt, int nthreads) {
    return tandem_attention_block_ws(h, norm_w, eps, qkv_l, q_norm, k_norm, qk_eps, cos, sin, pairs,
                                     k_cache, v_cache, kv_strides, pos, 0, NULL, o_l, out, D, H, G,
                                     hd, scale, dt, nthreads);
}

/* h (D) -> out (D), all of dtype dt: gu (2*I, D) = [W_gate; W_up], down (D, I) (tq_linear);
 * `act` the gate's activation: 0 silu (SwiGLU), 1 gelu_tanh (Gemma's GeGLU,
 * decode_ops.c tandem_gelu_tanh_mul). */
int tandem_mlp_block_act(const void *h, const void *norm_w, float eps, const tq_linear *gu_l,
                         const tq_linear *down_l, void *out, int64_t D, int64_t I, int act, int dt,
                         int nthreads) {
    if (D < 1 || I < 1 || act < 0 || act > 1) return -1;
    const int es = dt == DT_F32 ? 4 : 2;
    char *buf = (char *)malloc((size_t)(D + 3 * I) * es);
    if (!buf) return -1;
    char *xn = buf, *gu = xn + D * es, *a = gu + 2 * I * es;
    int rc = tandem_rmsnorm(h, D, norm_w, xn, 1, D, eps, dt, nthreads);
    if (!rc) rc = tandem_linear1(gu_l, xn, gu, 2 * I, D, dt, nthreads);
    if (!rc)
        rc = act ? tandem_gelu_tanh_mul(gu, a, 1, I, dt, nthreads)
                 : tandem_silu_mul(gu, a, 1, I, dt, nthreads);
    if (!rc) rc = tandem_linear1(down_l, a, out, D, I, dt, nthreads);
    free(buf);
    return rc;
}

int tandem_mlp_block(const void *h, const void *norm_w, float eps, const tq_linear *gu_l,
                     const tq_linear *down_l, void *out, int64_t D, int64_t I, int dt,
                     int nthreads) {
    return tandem_mlp_block_act(h, norm_w, eps, gu_l, down_l, out, D, I, 0, dt, nthreads);
}
