/* Products of many rows (a prefill) with int8 or int4 weights, in 8-bit integers.

   Each row of x is rounded to 8 bits with one scale per group of `xg` inputs (as llama.cpp's
   Q8 activations are, in blocks): xq = round(x * 127 / max|group|), halves away from zero,
   xs = max|group| / 127. Then, for each group g, the integer sum isum = sum_k xq[m,k] * q[n,k]
   is exact (|isum| < 2^24, so it is also exact in fp32), and

     int8 (one scale s[n] a row, xg = 128, 64 or 32):
       acc = fma((float)isum_g, xs[m,g], acc) for g = 0, 1, ...;  y[m,n] = acc * s[n]
     int4 (q in 0..15, (scale, lo) per group of the weights, xg = that group):
       acc = fma((float)isum_g, scale[n,g] * xs[m,g], acc);  acc = fma(lo[n,g], xsum[m,g], acc)
       y[m,n] = acc, where xsum is the group's sum of x itself (fp32, in input order).

   Every path computes these same operations in this order, so they give the same bits, on any
   thread count (an output is one thread's, start to end). The portable path multiplies row by row;
   the AVX2 path (qgemm_avx2.c) packs panels of 16 weight rows, 8 to a 32-byte vector, and sums
   with vpmaddubsw and vpmaddwd (exactly: see there, x not shifted);
   the AVX512-VNNI path packs a panel of 32 weight rows so that one 64-byte vector holds 4
   consecutive inputs of 16 rows, and `vpdpbusd` (u8 x s8, 4 products a lane) against 4 inputs of
   one row of x broadcast gives 16 outputs' sums at once: no horizontal sums, and the group's fp32
   step is three vector instructions for 16 outputs. vpdpbusd takes one unsigned operand: int4's
   q (0..15) is it, and for int8 x is shifted to xq + 128, the panel's 128 * sum_k q[n,k] over
   each group (vpdpbusd of ones, once per panel) subtracted from the sums after.

   The AMX path (qgemm_amx.c, on CPUs with AMX-INT8) takes the same panels as the tiles' B operand
   and x, not shifted, as their A: TDPBSSD (int8) or TDPBSUD (int4) give each group's sums.

   Weights stay in the row-major layout the one-row kernels read; a thread packs a panel (32 rows x
   K, 64 KiB at K = 2048) into its own buffer and multiplies every row of x by it, so the packing
   is amortised over the rows. */
#include "qgemm.h"

#include <omp.h>

/* One group of x (n inputs, a multiple of 16) rounded to 8 bits: q = round(x * 127 / max|x|), halves
   away from zero, xor `flip` (0x80: the VNNI path's xq + 128); returns the scale max|x| / 127 and,
   with `sum`, the group's fp32 sum of x (16 lane sums, lane j over inputs j, j + 16, ..., then
   sum16): the AVX-512 loop's order, so that both paths give the same bits. */
static float quantize_group(const float *v, int64_t n, int8_t *q, int flip, float *sum) {
    float mx = 0.f, t[16] = {0};
    for (int64_t k = 0; k < n; k++) {
        float a = v[k] < 0.f ? -v[k] : v[k];
        mx = a > mx ? a : mx;
        t[k & 15] += v[k];
    }
    float inv = mx > 0.f ? 127.f / mx : 0.f;
    for (int64_t k = 0; k < n; k++) {
        float r = v[k] * inv;
        q[k] = (int8_t)((uint8_t)(int8_t)(r < 0.f ? r - 0.5f : r + 0.5f) ^ flip);
    }
    if (sum) *sum = sum16(t);
    return mx / 127.f;
}

#if HAVE_X86
TARGET_QVNNI static float quantize_group_avx512(const float *v, int64_t n, int8_t *q, int flip, float *sum) {
    __m512 vm = _mm512_setzero_ps(), vs = vm;
    for (int64_t k = 0; k < n; k += 16) {
        __m512 a = _mm512_loadu_ps(v + k);
        vm = _mm512_max_ps(vm, _mm512_abs_ps(a));
        vs = _mm512_add_ps(vs, a);
    }
    float mx = _mm512_reduce_max_ps(vm);  /* a maximum is exact in any order */
    __m512 inv = _mm512_set1_ps(mx > 0.f ? 127.f / mx : 0.f), half = _mm512_set1_ps(0.5f);
    __m128i fl = _mm_set1_epi8((char)flip);
    __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t k = 0; k < n; k += 16) {
        __m512 r = _mm512_mul_ps(_mm512_loadu_ps(v + k), inv);
        /* r + copysign(0.5, r): r - 0.5 below zero, as the portable loop; -0 rounds to 0 either way */
        __m512 h = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(half),
                                                       _mm512_and_si512(_mm512_castps_si512(r), sign)));
        __m128i b = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(_mm512_add_ps(r, h)));
        _mm_storeu_si128((__m128i *)(q + k), _mm_xor_si128(b, fl));
    }
    if (sum) {
        float t[16];
        _mm512_storeu_ps(t, vs);
        *sum = sum16(t);
    }
    return mx / 127.f;
}
#endif

