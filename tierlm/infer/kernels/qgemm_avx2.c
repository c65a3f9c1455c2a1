/* qgemm.c's products of many rows on AVX2 (+FMA): the same integer sums per group and the same fp32
   steps in the same order as its other paths (qgemm.c's header), so the same bits.

   A panel of 16 weight rows is packed so that one 32-byte vector holds 4 consecutive inputs of 8
   rows, and 4 inputs of one row of x are broadcast against it. AVX2 has no u8 x s8 dot product into
   32 bits: `vpmaddubsw` multiplies u8 by s8 and adds pairs into s16, saturating, and `vpmaddwd`
   with ones adds those pairs into s32 lanes. It is exact only while a pair stays within 32767:
     int4: q (0..15) unsigned, x (-127..127) signed: |pair| <= 2 * 15 * 127.
     int8: |w| unsigned and x with w's sign (`vpsignb`) signed: |w| * |x| <= 128 * 127, a pair
           at most 32512. |w| rather than |x| as the unsigned operand because a weight may be
           -128 (quant._int8 clamps to -128..127), whose |w| = 128 is still a u8, while x is
           rounded to -127..127 (|x * 127 / max| <= 127 to within an ulp, + 0.5 truncated), so
           negating it cannot overflow.
   So x is rounded as the portable path rounds it (no + 128 shift), and each group's sum is exact. */
#include "qgemm.h"

#include <omp.h>

#if HAVE_X86
#define QA_NP 16 /* weight rows of a panel: two vectors of 8 lanes */

/* qgemm.c's quantize_group (flip 0) in vectors: the maximum is exact in any order, the rounding
   is the same per input, and the sum keeps 16 lane sums (two vectors of 8) in input order. */
TARGET_AVX2 float tl_quantize_group_avx2(const float *v, int64_t n, int8_t *q, float *sum) {
    __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vm = _mm256_setzero_ps(), s0 = vm, s1 = vm;
    for (int64_t k = 0; k < n; k += 16) {
        __m256 a = _mm256_loadu_ps(v + k), b = _mm256_loadu_ps(v + k + 8);
        vm = _mm256_max_ps(vm, _mm256_max_ps(_mm256_and_ps(a, absm), _mm256_and_ps(b, absm)));
        s0 = _mm256_add_ps(s0, a);
        s1 = _mm256_add_ps(s1, b);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float mx = _mm_cvtss_f32(m4);
    __m256 inv = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 0.f), half = _mm256_set1_ps(0.5f);
    __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    for (int64_t k = 0; k < n; k += 16) {
        __m256 r0 = _mm256_mul_ps(_mm256_loadu_ps(v + k), inv), r1 = _mm256_mul_ps(_mm256_loadu_ps(v + k + 8), inv);
        /* r + copysign(0.5, r), truncated: the portable loop's halves away from zero */
        __m256i i0 = _mm256_cvttps_epi32(_mm256_add_ps(r0, _mm256_or_ps(half, _mm256_and_ps(r0, sign))));
        __m256i i1 = _mm256_cvttps_epi32(_mm256_add_ps(r1, _mm256_or_ps(half, _mm256_and_ps(r1, sign))));
        __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xd8);  /* 16 words in order */
        __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        _mm_storeu_si128((__m128i *)(q + k), b);
    }
    if (sum) {
        float t[16];
        _mm256_storeu_ps(t, s0);
        _mm256_storeu_ps(t + 8, s1);
        *sum = sum16(t);
    }
    return mx / 127.f;
}

