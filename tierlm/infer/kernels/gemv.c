/* Products of a few rows with int8 or bf16 weights that stream the weights at memory speed.

   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]   (int8, one scale per output row)
   y[m, n] =            sum_k x[m, k] * w[n, k]   (bf16 stored as uint16)

   x is fp32 [M, K], y fp32 [M, N], w row-major [N, K]. Decoding reads every weight once per token
   for a handful of rows, so the loop is arranged to read each weight row once for all M rows and
   convert it once per group of up to 4 rows; PyTorch's int8 weight-only kernel is compute-bound at
   one row on AVX2 CPUs (docs/inference.md at a2b1c1e). Threads take contiguous ranges of output rows
   (OpenMP: the runtime PyTorch has already loaded, so one thread pool).

   Accumulation is fp32 in a fixed order for a given K, so results do not depend on the thread
   count. The path (portable, AVX2, AVX512-VNNI, AVX512-BF16: cpu_level below) is chosen at run
   time from the CPU's flags, capped by TIERLM_NATIVE_ISA. One row of x against bf16 weights uses
   AVX512-BF16's dot product on that path (rows_bf16_dp), and one row against int8 AVX512-VNNI's
   (row_i8x16_vnni).

   One row of x against int8 weights (decoding one sequence) runs in integers: x is rounded to
   16 bits with one scale for the row (a relative error of 2^-16 of its largest element, far below
   the weights' own 2^-8) and each product is a vpmaddwd of 16 weight/x pairs, half the vector work
   of converting every weight to fp32 (a scratch comparison of the two loops on a 277 MB matrix,
   2-vCPU EPYC, 2 threads: 28.2 against 25.2 GB/s of int8, a plain read 32.5; docs/inference.md at a2b1c1e). Integer sums are moved to fp32 every I16_BLOCK
   inputs, before they could overflow: a lane adds two products of |w| <= 128 and |x| <= 32767 per
   32 inputs, so 4096 inputs stay below 2^31.

   int4 weights (kind 2), group-wise: q in 0..15, w = q * scale + lo for each group of `group`
   inputs of a row; a row is K/2 bytes, and in each block of 32 inputs byte i holds input i in its
   low nibble and input i + 16 in its high one (two masks and one shift unpack 32 weights). For
   groups of a multiple of 64, x is rounded to 8 bits with one scale per group (as llama.cpp's int4
   dot products do: a relative error of 2^-8 of the group's largest element, against the weights'
   own 2^-4) and 64 weights are one 32-byte load and a vpmaddubsw pair (rows_i4x8); otherwise every
   row of x is rounded to 16 bits as above and each group's sum of q * x is a vpmaddwd chain
   (< 256 * 15 * 32767 < 2^31). y = sum_g scale_g * xs_g * sum(q * xq) + sum_g lo_g * sum(x) over
   the group, the second sum computed once per call from x itself.

   `tierlm_gemv_multi` runs several products of the same x in one parallel region (a layer's
   q, k and v; its gate and up): the threads split the rows of all of them, so a small matrix costs
   no fork of its own. */
#include "gemv.h"

#include <omp.h>

#define I16_BLOCK 4096
#define X8_GROUP 128  /* inputs of one row's x per 8-bit scale, int8 weights (rows_i8x8_vnni) */

/* ---- portable loops ---------------------------------------------------------------------- */
static void rows_i8x16_scalar(const int16_t *xq, float xs, int64_t K, const int8_t *w, const float *s,
                              float *y, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wr = w + n * K;
        float acc = 0.f;
        for (int64_t b = 0; b < K; b += I16_BLOCK) {
            int64_t e = b + I16_BLOCK < K ? b + I16_BLOCK : K;
            /* one sum of a block's products, not a vector lane's share of them: 4096 products
               of up to 128 * 32767 overflow 32 bits */
            int64_t part = 0;
            for (int64_t k = b; k < e; k++) part += (int64_t)xq[k] * wr[k];
            acc += (float)part;
        }
        y[n] = acc * xs * s[n];
    }
}

static inline int i4_at(const uint8_t *wr, int64_t k) {
    uint8_t b = wr[(k >> 5) * 16 + (k & 15)];
    return (k & 16) ? b >> 4 : b & 15;
}

/* Where of a 64-input block the 8-bit x of input i sits: the int4 kernel's 32-byte load unpacks to
   inputs 0-15 and 32-47 (low nibbles), then 16-31 and 48-63 (high), so x is stored in that order. */
static inline int64_t x8_pos(int64_t k) {
    int64_t i = k & 63;
    return (k & ~(int64_t)63) | (i & 15) | ((i & 16) << 1) | ((i & 32) >> 1);
}

/* The portable int4 loop for both roundings of x: 8 bits a group (`x8`, in x8_pos order, scales
   xs[m * G + g]) or 16 bits a row (scale xs[m]). */
static void rows_i4_scalar(const void *xq, int x8, const float *xs, const float *xsum, int64_t M, int64_t K,
                           const uint8_t *w, const float *sz, int64_t group, float *y, int64_t ldy,
                           int64_t n0, int64_t n1) {
    int64_t G = K / group;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wr = w + n * (K / 2);
        const float *s = sz + n * G * 2;
        for (int64_t m = 0; m < M; m++) {
            const int8_t *x8m = (const int8_t *)xq + m * K;
            const int16_t *x16m = (const int16_t *)xq + m * K;
            float acc = 0.f, r = 0.f;
            for (int64_t g = 0; g < G; g++) {
                int64_t part = 0;  /* a whole group's sum: 15 * 32767 a product overflows 32 bits past 4369 */
                for (int64_t k = g * group; k < (g + 1) * group; k++)
                    part += i4_at(wr, k) * (x8 ? (int64_t)x8m[x8_pos(k)] : (int64_t)x16m[k]);
                acc += (float)part * (x8 ? s[2 * g] * xs[m * G + g] : s[2 * g]);
                r += s[2 * g + 1] * xsum[m * G + g];
            }
            y[m * ldy + n] = (x8 ? acc : acc * xs[m]) + r;
        }
    }
}

