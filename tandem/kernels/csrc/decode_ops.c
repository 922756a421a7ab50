/* The small per-layer operations of a decode step, each one call instead of the 4-12 tensor ops
 * PyTorch dispatches for it (at batch 1 each op costs microseconds of dispatch for nanoseconds of
 * math): RMSNorm, per-head RMSNorm + rotary embedding in place, SwiGLU's silu(gate) * up,
 * attention (one decode token, a prefill chunk, or a whole step of both, each query row alone:
 * attend_group), and the greedy argmax. Each works row by row, so a row's result does not depend
 * on how many rows share the call (batch invariance).
 *
 * Every function reproduces the op-by-op PyTorch form of tandem/models (layers.py, rope.py) in the
 * tensor's dtype, rounding wherever that form rounds: arithmetic in float32, each intermediate
 * tensor rounded to the dtype (bf16 / f16; float32 rounds nowhere extra). Products of two 16-bit
 * values are exact in float32, so those steps match PyTorch bit for bit; a sum of squares is
 * accumulated in another order than PyTorch's reduction, exp is a polynomial (exp8) or libm's
 * expf, and attention rounds only its output, so a result may differ in the last bits of float32
 * (and then, rarely, by one 16-bit ulp; attention by up to two).
 *
 * Built with -ffp-contract=off (native.py): `a * b + c` must round twice, as PyTorch's does.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

enum { MAX_HEAD_DIM = 1024 };

/* Rows are split over `nthreads` threads (the caller passes torch's count: OpenMP's own default
 * is per calling thread) only when there are enough elements to pay for waking them. */
#define PARALLEL_MIN (1 << 16)

/* r = 1 / sqrt(mean(v^2) + eps) over n elements of v at p (dtype dt). */
static inline float inv_rms(const void *p, int64_t n, float eps, int dt) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    int64_t i = 0;
#if defined(__AVX2__)
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m256 u = load8(p, i, dt), v = load8(p, i + 8, dt);
        a = _mm256_add_ps(a, _mm256_mul_ps(u, u));
        b = _mm256_add_ps(b, _mm256_mul_ps(v, v));
    }
    s0 = hsum8(_mm256_add_ps(a, b));
#endif
    for (; i + 4 <= n; i += 4) {
        float a = load1(p, i, dt), b = load1(p, i + 1, dt), c = load1(p, i + 2, dt),
              d = load1(p, i + 3, dt);
        s0 += a * a, s1 += b * b, s2 += c * c, s3 += d * d;
    }
    for (; i < n; i++) {
        float a = load1(p, i, dt);
        s0 += a * a;
    }
    return 1.0f / sqrtf((s0 + s1 + s2 + s3) / (float)n + eps);
}

/* y = round((x * r) * w), one rounding (F.rms_norm's form): layers.RMSNorm over the last
 * dimension `dim`, `rows` rows of x at stride `x_stride` elements, y contiguous (rows, dim).
 * x, w, y of dtype dt. */
int tandem_rmsnorm(const void *x, int64_t x_stride, const void *w, void *y, int64_t rows,
                   int64_t dim, float eps, int dt, int nthreads) {
    if (rows < 0 || dim < 1 || dt < DT_F32 || dt > DT_F16 || (dt == DT_F16 && !HAVE_F16)) return -1;
    const int es = dt == DT_F32 ? 4 : 2;
    nthreads = nthreads < 1 ? 1 : nthreads;
#pragma omp parallel for if (rows * dim >= PARALLEL_MIN) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * x_stride * es;
        const float inv = inv_rms(xr, dim, eps, dt);
        int64_t i = 0;
#if defined(__AVX2__)
        const __m256 vinv = _mm256_set1_ps(inv);
        for (; i + 8 <= dim; i += 8)
            store8(y, r * dim + i, _mm256_mul_ps(_mm256_mul_ps(load8(xr, i, dt), vinv), load8(w, i, dt)), dt);
#endif
        for (; i < dim; i++) store1(y, r * dim + i, load1(xr, i, dt) * inv * load1(w, i, dt), dt);
    }
    return 0;
}

