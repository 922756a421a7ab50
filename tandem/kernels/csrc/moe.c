/* A mixture-of-experts block's experts in one call (decode and prefill alike): every token's
 * chosen experts, each expert's tokens as one product, only the chosen experts' weights read.
 *
 *   y[m] = sum over j < k with e = ids[m, j] - first in [0, count), in ascending e:
 *          w[m, j] * down_e(silu(gate_e x[m]) * up_e x[m])
 *
 * The experts' weights are stacked by expert, one ggml type per projection: expert e's gate rows
 * start at gate + e * W * row_bytes(gate_type, D) (up likewise), its down rows at
 * down + e * D * row_bytes(down_type, W). For each held expert with tokens routed to it, its rows
 * of x are gathered and go through one tandem_qgemv over [gate_e; up_e] (int8 activations for a
 * quantized expert, as every quantized layer), tandem_silu_mul, and one tandem_qgemv over down_e:
 * an expert with no token is never read, and one with n tokens is read once for all n.
 *
 * tandem_moe_route is the router's choice (`models.moe.MoE.route`) and tandem_moe_block a whole
 * sparse feed-forward (norm, router, route, experts) in one call, for the torch-free path;
 * tandem_moe_layer the same from a layer's tq_moe_layer, its shared expert (Qwen2-MoE) added.
 *
 * The roundings are `models.moe.Experts.forward`'s in dtype dt: the expert's output times the
 * weight rounded to dt, added to y[m] in dt (y starts at zero), experts in ascending order.
 *
 * tandem_moe_experts_act takes gpt-oss's experts too (quant.h's tq_moe_act): each projection's
 * bias added to its output (in the GEMV's float32 accumulator, as every biased layer), and the
 * clamped SwiGLU computed in float32 and rounded once to dt.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "quant.h"
#include "decode_layers.h"

int tandem_silu_mul(const void *gu, void *y, int64_t rows, int64_t inter, int dt, int nthreads);

static inline float round_dt(float v, int dt) {
    if (dt == DT_F32) return v;
    if (dt == DT_BF16) return bf16_to_f32(f32_to_bf16(v));
#if HAVE_F16
    return f16_to_f32(f32_to_f16(v));
#else
    return v;
#endif
}

/* gu (n, 2W) = [gate | up] per row -> act (n, W): gpt-oss's clamped SwiGLU (tq_moe_act). */
static void clamped_swiglu(const void *gu, void *act, int64_t n, int64_t W, float alpha,
                           float limit, int dt) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < W; c++) {
            float g = load1(gu, r * 2 * W + c, dt), u = load1(gu, r * 2 * W + W + c, dt);
            g = g < limit ? g : limit;
            u = u < -limit ? -limit : (u > limit ? limit : u);
            store1(act, r * W + c, (u + 1.0f) * (g / (1.0f + expf(-alpha * g))), dt);
        }
}

/* x (M, D), ids (M, k) int64 global expert ids, w (M, k) float32 (the router's weights, already
 * rounded to dt) -> y (M, D), all of dtype dt; `act` NULL or the activation and biases.
 * Returns 0, or -1 for arguments it cannot run. */