static void rows_i8_scalar(const float *x, int64_t M, int64_t K, const int8_t *w, const float *s,
                           float *y, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wr = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += xm[k] * (float)wr[k];
            y[m * N + n] = acc * s[n];
        }
    }
}

static void rows_f32_scalar(const float *x, int64_t M, int64_t K, const float *w,
                            float *y, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const float *wr = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += xm[k] * wr[k];
            y[m * N + n] = acc;
        }
    }
}

static void rows_bf16_scalar(const float *x, int64_t M, int64_t K, const uint16_t *w,
                             float *y, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += xm[k] * bf16_to_f32(wr[k]);
            y[m * N + n] = acc;
        }
    }
}

/* Weights are read once, row after row: a software prefetch this far ahead of the row being
   multiplied kept more reads in flight than the hardware's own prefetch did. A 1 GB int8 matrix,
   one row, 2 threads, five interleaved rounds: 18.3 GB/s without (median), 21.0 with 1024 bytes
   (768 and 1536 within noise of it), `sum` 23.7 (scratch comparison, 2026-11-23). 0 turns it off. */
static int64_t prefetch_bytes = 1024;
void tierlm_gemv_set_prefetch(int64_t bytes) { prefetch_bytes = bytes; }

#if HAVE_X86
#define PREFETCH(p) \
    do { if (prefetch_bytes) _mm_prefetch((const char *)(p) + prefetch_bytes, _MM_HINT_T0); } while (0)

TARGET_AVX2 static inline __m256 load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* One output row for rows 0..mb-1 of x (mb <= 4). Each FMA chain waits ~4 cycles for the one
   before it, so one row gets four chains (32 weights a turn) and 2-4 rows two each: otherwise the
   loop, not memory, sets the pace (measured: two chains at one row ran at 7 GB/s of int8 a core). */
#define ROW_KERNEL(NAME, WTYPE, LOAD, CONV)                                                       \
    TARGET_AVX2 static void NAME(const float *x, int64_t mb, int64_t K, const WTYPE *wr,           \
                                 float *out) {                                                     \
        int64_t k = 0;                                                                             \
        if (mb == 1) {                                                                             \
            __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;                            \
            for (; k + 32 <= K; k += 32) {                                                         \
                PREFETCH(wr + k);                                                                  \
                c0 = _mm256_fmadd_ps(LOAD(wr + k), _mm256_loadu_ps(x + k), c0);                    \
                c1 = _mm256_fmadd_ps(LOAD(wr + k + 8), _mm256_loadu_ps(x + k + 8), c1);            \
                c2 = _mm256_fmadd_ps(LOAD(wr + k + 16), _mm256_loadu_ps(x + k + 16), c2);          \
                c3 = _mm256_fmadd_ps(LOAD(wr + k + 24), _mm256_loadu_ps(x + k + 24), c3);          \
            }                                                                                      \
            float acc = hsum(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));         \
            for (; k < K; k++) acc += x[k] * CONV(wr[k]);                                          \
            out[0] = acc;                                                                          \
            return;                                                                                \
        }                                                                                          \
        __m256 a0[4], a1[4];                                                                       \
        for (int i = 0; i < 4; i++) a0[i] = a1[i] = _mm256_setzero_ps();                           \
        for (; k + 16 <= K; k += 16) {                                                             \
            PREFETCH(wr + k);                                                                      \
            __m256 w0 = LOAD(wr + k), w1 = LOAD(wr + k + 8);                                       \
            for (int i = 0; i < mb; i++) {                                                         \
                a0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * K + k), a0[i]);                \
                a1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * K + k + 8), a1[i]);            \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < mb; i++) {                                                             \
            float acc = hsum(_mm256_add_ps(a0[i], a1[i]));                                         \
            for (int64_t j = k; j < K; j++) acc += x[i * K + j] * CONV(wr[j]);                     \
            out[i] = acc;                                                                          \
        }                                                                                          \
    }

#define I8_CONV(v) ((float)(v))
ROW_KERNEL(row_i8_avx2, int8_t, load_i8, I8_CONV)
ROW_KERNEL(row_bf16_avx2, uint16_t, load_bf16, bf16_to_f32)
#define F32_CONV(v) (v)
ROW_KERNEL(row_f32_avx2, float, _mm256_loadu_ps, F32_CONV)

/* One row in integers (see the header); the tail past a multiple of 32 inputs is scalar. */
TARGET_AVX2 static float row_i8x16_avx2(const int16_t *xq, int64_t K, const int8_t *wr) {
    float acc = 0.f;
    int64_t k = 0;
    while (k + 32 <= K) {
        int64_t e = k + I16_BLOCK <= K ? k + I16_BLOCK : K;
        __m256i c0 = _mm256_setzero_si256(), c1 = c0;
        for (; k + 32 <= e; k += 32) {
            PREFETCH(wr + k);
            __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + k)));
            __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + k + 16)));
            c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(a, _mm256_loadu_si256((const __m256i *)(xq + k))));
            c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(b, _mm256_loadu_si256((const __m256i *)(xq + k + 16))));
        }
        acc += hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(c0, c1)));
    }
    int32_t tail = 0;
    for (; k < K; k++) tail += (int32_t)xq[k] * wr[k];
    return acc + (float)tail;
}

/* The same sums with AVX512-VNNI's vpdpwssd: 32 widened weights a multiply-add, products added in
   the instruction. Integer sums are exact, so only the fp32 adds of each block's 16 lane sums
   differ in order from row_i8x16_avx2 (a lane holds fewer products here: no overflow). */