/* In place on `rows` rows of `heads` heads of `hd` elements (row stride `row_stride` elements,
 * heads contiguous within a row): optionally the per-head RMSNorm with weight w (hd) (Qwen3's
 * q_norm / k_norm; w NULL skips it), then the rotary embedding of rope.apply_rope with this row's
 * cos and signed sin (rows, hd, contiguous):
 *     out_i = round(round(v_i * cos_i) + round(v_{p(i)} * sin_i))
 * where i's rotation partner p(i) is (i + hd/2) mod hd in the HF layout (pairs 0: a head's first
 * and second halves rotate together), or i ^ 1 in llama.cpp's (pairs 1: a llama GGUF's q/k rows
 * as its converter stored them, element j of the first half at 2j and of the second at 2j + 1;
 * cos, sin and w then in that order too). Same products, same roundings: without w a pairs-1
 * row is the pairs-0 row's elements in the stored order, bit for bit (with w, the norm's sum of
 * squares runs in the stored order).
 */
int tandem_norm_rope(void *x, int64_t rows, int64_t heads, int64_t hd, int64_t row_stride,
                     const void *w, float eps, const void *cos, const void *sin, int pairs, int dt,
                     int nthreads) {
    if (rows < 0 || heads < 1 || hd < 2 || hd % 2 || hd > MAX_HEAD_DIM || dt < DT_F32 ||
        dt > DT_F16 || (dt == DT_F16 && !HAVE_F16))
        return -1;
    const int es = dt == DT_F32 ? 4 : 2;
    const int64_t half = hd / 2;
    nthreads = nthreads < 1 ? 1 : nthreads;
#pragma omp parallel for if (rows * heads * hd >= PARALLEL_MIN) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        float v[MAX_HEAD_DIM];
        const char *c = (const char *)cos + r * hd * es, *s = (const char *)sin + r * hd * es;
        for (int64_t h = 0; h < heads; h++) {
            char *p = (char *)x + (r * row_stride + h * hd) * es;
            const float inv = w ? inv_rms(p, hd, eps, dt) : 1.0f;
            int64_t i = 0;
#if defined(__AVX2__)
            if (pairs ? hd % 8 == 0 : half % 8 == 0) {
                const __m256 vinv = _mm256_set1_ps(inv);
                for (; i < hd; i += 8) {
                    __m256 e = load8(p, i, dt);
                    _mm256_storeu_ps(v + i, w ? round8(_mm256_mul_ps(_mm256_mul_ps(e, vinv), load8(w, i, dt)), dt) : e);
                }
                for (i = 0; i < hd; i += 8) {
                    __m256 a = round8(_mm256_mul_ps(_mm256_loadu_ps(v + i), load8(c, i, dt)), dt);
                    __m256 o = pairs ? _mm256_permute_ps(_mm256_loadu_ps(v + i), 0xB1) /* lanes 1,0,3,2.. */
                                     : _mm256_loadu_ps(v + (i + half) % hd);
                    __m256 b = round8(_mm256_mul_ps(o, load8(s, i, dt)), dt);
                    store8(p, i, _mm256_add_ps(a, b), dt);
                }
                continue;
            }
#endif
            for (i = 0; i < hd; i++)
                v[i] = w ? round_to(load1(p, i, dt) * inv * load1(w, i, dt), dt) : load1(p, i, dt);
            for (i = 0; i < hd; i++) {
                float a = round_to(v[i] * load1(c, i, dt), dt);
                float b = round_to(v[pairs ? i ^ 1 : (i + half) % hd] * load1(s, i, dt), dt);
                store1(p, i, a + b, dt);
            }
        }
    }
    return 0;
}

