/* A whole decoder layer's decode step (llama, mistral, qwen2, qwen3, gemma; every row brings one
   token) in one parallel region: RMSNorm, q/k/v, per-head q and k RMSNorms where the layer has
   them (qwen3), rotary embedding, the KV cache write, attention, o, residual, RMSNorm, gate/up,
   act(gate) * up (silu, or gemma's tanh-approximated gelu), down, residual.

   Why one region: a decode step made 89 kernel calls (TinyLlama), each its own OpenMP fork and
   join, with 6-9 ms of torch ops a token between them (norm glue, rotary, SDPA on a few dozen
   positions, residual adds); the step's products read ~20% slower than one call over the same
   bytes (docs/inference.md at a2b1c1e). Here the threads meet at barriers instead, and the small work
   between the products (a few thousand floats a row) runs on one of them while the other waits.

   The products are gemv.c's (tl_rows_range), so the weights' formats, rounding of x and results
   are the same as the per-product calls'. Attention runs in fp32 whatever the cache's dtype (bf16
   keys and values are widened, not the query narrowed); masked positions (-inf) weigh exactly 0. */
#include "gemv.h"

#include <omp.h>


typedef struct {
    int64_t kind, hidden, heads, kv_heads, head_dim, inter, ln_flags;  /* ln_flags: TL_NORM_* of ln1, ln2 */
    int64_t group[4];   /* int4: the groups of q/k/v, o, gate/up and down (each its inputs') */
    double eps, scaling;
    const void *w[7];   /* q, k, v, o, gate, up, down: [N, K] row-major (int4: [N, K/2]) */
    const float *s[7];  /* their int8 scales [N] or int4 (scale, lo) pairs; NULL for bf16/fp32 */
    const float *bias;  /* the q, k and v biases side by side (fp32), or NULL */
    const void *ln1, *ln2;
    int64_t act;        /* TL_ACT_SILU or TL_ACT_GELU_TANH */
    int64_t qk_norm;    /* 0: none; else TL_NORM_* | TL_QK_NORM of qn and kn, RMSNorms over each head */
    double qk_eps;
    const void *qn, *kn;  /* [head_dim] */
} tierlm_layer_w;

#define TL_ACT_SILU 0
#define TL_ACT_GELU_TANH 1
#define TL_QK_NORM 4

typedef struct {
    int64_t rows, kv_len, kv_bf16, slot_stride, head_stride, threads;
    const float *cos, *sin;    /* [rows, head_dim] */
    const float *mask;         /* [rows, kv_len]: 0 where a row attends, -inf where it must not */
    const int64_t *write_pos;  /* [rows]: the position of each row's new key and value in its slot */
} tierlm_step;

typedef struct {
    const float *x;
    const int16_t *xq;
    const float *xs, *xsum;
} prepped;

#define ALIGN_F 16  /* floats: each scratch buffer starts on a 64-byte line */
static int64_t up16(int64_t n) { return (n + ALIGN_F - 1) / ALIGN_F * ALIGN_F; }

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    int64_t m = a > b ? a : b;
    return m > c ? m : c;
}

/* Scratch floats, in the order laid out below. */
static int64_t scratch_floats(const tierlm_layer_w *lw, const tierlm_step *st, int64_t *parts) {
    int64_t M = st->rows, H = lw->hidden, nq = lw->heads * lw->head_dim, nkv = lw->kv_heads * lw->head_dim;
    int64_t I = lw->inter, K = max3(H, nq, I);
    int64_t g = K;  /* the most groups any product's x has */
    for (int i = 0; i < 4; i++) g = lw->kind == 2 && lw->group[i] < g ? lw->group[i] : g;
    int64_t sizes[8] = {M * H, M * nq, M * I, M * (nq + 2 * nkv), M * H, M * 2 * I, (tl_xq_halves((int)lw->kind, M, K) + 1) / 2,
                        tl_xs_floats((int)lw->kind, g, M, K)};
    int64_t total = 0;
    for (int i = 0; i < 8; i++) {
        parts[i] = total;
        total += up16(sizes[i]);
    }
    parts[8] = total;  /* the attention's scores: kv_len a thread */
    return total + st->threads * up16(st->kv_len);
}