/* x [M, K] rounded to 8 bits a group of xg (xq [Mp, K], the rows from M to Mp zero), scales xs
   [Mp, G]; with xsum, also each group's fp32 sum of x. Rows are shared among the threads. */
static void quantize_x(const float *x, int64_t M, int64_t Mp, int64_t K, int64_t xg, int flip, int8_t *xq,
                       float *xs, float *xsum, int threads) {
    int64_t G = K / xg;
#if HAVE_X86
    int vec = tl_use_vnni() ? 2 : tl_use_avx2();  /* flip is 0 on the AVX2 path */
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < Mp; m++)
        for (int64_t g = 0; g < G; g++) {
            int8_t *q = xq + m * K + g * xg;
            float *sum = xsum ? xsum + m * G + g : NULL;
            if (m >= M) {
                memset(q, flip, (size_t)xg);
                xs[m * G + g] = 0.f;
                if (sum) *sum = 0.f;
                continue;
            }
#if HAVE_X86
            if (vec) {
                const float *v = x + m * K + g * xg;
                xs[m * G + g] = vec == 2 ? quantize_group_avx512(v, xg, q, flip, sum)
                                         : tl_quantize_group_avx2(v, xg, q, sum);
                continue;
            }
#endif
            xs[m * G + g] = quantize_group(x + m * K + g * xg, xg, q, flip, sum);
        }
}

static inline int i4_q(const uint8_t *wr, int64_t k) {
    uint8_t b = wr[(k >> 5) * 16 + (k & 15)];
    return (k & 16) ? b >> 4 : b & 15;
}

/* ---- portable: output rows n0..n1, a row of weights at a time widened into qrow [K] ---------- */
static void qgemm_portable(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                           int64_t xg, const void *w, const float *s, float *y, int64_t ldy, int64_t n0,
                           int64_t n1, int32_t *qrow) {
    int64_t G = K / xg;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t k = 0; k < K; k++)
            qrow[k] = int4 ? i4_q((const uint8_t *)w + n * (K / 2), k) : ((const int8_t *)w)[n * K + k];
        for (int64_t m = 0; m < M; m++) {
            const int8_t *xr = xq + m * K;
            float acc = 0.f;
            for (int64_t g = 0; g < G; g++) {
                int32_t isum = 0;
                for (int64_t k = g * xg; k < (g + 1) * xg; k++) isum += (int32_t)xr[k] * qrow[k];
                if (int4) {
                    const float *sl = s + (n * G + g) * 2;
                    acc = fmaf((float)isum, sl[0] * xs[m * G + g], acc);
                    acc = fmaf(sl[1], xsum[m * G + g], acc);
                } else {
                    acc = fmaf((float)isum, xs[m * G + g], acc);
                }
            }
            y[m * ldy + n] = int4 ? acc : acc * s[n];
        }
    }
}

#if HAVE_X86
/* A panel of weight rows n0.. (nr <= 32 of them, the rest zero) as int32 words [K/4][32]: word
   (kq, c) is inputs 4kq..4kq+3 of row n0 + c. int4 rows are unpacked to bytes 0..15 first (into
   `rows`, [33][K] bytes, the last row zeros). Also per group: int8, 128 * the sum of each row's
   weights (corr [G][32]); int4, scale and lo ([G][32] each). */
TARGET_QVNNI static void pack_panel(int int4, const void *w, const float *s, int64_t K, int64_t xg, int64_t n0,
                                    int64_t nr, int32_t *P, uint8_t *rows, int32_t *corr, float *sc, float *lo) {
    int64_t KQ = K / 4, G = K / xg;
    const uint8_t *src[QG_NP];
    panel_sources(int4, w, s, K, G, n0, nr, QG_NP, rows, src, sc, lo);
    pack_words(src, KQ, P);
    if (int4) return;
    __m512i ones = _mm512_set1_epi8(1);
    for (int64_t g = 0; g < G; g++)
        for (int h = 0; h < 2; h++) {
            __m512i a = _mm512_setzero_si512();
            for (int64_t kq = g * xg / 4; kq < (g + 1) * xg / 4; kq++)
                a = _mm512_dpbusd_epi32(a, ones, _mm512_loadu_si512(P + kq * QG_NP + 16 * h));
            _mm512_storeu_si512(corr + g * QG_NP + 16 * h, _mm512_slli_epi32(a, 7));
        }
}