#if defined(__AVX2__)
/* e^x in eight lanes, x clamped to [-87.3, 88.7] (no overflow): Cephes' expf, 2^n by the
 * exponent bits; within 2 ulp of libm's expf. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* y (rows, inter) = round(silu(g)) * u for gu (rows, 2 * inter) = [g, u] per row (the fused
 * gate/up GEMV's output), contiguous: layers.MLP's F.silu(gate) * up. */
int tandem_silu_mul(const void *gu, void *y, int64_t rows, int64_t inter, int dt, int nthreads) {
    if (rows < 0 || inter < 1 || dt < DT_F32 || dt > DT_F16 || (dt == DT_F16 && !HAVE_F16)) return -1;
    nthreads = nthreads < 1 ? 1 : nthreads;
#pragma omp parallel for if (rows * inter >= PARALLEL_MIN) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g0 = r * 2 * inter, u0 = g0 + inter;
        int64_t i = 0;
#if defined(__AVX2__)
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= inter; i += 8) {
            __m256 g = load8(gu, g0 + i, dt);
            __m256 act = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
            /* exp(-g) overflows for g < -88.7: g / inf is -0, as PyTorch's */
            act = _mm256_blendv_ps(act, _mm256_mul_ps(g, zero), _mm256_cmp_ps(g, _mm256_set1_ps(-88.7f), _CMP_LT_OQ));
            store8(y, r * inter + i, _mm256_mul_ps(round8(act, dt), load8(gu, u0 + i, dt)), dt);
        }
#endif
        for (; i < inter; i++) {
            float g = load1(gu, g0 + i, dt);
            float act = round_to(g / (1.0f + expf(-g)), dt);
            store1(y, r * inter + i, act * load1(gu, u0 + i, dt), dt);
        }
    }
    return 0;
}

/* y (rows, inter) = gelu_tanh(g) * u for gu (rows, 2 * inter) = [g, u] per row, contiguous
 * (Gemma's GeGLU, layers.GeluTanhMLP), in float32 with one rounding per operation:
 *     inner = c0 * (g + c1 * ((g * g) * g)),  c0 = sqrt(2/pi), c1 = 0.044715
 *     y     = round_dt(((0.5 * g) * (1 + tanhf(inner))) * u)
 * (the torch-free path's per-step forward and its decode call both run this one function). */
int tandem_gelu_tanh_mul(const void *gu, void *y, int64_t rows, int64_t inter, int dt,
                         int nthreads) {
    if (rows < 0 || inter < 1 || dt < DT_F32 || dt > DT_F16 || (dt == DT_F16 && !HAVE_F16)) return -1;
    const float c0 = 0.7978845608028654f, c1 = 0.044715f;
    nthreads = nthreads < 1 ? 1 : nthreads;
#pragma omp parallel for if (rows * inter >= PARALLEL_MIN) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g0 = r * 2 * inter, u0 = g0 + inter;
        for (int64_t i = 0; i < inter; i++) {
            const float g = load1(gu, g0 + i, dt);
            const float inner = c0 * (g + c1 * (g * g * g));
            const float act = 0.5f * g * (1.0f + tanhf(inner));
            store1(y, r * inter + i, act * load1(gu, u0 + i, dt), dt);
        }
    }
    return 0;
}

/* out[r] = the index of the first maximum of row r of x (rows, n), contiguous; a NaN counts as
 * the maximum (torch.argmax's rule). The greedy pick over a vocabulary-sized row of logits: one
 * vector pass for the maximum (and whether any NaN), one for its first position. */
static inline __attribute__((always_inline)) void argmax_rows(const void *x, int64_t rows,
                                                                int64_t n, int64_t *out,
                                                                const int dt) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * n;
        int64_t i = 0;
        float m = load1(x, base, dt);
        int nan = m != m;
#if defined(__AVX2__)
        __m256 vm = _mm256_set1_ps(m), vnan = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            __m256 v = load8(x, base + i, dt);
            vm = _mm256_max_ps(vm, v);
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vm);
        for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
        nan |= _mm256_movemask_ps(vnan) != 0;
