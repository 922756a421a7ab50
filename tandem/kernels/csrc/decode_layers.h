/* One decoder layer as csrc/decode_model.c chains them, shared with csrc/decode_token.c. */
#ifndef TANDEM_DECODE_LAYERS_H
#define TANDEM_DECODE_LAYERS_H
#include <stdint.h>

#include "quant.h"

/* A sparse layer's sigmoid-gated shared expert (Qwen2-MoE, Qwen3.5-MoE; csrc/moe.c): on the
 * normed input xn (D), sigmoid(gate . xn) * down(silu(g) * u) with [g; u] = gate_up xn, added to
 * the routed experts' sum. gate_up (2W, D), down (D, W), gate (1, D): GGUF parts (quant.h
 * tq_linear), W the shared expert's width. */
typedef struct {
    const tq_linear *gate_up, *down, *gate;
    int64_t W;
} tq_moe_shared;

/* A sparse layer's feed-forward (csrc/moe.c tandem_moe_layer, the layer's post_norm its input
 * norm): the router (E outputs), k experts a token, the route kind (0 softmax_topk,
 * 1 topk_softmax) and renormalisation, the expert width W, the experts' stacked blocks and ggml
 * types, gpt-oss's biases and activation (or NULL), and a shared expert (or NULL). */
typedef struct {
    const tq_linear *router;
    int64_t E, k, route, normalize, W;
    const void *gate, *up, *down;
    int64_t gate_type, up_type, down_type;
    const tq_moe_act *act;
    const tq_moe_shared *shared;
} tq_moe_layer;

/* The layer `m` on h (M, D) normed by norm_w / eps -> out (M, D), all of dtype dt: every expert
 * of the file held (first 0, count E). Returns 0, or -1 for arguments it cannot run. */
int tandem_moe_layer(const tq_moe_layer *m, const void *h, int64_t M, const void *norm_w,
                     float eps, int64_t D, void *out, int dt, int nthreads);

/* One decoder layer as the model call takes it (tandem/kernels/decode_model.py and
 * tandem/kernels/lean/model.py build these): the two RMSNorm weights and eps, the four
 * projections (quant.h tq_linear), the q/k norm weights (or NULL) and eps, and the layer's k and v
 * caches at slot 0: element (slot, g, s, d) at k + slot*slot_stride + g*kv_strides[0] +
 * s*kv_strides[1] + d, every layer alike; the q/k rows' RoPE layout (decode_ops.c
 * tandem_norm_rope's `pairs`). The fields after rope_pairs are zero for a plain dense layer:
 *   window       keys max(0, pos - window + 1)..pos only (0: every earlier key)
 *   sinks        float32 (H) sink logits joining each head's softmax (gpt-oss), or NULL
 *   attn_out_norm, mlp_out_norm   Gemma's sandwich norms of the two halves' outputs, or NULL
 *                (eps post_eps)
 *   act          the dense MLP's activation: 0 silu, 1 gelu_tanh
 *   rope_local   1: this layer rotates by the local table (Gemma 3's windowed layers)
 *   moe          the sparse feed-forward in place of gate_up / down, or NULL */
typedef struct {
    const void *in_norm, *post_norm;
    float in_eps, post_eps, qk_eps;
    const tq_linear *qkv, *o, *gate_up, *down;
    const void *q_norm, *k_norm;
    void *k_cache, *v_cache;
    int rope_pairs; /* the q/k rows' RoPE layout: tandem_norm_rope's `pairs` */
    int64_t window;
    const float *sinks;
    const void *attn_out_norm, *mlp_out_norm;
    int64_t act, rope_local;
    const tq_moe_layer *moe;
} tq_layer;

int tandem_decode_layers(const tq_layer *layers, int64_t n, void *h, const void *cos,
                         const void *sin, const void *cos_local, const void *sin_local,
                         int64_t slot, int64_t slot_stride, const int64_t *kv_strides, int64_t pos,
                         int64_t D, int64_t H, int64_t G, int64_t hd, int64_t I, float scale,
                         int dt, int nthreads);
int tq_decode_layers_with(const tq_layer *layers, int64_t n, void *h, const void *cos,
                          const void *sin, const void *cos_local, const void *sin_local,
                          int64_t slot, int64_t slot_stride, const int64_t *kv_strides,
                          int64_t pos, int64_t D, int64_t H, int64_t G, int64_t hd, int64_t I,
                          float scale, int dt, int nthreads, void *x);
#endif
