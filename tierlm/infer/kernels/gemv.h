/* What gemv.c shares with layer.c: the products of a few rows, split by output rows, and the
   preparation of their x (the RMSNorm before a product, x rounded to integers for int8/int4). */
#ifndef TIERLM_GEMV_H
#define TIERLM_GEMV_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#define TARGET_BF16DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
#else
#define HAVE_X86 0
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as PyTorch's conversion to bf16 does (NaN stays NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if HAVE_X86
/* The sum of 8 floats; 8 bf16 (as uint16) widened to fp32. */
TARGET_AVX2 static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}
TARGET_AVX2 static inline __m256 load_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
#endif

/* An RMSNorm weight's flags: stored as bf16 (else fp32); the norm scales by (1 + weight), as
   Gemma's do (computed in fp32, as transformers' GemmaRMSNorm does), else by the weight. */
#define TL_NORM_BF16 1
#define TL_NORM_ONE_PLUS 2

static inline float tl_norm_w(const void *nw, int flags, int64_t k) {
    float w = flags & TL_NORM_BF16 ? bf16_to_f32(((const uint16_t *)nw)[k]) : ((const float *)nw)[k];
    return flags & TL_NORM_ONE_PLUS ? 1.f + w : w;
}

int tl_use_avx2(void);
void tl_prep_rows(const float *x, int64_t M, int64_t K, const void *nw, int nw_flags, float eps, float *out);
int tl_use_bf16dp(void);
int tl_use_vnni(void);
int tl_rounds_x(int kind, int64_t M);
int64_t tl_xq_halves(int kind, int64_t M, int64_t K);
int64_t tl_xs_floats(int kind, int64_t group, int64_t M, int64_t K);
void tl_prepare_x(int kind, int64_t group, const float *x, int64_t M, int64_t K, int16_t *xq, float *xs);
/* A product's rows shared among threads (gemv.c, tl_rows_shared): each thread's even share, taken
   in chunks from its front; a thread that is done takes the back half of the largest share left. */
#define TL_MAX_SPANS 256  /* threads a product's rows are shared among (more are not started) */
typedef struct {
    uint64_t v;  /* front << 32 | back */
    char pad[56];
} tl_span;
void tl_spans_reset(tl_span *sp, const int64_t *N, int64_t nmat, int64_t T);
void tl_rows_shared(int kind, const float *x, const int16_t *xq, const float *xs, const float *xsum, int64_t group,
                    int64_t M, int64_t K, int64_t nmat, const void *const *w, const float *const *s,
                    float *const *y, const int64_t *N, int64_t ldy, int64_t tt, int64_t T, tl_span *sp, int avx2);
void tl_rows_range(int kind, const float *x, const int16_t *xq, const float *xs, const float *xsum,
                   int64_t group, int64_t M, int64_t K, int64_t nmat, const void *const *w,
                   const float *const *s, float *const *y, const int64_t *N, int64_t ldy, int64_t r0,
                   int64_t r1, int avx2);
#endif