int64_t tierlm_layer_scratch_bytes(const tierlm_layer_w *lw, const tierlm_step *st) {
    int64_t parts[9];
    return scratch_floats(lw, st, parts) * (int64_t)sizeof(float);
}

static void prep(const tierlm_layer_w *lw, int stage, const float *x, int64_t M, int64_t K, int16_t *xq,
                 float *xs, prepped *p) {
    int kind = (int)lw->kind;
    int64_t group = lw->group[stage];
    p->x = x;
    p->xq = NULL;
    p->xs = p->xsum = NULL;
    if (!tl_rounds_x(kind, M)) return;
    tl_prepare_x(kind, group, x, M, K, xq, xs);
    p->xq = xq;
    p->xs = xs;
    p->xsum = xs + M * ((kind == 2 ? K / group : 0) + 1);
}

/* Thread tt's rows of w[first .. first + nmat), products of stage `stage`: gemv.c's shared rows
   (tl_rows_shared; tl_spans_reset before). */
static void share(const tierlm_layer_w *lw, int stage, const prepped *p, int64_t M, int64_t K, int first,
                  int nmat, float *const *y, const int64_t *N, int64_t ldy, int64_t tt, int64_t T, tl_span *sp,
                  int avx2) {
    tl_rows_shared((int)lw->kind, p->x, p->xq, p->xs, p->xsum, lw->group[stage], M, K, nmat, lw->w + first,
                   lw->s + first, y, N, ldy, tt, T, sp, avx2);
}

/* gelu_tanh's constants, as PyTorch's: sqrt(2 / pi) and the cube's weight */
#define GELU_BETA 0.7978845608028654f
#define GELU_KAPPA 0.044715f

/* the exponent of act's sigmoid form: act(g) = g / (1 + exp(act_arg(g))) */
static inline float act_arg(int act, float g) {
    return act == TL_ACT_GELU_TANH ? -2.f * GELU_BETA * (g + GELU_KAPPA * g * g * g) : -g;
}

/* ---- attention ------------------------------------------------------------------------ */
#if HAVE_X86
TARGET_AVX2 static inline __m256 kv8(const void *kv, int bf16, int64_t i) {
    if (bf16) return load_bf16((const uint16_t *)kv + i);
    return _mm256_loadu_ps((const float *)kv + i);
}

TARGET_AVX2 static float dot_avx2(const float *q, const void *k, int bf16, int64_t n) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv8(k, bf16, i), a);
    return hsum(a);
}

/* q against 4 keys `stride` bytes apart: four independent chains. One chain a key (dot_avx2) waits
   on each FMA before the next, ~45 cycles a position at 64 dims; attention took ~30 us a layer at
   80 positions (TinyLlama), ~3% of an int8 token in a 2-vCPU Zen 4 VM's fast memory state. Each key's sum
   runs in dot_avx2's order, so the scores are the same to the bit. */
TARGET_AVX2 static void dot4_avx2(const float *q, const char *k, int64_t stride, int bf16, int64_t n, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const char *k1 = k + stride, *k2 = k1 + stride, *k3 = k2 + stride;
    for (int64_t i = 0; i < n; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, kv8(k, bf16, i), a0);
        a1 = _mm256_fmadd_ps(qv, kv8(k1, bf16, i), a1);
        a2 = _mm256_fmadd_ps(qv, kv8(k2, bf16, i), a2);
        a3 = _mm256_fmadd_ps(qv, kv8(k3, bf16, i), a3);
    }
    out[0] = hsum(a0);
    out[1] = hsum(a1);
    out[2] = hsum(a2);
    out[3] = hsum(a3);
}

/* o = sum over j of p[j] * v_j (p[j] == 0 skipped), 64 outputs at a time held in registers across
   the positions where a loop of o[i] += p * v[i] loaded and stored o at each; each output summed in the same order. */