#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
TARGET_VNNI static float row_i8x16_vnni(const int16_t *xq, int64_t K, const int8_t *wr) {
    float acc = 0.f;
    int64_t k = 0;
    while (k + 64 <= K) {
        int64_t e = k + I16_BLOCK <= K ? k + I16_BLOCK : K;
        __m512i c0 = _mm512_setzero_si512(), c1 = c0;
        for (; k + 64 <= e; k += 64) {
            __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + k)));
            __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + k + 32)));
            c0 = _mm512_dpwssd_epi32(c0, a, _mm512_loadu_si512(xq + k));
            c1 = _mm512_dpwssd_epi32(c1, b, _mm512_loadu_si512(xq + k + 32));
        }
        acc += _mm512_reduce_add_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(c0, c1)));
    }
    int32_t tail = 0;
    for (; k < K; k++) tail += (int32_t)xq[k] * wr[k];
    return acc + (float)tail;
}

TARGET_AVX2 static void rows_i8x16_avx2(const int16_t *xq, float xs, int64_t K, const int8_t *w,
                                        const float *s, float *y, int64_t n0, int64_t n1) {
    if (tl_use_vnni()) {
        for (int64_t n = n0; n < n1; n++) y[n] = row_i8x16_vnni(xq, K, w + n * K) * xs * s[n];
        return;
    }
    for (int64_t n = n0; n < n1; n++) y[n] = row_i8x16_avx2(xq, K, w + n * K) * xs * s[n];
}

TARGET_AVX2 static void rows_i4_avx2(const int16_t *xq, const float *xs, const float *xsum, int64_t M,
                                     int64_t K, const uint8_t *w, const float *sz, int64_t group, float *y,
                                     int64_t ldy, int64_t n0, int64_t n1) {
    int64_t G = K / group;
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wr = w + n * (K / 2);
        const float *s = sz + n * G * 2;
        for (int64_t m = 0; m < M; m++) {
            const int16_t *xm = xq + m * K;
            __m256 acc = _mm256_setzero_ps();
            float r = 0.f;
            for (int64_t g = 0; g < G; g++) {
                __m256i c0 = _mm256_setzero_si256(), c1 = c0;
                for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
                    PREFETCH(wr + k / 2);
                    __m128i b = _mm_loadu_si128((const __m128i *)(wr + k / 2));
                    __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(b, low));
                    __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low));
                    c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)(xm + k))));
                    c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xm + k + 16))));
                }
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(c0, c1)), _mm256_set1_ps(s[2 * g]), acc);
                r += s[2 * g + 1] * xsum[m * G + g];
            }
            y[m * ldy + n] = hsum(acc) * xs[m] + r;
        }
    }
}

/* int4 weights against 8-bit x (groups of a multiple of 64): a 32-byte load is 64 weights; the
   low and high nibbles multiply x with vpmaddubsw (15 * 127 * 2 per pair, their sum < 2^15), and
   vpmaddwd by ones widens to 32 bits: 7 vector operations per 64 weights against 18 with 16-bit x. */
TARGET_AVX2 static void rows_i4x8_avx2(const int8_t *xq, const float *xs, const float *xsum, int64_t M,
                                       int64_t K, const uint8_t *w, const float *sz, int64_t group, float *y,
                                       int64_t ldy, int64_t n0, int64_t n1) {
    int64_t G = K / group;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wr = w + n * (K / 2);
        const float *s = sz + n * G * 2;
        for (int64_t m = 0; m < M; m++) {
            const int8_t *xm = xq + m * K;
            __m256 acc = _mm256_setzero_ps();
            float r = 0.f;
            for (int64_t g = 0; g < G; g++) {
                __m256i c = _mm256_setzero_si256();
                for (int64_t k = g * group; k < (g + 1) * group; k += 64) {
                    PREFETCH(wr + k / 2);
                    __m256i b = _mm256_loadu_si256((const __m256i *)(wr + k / 2));
                    __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
                    __m256i p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(xm + k))),
                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xm + k + 32))));
                    c = _mm256_add_epi32(c, _mm256_madd_epi16(p, ones));
                }
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(s[2 * g] * xs[m * G + g]), acc);
                r += s[2 * g + 1] * xsum[m * G + g];
            }
            y[m * ldy + n] = hsum(acc) + r;
        }
    }
}

TARGET_AVX2 static void dequant_row_i4_avx2(const uint8_t *wr, const float *s, int64_t K, int64_t group,
                                            float *o) {
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t k = 0; k < K; k += 32) {
        __m256 sc = _mm256_set1_ps(s[2 * (k / group)]), lo = _mm256_set1_ps(s[2 * (k / group) + 1]);
        __m128i b = _mm_loadu_si128((const __m128i *)(wr + k / 2));
        __m128i l = _mm_and_si128(b, low), h = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        __m128i parts[4] = {l, _mm_srli_si128(l, 8), h, _mm_srli_si128(h, 8)};
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(o + k + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), sc, lo));
    }
}

TARGET_AVX2 static void rows_i8_avx2(const float *x, int64_t M, int64_t K, const int8_t *w,
                                     const float *s, float *y, int64_t N, int64_t n0, int64_t n1) {
    float out[4];
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int64_t mb = M - m0 < 4 ? M - m0 : 4;
            row_i8_avx2(x + m0 * K, mb, K, w + n * K, out);
            for (int64_t i = 0; i < mb; i++) y[(m0 + i) * N + n] = out[i] * s[n];
        }
}

TARGET_AVX2 static void rows_bf16_avx2(const float *x, int64_t M, int64_t K, const uint16_t *w,
                                       float *y, int64_t N, int64_t n0, int64_t n1) {
    float out[4];
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int64_t mb = M - m0 < 4 ? M - m0 : 4;
            row_bf16_avx2(x + m0 * K, mb, K, w + n * K, out);
            for (int64_t i = 0; i < mb; i++) y[(m0 + i) * N + n] = out[i];
        }
}

TARGET_AVX2 static void rows_f32_avx2(const float *x, int64_t M, int64_t K, const float *w,
                                      float *y, int64_t N, int64_t n0, int64_t n1) {
    float out[4];
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int64_t mb = M - m0 < 4 ? M - m0 : 4;
            row_f32_avx2(x + m0 * K, mb, K, w + n * K, out);
            for (int64_t i = 0; i < mb; i++) y[(m0 + i) * N + n] = out[i];
        }
}

