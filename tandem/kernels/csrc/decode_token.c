/* One decode token of one sequence, from its token id to its logits or its argmax, in one call:
 * what the torch-free path (tandem/kernels/lean/model.py) otherwise spends five Python-side
 * calls and four allocations on, at ~4 ms a token on a 135 M model.
 *
 *   h      = embed[token]                      (D) float32: the row as gguf-py dequantizes it,
 *                                              for the types below; else the caller's h as given
 *   h      = h * embed_scale                   (Gemma's sqrt(D), rounded to float32; 0: none)
 *   h      = decode_layers(h)                  csrc/decode_model.c, in place
 *   hn     = rmsnorm(h) * norm_w               csrc/decode_ops.c tandem_rmsnorm, one row
 *   logits = hn Whead^T (+ b)                  (V) csrc/qgemv.c tandem_qgemv, M = 1
 *   return argmax(logits)                      csrc/decode_ops.c tandem_argmax (greedy only)
 *
 * Each step is the very call the Python path makes, on the same buffers' values, so the logits
 * and the id are those of that path bit for bit (tests/unit/test_decode_token.py).
 *
 * The embedding row, float32 as gguf-py's `dequantize` gives it (numpy float32, one rounding per
 * operation; this file builds with -ffp-contract=off, so no fused multiply-add):
 *   F32 as stored;  F16, BF16 widened (exact);
 *   Q8_0  (34 B / 32):  q_j * d      (GT_Q8_0X, quant.h: the same numbers, repacked)
 *   Q4_0  (18 B / 32):  d * (float)(nib_j - 8)          nib_j: byte j's low nibble (j < 16),
 *   Q4_1  (20 B / 32):  (d * (float)nib_j) + m          byte j - 16's high nibble (j >= 16)
 */
#include <stdint.h>
#include <string.h>

#include "dtypes.h"
#include "quant.h"
#include "decode_layers.h"

int tandem_rmsnorm(const void *x, int64_t x_stride, const void *w, void *y, int64_t rows,
                   int64_t dim, float eps, int dt, int nthreads);
int tandem_argmax(const void *x, int64_t rows, int64_t n, int64_t *out, int dt);

/* What stays fixed from token to token (tandem/kernels/cstructs.py TqDecodePlan fills it):
 * the layers and their cache geometry (decode_model.c), the final norm, the head, the embedding
 * table as stored (rows of `embed_row_bytes`, ggml type `embed_type`), and the two float32 (D)
 * buffers: the residual stream h and its normed copy hn, plus a (D) scratch; the embedding's
 * scale (Gemma) or 0. */
typedef struct {
    const tq_layer *layers;
    int64_t n_layers;
    int64_t slot_stride;
    const int64_t *kv_strides;
    int64_t D, H, G, hd, I;
    float scale;
    const float *norm_w;
    float eps;
    const tq_linear *head;
    int64_t vocab;
    const uint8_t *embed;
    int64_t embed_type, embed_rows, embed_row_bytes;
    float *h, *hn, *scratch;
    int nthreads;
    float embed_scale; /* 0: the row as is */
} tq_decode_plan;

/* 1 where `embed_row` dequantizes type t. */
int tandem_embed_type_native(int64_t t) {
    return t == GT_F32 || t == GT_F16 || t == GT_BF16 || t == GT_Q8_0 || t == GT_Q8_0X ||
           t == GT_Q4_0 || t == GT_Q4_1;
}

static inline float half(const uint8_t *p) {
    uint16_t u;
    memcpy(&u, p, 2);
#if HAVE_F16
    return f16_to_f32(u);
#else
    return 0.0f;
#endif
}

/* Row `row` (row_bytes of type t) -> y (D) float32 as the file header above states. Returns 0,
 * or -1 for a type it lacks. */
static int embed_row(const uint8_t *row, int64_t t, int64_t D, float *y) {
    switch (t) {
    case GT_F32:
        memcpy(y, row, (size_t)D * 4);
        return 0;
    case GT_F16:
        for (int64_t i = 0; i < D; i++) y[i] = half(row + 2 * i);
        return 0;
    case GT_BF16:
        for (int64_t i = 0; i < D; i++) {
            uint16_t u;
            memcpy(&u, row + 2 * i, 2);
            y[i] = bf16_to_f32(u);
        }
        return 0;
    case GT_Q8_0X:
        for (int64_t b = 0; b < D / 32; b++) {
            const float d = half(row + 2 * b);
            for (int j = 0; j < 32; j++)
                y[b * 32 + j] = (float)(int8_t)(row[tq_q8x_at(D / 32, b, j)] ^ 0x80) * d;
        }
        return 0;
    case GT_Q8_0:
        for (int64_t b = 0; b < D / 32; b++, row += 34) {
            const float d = half(row);
            for (int j = 0; j < 32; j++) y[b * 32 + j] = (float)(int8_t)row[2 + j] * d;
        }
        return 0;
    case GT_Q4_0:
        for (int64_t b = 0; b < D / 32; b++, row += 18) {
            const float d = half(row);
            for (int j = 0; j < 16; j++) {
                y[b * 32 + j] = d * (float)((int)(row[2 + j] & 0x0F) - 8);
                y[b * 32 + 16 + j] = d * (float)((int)(row[2 + j] >> 4) - 8);
            }
        }
        return 0;
    case GT_Q4_1:
        for (int64_t b = 0; b < D / 32; b++, row += 20) {
            const float d = half(row), m = half(row + 2);
            for (int j = 0; j < 16; j++) {
                y[b * 32 + j] = d * (float)(row[4 + j] & 0x0F) + m;
                y[b * 32 + 16 + j] = d * (float)(row[4 + j] >> 4) + m;
            }
        }
        return 0;
    }
    return -1;
}

/* One token (module comment): `token` >= 0 is embedded here (a type `tandem_embed_type_native`
 * takes), -1 takes p->h as the caller filled it (the scale then applied here alike); cos, sin
 * (hd) the RoPE rows of `pos`, cos_local, sin_local the local table's (Gemma 3) or NULL; the
 * logits (vocab) written to `logits`. Returns the argmax id where `greedy`, else 0; -1 where a
 * call refuses its arguments or the token is outside the table. */
int64_t tandem_decode_token(const tq_decode_plan *p, int64_t token, int64_t slot, int64_t pos,
                            const void *cos, const void *sin, const void *cos_local,
                            const void *sin_local, float *logits, int greedy) {
    if (token >= p->embed_rows || token < -1) return -1;
    if (token >= 0) {
        const uint8_t *row = p->embed + token * p->embed_row_bytes;
        if (embed_row(row, p->embed_type, p->D, p->h)) return -1;
    }
    if (p->embed_scale != 0.0f)
        for (int64_t i = 0; i < p->D; i++) p->h[i] *= p->embed_scale;
    if (tq_decode_layers_with(p->layers, p->n_layers, p->h, cos, sin, cos_local, sin_local,
                              slot, p->slot_stride,
                              p->kv_strides, pos, p->D, p->H, p->G, p->hd, p->I, p->scale, DT_F32,
                              p->nthreads, p->scratch))
        return -1;
    if (tandem_rmsnorm(p->h, p->D, p->norm_w, p->hn, 1, p->D, p->eps, DT_F32, p->nthreads))
        return -1;
    const tq_linear *hl = p->head;
    if (tandem_qgemv(p->hn, hl->parts, hl->nparts, hl->bias, logits, 1, p->D, DT_F32,
                     p->nthreads))
        return -1;
    if (!greedy) return 0;
    int64_t id;
    if (tandem_argmax(logits, 1, p->vocab, &id, DT_F32)) return -1;
    return id;
}