TARGET_AVX2 static void wsum_avx2(const float *p, int64_t L, const char *vb, int64_t stride, int bf16, int64_t hd,
                                  float *o) {
    for (int64_t c = 0; c < hd; c += 64) {
        if (hd - c >= 64) {
            __m256 a[8];
            for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
            for (int64_t j = 0; j < L; j++) {
                if (p[j] == 0.f) continue;
                __m256 pv = _mm256_set1_ps(p[j]);
                const char *v = vb + j * stride;
                for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(pv, kv8(v, bf16, c + 8 * u), a[u]);
            }
            for (int u = 0; u < 8; u++) _mm256_storeu_ps(o + c + 8 * u, a[u]);
            continue;
        }
        for (int64_t u = c; u < hd; u += 8) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t j = 0; j < L; j++)
                if (p[j] != 0.f) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), kv8(vb + j * stride, bf16, u), a);
            _mm256_storeu_ps(o + u, a);
        }
    }
}

/* exp(x) for 8 floats (Cephes' expf: range reduction by ln 2, a degree-5 polynomial; ~1 ulp),
   0 below -87.3 (so masked scores weigh exactly nothing). */
TARGET_AVX2 static __m256 exp8(__m256 x) {
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

/* s[i] = exp(s[i] - mx), returns their sum */
TARGET_AVX2 static float exp_sum_avx2(float *s, int64_t n, float mx) {
    __m256 m = _mm256_set1_ps(mx), acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float t = hsum(acc);
    for (; i < n; i++) t += (s[i] = s[i] == -INFINITY ? 0.f : expf(s[i] - mx));
    return t;
}

/* silu(g) * u = g * u / (1 + exp(-g)); gelu_tanh(g) * u = g * u / (1 + exp(-2 t)) with
   t = sqrt(2 / pi) * (g + 0.044715 g^3), since 0.5 * (1 + tanh(t)) = sigmoid(2 t) */
TARGET_AVX2 static void act_mul_avx2(int act, const float *g, const float *u, float *o, int64_t n) {
    int64_t i = 0;
    __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    __m256 c1 = _mm256_set1_ps(-2.f * GELU_BETA), c3 = _mm256_set1_ps(-2.f * GELU_BETA * GELU_KAPPA);
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 z = act == TL_ACT_GELU_TANH
            ? _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(gv, gv), gv), c3, _mm256_mul_ps(gv, c1))
            : _mm256_sub_ps(zero, gv);
        __m256 e = exp8(z);
        _mm256_storeu_ps(o + i, _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(u + i)), _mm256_add_ps(one, e)));
    }
    for (; i < n; i++) o[i] = g[i] * u[i] / (1.f + expf(act_arg(act, g[i])));
}
#endif

static float dot_scalar(const float *q, const void *k, int bf16, int64_t n) {
    float a = 0.f;
    for (int64_t i = 0; i < n; i++) a += q[i] * (bf16 ? bf16_to_f32(((const uint16_t *)k)[i]) : ((const float *)k)[i]);
    return a;
}