/* One row of x (M = 1) against bf16 weights with AVX512-BF16's dot product: x is split into
   bf16 halves, hi = bf16(x) and lo = bf16(x - hi), so hi + lo is x to 2^-17 of |x| (the int8
   path rounds x to 16 bits likewise), and each 32 weights take two vdpbf16ps: bf16 products are
   exact in fp32, summed in fp32. Widening every weight to fp32 first (row_bf16_avx2) costs three
   instructions per 8 weights; on a Zen 4 with 2 threads and its weights on 2 MiB pages, a scratch
   loop over TinyLlama's products read 45-47 GB/s this way against 40-41 (a plain sum 51-57). The
   tail past a multiple of 64 inputs is scalar, with x itself. No prefetch: it ran slower with. */
TARGET_BF16DP static void rows_bf16_dp(const uint16_t *xh, const uint16_t *xl, const float *x, int64_t K,
                                       const uint16_t *w, float *y, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * K;
        __m512 c0 = _mm512_setzero_ps(), c1 = c0, d0 = c0, d1 = c0;
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k), w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
            c0 = _mm512_dpbf16_ps(c0, w0, (__m512bh)_mm512_loadu_si512(xh + k));
            d0 = _mm512_dpbf16_ps(d0, w0, (__m512bh)_mm512_loadu_si512(xl + k));
            c1 = _mm512_dpbf16_ps(c1, w1, (__m512bh)_mm512_loadu_si512(xh + k + 32));
            d1 = _mm512_dpbf16_ps(d1, w1, (__m512bh)_mm512_loadu_si512(xl + k + 32));
        }
        float acc = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(d0, d1)));
        for (; k < K; k++) acc += x[k] * bf16_to_f32(wr[k]);
        y[n] = acc;
    }
}

/* The same with x rounded to bf16 (hi only), as a bf16 model computes in transformers: one
   vdpbf16ps and one x load per 32 weights where the split takes two of each. From DRAM the loop's
   share of a plain read follows how few instructions it issues per byte, not its arithmetic
   (benchmarks/row_loop_layouts.c: 2 threads, 99% of the plain read against the split's 89%). */
TARGET_BF16DP static void rows_bf16_dp1(const uint16_t *xh, int64_t K, const uint16_t *w, float *y, int64_t n0,
                                        int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * K;
        __m512 c0 = _mm512_setzero_ps(), c1 = c0;
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            c0 = _mm512_dpbf16_ps(c0, (__m512bh)_mm512_loadu_si512(wr + k), (__m512bh)_mm512_loadu_si512(xh + k));
            c1 = _mm512_dpbf16_ps(c1, (__m512bh)_mm512_loadu_si512(wr + k + 32),
                                  (__m512bh)_mm512_loadu_si512(xh + k + 32));
        }
        float acc = _mm512_reduce_add_ps(_mm512_add_ps(c0, c1));
        for (; k < K; k++) acc += bf16_to_f32(xh[k]) * bf16_to_f32(wr[k]);
        y[n] = acc;
    }
}

/* One int8 row against 8-bit x with one scale per X8_GROUP inputs (llama.cpp's q8 activations):
   the weights' sign bit flipped makes them unsigned (w + 128), so one vpdpbusd takes 64 weight/x
   pairs with no widening, 4 instructions per 64 weights against 8 for 16-bit x. The 128 * sum(xq)
   the flip adds does not depend on the row: xs[G] holds it, scaled, subtracted once per row.
   Per group and lane, 8 products of <= 255 * 127 stay below 2^24, so the move to fp32 is exact. */
TARGET_VNNI static void rows_i8x8_vnni(const int8_t *xq, const float *xs, int64_t K, const int8_t *w,
                                       const float *s, float *y, int64_t n0, int64_t n1) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    int64_t G = K / X8_GROUP;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wr = w + n * K;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t g = 0, k = 0; g < G; g++, k += X8_GROUP) {
            __m512i c0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(_mm512_loadu_si512(wr + k), flip),
                                             _mm512_loadu_si512(xq + k));
            __m512i c1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                             _mm512_xor_si512(_mm512_loadu_si512(wr + k + 64), flip),
                                             _mm512_loadu_si512(xq + k + 64));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(c0, c1)), _mm512_set1_ps(xs[g]), acc);
        }
        y[n] = (_mm512_reduce_add_ps(acc) - xs[G]) * s[n];
    }
}
#endif

/* The instruction-set paths of these loops, each a superset of the one before:
   0 portable  the plain C loops (any CPU; what a CPU without AVX2, an ARM server say, runs)
   1 avx2      AVX2 + FMA loops for every kind
   2 avx512vnni  as 1, and one int8 row through AVX512-VNNI (row_i8x16_vnni, rows_i8x8_vnni)
   3 avx512bf16  as 2, and one bf16 row through AVX512-BF16's dot product (rows_bf16_dp, _dp1)
   4 amx       as 3, and many rows against int8/int4 weights through AMX-INT8's tiles (qgemm_amx.c),
               only where tl_amx_usable() finds them in CPUID, enabled by the OS, and granted to
               this process (Linux's arch_prctl); one row stays on 3's loops (memory-bound)
   By default the highest this CPU has runs; the
   caller (native.py, from TIERLM_NATIVE_ISA) may cap it lower with tierlm_native_set_isa before
   the first product, so that each path's loops can be tested on any CPU that has it. The choice
   follows the CPU's flags and that cap only, so one command gives the same bits on one CPU. */
int tl_amx_usable(void); /* qgemm_amx.c */
static int cpu_level(void) {
#if HAVE_X86
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        int lv = 0;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) lv = 1;
        if (lv == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
            lv = 2;
        if (lv == 2 && __builtin_cpu_supports("avx512bf16")) lv = 3;
        if (lv == 3 && tl_amx_usable()) lv = 4;
        cached = lv;
    }
    return cached;
#else
    return 0;
#endif
}
static int isa_level = -1;  /* the active path; -1: not chosen yet (the CPU's highest) */
static int level(void) {
    if (isa_level < 0) isa_level = cpu_level();
    return isa_level;
}
/* The highest path this CPU has. */
int tierlm_native_cpu_isa(void) { return cpu_level(); }
/* Runs path `lv` from now on (before any product: the loops read it unguarded); -1 where this CPU
   lacks it (nothing changes), else the path. */
