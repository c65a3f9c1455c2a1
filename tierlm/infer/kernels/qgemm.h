/* What qgemm.c shares with its AVX2 and AMX paths (qgemm_avx2.c, qgemm_amx.c): the rows of x a
   micro-kernel takes, the order of a group's fp32 sum of x, a panel's weight rows and their packing
   into 4-byte words, and the paths' entry points. */
#ifndef TIERLM_QGEMM_H
#define TIERLM_QGEMM_H
#include "gemv.h"

#ifndef QG_MR
#define QG_MR 4  /* rows of x per micro-kernel (x's rows are padded to a multiple of it) */
#endif
#define QG_NP 32 /* weight rows of a VNNI or AMX panel: two vectors (or B tiles) of 16 lanes */

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

#define TARGET_QVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

/* 16 vectors of 16 words, rows of a 16 x 16 matrix, transposed in place (three rounds of unpacks
   and lane shuffles). */
TARGET_QVNNI static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int a = 0; a < 4; a++) {  /* r[4a + j], 128-bit lane L: column 4L + j of rows 4a..4a+3 */
        r[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
        r[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
        r[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
        r[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
        t[4 + j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
        t[8 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
        r[12 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0xdd);
    }
}

/* A panel of QG_NP weight rows (src[c]: row c's K bytes) as int32 words [KQ = K/4][QG_NP]: word (kq, c) is
   inputs 4kq..4kq+3 of row c. The VNNI path's layout, and AMX's B tiles' (two of 16 columns). */
TARGET_QVNNI static inline void pack_words(const uint8_t *const *src, int64_t KQ, int32_t *P) {
    int64_t kq = 0;
    for (; kq + 16 <= KQ; kq += 16)
        for (int h = 0; h < 2; h++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src[16 * h + i] + 4 * kq);
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(P + (kq + i) * QG_NP + 16 * h, r[i]);
        }
    for (; kq < KQ; kq++)
        for (int64_t c = 0; c < QG_NP; c++) memcpy(P + kq * QG_NP + c, src[c] + 4 * kq, 4);
}

float tl_quantize_group_avx2(const float *v, int64_t n, int8_t *q, float *sum);
int tl_qgemm_avx2(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t Mp, int64_t K,
                  int64_t xg, const void *w, const float *s, float *y, int64_t ldy, int64_t N, int threads);
#endif

/* The AMX path (qgemm_amx.c): its kernel with the CPU's tiles and against software ones (_emu);
   both take x rounded, not shifted, in rows padded to a multiple of TL_AMX_ROWS. */
#define TL_AMX_ROWS 32
int tierlm_gemv_isa(void);
int tl_use_amx(void);
int tl_amx_usable(void);
int tl_qgemm_amx(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t Mp, int64_t K,
                 int64_t xg, const void *w, const float *s, float *y, int64_t ldy, int64_t N, int threads);
int tl_qgemm_amx_emu(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t Mp,
                     int64_t K, int64_t xg, const void *w, const float *s, float *y, int64_t ldy, int64_t N,
                     int threads);
#endif
