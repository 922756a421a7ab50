/* One decoder layer as csrc/decode_model.c chains them, shared with csrc/decode_token.c. */
#ifndef TANDEM_DECODE_LAYERS_H
#define TANDEM_DECODE_LAYERS_H
#include <stdint.h>

#include "quant.h"

/* One decoder layer as the model call takes it (tandem/kernels/decode_model.py builds these):
 * the two RMSNorm weights and eps, the four projections (quant.h tq_linear), the q/k norm weights
 * (or NULL) and eps, and the layer's k and v caches at slot 0: element (slot, g, s, d) at
 * k + slot*slot_stride + g*kv_strides[0] + s*kv_strides[1] + d, every layer alike; the q/k
 * rows' RoPE layout (decode_ops.c tandem_norm_rope's `pairs`). */
typedef struct {
    const void *in_norm, *post_norm;
    float in_eps, post_eps, qk_eps;
    const tq_linear *qkv, *o, *gate_up, *down;
    const void *q_norm, *k_norm;
    void *k_cache, *v_cache;
    int rope_pairs; /* the q/k rows' RoPE layout: tandem_norm_rope's `pairs` */
} tq_layer;

int tandem_decode_layers(const tq_layer *layers, int64_t n, void *h, const void *cos,
                         const void *sin, int64_t slot, int64_t slot_stride,
                         const int64_t *kv_strides, int64_t pos, int64_t D, int64_t H, int64_t G,
                         int64_t hd, int64_t I, float scale, int dt, int nthreads);
int tq_decode_layers_with(const tq_layer *layers, int64_t n, void *h, const void *cos,
                          const void *sin, int64_t slot, int64_t slot_stride,
                          const int64_t *kv_strides, int64_t pos, int64_t D, int64_t H, int64_t G,
                          int64_t hd, int64_t I, float scale, int dt, int nthreads, void *x);
#endif