int tierlm_native_set_isa(int lv) {
    if (lv < 0 || lv > cpu_level()) return -1;
    isa_level = lv;
    return lv;
}
int tl_use_avx2(void) { return level() >= 1; }
int tl_use_vnni(void) { return level() >= 2; }
int tl_use_bf16dp(void) { return level() >= 3; }

/* Whether one row's x is rounded as the AVX-512 loops' lighter forms take it: to bf16 for bf16
   weights (rows_bf16_dp1), to 8 bits a group for int8 (rows_i8x8_vnni). TIERLM_NATIVE_EXACT_X=1
   (or tierlm_gemv_set_light_x(0) between calls) keeps x to 2^-16 of its largest element (the
   bf16 split, 16-bit x): tests and benchmarks compare the two. */
static int light_x = -1;
static int x_light(void) {
    if (light_x < 0) {
        const char *e = getenv("TIERLM_NATIVE_EXACT_X");
        light_x = !(e && *e && strcmp(e, "0"));
    }
    return light_x;
}
void tierlm_gemv_set_light_x(int on) { light_x = on != 0; }
static int i8_x8(int64_t K) { return tl_use_vnni() && x_light() && K % X8_GROUP == 0; }

/* The active path (0-4 above), plus 16 where its one-row loops round x lighter (x_light). */
int tierlm_gemv_isa(void) { return level() | (tl_use_vnni() && x_light() ? 16 : 0); }

/* int4 weights back to fp32 [N, K] for products of many rows (a prefill), which then run as one
   fp32 matrix product: PyTorch's int4 kernel read 5-6 GB/s here, and the same unpacking in torch
   ops took ~6 s for a 1.1B model's 64-token prefill (a pass per op over every weight). */
void tierlm_dequant_int4(const uint8_t *w, const float *sz, int64_t N, int64_t K, int64_t group, float *out,
                         int threads) {
    int64_t G = K / group;
    int avx2 = tl_use_avx2();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wr = w + n * (K / 2);
        const float *s = sz + n * G * 2;
        float *o = out + n * K;
#if HAVE_X86
        if (avx2) {
            dequant_row_i4_avx2(wr, s, K, group, o);
            continue;
        }
#endif
        for (int64_t k = 0; k < K; k++) o[k] = (float)i4_at(wr, k) * s[2 * (k / group)] + s[2 * (k / group) + 1];
    }
    (void)avx2;
}

/* The preparation of x below runs on one thread while the others wait (in a fused layer, at a
   barrier): scalar, rounding 5632 inputs took ~70 us (a mispredicted branch per input on the sign),
   a tenth of a layer's products; these AVX2 loops give the same integers. */
#if HAVE_X86
TARGET_AVX2 static float absmax_avx2(const float *x, int64_t n) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + k), abs), m);
    float t[8], r = 0.f;
    _mm256_storeu_ps(t, m);
    for (int i = 0; i < 8; i++) r = t[i] > r ? t[i] : r;
    for (; k < n; k++) {
        float a = x[k] < 0.f ? -x[k] : x[k];
        r = a > r ? a : r;
    }
    return r;
}

/* 16 inputs times inv, rounded to nearest with halves away from zero (v +- 0.5, truncated: the
   scalar loops' rounding), as 16 int16 in order */
TARGET_AVX2 static inline __m256i round16_avx2(const float *x, __m256 inv) {
    const __m256 half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x), inv), b = _mm256_mul_ps(_mm256_loadu_ps(x + 8), inv);
    a = _mm256_add_ps(a, _mm256_or_ps(_mm256_and_ps(a, sign), half));
    b = _mm256_add_ps(b, _mm256_or_ps(_mm256_and_ps(b, sign), half));
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_cvttps_epi32(a), _mm256_cvttps_epi32(b)), 0xD8);
}

TARGET_AVX2 static int64_t round_i16_avx2(const float *x, int64_t K, float inv, int16_t *xq) {
    __m256 iv = _mm256_set1_ps(inv);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) _mm256_storeu_si256((__m256i *)(xq + k), round16_avx2(x + k, iv));
    return k;
}

/* one group (a multiple of 64 inputs) to 8 bits in x8_pos order: of each 64, the 16-input
   chunks go to 0, 32, 16, 48 */
TARGET_AVX2 static void round_i8_group_avx2(const float *x, int64_t group, float inv, int8_t *xq) {
    static const int at[4] = {0, 32, 16, 48};
    __m256 iv = _mm256_set1_ps(inv);
    for (int64_t b = 0; b < group; b += 64)
        for (int c = 0; c < 4; c++) {
            __m256i v = round16_avx2(x + b + 16 * c, iv);
            __m128i p = _mm_packs_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storeu_si128((__m128i *)(xq + b + at[c]), p);
        }
}

/* n (a multiple of 16) inputs to 8 bits in order (rows_i8x8_vnni) */
TARGET_AVX2 static void round_i8_avx2(const float *x, int64_t n, float inv, int8_t *xq) {
    __m256 iv = _mm256_set1_ps(inv);
    for (int64_t k = 0; k < n; k += 16) {
        __m256i v = round16_avx2(x + k, iv);
        _mm_storeu_si128((__m128i *)(xq + k), _mm_packs_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
    }
}

TARGET_AVX2 static void rms_row_avx2(const float *x, int64_t K, const void *nw, int nw_flags, float eps, float *o) {
    int nw_bf16 = nw_flags & TL_NORM_BF16;
    __m256 add = _mm256_set1_ps(nw_flags & TL_NORM_ONE_PLUS ? 1.f : 0.f);
    __m256 acc = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 v = _mm256_loadu_ps(x + k);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (int64_t j = k; j < K; j++) ss += x[j] * x[j];
    float r = 1.f / sqrtf(ss / (float)K + eps);
    __m256 rv = _mm256_set1_ps(r);
    for (k = 0; k + 8 <= K; k += 8) {
        __m256 w = _mm256_add_ps(nw_bf16 ? load_bf16((const uint16_t *)nw + k) : _mm256_loadu_ps((const float *)nw + k), add);
        _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), rv), w));
    }
    for (; k < K; k++) {
        o[k] = x[k] * r * tl_norm_w(nw, nw_flags, k);
    }
}
#endif