/* 8 vectors of 8 words, rows of an 8 x 8 matrix, transposed in place. */
TARGET_AVX2 static void transpose8(__m256i r[8]) {
    __m256i t[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int a = 0; a < 2; a++) {  /* r[4a + j], 128-bit lane L: column 4L + j of rows 4a..4a+3 */
        r[4 * a] = _mm256_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
        r[4 * a + 1] = _mm256_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
        r[4 * a + 2] = _mm256_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
        r[4 * a + 3] = _mm256_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    for (int j = 0; j < 4; j++) {
        t[j] = _mm256_permute2x128_si256(r[j], r[4 + j], 0x20);
        t[4 + j] = _mm256_permute2x128_si256(r[j], r[4 + j], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}

/* A panel of weight rows n0.. (nr <= 16 of them, the rest zero) as int32 words P [K/4][16]: word
   (kq, c) is inputs 4kq..4kq+3 of row n0 + c. int4 rows are unpacked to bytes 0..15 first (into
   `rows`, [17][K] bytes, the last row zeros), with scale and lo per group ([G][16] each); int8's
   |w| goes to A (same layout) and its row scales to sn [16]. */
TARGET_AVX2 static void pack_panel(int int4, const void *w, const float *s, int64_t K, int64_t xg, int64_t n0,
                                   int64_t nr, int32_t *P, int32_t *A, uint8_t *rows, float *sc, float *lo,
                                   float *sn) {
    int64_t KQ = K / 4, G = K / xg;
    const uint8_t *src[QA_NP];
    panel_sources(int4, w, s, K, G, n0, nr, QA_NP, rows, src, sc, lo);
    for (int64_t c = 0; c < QA_NP && !int4; c++) sn[c] = c < nr ? s[n0 + c] : 0.f;
    int64_t kq = 0;
    for (; kq + 8 <= KQ; kq += 8)
        for (int h = 0; h < 2; h++) {
            __m256i r[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(src[8 * h + i] + 4 * kq));
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_si256((__m256i *)(P + (kq + i) * QA_NP + 8 * h), r[i]);
        }
    for (; kq < KQ; kq++)
        for (int64_t c = 0; c < QA_NP; c++) memcpy(P + kq * QA_NP + c, src[c] + 4 * kq, 4);
    if (int4) return;
    for (int64_t i = 0; i < KQ * QA_NP; i += 8)  /* |-128| = 128: still a u8 */
        _mm256_storeu_si256((__m256i *)(A + i), _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(P + i))));
}

/* Rows m0..m0+QG_MR-1 of x against a packed panel: all 16 outputs of each row into yb (ldy apart).
   Inlined into two copies, int4 a constant in each. */
TARGET_AVX2 static inline __attribute__((always_inline)) void
panel_rows(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t K, int64_t xg, const int32_t *P,
           const int32_t *A, const float *sc, const float *lo, const float *sn, int64_t m0, float *yb, int64_t ldy) {
    int64_t G = K / xg;
    const int32_t *U = int4 ? P : A;  /* the unsigned operand: q, or |w| */
    __m256i ones = _mm256_set1_epi16(1);
    /* int4's pairs are at most 2 * 15 * 127 = 3810, so 8 steps' add up in s16 (30480) before
       widening: fewer vpmaddwd; int8's pairs reach 32512 and widen every step */
    const int ks = int4 ? 8 : 1;
    __m256 f[QG_MR][2];
    for (int r = 0; r < QG_MR; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i a[QG_MR][2];
        for (int r = 0; r < QG_MR; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
        for (int64_t kq = g * xg / 4; kq < (g + 1) * xg / 4; kq += ks) {
            __m256i p[QG_MR][2];  /* s16 pair sums of ks steps */
            for (int r = 0; r < QG_MR; r++) p[r][0] = p[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
            for (int j = 0; j < ks; j++) {
                __m256i u0 = _mm256_loadu_si256((const __m256i *)(U + (kq + j) * QA_NP));
                __m256i u1 = _mm256_loadu_si256((const __m256i *)(U + (kq + j) * QA_NP + 8));
                for (int r = 0; r < QG_MR; r++) {
                    int32_t xv;
                    memcpy(&xv, xq + (m0 + r) * K + 4 * (kq + j), 4);
                    __m256i x0 = _mm256_set1_epi32(xv), x1 = x0;
                    if (!int4) {
                        const __m256i *wv = (const __m256i *)(P + (kq + j) * QA_NP);
                        x0 = _mm256_sign_epi8(x0, _mm256_loadu_si256(wv));
                        x1 = _mm256_sign_epi8(x1, _mm256_loadu_si256(wv + 1));
                    }
                    __m256i p0 = _mm256_maddubs_epi16(u0, x0), p1 = _mm256_maddubs_epi16(u1, x1);
                    p[r][0] = _mm256_add_epi16(p[r][0], p0);
                    p[r][1] = _mm256_add_epi16(p[r][1], p1);
                }
            }
            for (int r = 0; r < QG_MR; r++) {
                a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(p[r][0], ones));
                a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(p[r][1], ones));
            }
        }
        for (int h = 0; h < 2; h++) {
            if (int4) {
                __m256 sv = _mm256_loadu_ps(sc + g * QA_NP + 8 * h), lv = _mm256_loadu_ps(lo + g * QA_NP + 8 * h);
                for (int r = 0; r < QG_MR; r++) {
                    __m256 t = _mm256_mul_ps(sv, _mm256_set1_ps(xs[(m0 + r) * G + g]));
                    f[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][h]), t, f[r][h]);
                    f[r][h] = _mm256_fmadd_ps(lv, _mm256_set1_ps(xsum[(m0 + r) * G + g]), f[r][h]);
                }
            } else {
                for (int r = 0; r < QG_MR; r++)
                    f[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][h]), _mm256_set1_ps(xs[(m0 + r) * G + g]),
                                              f[r][h]);
            }
        }
    }
    for (int h = 0; h < 2; h++) {
        __m256 sv = int4 ? _mm256_set1_ps(1.f) : _mm256_loadu_ps(sn + 8 * h);
        for (int r = 0; r < QG_MR; r++)
            _mm256_storeu_ps(yb + r * ldy + 8 * h, int4 ? f[r][h] : _mm256_mul_ps(f[r][h], sv));
    }
}