int tandem_moe_experts_act(const void *x, int64_t M, int64_t D, int64_t W, const int64_t *ids,
                           const float *w, int64_t k, int64_t first, int64_t count,
                           const void *gate, const void *up, const void *down, int64_t gate_type,
                           int64_t up_type, int64_t down_type, const tq_moe_act *act_spec, void *y,
                           int dt, int nthreads) {
    if (M < 1 || D < 1 || W < 1 || k < 1 || count < 1 || dt < DT_F32 || dt > DT_F16) return -1;
    if (act_spec && (act_spec->kind < 0 || act_spec->kind > 1)) return -1;
    const int biased = act_spec && (act_spec->gate_bias || act_spec->up_bias);
    const int64_t gb = tq_block_size(gate_type), ub = tq_block_size(up_type);
    const int64_t db = tq_block_size(down_type);
    if (!gb || !ub || !db || D % gb || D % ub || W % db) return -1;
    const int es = dt == DT_F32 ? 4 : 2;
    const int64_t g_stride = W * tq_row_bytes(gate_type, D), u_stride = W * tq_row_bytes(up_type, D);
    const int64_t d_stride = D * tq_row_bytes(down_type, W);
    /* an expert's rows: up to R = M k, not M, where a row names one expert twice (a router never
     * does; the conformance probe of a rank holding one expert does, `probed_experts`) */
    const int64_t R = M * k;
    int64_t *rows = (int64_t *)malloc((size_t)R * sizeof(int64_t)); /* (m * k + j) */
    char *buf = (char *)malloc((size_t)(R * (D + 3 * W + D)) * es);
    float *gu_bias = biased ? (float *)calloc((size_t)(2 * W), sizeof(float)) : NULL;
    if (!rows || !buf || (biased && !gu_bias)) {
        free(rows);
        free(buf);
        free(gu_bias);
        return -1;
    }
    char *xs = buf, *gu = xs + R * D * es, *act = gu + 2 * R * W * es, *out = act + R * W * es;
    memset(y, 0, (size_t)(M * D) * es);
    int rc = 0;
    for (int64_t e = 0; e < count && !rc; e++) {
        int64_t n = 0;
        for (int64_t i = 0; i < M * k; i++)
            if (ids[i] - first == e) rows[n++] = i;
        if (n == 0) continue;
        for (int64_t r = 0; r < n; r++)
            memcpy(xs + r * D * es, (const char *)x + (rows[r] / k) * D * es, (size_t)(D * es));
        const tq_part gu_parts[2] = {
            {(const char *)gate + e * g_stride, W, gate_type},
            {(const char *)up + e * u_stride, W, up_type},
        };
        const tq_part down_part = {(const char *)down + e * d_stride, D, down_type};
        if (biased) { /* [gate_b_e | up_b_e]: the fused product's bias */
            if (act_spec->gate_bias) memcpy(gu_bias, act_spec->gate_bias + e * W, W * sizeof(float));
            if (act_spec->up_bias) memcpy(gu_bias + W, act_spec->up_bias + e * W, W * sizeof(float));
        }
        const float *down_bias = act_spec && act_spec->down_bias ? act_spec->down_bias + e * D : NULL;
        rc = tandem_qgemv(xs, gu_parts, 2, gu_bias, gu, n, D, dt, nthreads);
        if (!rc && act_spec && act_spec->kind == 1)
            clamped_swiglu(gu, act, n, W, act_spec->alpha, act_spec->limit, dt);
        else if (!rc)
            rc = tandem_silu_mul(gu, act, n, W, dt, nthreads);
        if (!rc) rc = tandem_qgemv(act, &down_part, 1, down_bias, out, n, W, dt, nthreads);
        if (rc) break;
        for (int64_t r = 0; r < n; r++) {
            const int64_t m = rows[r] / k;
            const float wt = w[rows[r]];
            for (int64_t c = 0; c < D; c++) {
                float v = round_dt(load1(out, r * D + c, dt) * wt, dt);
                store1(y, m * D + c, load1(y, m * D + c, dt) + v, dt);
            }
        }
    }
    free(rows);
    free(buf);
    free(gu_bias);
    return rc;
}

int tandem_moe_experts(const void *x, int64_t M, int64_t D, int64_t W, const int64_t *ids,
                       const float *w, int64_t k, int64_t first, int64_t count, const void *gate,
                       const void *up, const void *down, int64_t gate_type, int64_t up_type,
                       int64_t down_type, void *y, int dt, int nthreads) {
    return tandem_moe_experts_act(x, M, D, W, ids, w, k, first, count, gate, up, down, gate_type,
                                  up_type, down_type, NULL, y, dt, nthreads);
}

int tandem_rmsnorm(const void *x, int64_t x_stride, const void *w, void *y, int64_t rows,
                   int64_t dim, float eps, int dt, int nthreads);

/* The router's choice for each row of logits (M, E) (dtype dt), by `kind` (models.moe.MoE.route):
 *   0 (softmax_topk): p = softmax(logits) in float32, the k largest (ties to the lower expert id,
 *     in descending order), renormalised to sum 1 when `norm`;
 *   1 (topk_softmax, gpt-oss): the k largest logits (same order), then w = softmax over those k
 *     in float32: e_j = exp(l_j - l_max), w_j = e_j / sum_j e_j;
 * ids (M, k) int64, w (M, k) float32 holding the weights rounded to dt. */
