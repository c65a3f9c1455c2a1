/* What qgemm.c shares with its AVX2 path (qgemm_avx2.c): the rows of x a micro-kernel takes, the
   order of a group's fp32 sum of x, and the AVX2 path's entry points. */
#ifndef TIERLM_QGEMM_H
#define TIERLM_QGEMM_H
#include "gemv.h"

#ifndef QG_MR
#define QG_MR 4  /* rows of x per micro-kernel (x's rows are padded to a multiple of it) */
#endif

/* The sum of 16 lane sums, halves first (as the AVX-512 path adds its vector's halves). */
static inline float sum16(float *t) {
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] = t[i] + t[i + w];
    return t[0];
}

#if HAVE_X86
#include <immintrin.h>
#include <string.h>

/* A panel's np weight rows n0.. as bytes, for both x86 paths' packing: src[c] is row c's K
   weights (int8 in place; int4 unpacked to bytes 0..15 into rows + c * K); rows beyond the nr that
   exist read the zero row at rows + np * K; int4's (scale, lo) per group go to sc and lo [G][np]. */
static inline void panel_sources(int int4, const void *w, const float *s, int64_t K, int64_t G, int64_t n0,
                              int64_t nr, int64_t np, uint8_t *rows, const uint8_t **src, float *sc, float *lo) {
    memset(rows + np * K, 0, (size_t)K);
    for (int64_t c = 0; c < np; c++) {
        if (c >= nr) {
            src[c] = rows + np * K;
        } else if (int4) {
            const uint8_t *wr = (const uint8_t *)w + (n0 + c) * (K / 2);
            uint8_t *row = rows + c * K;
            __m128i m15 = _mm_set1_epi8(15);
            for (int64_t b = 0; b < K / 32; b++) {
                __m128i v = _mm_loadu_si128((const __m128i *)(wr + b * 16));
                _mm_storeu_si128((__m128i *)(row + b * 32), _mm_and_si128(v, m15));
                _mm_storeu_si128((__m128i *)(row + b * 32 + 16), _mm_and_si128(_mm_srli_epi16(v, 4), m15));
            }
            src[c] = row;
        } else {
            src[c] = (const uint8_t *)w + (n0 + c) * K;
        }
        for (int64_t g = 0; g < G && int4; g++) {
            sc[g * np + c] = c < nr ? s[((n0 + c) * G + g) * 2] : 0.f;
            lo[g * np + c] = c < nr ? s[((n0 + c) * G + g) * 2 + 1] : 0.f;
        }
    }
}

float tl_quantize_group_avx2(const float *v, int64_t n, int8_t *q, float *sum);
int tl_qgemm_avx2(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t Mp, int64_t K,
                  int64_t xg, const void *w, const float *s, float *y, int64_t ldy, int64_t N, int threads);
#endif
#endif