static float absmax(const float *x, int64_t n) {
#if HAVE_X86
    if (tl_use_avx2()) return absmax_avx2(x, n);
#endif
    float m = 0.f;
    for (int64_t k = 0; k < n; k++) {
        float a = x[k] < 0.f ? -x[k] : x[k];
        m = a > m ? a : m;
    }
    return m;
}

/* x rounded to 16 bits with one scale: x ~= xq * xs. */
static float quantize_row(const float *x, int64_t K, int16_t *xq) {
    float m = absmax(x, K);
    if (m == 0.f) {
        memset(xq, 0, (size_t)K * sizeof(int16_t));
        return 0.f;
    }
    float inv = 32767.f / m;
    int64_t k = 0;
#if HAVE_X86
    if (tl_use_avx2()) k = round_i16_avx2(x, K, inv, xq);
#endif
    for (; k < K; k++) {
        float v = x[k] * inv;
        xq[k] = (int16_t)(v < 0.f ? v - 0.5f : v + 0.5f);  /* nearest, halves away from zero */
    }
    return m / 32767.f;
}

/* x rounded to 8 bits with one scale per group (x ~= xq * xs[g]), stored in x8_pos order. */
static void quantize_row_i8g(const float *x, int64_t K, int64_t group, int8_t *xq, float *xs) {
    for (int64_t g = 0; g < K / group; g++) {
        float m = absmax(x + g * group, group);
        float inv = m > 0.f ? 127.f / m : 0.f;
        xs[g] = m / 127.f;
#if HAVE_X86
        if (tl_use_avx2() && group % 64 == 0) {
            round_i8_group_avx2(x + g * group, group, inv, xq + g * group);
            continue;
        }
#endif
        for (int64_t k = g * group; k < (g + 1) * group; k++) {
            float v = x[k] * inv;
            xq[x8_pos(k)] = (int8_t)(v < 0.f ? v - 0.5f : v + 0.5f);  /* nearest, halves away from zero */
        }
    }
}

/* The rows the product multiplies, RMS-normalised and scaled by a norm weight `nw` (fp32, or bf16
   with TL_NORM_BF16 in nw_flags): x * (1 / sqrt(mean(x^2) + eps)) * nw (with TL_NORM_ONE_PLUS,
   * (1 + nw): Gemma's norms, whose weights are stored as offsets from 1), the norm before a layer's attention or MLP,
   so it costs no torch ops of its own (19 us against 35-47 in torch for 2048 inputs; less since
   the AVX2 loop). A gated MLP's silu(gate) * up was tried here with a scalar expf and dropped (90
   us for 5632 inputs against torch's 35); the fused layer (layer.c) computes it with a vector exp. */
void tl_prep_rows(const float *x, int64_t M, int64_t K, const void *nw, int nw_flags, float eps, float *out) {
#if HAVE_X86
    if (tl_use_avx2()) {
        for (int64_t m = 0; m < M; m++) rms_row_avx2(x + m * K, K, nw, nw_flags, eps, out + m * K);
        return;
    }
#endif
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        float *o = out + m * K;
        float ss = 0.f;
        for (int64_t k = 0; k < K; k++) ss += xr[k] * xr[k];
        float r = 1.f / sqrtf(ss / (float)K + eps);
        for (int64_t k = 0; k < K; k++) o[k] = xr[k] * r * tl_norm_w(nw, nw_flags, k);
    }
}

/* Rows [r0, r1) of the concatenation of the `nmat` outputs. */
void tl_rows_range(int kind, const float *x, const int16_t *xq, const float *xs, const float *xsum,
                       int64_t group, int64_t M, int64_t K,
                       int64_t nmat, const void *const *w, const float *const *s, float *const *y,
                       const int64_t *N, int64_t ldy, int64_t r0, int64_t r1, int avx2) {
    int64_t base = 0;
    for (int64_t j = 0; j < nmat; base += N[j], j++) {
        int64_t lo = r0 > base ? r0 - base : 0, hi = r1 - base < N[j] ? r1 - base : N[j];
        int64_t ld = ldy ? ldy : N[j];
        if (lo >= hi) continue;
        if (kind == 2 && group % 64 == 0) {
#if HAVE_X86
            if (avx2) { rows_i4x8_avx2((const int8_t *)xq, xs, xsum, M, K, w[j], s[j], group, y[j], ld, lo, hi); continue; }
#endif
            rows_i4_scalar(xq, 1, xs, xsum, M, K, w[j], s[j], group, y[j], ld, lo, hi);
        } else if (kind == 2) {
#if HAVE_X86
            if (avx2) { rows_i4_avx2(xq, xs, xsum, M, K, w[j], s[j], group, y[j], ld, lo, hi); continue; }
#endif
            rows_i4_scalar(xq, 0, xs, xsum, M, K, w[j], s[j], group, y[j], ld, lo, hi);
        } else if (kind == 0 && xq) {
#if HAVE_X86
            if (i8_x8(K)) { rows_i8x8_vnni((const int8_t *)xq, xs, K, w[j], s[j], y[j], lo, hi); continue; }
            if (avx2) { rows_i8x16_avx2(xq, xs[0], K, w[j], s[j], y[j], lo, hi); continue; }
#endif
            rows_i8x16_scalar(xq, xs[0], K, w[j], s[j], y[j], lo, hi);
        } else if (kind == 0) {
#if HAVE_X86
            if (avx2) { rows_i8_avx2(x, M, K, w[j], s[j], y[j], ld, lo, hi); continue; }
#endif
            rows_i8_scalar(x, M, K, w[j], s[j], y[j], ld, lo, hi);
        } else if (kind == 3) {
#if HAVE_X86
            if (avx2) { rows_f32_avx2(x, M, K, w[j], y[j], ld, lo, hi); continue; }
#endif
            rows_f32_scalar(x, M, K, w[j], y[j], ld, lo, hi);
        } else if (kind == 1 && xq) {
#if HAVE_X86
            if (x_light()) rows_bf16_dp1((const uint16_t *)xq, K, w[j], y[j], lo, hi);
            else rows_bf16_dp((const uint16_t *)xq, (const uint16_t *)xq + K, x, K, w[j], y[j], lo, hi);
#endif
        } else {
#if HAVE_X86
            if (avx2) { rows_bf16_avx2(x, M, K, w[j], y[j], ld, lo, hi); continue; }
#endif
            rows_bf16_scalar(x, M, K, w[j], y[j], ld, lo, hi);
        }
    }
    (void)avx2;
}

