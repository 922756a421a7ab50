/* GGUF (ggml) block-quantized weights as tandem's kernels read them: the type ids, the block
 * sizes, and a linear layer as a list of row-stacked parts, each of its own type.
 *
 * The layouts are tandem/models/quant/blocks.py's table (the Python side checks every weight
 * against it before a pointer reaches C); here they are the byte offsets the kernels load. */
#ifndef TANDEM_QUANT_H
#define TANDEM_QUANT_H
#include <stdint.h>

enum {
    GT_F32 = 0, GT_F16 = 1, GT_Q4_0 = 2, GT_Q4_1 = 3, GT_Q5_0 = 6, GT_Q5_1 = 7, GT_Q8_0 = 8,
    GT_Q4_K = 12, GT_Q5_K = 13, GT_Q6_K = 14, GT_BF16 = 30, GT_MXFP4 = 39,
    GT_Q8_0X = 60, /* tandem's own: Q8_0 rows repacked at load (tq_q8x_at, csrc/q8x.c) */
};

/* GT_Q8_0X, never in a file: a Q8_0 row of nb blocks repacked in place into the same 34 nb bytes,
 * the nb float16 scales first, then per group g of n = min(16, nb - 16 g) blocks 8 runs of 4 n
 * bytes: run k, bytes 4 i .. 4 i + 3 = elements 4 k .. 4 k + 3 of block 16 g + i, each stored as
 * the unsigned w + 128 (w XOR 0x80). A group of 16 blocks is 8 64-byte vectors whose 32-bit lane i
 * belongs to block i alone, so one VPDPBUSD chain of 8 gives the 16 blocks' integer dots with no
 * horizontal sums (the transposed form qgemm.c decodes every type into), and the 16 scales are
 * one 32-byte load. Byte j of block b of a row sits at tq_q8x_at(nb, b, j). */
static inline int64_t tq_q8x_at(int64_t nb, int64_t b, int64_t j) {
    const int64_t g = b / 16, n = nb - 16 * g < 16 ? nb - 16 * g : 16;
    return 2 * nb + 512 * g + 4 * n * (j >> 2) + 4 * (b % 16) + (j & 3);
}

/* One weight of a (possibly fused) linear layer: `rows` rows of ggml type `type`, row-major,
 * each row K / block_size whole blocks. A layer's parts stack their rows: part p's outputs are
 * the columns after those of parts 0..p-1. */
typedef struct {
    const void *w;
    int64_t rows;
    int64_t type;
} tq_part;

/* A linear layer as the decode blocks (decode_block.c) take it: a dense weight `w` of the
 * activations' dtype (parts == NULL: gemv.c), or `nparts` GGUF parts (qgemv.c); `bias` float32
 * (out) or NULL. */
typedef struct {
    const void *w;
    const float *bias;
    const tq_part *parts;
    int64_t nparts;
} tq_linear;

/* An MoE block's expert activation and biases (csrc/moe.c; NULL there: SwiGLU, no biases).
 * kind 0: silu(g) * u; kind 1 (gpt-oss): g' = min(g, limit), u' = clamp(u, -limit, limit),
 * (u' + 1) * g' * sigmoid(alpha g'). Biases float32, stacked by held expert: gate and up
 * (count, W), down (count, D); any may be NULL. */
typedef struct {
    const float *gate_bias;
    const float *up_bias;
    const float *down_bias;
    int64_t kind;
    float alpha;
    float limit;
} tq_moe_act;

/* Elements per block of type t (1 for the dense types), or 0 for a type the kernels lack. */
static inline int64_t tq_block_size(int64_t t) {
    switch (t) {
    case GT_F32: case GT_F16: case GT_BF16: return 1;
    case GT_Q4_0: case GT_Q4_1: case GT_Q5_0: case GT_Q5_1: case GT_Q8_0: case GT_MXFP4: case GT_Q8_0X:
        return 32;
    case GT_Q4_K: case GT_Q5_K: case GT_Q6_K: return 256;
    default: return 0;
    }
}

/* Bytes per block of type t (see blocks.py), 0 for a type the kernels lack. */
static inline int64_t tq_block_bytes(int64_t t) {
    switch (t) {
    case GT_F32: return 4;
    case GT_F16: case GT_BF16: return 2;
    case GT_Q4_0: return 18;
    case GT_Q4_1: return 20;
    case GT_Q5_0: return 22;
    case GT_Q5_1: return 24;
    case GT_Q8_0: case GT_Q8_0X: return 34;
    case GT_MXFP4: return 17;
    case GT_Q4_K: return 144;
    case GT_Q5_K: return 176;
    case GT_Q6_K: return 210;
    default: return 0;
    }
}

static inline int64_t tq_row_bytes(int64_t t, int64_t K) {
    return K / tq_block_size(t) * tq_block_bytes(t);
}

/* MXFP4: the 16 codes' values (the OCP MX E2M1 values doubled, blocks.py), as a byte-shuffle
 * table: signed (kv), magnitudes (|kv|, the same for code and code ^ 8) and kv + 12 (unsigned,
 * 0..24, for the kernels that carry a weight as s * u + o with o = -12 s). */
#define TQ_MXFP4_KV 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12
#define TQ_MXFP4_ABS 0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12
#define TQ_MXFP4_U12 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0

/* An MXFP4 block's scale from its E8M0 byte: 2^(e - 128) as float32, exactly (ggml's
 * GGML_E8M0_TO_FP32_HALF): e < 2 the subnormals 2^-128, 2^-127, else the bits (e - 1) << 23;
 * e = 255 is 2^127, never NaN. */
static inline float tq_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

/* Y (M, sum of rows) = X (M, K) . [W_0; W_1; ...]^T (+ bias, float32), X and Y of dtype dt
 * (DT_F32 / DT_BF16 / DT_F16), any M >= 1 (decode: 1-4; prefill: all rows of a prompt, W read
 * once). Returns 0, or -1 for arguments it cannot run. */
int tandem_qgemv(const void *x, const tq_part *parts, int64_t nparts, const float *bias, void *y,
                 int64_t M, int64_t K, int dt, int nthreads);

/* y (N) = L x (K) for one row of dtype dt, dense (tandem_gemv) or GGUF parts (tandem_qgemv);
 * -1 if L's parts do not make N rows (csrc/decode_block.c). */
int tandem_linear1(const tq_linear *L, const void *x, void *y, int64_t N, int64_t K, int dt,
                   int nthreads);
#endif