/* Rows m0..m0+QG_MR-1 of x against a packed panel; writes outputs n0..n0+nr-1. xq is xq + 128 for
   int8 (the unsigned operand), xq itself for int4 (the signed one; q is the unsigned). */
TARGET_QVNNI static void panel_rows(int int4, const uint8_t *xq, const float *xs, const float *xsum, int64_t K,
                                    int64_t xg, const int32_t *P, const int32_t *corr, const float *sc,
                                    const float *lo, const float *sn, int64_t m0, float *yb, int64_t ldy, int64_t nr) {
    int64_t G = K / xg;
    __m512 f[QG_MR][2];
    for (int r = 0; r < QG_MR; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i a[QG_MR][2];
        for (int r = 0; r < QG_MR; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
        for (int64_t kq = g * xg / 4; kq < (g + 1) * xg / 4; kq++) {
            __m512i w0 = _mm512_loadu_si512(P + kq * QG_NP), w1 = _mm512_loadu_si512(P + kq * QG_NP + 16);
            for (int r = 0; r < QG_MR; r++) {
                int32_t xv;
                memcpy(&xv, xq + (m0 + r) * K + 4 * kq, 4);
                __m512i xb = _mm512_set1_epi32(xv);
                if (int4) {
                    a[r][0] = _mm512_dpbusd_epi32(a[r][0], w0, xb);
                    a[r][1] = _mm512_dpbusd_epi32(a[r][1], w1, xb);
                } else {
                    a[r][0] = _mm512_dpbusd_epi32(a[r][0], xb, w0);
                    a[r][1] = _mm512_dpbusd_epi32(a[r][1], xb, w1);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            if (int4) {
                __m512 sv = _mm512_loadu_ps(sc + g * QG_NP + 16 * h), lv = _mm512_loadu_ps(lo + g * QG_NP + 16 * h);
                for (int r = 0; r < QG_MR; r++) {
                    __m512 t = _mm512_mul_ps(sv, _mm512_set1_ps(xs[(m0 + r) * G + g]));
                    f[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][h]), t, f[r][h]);
                    f[r][h] = _mm512_fmadd_ps(lv, _mm512_set1_ps(xsum[(m0 + r) * G + g]), f[r][h]);
                }
            } else {
                __m512i cv = _mm512_loadu_si512(corr + g * QG_NP + 16 * h);
                for (int r = 0; r < QG_MR; r++) {
                    __m512 i = _mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][h], cv));
                    f[r][h] = _mm512_fmadd_ps(i, _mm512_set1_ps(xs[(m0 + r) * G + g]), f[r][h]);
                }
            }
        }
    }
    for (int h = 0; h < 2; h++) {
        int64_t c0 = 16 * h, cnt = nr - c0;
        if (cnt <= 0) break;
        __mmask16 mk = cnt >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cnt) - 1);
        __m512 sv = int4 ? _mm512_set1_ps(1.f) : _mm512_maskz_loadu_ps(mk, sn + c0);
        for (int r = 0; r < QG_MR; r++) {
            __m512 o = int4 ? f[r][h] : _mm512_mul_ps(f[r][h], sv);
            _mm512_mask_storeu_ps(yb + r * ldy + c0, mk, o);
        }
    }
}

/* The threads share the panels: each packs one and runs all rows (Mp, a multiple of QG_MR) through
   it, the last block's rows past M into a scratch tile rather than y. Returns -1 where a thread's
   buffers cannot be had. */