int tandem_moe_route_kind(const void *logits, int64_t M, int64_t E, int64_t k, int kind, int norm,
                          int64_t *ids, float *w, int dt) {
    if (M < 1 || E < 1 || k < 1 || k > E || kind < 0 || kind > 1 || dt < DT_F32 || dt > DT_F16)
        return -1;
    float *p = (float *)malloc((size_t)E * sizeof(float));
    char *taken = (char *)malloc((size_t)E);
    if (!p || !taken) {
        free(p);
        free(taken);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) {
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            p[e] = load1(logits, m * E + e, dt);
            mx = p[e] > mx ? p[e] : mx;
        }
        if (kind == 0) {
            for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(p[e] - mx));
            for (int64_t e = 0; e < E; e++) p[e] /= sum;
        }
        memset(taken, 0, (size_t)E);
        float total = 0.0f;
        for (int64_t j = 0; j < k; j++) { /* selection: k is small (2-8 of 8-128 experts) */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (kind || p[e] >= 0.0f) && (best < 0 || p[e] > p[best])) best = e;
            if (best < 0) { /* softmax_topk: NaN probabilities are never chosen */
                ids[m * k + j] = -1, w[m * k + j] = 0.0f;
                continue;
            }
            ids[m * k + j] = best;
            w[m * k + j] = p[best];
            total += p[best];
            taken[best] = 1;
        }
        if (kind == 1) { /* softmax over the k chosen logits; w[m*k] is their maximum */
            const float top = w[m * k];
            total = 0.0f;
            for (int64_t j = 0; j < k; j++) total += (w[m * k + j] = expf(w[m * k + j] - top));
            for (int64_t j = 0; j < k; j++) w[m * k + j] = round_dt(w[m * k + j] / total, dt);
            continue;
        }
        for (int64_t j = 0; j < k; j++)
            w[m * k + j] = round_dt(norm ? w[m * k + j] / total : w[m * k + j], dt);
    }
    free(p);
    free(taken);
    return 0;
}

int tandem_moe_route(const void *logits, int64_t M, int64_t E, int64_t k, int norm, int64_t *ids,
                     float *w, int dt) {
    return tandem_moe_route_kind(logits, M, E, k, 0, norm, ids, w, dt);
}

/* A shared expert (decode_layers.h tq_moe_shared) on xn (M, D), added to y (M, D), dtype dt:
 *   [g | u] = xn gate_up^T (M, 2W);  a = silu(g) * u (M, W);  o = a down^T (M, D);
 *   s = 1 / (1 + exp(-(xn . gate))) (M) in float32;  y[m] = round(y[m] + round(o[m] * s[m])),
 * transformers' Qwen2MoeSparseMoeBlock `routed + sigmoid(gate(x)) * shared(x)` in dtype dt. */
static int64_t parts_rows(const tq_linear *L) { /* 0 for a dense weight */
    int64_t rows = 0;
    for (int64_t p = 0; L->parts && p < L->nparts; p++) rows += L->parts[p].rows;
    return rows;
}

static int moe_shared(const tq_moe_shared *s, const void *xn, int64_t M, int64_t D, void *y,
                      int dt, int nthreads) {
    const int64_t W = s->W;
    if (W < 1 || parts_rows(s->gate_up) != 2 * W || parts_rows(s->down) != D ||
        parts_rows(s->gate) != 1)
        return -1;
    const int es = dt == DT_F32 ? 4 : 2;
    char *buf = (char *)malloc((size_t)(M * (3 * W + D + 1)) * es);
    if (!buf) return -1;
    char *gu = buf, *a = gu + M * 2 * W * es, *o = a + M * W * es, *g = o + M * D * es;
    int rc = tandem_qgemv(xn, s->gate_up->parts, s->gate_up->nparts, s->gate_up->bias, gu, M, D,
                          dt, nthreads);
    if (!rc) rc = tandem_silu_mul(gu, a, M, W, dt, nthreads);
    if (!rc)
        rc = tandem_qgemv(a, s->down->parts, s->down->nparts, s->down->bias, o, M, W, dt,
                          nthreads);
    if (!rc)
        rc = tandem_qgemv(xn, s->gate->parts, s->gate->nparts, s->gate->bias, g, M, D, dt,
                          nthreads);
    for (int64_t m = 0; m < M && !rc; m++) {
        const float sg = 1.0f / (1.0f + expf(-load1(g, m, dt)));
        for (int64_t c = 0; c < D; c++) {
            const float v = round_dt(load1(o, m * D + c, dt) * sg, dt);
            store1(y, m * D + c, load1(y, m * D + c, dt) + v, dt);
        }
    }
    free(buf);
    return rc;
}