/* How a kind's kernels take x (tl_prepare_x): int8 at one row, and int4, round it to integers
   (16 bits a row, or 8 bits a group of a multiple of 64 inputs) with scales, and int4 also needs
   each group's sum of x. Sizes of the buffers it fills, in elements: */
int tl_rounds_x(int kind, int64_t M) {
    return (kind == 0 && M == 1) || kind == 2 || (kind == 1 && M == 1 && tl_use_bf16dp());
}
/* int16 elements of xq: x's bf16 halves take two per input (rows_bf16_dp), the rest one. */
int64_t tl_xq_halves(int kind, int64_t M, int64_t K) { return (kind == 1 ? 2 : 1) * M * K; }
int64_t tl_xs_floats(int kind, int64_t group, int64_t M, int64_t K) {
    /* int8's 8-bit x: a scale per group and the flip's sum; by K's floor, so that a fused layer's
       buffer sized for its longest x holds that of a shorter one that divides into groups, and
       whether x is light or not (it can change between calls) */
    int64_t G = kind == 2 ? K / group : kind == 0 && M == 1 && tl_use_vnni() ? K / X8_GROUP : 0;
    return M * (G + 1) + M * G;
}

/* x's rounded copy into xq (M * K int16) and its scales and group sums into xs
   (tl_xs_floats); nothing for kinds that take fp32 x. */
void tl_prepare_x(int kind, int64_t group, const float *x, int64_t M, int64_t K, int16_t *xq, float *xs) {
    if (!tl_rounds_x(kind, M)) return;
    if (kind == 1) {  /* bf16 halves of the one row (rows_bf16_dp), or hi only (rows_bf16_dp1) */
        uint16_t *hi = (uint16_t *)xq, *lo = hi + K;
        int split = !x_light();
        for (int64_t k = 0; k < K; k++) {
            hi[k] = f32_to_bf16(x[k]);
            if (split) lo[k] = f32_to_bf16(x[k] - bf16_to_f32(hi[k]));
        }
        return;
    }
    if (kind == 0 && i8_x8(K)) {  /* 8 bits a group, in order, and the flip's sum (rows_i8x8_vnni) */
        int64_t G = K / X8_GROUP;
        int8_t *q = (int8_t *)xq;
        double c = 0.;
        for (int64_t g = 0; g < G; g++) {
            const float *xg = x + g * X8_GROUP;
            float m = absmax(xg, X8_GROUP), inv = m > 0.f ? 127.f / m : 0.f;
            int8_t *qg = q + g * X8_GROUP;
            int32_t t = 0;
            xs[g] = m / 127.f;
#if HAVE_X86
            round_i8_avx2(xg, X8_GROUP, inv, qg);
#endif
            for (int64_t k = 0; k < X8_GROUP; k++) t += qg[k];
            c += (double)xs[g] * 128. * t;
        }
        xs[G] = (float)c;
        return;
    }
    int64_t G = kind == 2 ? K / group : 0;
    int x8 = kind == 2 && group % 64 == 0;  /* 8-bit x, one scale per group (rows_i4x8) */
    float *xsum = xs + M * (G + 1);
    for (int64_t m = 0; m < M; m++) {
        if (x8)
            quantize_row_i8g(x + m * K, K, group, (int8_t *)xq + m * K, xs + m * G);
        else
            xs[m] = quantize_row(x + m * K, K, xq + m * K);
        for (int64_t g = 0; g < G; g++) {
            float t = 0.f;
            for (int64_t k = g * group; k < (g + 1) * group; k++) t += x[m * K + k];
            xsum[m * G + g] = t;
        }
    }
}

/* How the rows of a product (a fused layer's stage; every call of tierlm_gemv_multi, the head's
   included) are shared among threads: evenly at first, each thread's share a [front, back) pair in
   one word on a cache line of its own. A thread takes chunks of ~64 KiB of weights from its own front;
   one whose share is done takes the back half of the largest share left, and goes on with it as
   its own. Each row is still computed whole by one thread, so results do not depend on who took it.
   Why: in a 2-vCPU Zen 4 VM's ~60 GB/s memory state one core read up to ~20% slower than the other for
   seconds at a time, and with fixed halves the faster one waited 1-7 ms of a ~40 ms token at the
   barriers (TinyLlama bf16, each thread's products and waits timed in a scratch build). */
static int steal = 1;
static int64_t steals;
/* 0: each thread computes its even share and no more (benchmarks compare the two in one process);
   2: as 1, with thread 0 held back before each product until another takes rows of its share
   (100 ms at most; tests). tierlm_steals: how many times a thread took rows since the last call. */
void tierlm_set_steal(int mode) { steal = mode; }
int64_t tierlm_steals(void) { return __atomic_exchange_n(&steals, 0, __ATOMIC_RELAXED); }

void tl_spans_reset(tl_span *sp, const int64_t *N, int64_t nmat, int64_t T) {
    int64_t total = 0;
    for (int64_t j = 0; j < nmat; j++) total += N[j];
    for (int64_t t = 0; t < T; t++)
        __atomic_store_n(&sp[t].v, (uint64_t)(total * t / T) << 32 | (uint64_t)(total * (t + 1) / T), __ATOMIC_RELAXED);
}