#endif
        for (; i < n; i++) {
            float v = load1(x, base + i, dt);
            nan |= v != v;
            m = v > m ? v : m;
        }
        int64_t best = 0;
        for (int64_t j = 0; j < n; j++) {
            float v = load1(x, base + j, dt);
            if (nan ? v != v : v == m) {
                best = j;
                break;
            }
        }
        out[r] = best;
    }
}

int tandem_argmax(const void *x, int64_t rows, int64_t n, int64_t *out, int dt) {
    if (rows < 0 || n < 1 || dt < DT_F32 || dt > DT_F16 || (dt == DT_F16 && !HAVE_F16)) return -1;
    if (dt == DT_F32) argmax_rows(x, rows, n, out, DT_F32); /* a literal dtype per loop */
    else if (dt == DT_BF16) argmax_rows(x, rows, n, out, DT_BF16);
    else argmax_rows(x, rows, n, out, DT_F16);
    return 0;
}

enum { STACK_KEYS = 8192 };

/* The R query heads of kv head g for one query row against S keys:
 *     out[j] = softmax_s(scale * q[g*R + j] . k[s]) . v[s]      (j < R, s < S)
 * q_row: the row's heads contiguous; kb, vb: key / value s at kb + s*k_step (elements);
 * out_row: the row's output heads, contiguous. p: S floats of scratch. Float32 scores, softmax
 * and sums, one rounding of the output. `sinks` (NULL, or one float32 logit per query head:
 * gpt-oss) joins each head's softmax without a value: its max and, last, its denominator.
 *
 * The order of every sum (AVX2 and AVX-512 builds alike: 8-lane vectors throughout):
 *   score z_s = hsum8 of 8 lanes, lane l the fmas of q[d] k_s[d] for d = 8i + l in increasing i,
 *               then the hd % 8 last terms one product and one add at a time; times scale;
 *   e_s = exp(z_s - max z): exp8 (a polynomial within 2 ulp of expf) over 8 keys at a time, the
 *               S % 8 last ones through the same 8 lanes;
 *   denominator = hsum8 of 8 lanes, lane l the sum of e_s for s = 8i + l in increasing i, then
 *               (+ the sink's e);
 *   acc[d] = fma(e_s, v_s[d], acc[d]) for s in increasing order, from +0; out = acc * (1/den).
 *
 * Every attention of the native paths (decode, prefill, a whole step) computes a query row here,
 * and nothing here depends on the other rows of the call: a row's output is a function of its q
 * and its S keys and values only (batch invariance). */
#if defined(__AVX2__)
/* exp8 with a NaN kept NaN (the clamps return their second operand for a NaN first one) */
static inline __m256 exp8n(__m256 x) {
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_or_ps(exp8(x), nan);
}
#endif

static void attend_group(const char *q_row, const char *kb, int64_t k_step, const char *vb,
                         int64_t v_step, void *out_row, int64_t g, int64_t R, int64_t S,
                         int64_t hd, float scale, const float *sinks, int dt, float *p) {
    const int es = dt == DT_F32 ? 4 : 2;
    float acc[MAX_HEAD_DIM], qf[MAX_HEAD_DIM];
    for (int64_t j = 0; j < R; j++) {
        const int64_t h = g * R + j;
        const char *qh = q_row + h * hd * es;
        for (int64_t d = 0; d < hd; d++) qf[d] = load1(qh, d, dt);
        float m = sinks ? sinks[h] : -INFINITY;
        int64_t s = 0;
#if defined(__AVX2__)
        const int64_t hv = hd / 8 * 8;
        for (; s + 4 <= S; s += 4) { /* 4 keys at once: independent chains */
            const char *k0 = kb + s * k_step * es, *k1 = k0 + k_step * es;
            const char *k2 = k1 + k_step * es, *k3 = k2 + k_step * es;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < hv; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qf + d);
                a0 = _mm256_fmadd_ps(qv, load8(k0, d, dt), a0);
                a1 = _mm256_fmadd_ps(qv, load8(k1, d, dt), a1);
                a2 = _mm256_fmadd_ps(qv, load8(k2, d, dt), a2);
                a3 = _mm256_fmadd_ps(qv, load8(k3, d, dt), a3);
            }
            float z[4] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
            const char *kr[4] = {k0, k1, k2, k3};
            for (int u = 0; u < 4; u++) {
                for (int64_t d = hv; d < hd; d++) z[u] += qf[d] * load1(kr[u], d, dt);
                p[s + u] = z[u] * scale;
                m = p[s + u] > m ? p[s + u] : m;
            }
        }