static void act_mul(int act, const float *g, const float *u, float *o, int64_t n, int avx2) {
#if HAVE_X86
    if (avx2) {
        act_mul_avx2(act, g, u, o, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) o[i] = g[i] * u[i] / (1.f + expf(act_arg(act, g[i])));
    (void)avx2;
}

/* x <- RMSNorm(x) over one head (a qwen3 q or k head; flags TL_NORM_*) */
static void head_norm(float *x, const void *w, int flags, float eps, int64_t hd) {
    float ss = 0.f;
    for (int64_t i = 0; i < hd; i++) ss += x[i] * x[i];
    float r = 1.f / sqrtf(ss / (float)hd + eps);
    for (int64_t i = 0; i < hd; i++) x[i] = x[i] * r * tl_norm_w(w, flags, i);
}

/* x <- x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]) */
static void rotate(float *x, const float *cs, const float *sn, int64_t hd) {
    float t[512];
    int64_t half = hd / 2;
    memcpy(t, x, (size_t)hd * sizeof(float));
    for (int64_t j = 0; j < half; j++) x[j] = t[j] * cs[j] + (-t[j + half]) * sn[j];
    for (int64_t j = half; j < hd; j++) x[j] = t[j] * cs[j] + t[j - half] * sn[j];
}

/* Row m's KV head h: bias, q/k norms and rotation of its query heads and key, the key and value
   written to the cache (before any of the row's query heads attends: `attend`). */
static void place(const tierlm_layer_w *lw, const tierlm_step *st, float *qkv, int64_t m, int64_t h,
                  void *kc, void *vc) {
    int64_t hd = lw->head_dim, nq = lw->heads * hd, nkv = lw->kv_heads * hd, gq = lw->heads / lw->kv_heads;
    int64_t esz = st->kv_bf16 ? 2 : 4;
    int bf16 = (int)st->kv_bf16;
    float *row = qkv + m * (nq + 2 * nkv);
    float *q0 = row + h * gq * hd, *k = row + nq + h * hd, *v = row + nq + nkv + h * hd;
    const float *cs = st->cos + m * hd, *sn = st->sin + m * hd;
    if (lw->bias) {
        const float *b = lw->bias;
        for (int64_t i = 0; i < gq * hd; i++) q0[i] += b[h * gq * hd + i];
        for (int64_t i = 0; i < hd; i++) {
            k[i] += b[nq + h * hd + i];
            v[i] += b[nq + nkv + h * hd + i];
        }
    }
    if (lw->qk_norm) {
        int fl = (int)lw->qk_norm;
        float qe = (float)lw->qk_eps;
        for (int64_t g = 0; g < gq; g++) head_norm(q0 + g * hd, lw->qn, fl, qe, hd);
        head_norm(k, lw->kn, fl, qe, hd);
    }
    for (int64_t g = 0; g < gq; g++) rotate(q0 + g * hd, cs, sn, hd);
    rotate(k, cs, sn, hd);
    int64_t base = m * st->slot_stride + h * st->head_stride;
    char *kdst = (char *)kc + (base + st->write_pos[m] * hd) * esz;
    char *vdst = (char *)vc + (base + st->write_pos[m] * hd) * esz;
    if (bf16) {
        for (int64_t i = 0; i < hd; i++) {
            ((uint16_t *)kdst)[i] = f32_to_bf16(k[i]);
            ((uint16_t *)vdst)[i] = f32_to_bf16(v[i]);
        }
    } else {
        memcpy(kdst, k, (size_t)hd * 4);
        memcpy(vdst, v, (size_t)hd * 4);
    }
}

/* Row m's query head qh (placed): its attention over the row's kv_len positions into att. One
   query head a work item, not one KV head: with fewer KV heads than threads (gemma's one, or
   8 on a 16-core machine) the rest of the threads would wait. */
static void attend(const tierlm_layer_w *lw, const tierlm_step *st, const float *qkv, int64_t m, int64_t qh,
                   const void *kc, const void *vc, float *att, float *sc, int avx2) {
    int64_t hd = lw->head_dim, nq = lw->heads * hd, nkv = lw->kv_heads * hd, gq = lw->heads / lw->kv_heads;
    int64_t L = st->kv_len, esz = st->kv_bf16 ? 2 : 4, h = qh / gq;
    int bf16 = (int)st->kv_bf16;
    const float *q = qkv + m * (nq + 2 * nkv) + qh * hd, *mask = st->mask + m * L;
    int64_t base = m * st->slot_stride + h * st->head_stride;
    const char *kbase = (const char *)kc + base * esz, *vbase = (const char *)vc + base * esz;
    float scale = (float)lw->scaling;
    int vec = avx2 && hd % 8 == 0;
    {
        float mx = -INFINITY;
        int64_t j0 = 0;
#if HAVE_X86
        for (; vec && j0 + 4 <= L; j0 += 4) {
            float d[4];
            dot4_avx2(q, kbase + j0 * hd * esz, hd * esz, bf16, hd, d);
            for (int t = 0; t < 4; t++) {  /* a masked key's score, computed or not, is -inf */
                int64_t j = j0 + t;
                sc[j] = mask[j] == -INFINITY ? -INFINITY : d[t] * scale + mask[j];
                mx = sc[j] > mx ? sc[j] : mx;
            }
        }
#endif
        for (int64_t j = j0; j < L; j++) {
            if (mask[j] == -INFINITY) {
                sc[j] = -INFINITY;
                continue;
            }
            const void *kj = kbase + j * hd * esz;
#if HAVE_X86
            float d = vec ? dot_avx2(q, kj, bf16, hd) : dot_scalar(q, kj, bf16, hd);
#else
            float d = dot_scalar(q, kj, bf16, hd);
#endif
            sc[j] = d * scale + mask[j];
            mx = sc[j] > mx ? sc[j] : mx;
        }
        float *o = att + m * nq + qh * hd;
        memset(o, 0, (size_t)hd * sizeof(float));
        if (mx == -INFINITY) return;  /* a row that sees nothing (none in a decode step) */
        float tot = 0.f;
#if HAVE_X86
        if (avx2) tot = exp_sum_avx2(sc, L, mx);
        else
#endif
            for (int64_t j = 0; j < L; j++) tot += (sc[j] = sc[j] == -INFINITY ? 0.f : expf(sc[j] - mx));
#if HAVE_X86
        if (vec) {
            for (int64_t j = 0; j < L; j++) sc[j] /= tot;
            wsum_avx2(sc, L, vbase, hd * esz, bf16, hd, o);
            return;
        }
#endif
        for (int64_t j = 0; j < L; j++) {
            float p = sc[j] / tot;
            if (p == 0.f) continue;
            const void *vj = vbase + j * hd * esz;
            for (int64_t i = 0; i < hd; i++)
                o[i] += p * (bf16 ? bf16_to_f32(((const uint16_t *)vj)[i]) : ((const float *)vj)[i]);
        }
    }
}

/* x [rows, hidden] (fp32, updated in place) through one decoder layer; kc, vc are this layer's
   cache [slots, kv_heads, positions, head_dim] (fp32 or bf16). `scratch` holds
   tierlm_layer_scratch_bytes. Returns -2 for an int4 group that does not divide its product's
   inputs, -3 for a head geometry the kernel does not take. */
int tierlm_layer_decode(const tierlm_layer_w *lw, const tierlm_step *st, float *x, void *kc, void *vc,
                        float *scratch) {
    int64_t M = st->rows, H = lw->hidden, hd = lw->head_dim, I = lw->inter, T = st->threads;
    int64_t nq = lw->heads * hd, nkv = lw->kv_heads * hd, kvh = lw->kv_heads, nh = lw->heads;
    int kind = (int)lw->kind, avx2 = tl_use_avx2();
    int64_t ins[4] = {H, nq, H, I};
    for (int i = 0; kind == 2 && i < 4; i++)
        if (lw->group[i] <= 0 || lw->group[i] % 32 || ins[i] % lw->group[i]) return -2;
    if (hd % 2 || hd > 512 || lw->heads % kvh) return -3;
    int64_t parts[9];
    scratch_floats(lw, st, parts);
    float *xn = scratch + parts[0], *att = scratch + parts[1], *act = scratch + parts[2],
          *qkv = scratch + parts[3], *y = scratch + parts[4], *gu = scratch + parts[5],
          *xs = scratch + parts[7], *sc = scratch + parts[8];
    int16_t *xq = (int16_t *)(scratch + parts[6]);
    float eps = (float)lw->eps;
    prepped p;
    int64_t n_qkv[3] = {nq, nkv, nkv}, n_h[1] = {H}, n_gu[2] = {I, I};
    float *y_qkv[3] = {qkv, qkv + nq, qkv + nq + nkv}, *y_h[1] = {y}, *y_gu[2] = {gu, gu + I};
    tl_span spans_mem[TL_MAX_SPANS + 1];
    tl_span *sp = (tl_span *)(((uintptr_t)spans_mem + 63) & ~(uintptr_t)63);
    if (T > TL_MAX_SPANS) T = TL_MAX_SPANS;
#pragma omp parallel num_threads(T)
    {
        int64_t me = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
        {
            tl_prep_rows(x, M, H, lw->ln1, (int)lw->ln_flags, eps, xn);
            prep(lw, 0, xn, M, H, xq, xs, &p);
            tl_spans_reset(sp, n_qkv, 3, nt);
        }
        share(lw, 0, &p, M, H, 0, 3, y_qkv, n_qkv, nq + 2 * nkv, me, nt, sp, avx2);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t tt = 0; tt < nt; tt++)
            for (int64_t it = M * kvh * tt / nt; it < M * kvh * (tt + 1) / nt; it++)
                place(lw, st, qkv, it / kvh, it % kvh, kc, vc);
#pragma omp for schedule(static)
        for (int64_t tt = 0; tt < nt; tt++)
            for (int64_t it = M * nh * tt / nt; it < M * nh * (tt + 1) / nt; it++)
                attend(lw, st, qkv, it / nh, it % nh, kc, vc, att, sc + tt * up16(st->kv_len), avx2);
#pragma omp single
        {
            prep(lw, 1, att, M, nq, xq, xs, &p);
            tl_spans_reset(sp, n_h, 1, nt);
        }
        share(lw, 1, &p, M, nq, 3, 1, y_h, n_h, H, me, nt, sp, avx2);
#pragma omp barrier
#pragma omp single
        {
            for (int64_t i = 0; i < M * H; i++) x[i] += y[i];
            tl_prep_rows(x, M, H, lw->ln2, (int)lw->ln_flags, eps, xn);
            prep(lw, 2, xn, M, H, xq, xs, &p);
            tl_spans_reset(sp, n_gu, 2, nt);
        }
        share(lw, 2, &p, M, H, 4, 2, y_gu, n_gu, 2 * I, me, nt, sp, avx2);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t tt = 0; tt < nt; tt++)
            for (int64_t m = 0; m < M; m++) {
                int64_t a = I * tt / nt, b = I * (tt + 1) / nt;
                act_mul((int)lw->act, gu + m * 2 * I + a, gu + m * 2 * I + I + a, act + m * I + a, b - a, avx2);
            }
#pragma omp single
        {
            prep(lw, 3, act, M, I, xq, xs, &p);
            tl_spans_reset(sp, n_h, 1, nt);
        }
        share(lw, 3, &p, M, I, 6, 1, y_h, n_h, H, me, nt, sp, avx2);
    }
    for (int64_t i = 0; i < M * H; i++) x[i] += y[i];
    return 0;
}