/* Rows m0.. of x against the panel of outputs n0..n0+nr-1: into y, or through a tile where the
   panel or the block of rows is short. */
TARGET_AVX2 static void panel_block(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t M,
                                    int64_t K, int64_t xg, const int32_t *P, const int32_t *A, const float *sc,
                                    const float *lo, const float *sn, int64_t m0, float *y, int64_t ldy, int64_t n0,
                                    int64_t nr) {
    float tmp[QG_MR * QA_NP];
    int whole = m0 + QG_MR <= M && nr == QA_NP;
    float *yb = whole ? y + m0 * ldy + n0 : tmp;
    int64_t lb = whole ? ldy : QA_NP;
    if (int4)
        panel_rows(1, xq, xs, xsum, K, xg, P, A, sc, lo, sn, m0, yb, lb);
    else
        panel_rows(0, xq, xs, xsum, K, xg, P, A, sc, lo, sn, m0, yb, lb);
    if (whole) return;
    for (int64_t r = m0; r < M && r < m0 + QG_MR; r++)
        memcpy(y + r * ldy + n0, tmp + (r - m0) * QA_NP, (size_t)nr * sizeof(float));
}

/* The threads share the panels: each packs one and runs all rows (Mp, a multiple of QG_MR) through
   it. xq is x rounded as the portable path rounds it. Returns -1 where a thread's buffers cannot
   be had. */
TARGET_AVX2 int tl_qgemm_avx2(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t Mp,
                              int64_t K, int64_t xg, const void *w, const float *s, float *y, int64_t ldy, int64_t N,
                              int threads) {
    int64_t G = K / xg, panels = (N + QA_NP - 1) / QA_NP;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        size_t pb = (size_t)K * QA_NP, rb = (size_t)K * (QA_NP + 1), gb = (size_t)G * QA_NP * 4;
        char *buf = (char *)aligned_alloc(32, (2 * pb + rb + 2 * gb + QA_NP * 4 + 31) / 32 * 32);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            int32_t *P = (int32_t *)buf, *A = (int32_t *)(buf + pb);
            uint8_t *rows = (uint8_t *)(buf + 2 * pb);
            float *sc = (float *)(buf + 2 * pb + rb), *lo = sc + G * QA_NP, *sn = lo + G * QA_NP;
#pragma omp for schedule(dynamic, 1)
            for (int64_t p = 0; p < panels; p++) {
                int64_t n0 = p * QA_NP, nr = N - n0 < QA_NP ? N - n0 : QA_NP;
                pack_panel(int4, w, s, K, xg, n0, nr, P, A, rows, sc, lo, sn);
                for (int64_t m0 = 0; m0 < Mp; m0 += QG_MR)
                    panel_block(int4, xq, xs, xsum, M, K, xg, P, A, sc, lo, sn, m0, y, ldy, n0, nr);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
#endif