#endif
        for (; s < S; s++) {
            const char *kr = kb + s * k_step * es;
            float dot = 0.f;
            int64_t d = 0;
#if defined(__AVX2__)
            __m256 a = _mm256_setzero_ps();
            for (; d + 8 <= hd; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qf + d), load8(kr, d, dt), a);
            dot = hsum8(a);
#endif
            for (; d < hd; d++) dot += qf[d] * load1(kr, d, dt);
            p[s] = dot * scale;
            m = p[s] > m ? p[s] : m;
        }
        float sum;
#if defined(__AVX2__)
        {
            const __m256 vm = _mm256_set1_ps(m);
            __m256 vs = _mm256_setzero_ps();
            int64_t t = 0;
            for (; t + 8 <= S; t += 8) {
                const __m256 e = exp8n(_mm256_sub_ps(_mm256_loadu_ps(p + t), vm));
                _mm256_storeu_ps(p + t, e);
                vs = _mm256_add_ps(vs, e);
            }
            if (t < S) { /* the last S % 8 keys in lanes 0..; the others add +0 */
                float tail[8] = {0};
                for (int64_t u = t; u < S; u++) tail[u - t] = p[u] - m;
                __m256 e = exp8n(_mm256_loadu_ps(tail));
                const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                const __m256 live = _mm256_castsi256_ps(
                    _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(S - t)), lane));
                e = _mm256_and_ps(e, live);
                _mm256_storeu_ps(tail, e);
                for (int64_t u = t; u < S; u++) p[u] = tail[u - t];
                vs = _mm256_add_ps(vs, e);
            }
            sum = hsum8(vs);
            if (sinks) {
                float sk[8] = {sinks[h] - m};
                _mm256_storeu_ps(sk, exp8n(_mm256_loadu_ps(sk)));
                sum += sk[0];
            }
        }
#else
        sum = 0.f;
        for (int64_t t = 0; t < S; t++) sum += (p[t] = expf(p[t] - m));
        if (sinks) sum += expf(sinks[h] - m);
#endif
        int64_t d = 0;
#if defined(__AVX2__)
        for (; d + 64 <= hd; d += 64) { /* 64 accumulators in registers over every key */
            __m256 c[8];
            for (int u = 0; u < 8; u++) c[u] = _mm256_setzero_ps();
            for (int64_t t = 0; t < S; t++) {
                const char *vr = vb + t * v_step * es;
                const __m256 ps = _mm256_set1_ps(p[t]);
                for (int u = 0; u < 8; u++)
                    c[u] = _mm256_fmadd_ps(ps, load8(vr, d + 8 * u, dt), c[u]);
            }
            for (int u = 0; u < 8; u++) _mm256_storeu_ps(acc + d + 8 * u, c[u]);
        }
        for (; d + 8 <= hd; d += 8) {
            __m256 c = _mm256_setzero_ps();
            for (int64_t t = 0; t < S; t++)
                c = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), load8(vb + t * v_step * es, d, dt), c);
            _mm256_storeu_ps(acc + d, c);
        }
#endif
        for (; d < hd; d++) {
            float a = 0.f;
            for (int64_t t = 0; t < S; t++) a += p[t] * load1(vb + t * v_step * es, d, dt);
            acc[d] = a;
        }
        const float inv = 1.0f / sum;
        for (d = 0; d < hd; d++) store1(out_row, h * hd + d, acc[d] * inv, dt);
    }
}

