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
float tl_quantize_group_avx2(const float *v, int64_t n, int8_t *q, float *sum);
int tl_qgemm_avx2(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t Mp, int64_t K,
                  int64_t xg, const void *w, const float *s, float *y, int64_t ldy, int64_t N, int threads);
#endif
#endif
