/* A stack of decoder layers for one decode token (one sequence, one new position) in one call:
 * decode_block.c's two halves per layer with the residual adds between them, so that no Python
 * runs from the first layer to the last. At batch 1 on a small model the interpreter between the
 * per-layer calls (module dispatch, the eligibility checks, ctypes argument conversion: ~60 us a
 * layer) is a large share of the token: SmolLM2-135M has 30 layers of ~2.2 MB of weights each.
 *
 *   for each layer l:  h = round(h + attn_out_norm_l(attention_block_l(h)))
 *                      h = round(h + mlp_out_norm_l(ffn_l(h)))
 *
 * ffn_l the layer's dense MLP half (silu or gelu_tanh) or its sparse block (csrc/moe.c
 * tandem_moe_layer, a shared expert too); the attention windowed and with sinks where the
 * layer has them; the out norms Gemma's sandwich norms, the identity elsewhere (tq_layer).
 *
 * `round` is the rounding to the activations' dtype that PyTorch's `h + a` applies (float32
 * arithmetic, one rounding), so this call gives what the per-layer calls give, bit for bit.
 */
#include <stdlib.h>

#include "dtypes.h"
#include "quant.h"
#include "decode_layers.h"

int tandem_attention_block_ws(const void *h, const void *norm_w, float eps,
                              const tq_linear *qkv_l, const void *q_norm, const void *k_norm,
                              float qk_eps, const void *cos, const void *sin, int pairs,
                              void *k_cache, void *v_cache, const int64_t *kv_strides, int64_t pos,
                              int64_t window, const float *sinks, const tq_linear *o_l, void *out,
                              int64_t D, int64_t H, int64_t G, int64_t hd, float scale, int dt,
                              int nthreads);
int tandem_mlp_block_act(const void *h, const void *norm_w, float eps, const tq_linear *gu_l,
                         const tq_linear *down_l, void *out, int64_t D, int64_t I, int act, int dt,
                         int nthreads);
int tandem_rmsnorm(const void *x, int64_t x_stride, const void *w, void *y, int64_t rows,
                   int64_t dim, float eps, int dt, int nthreads);

/* h += x elementwise over n elements of dtype dt, each sum rounded once to dt. */
static void residual_add(void *h, const void *x, int64_t n, int dt) {
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) store8(h, i, _mm256_add_ps(load8(h, i, dt), load8(x, i, dt)), dt);
#endif
    for (; i < n; i++) store1(h, i, load1(h, i, dt) + load1(x, i, dt), dt);
}

/* h (D), in place: the `n` layers in order, this token at position `pos` written into each
 * layer's cache row of `slot` (cos, sin: (hd) for pos, the global table; cos_local, sin_local
 * the local table's rows, for a layer with rope_local, else may be NULL; D, H q heads, G kv
 * heads of hd, I the dense MLP width, scale the attention's score scale), x (D) the caller's
 * scratch. Returns 0, or -1 where a block refuses. */
int tq_decode_layers_with(const tq_layer *layers, int64_t n, void *h, const void *cos,
                          const void *sin, const void *cos_local, const void *sin_local,
                          int64_t slot, int64_t slot_stride, const int64_t *kv_strides,
                          int64_t pos, int64_t D, int64_t H, int64_t G, int64_t hd, int64_t I,
                          float scale, int dt, int nthreads, void *x) {
    if (n < 0 || slot < 0 || D < 1 || dt < DT_F32 || dt > DT_F16) return -1;
    const int es = dt == DT_F32 ? 4 : 2;
    int rc = 0;
    for (int64_t l = 0; l < n && !rc; l++) {
        const tq_layer *L = &layers[l];
        const int64_t off = slot * slot_stride * es;
        const void *c = L->rope_local ? cos_local : cos, *s = L->rope_local ? sin_local : sin;
        if (!c || !s) return -1;
        rc = tandem_attention_block_ws(h, L->in_norm, L->in_eps, L->qkv, L->q_norm, L->k_norm,
                                       L->qk_eps, c, s, L->rope_pairs, (char *)L->k_cache + off,
                                       (char *)L->v_cache + off, kv_strides, pos, L->window,
                                       L->sinks, L->o, x, D, H, G, hd, scale, dt, nthreads);
        if (!rc && L->attn_out_norm) /* in place: one row, its rms taken before any write */
            rc = tandem_rmsnorm(x, D, L->attn_out_norm, x, 1, D, L->post_eps, dt, nthreads);
        if (rc) break;
        residual_add(h, x, D, dt);
        const tq_moe_layer *m = L->moe;
        if (m)
            rc = tandem_moe_layer(m, h, 1, L->post_norm, L->post_eps, D, x, dt, nthreads);
        else
            rc = tandem_mlp_block_act(h, L->post_norm, L->post_eps, L->gate_up, L->down, x, D,
                                      I, (int)L->act, dt, nthreads);
        if (!rc && L->mlp_out_norm)
            rc = tandem_rmsnorm(x, D, L->mlp_out_norm, x, 1, D, L->post_eps, dt, nthreads);
        if (!rc) residual_add(h, x, D, dt);
    }
    return rc;
}

/* tq_decode_layers_with on a scratch of its own. */
int tandem_decode_layers(const tq_layer *layers, int64_t n, void *h, const void *cos,
                         const void *sin, const void *cos_local, const void *sin_local,
                         int64_t slot, int64_t slot_stride, const int64_t *kv_strides, int64_t pos,
                         int64_t D, int64_t H, int64_t G, int64_t hd, int64_t I, float scale,
                         int dt, int nthreads) {
    if (D < 1 || dt < DT_F32 || dt > DT_F16) return -1;
    void *x = malloc((size_t)D * (dt == DT_F32 ? 4 : 2));
    if (!x) return -1;
    int rc = tq_decode_layers_with(layers, n, h, cos, sin, cos_local, sin_local, slot,
                                   slot_stride, kv_strides, pos, D, H, G, hd, I, scale, dt,
                                   nthreads, x);
    free(x);
    return rc;
}