/* One decode step of grouped-query attention, every cached key visible (no mask):
 *     out[b, g*R + j] = softmax_s(scale * q[b, g*R + j] . k[b, g, s]) . v[b, g, :]
 * for B rows, G key/value heads, R = n_rep query heads per kv head, S keys, head_dim hd.
 * q: row b at q + b*q_stride, heads contiguous (the fused projection's output, roped in place);
 * k, v: element (b, g, s, d) at b*ks[0] + g*ks[1] + s*ks[2] + d (the cache's strided view);
 * out contiguous (B, G*R*hd). Float32 scores, softmax and sums, one rounding of the output, as
 * F.scaled_dot_product_attention does on the CPU; (b, g) pairs split over threads. */
int tandem_decode_attention(const void *q, int64_t q_stride, const void *k, const int64_t *ks,
                            const void *v, const int64_t *vs, void *out, int64_t B, int64_t G,
                            int64_t R, int64_t S, int64_t hd, float scale, int dt,
                            int nthreads) {
    if (B < 1 || G < 1 || R < 1 || S < 1 || hd < 1 || hd > MAX_HEAD_DIM || dt < DT_F32 ||
        dt > DT_F16 || (dt == DT_F16 && !HAVE_F16))
        return -1;
    const int es = dt == DT_F32 ? 4 : 2;
    int fail = 0;
    nthreads = nthreads < 1 ? 1 : nthreads;
#pragma omp parallel for if (B * G * S * hd >= 2 * PARALLEL_MIN) num_threads(nthreads) \
    reduction(| : fail)
    for (int64_t bg = 0; bg < B * G; bg++) {
        const int64_t b = bg / G, g = bg % G;
        float stack[STACK_KEYS];
        float *p = S <= STACK_KEYS ? stack : (float *)malloc((size_t)S * sizeof(float));
        if (!p) {
            fail = 1;
            continue;
        }
        attend_group((const char *)q + b * q_stride * es,
                     (const char *)k + (b * ks[0] + g * ks[1]) * es, ks[2],
                     (const char *)v + (b * vs[0] + g * vs[1]) * es, vs[2],
                     (char *)out + b * G * R * hd * es, g, R, S, hd, scale, NULL, dt, p);
        if (p != stack) free(p);
    }
    return fail ? -1 : 0;
}

/* Causal grouped-query attention for T new query rows of one sequence, at positions
 * start .. start+T-1 (a prefill chunk), their keys and values already in the cache:
 *     out[t, g*R + j] = softmax_{s <= start+t}(scale * q[t, g*R + j] . k[g, s]) . v[g, s]
 * q: row t at q + t*q_stride, heads contiguous; k, v: element (g, s, d) at g*ks[0] + s*ks[1] + d;
 * out contiguous (T, G*R*hd). The decode step's arithmetic per row; (t, g) pairs split over
 * threads. */
int tandem_prefill_attention(const void *q, int64_t q_stride, const void *k, const int64_t *ks,
                             const void *v, const int64_t *vs, void *out, int64_t T, int64_t G,
                             int64_t R, int64_t start, int64_t hd, float scale, int dt,
                             int nthreads) {
    if (T < 1 || G < 1 || R < 1 || start < 0 || hd < 1 || hd > MAX_HEAD_DIM || dt < DT_F32 ||
        dt > DT_F16 || (dt == DT_F16 && !HAVE_F16))
        return -1;
    const int es = dt == DT_F32 ? 4 : 2;
    const int64_t S_max = start + T;
    int fail = 0;
    nthreads = nthreads < 1 ? 1 : nthreads;
#pragma omp parallel for schedule(dynamic, 1) if (T * G * S_max * hd >= 2 * PARALLEL_MIN) \
    num_threads(nthreads) reduction(| : fail)
    for (int64_t tg = 0; tg < T * G; tg++) {
        const int64_t t = tg / G, g = tg % G, S = start + t + 1;
        float stack[STACK_KEYS];
        float *p = S <= STACK_KEYS ? stack : (float *)malloc((size_t)S * sizeof(float));
        if (!p) {
            fail = 1;
            continue;
        }
        attend_group((const char *)q + t * q_stride * es, (const char *)k + g * ks[0] * es, ks[1],
                     (const char *)v + g * vs[0] * es, vs[1], (char *)out + t * G * R * hd * es,
                     g, R, S, hd, scale, NULL, dt, p);
        if (p != stack) free(p);
    }
    return fail ? -1 : 0;
}