/* A sparse layer's feed-forward for M rows in one call: xn = rmsnorm(h), logits = router(xn)
 * (E outputs, quant.h's tq_linear, its bias included), the route (tandem_moe_route_kind of
 * `router_kind`), then the held experts (tandem_moe_experts_act with `act`: NULL, or gpt-oss's
 * biases and clamped SwiGLU) -> out (M, D), plus the shared expert on xn (`moe_shared`) where
 * `shared` is not NULL; all of dtype dt. The caller adds the residual. */
static int moe_block(const void *h, int64_t M, const void *norm_w, float eps,
                     const tq_linear *router, int64_t E, int64_t k, int router_kind, int norm,
                     int64_t D, int64_t W, int64_t first, int64_t count, const void *gate,
                     const void *up, const void *down, int64_t gate_type, int64_t up_type,
                     int64_t down_type, const tq_moe_act *act, const tq_moe_shared *shared,
                     void *out, int dt, int nthreads) {
    if (M < 1 || E < 1 || k < 1 || k > E || !router->parts) return -1;
    const int es = dt == DT_F32 ? 4 : 2;
    char *xn = (char *)malloc((size_t)(M * (D + E)) * es);
    int64_t *ids = (int64_t *)malloc((size_t)(M * k) * sizeof(int64_t));
    float *w = (float *)malloc((size_t)(M * k) * sizeof(float));
    if (!xn || !ids || !w) {
        free(xn);
        free(ids);
        free(w);
        return -1;
    }
    char *logits = xn + M * D * es;
    int rc = tandem_rmsnorm(h, D, norm_w, xn, M, D, eps, dt, nthreads);
    if (!rc) rc = tandem_qgemv(xn, router->parts, router->nparts, router->bias, logits, M, D, dt, nthreads);
    if (!rc) rc = tandem_moe_route_kind(logits, M, E, k, router_kind, norm, ids, w, dt);
    if (!rc)
        rc = tandem_moe_experts_act(xn, M, D, W, ids, w, k, first, count, gate, up, down,
                                    gate_type, up_type, down_type, act, out, dt, nthreads);
    if (!rc && shared) rc = moe_shared(shared, xn, M, D, out, dt, nthreads);
    free(xn);
    free(ids);
    free(w);
    return rc;
}

int tandem_moe_block_act(const void *h, int64_t M, const void *norm_w, float eps,
                         const tq_linear *router, int64_t E, int64_t k, int router_kind, int norm,
                         int64_t D, int64_t W, int64_t first, int64_t count, const void *gate,
                         const void *up, const void *down, int64_t gate_type, int64_t up_type,
                         int64_t down_type, const tq_moe_act *act, void *out, int dt,
                         int nthreads) {
    return moe_block(h, M, norm_w, eps, router, E, k, router_kind, norm, D, W, first, count, gate,
                     up, down, gate_type, up_type, down_type, act, NULL, out, dt, nthreads);
}

/* decode_layers.h: the single-node sparse layer, its shared expert included (the one-call
 * decode's and the torch-free path's layer by layer call alike). */
int tandem_moe_layer(const tq_moe_layer *m, const void *h, int64_t M, const void *norm_w,
                     float eps, int64_t D, void *out, int dt, int nthreads) {
    if (!m) return -1;
    return moe_block(h, M, norm_w, eps, m->router, m->E, m->k, (int)m->route, (int)m->normalize,
                     D, m->W, 0, m->E, m->gate, m->up, m->down, m->gate_type, m->up_type,
                     m->down_type, m->act, m->shared, out, dt, nthreads);
}

int tandem_moe_block(const void *h, int64_t M, const void *norm_w, float eps,
                     const tq_linear *router, int64_t E, int64_t k, int norm, int64_t D,
                     int64_t W, int64_t first, int64_t count, const void *gate, const void *up,
                     const void *down, int64_t gate_type, int64_t up_type, int64_t down_type,
                     void *out, int dt, int nthreads) {
    return tandem_moe_block_act(h, M, norm_w, eps, router, E, k, 0, norm, D, W, first, count, gate,
                                up, down, gate_type, up_type, down_type, NULL, out, dt, nthreads);
}