/* Layers 0..n-1 in one call: layer i with lws[i], its mask kind's step sts[i], its cache kc[i],
   vc[i]. Returns 0; -4 with *info the bytes needed where `scratch` (scratch_bytes long) is smaller
   than a layer's tierlm_layer_scratch_bytes (nothing computed); or the first refusal's code with
   *info its layer.
   Why: a resident model's decode step made one ctypes call a layer, and each cost ~35 us of Python
   and glue beside the C (TinyLlama, 22 layers: ~0.8 ms of a ~21 ms int8 token in a 2-vCPU Zen 4 VM's fast
   memory state), much of it the interpreter running from caches the layer's weights had just
   swept. */
int tierlm_layers_decode(const tierlm_layer_w *const *lws, const tierlm_step *const *sts, int64_t n, float *x,
                         void *const *kc, void *const *vc, float *scratch, int64_t scratch_bytes, int64_t *info) {
    int64_t need = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t b = tierlm_layer_scratch_bytes(lws[i], sts[i]);
        need = b > need ? b : need;
    }
    if (need > scratch_bytes) {
        *info = need;
        return -4;
    }
    for (int64_t i = 0; i < n; i++) {
        int rc = tierlm_layer_decode(lws[i], sts[i], x, kc[i], vc[i], scratch);
        if (rc) {
            *info = i;
            return rc;
        }
    }
    return 0;
}