/* The attention of a whole step of B sequences, each row b holding lens[b] new query rows at
 * positions starts[b] .. starts[b] + lens[b] - 1 (a prefill chunk at any start, or one decode
 * token), their keys and values already in the cache:
 *     out[b, t, g*R + j] = softmax_{lo <= s <= pos}(scale * q[b, t, g*R + j] . k[b, g, s]) . v[b, g, s]
 * with pos = starts[b] + t and lo = max(0, pos - window + 1) (window 0: lo = 0), `sinks` as
 * attend_group's. q: row (b, t) at q + b*qs[0] + t*qs[1], heads contiguous; k, v: element
 * (b, g, s, d) at b*ks[0] + g*ks[1] + s*ks[2] + d; out contiguous (B, T, G*R*hd), a padded row
 * (t >= lens[b]) zeros. Each query row is attend_group over exactly its visible keys, as the
 * decode and prefill calls above compute it, so a row's output does not depend on which rows
 * share the step; (b, t, g) triples split over threads. */
int tandem_step_attention(const void *q, const int64_t *qs, const void *k, const int64_t *ks,
                          const void *v, const int64_t *vs, void *out, int64_t B, int64_t T,
                          int64_t G, int64_t R, const int64_t *starts, const int64_t *lens,
                          int64_t window, const float *sinks, int64_t hd, float scale, int dt,
                          int nthreads) {
    if (B < 1 || T < 1 || G < 1 || R < 1 || window < 0 || hd < 1 || hd > MAX_HEAD_DIM ||
        dt < DT_F32 || dt > DT_F16 || (dt == DT_F16 && !HAVE_F16))
        return -1;
    int64_t S_max = 0;
    for (int64_t b = 0; b < B; b++) {
        if (starts[b] < 0 || lens[b] < 1 || lens[b] > T) return -1;
        S_max = starts[b] + lens[b] > S_max ? starts[b] + lens[b] : S_max;
    }
    const int es = dt == DT_F32 ? 4 : 2;
    int fail = 0;
    nthreads = nthreads < 1 ? 1 : nthreads;
#pragma omp parallel for schedule(dynamic, 1) if (B * T * G * S_max * hd >= 2 * PARALLEL_MIN) \
    num_threads(nthreads) reduction(| : fail)
    for (int64_t btg = 0; btg < B * T * G; btg++) {
        const int64_t b = btg / (T * G), t = btg / G % T, g = btg % G;
        char *o = (char *)out + ((b * T + t) * G + g) * R * hd * es;
        if (t >= lens[b]) {
            memset(o, 0, (size_t)(R * hd * es));
            continue;
        }
        const int64_t pos = starts[b] + t;
        const int64_t lo = window && pos - window + 1 > 0 ? pos - window + 1 : 0, S = pos + 1 - lo;
        float stack[STACK_KEYS];
        float *p = S <= STACK_KEYS ? stack : (float *)malloc((size_t)S * sizeof(float));
        if (!p) {
            fail = 1;
            continue;
        }
        attend_group((const char *)q + (b * qs[0] + t * qs[1]) * es,
                     (const char *)k + (b * ks[0] + g * ks[1] + lo * ks[2]) * es, ks[2],
                     (const char *)v + (b * vs[0] + g * vs[1] + lo * vs[2]) * es, vs[2],
                     o - g * R * hd * es, g, R, S, hd, scale, sinks, dt, p);
        if (p != stack) free(p);
    }
    return fail ? -1 : 0;
}