static inline int64_t span_front(uint64_t v) { return (int64_t)(v >> 32); }
static inline int64_t span_back(uint64_t v) { return (int64_t)(v & 0xffffffffu); }
static inline uint64_t span_of(int64_t f, int64_t b) { return (uint64_t)f << 32 | (uint64_t)b; }

/* Thread tt's rows of the products y[j] = x @ w[j]^T, j < nmat (tl_rows_range's arguments; rows
   counted across the matrices), out of T threads sharing `sp` (tl_spans_reset before). */
void tl_rows_shared(int kind, const float *x, const int16_t *xq, const float *xs, const float *xsum, int64_t group,
                    int64_t M, int64_t K, int64_t nmat, const void *const *w, const float *const *s,
                    float *const *y, const int64_t *N, int64_t ldy, int64_t tt, int64_t T, tl_span *sp, int avx2) {
    /* bytes of a row: int8 1 a weight, bf16 2, int4 1/2, fp32 4 */
    int64_t rb = kind == 2 ? K / 2 : K * (kind == 0 ? 1 : kind == 1 ? 2 : 4);
    int64_t ch = (1 << 16) / (rb > 0 ? rb : 1);
    ch = ch < 4 ? 4 : ch / 4 * 4;
    if (steal == 2 && tt == 0 && T > 1) {  /* until another thread takes rows of this share (100 ms at most) */
        uint64_t v0 = __atomic_load_n(&sp[0].v, __ATOMIC_ACQUIRE);
        for (double t0 = omp_get_wtime(); omp_get_wtime() - t0 < 0.1 && __atomic_load_n(&sp[0].v, __ATOMIC_ACQUIRE) == v0;) {}
    }
    for (;;) {
        uint64_t v = __atomic_load_n(&sp[tt].v, __ATOMIC_ACQUIRE);
        int64_t f = span_front(v), b = span_back(v);
        if (f < b) {
            int64_t n = b - f < ch ? b - f : ch;
            if (!__atomic_compare_exchange_n(&sp[tt].v, &v, span_of(f + n, b), 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                continue;  /* a thief took the back half meanwhile */
            tl_rows_range(kind, x, xq, xs, xsum, group, M, K, nmat, w, s, y, N, ldy, f, f + n, avx2);
            continue;
        }
        int64_t victim = -1, most = 0;
        for (int64_t t = 0; steal && t < T; t++) {
            uint64_t u = __atomic_load_n(&sp[t].v, __ATOMIC_ACQUIRE);
            if (t != tt && span_back(u) - span_front(u) > most) {
                most = span_back(u) - span_front(u);
                victim = t;
            }
        }
        if (!steal || most < 2 * ch) return;  /* what is left its owners finish within a chunk or two */
        uint64_t u = __atomic_load_n(&sp[victim].v, __ATOMIC_ACQUIRE);
        int64_t vf = span_front(u), vb = span_back(u);
        if (vb - vf < 2 * ch) continue;
        int64_t cut = vb - (vb - vf) / 2;
        if (!__atomic_compare_exchange_n(&sp[victim].v, &u, span_of(vf, cut), 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        /* [cut, vb) is this thread's now; its own span was empty, so no thief can have changed it */
        __atomic_store_n(&sp[tt].v, span_of(cut, vb), __ATOMIC_RELEASE);
        __atomic_add_fetch(&steals, 1, __ATOMIC_RELAXED);
    }
}

/* y[j] = x @ w[j]^T for j < nmat (kind 0: int8 with scales s[j]; 1: bf16; 2: int4 with (scale, lo)
   pairs s[j] [N][K/group][2]; 3: fp32); row m of y[j] starts
   at y[j] + m * ldy (ldy 0: N[j]), so the outputs may be column blocks of one [M, sum N] matrix.
   With a norm weight `nw`, x is first RMS-normalised by tl_prep_rows (nw_flags: TL_NORM_*). Threads take contiguous ranges
   of all the matrices' rows together. Returns -1 if a buffer cannot be allocated, -2 for an int4
   group that is not a multiple of 32 dividing K. */
int tierlm_gemv_multi(int kind, const float *x, int64_t M, int64_t K, int64_t nmat, const void *const *w,
                      const float *const *s, float *const *y, const int64_t *N, int64_t ldy,
                      const void *nw, int nw_flags, float eps, int threads, int64_t group) {
    int avx2 = tl_use_avx2();
    if (kind == 2 && (group <= 0 || group % 32 || K % group)) return -2;
    float *xp = NULL;
    if (nw) {
        xp = (float *)malloc((size_t)(M * K) * sizeof(float));
        if (!xp) return -1;
        tl_prep_rows(x, M, K, nw, nw_flags, eps, xp);
        x = xp;
    }
    int16_t *xq = NULL;
    float *xs = NULL, *xsum = NULL;
    if (tl_rounds_x(kind, M)) {
        xq = (int16_t *)malloc((size_t)tl_xq_halves(kind, M, K) * sizeof(int16_t));
        xs = (float *)malloc((size_t)tl_xs_floats(kind, group, M, K) * sizeof(float));
        if (!xq || !xs) {
            free(xq);
            free(xs);
            free(xp);
            return -1;
        }
        tl_prepare_x(kind, group, x, M, K, xq, xs);
        xsum = xs + M * ((kind == 2 ? K / group : 0) + 1);
    }
    tl_span spans_mem[TL_MAX_SPANS + 1];
    tl_span *sp = (tl_span *)(((uintptr_t)spans_mem + 63) & ~(uintptr_t)63);
    if (threads > TL_MAX_SPANS) threads = TL_MAX_SPANS;
#pragma omp parallel num_threads(threads)
    {
        int64_t nt = omp_get_num_threads();
#pragma omp single
        tl_spans_reset(sp, N, nmat, nt);
        tl_rows_shared(kind, x, xq, xs, xsum, group, M, K, nmat, w, s, y, N, ldy, omp_get_thread_num(), nt, sp,
                       avx2);
    }
    free(xq);
    free(xs);
    free(xp);
    return 0;
}