TARGET_QVNNI static int qgemm_vnni(int int4, const uint8_t *xq, const float *xs, const float *xsum, int64_t M,
                                   int64_t Mp, int64_t K, int64_t xg, const void *w, const float *s, float *y,
                                   int64_t ldy, int64_t N, int threads) {
    int64_t G = K / xg, panels = (N + QG_NP - 1) / QG_NP;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        size_t pb = (size_t)K * QG_NP, gb = (size_t)G * QG_NP * 4;
        size_t rb = (size_t)K * (QG_NP + 1);
        char *buf = (char *)aligned_alloc(64, (pb + rb + 3 * gb + 63) / 64 * 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            int32_t *P = (int32_t *)buf, *corr = (int32_t *)(buf + pb + rb);
            float *sc = (float *)(buf + pb + rb + gb), *lo = sc + G * QG_NP;
#pragma omp for schedule(dynamic, 1)
            for (int64_t p = 0; p < panels; p++) {
                int64_t n0 = p * QG_NP, nr = N - n0 < QG_NP ? N - n0 : QG_NP;
                pack_panel(int4, w, s, K, xg, n0, nr, P, (uint8_t *)(buf + pb), corr, sc, lo);
                for (int64_t m0 = 0; m0 < Mp; m0 += QG_MR) {
                    if (m0 + QG_MR <= M) {
                        panel_rows(int4, xq, xs, xsum, K, xg, P, corr, sc, lo, s + n0, m0, y + m0 * ldy + n0, ldy,
                                   nr);
                    } else {
                        float tmp[QG_MR * QG_NP];
                        panel_rows(int4, xq, xs, xsum, K, xg, P, corr, sc, lo, s + n0, m0, tmp, QG_NP, nr);
                        for (int64_t r = m0; r < M; r++)
                            memcpy(y + r * ldy + n0, tmp + (r - m0) * QG_NP, (size_t)nr * sizeof(float));
                    }
                }
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
#endif

/* gemv.c's path 4: AMX's tiles usable (its cpu_level) and not capped below. */
int tl_use_amx(void) { return (tierlm_gemv_isa() & 15) >= 4; }

/* TIERLM_NATIVE_ISA=amx-emulated (native.py, before the first product): the products below take the
   AMX kernel against software tiles (qgemm_amx_emu.c), on any x86 CPU, so that tests check its
   bits where no CPU with AMX is at hand; the other loops keep their path. -1 where there is none. */
static int amx_emulated;
int tierlm_qgemm_set_amx_emulated(int on) {
    if (!HAVE_X86) return -1;
    amx_emulated = on != 0;
    return amx_emulated;
}
int tierlm_qgemm_amx_emulated(void) { return amx_emulated; }

/* y [M, ldy] = x [M, K] @ W^T as the header says: int8 weights [N, K] with scales s [N] (`group`
   0; xg, the x group, 128, 64 or 32 dividing K), or int4 weights [N, K/2] with (scale, lo) pairs
   s [N, K/group, 2] (`group` > 0, a multiple of 32 dividing K; xg = group). Returns -1 where
   memory cannot be had, -2 for groups that do not fit. */
int tierlm_qgemm(const float *x, int64_t M, int64_t K, const void *w, const float *s, int64_t N, int64_t group,
                 int64_t xg, float *y, int64_t ldy, int threads) {
    int int4 = group > 0;
    if (int4) xg = group;
    if (xg <= 0 || xg % 32 || K % xg || (int4 && K % 32)) return -2;
    if (ldy <= 0) ldy = N;
    int amx = amx_emulated ? 2 : tl_use_amx();  /* 1: the CPU's tiles, 2: software ones */
    int64_t mr = amx ? TL_AMX_ROWS : QG_MR, Mp = (M + mr - 1) / mr * mr, G = K / xg;
    int8_t *xq = (int8_t *)malloc((size_t)(Mp * K));
    float *xs = (float *)malloc((size_t)(2 * Mp * G) * sizeof(float));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -1;
    }
    float *xsum = int4 ? xs + Mp * G : NULL;
    int vnni = tl_use_vnni() && !amx;
    /* the VNNI path takes int8's x as the unsigned operand, xq + 128 */
    quantize_x(x, M, Mp, K, xg, vnni && !int4 ? 0x80 : 0, xq, xs, xsum, threads);
    int rc = 0;
#if HAVE_X86
    if (amx) {
        rc = (amx == 2 ? tl_qgemm_amx_emu : tl_qgemm_amx)(int4, xq, xs, xsum, M, Mp, K, xg, w, s, y, ldy, N, threads);
        free(xq);
        free(xs);
        return rc;
    }
    if (vnni) {
        rc = qgemm_vnni(int4, (const uint8_t *)xq, xs, xsum, M, Mp, K, xg, w, s, y, ldy, N, threads);
        free(xq);
        free(xs);
        return rc;
    }
    if (tl_use_avx2()) {
        rc = tl_qgemm_avx2(int4, xq, xs, xsum, M, Mp, K, xg, w, s, y, ldy, N, threads);
        free(xq);
        free(xs);
        return rc;
    }
#endif
#pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        int32_t *qrow = (int32_t *)malloc((size_t)K * sizeof(int32_t));
        if (qrow)
            qgemm_portable(int4, xq, xs, xsum, M, K, xg, w, s, y, ldy, N * t / T, N * (t + 1) / T, qrow);
        else
#pragma omp atomic write
            rc = -1;
        free(qrow);
    }
    free(xq);
    free(xs);
    return rc;
}

/* Whether this path multiplies many rows in integers faster than a dequantised fp32 product. */
int tierlm_qgemm_fast(void) { return tl_use_avx2(); }
