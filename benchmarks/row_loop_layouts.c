/* Decode's one-row product loops, side by side, against a plain read of the same bytes: the
   shipped row-major loops (bf16: x split into bf16 hi + lo, two vdpbf16ps per 32 weights; int8:
   x in 16 bits, vpdpwssd), four rows at once from row-major (x loaded once for four weight
   streams), and a tiled layout (4 rows x 128 inputs contiguous, in the order the loop reads them:
   32 inputs of each of the 4 rows, then the next 32; one stream, x held in registers).
   Needs AVX512-BF16 and AVX512-VNNI.

       cc -O3 -fopenmp -o /tmp/row_loop_layouts benchmarks/row_loop_layouts.c
       /tmp/row_loop_layouts cache   # one core, from L2 (128 rows) and L3 (2048 rows), K = 2048
       /tmp/row_loop_layouts dram 5  # 16 matrices of 5632 x 2048, 1 and 2 threads, best of 5 rounds
       /tmp/row_loop_layouts watch 600 > rounds.txt  # the same at 2 threads for 600 s, every round
                                                     # printed, a plain read first and last in each

   This machine's memory rate switches between ~30 and ~60 GB/s for seconds at a time; `watch`
   catches the fast state's rounds, told apart by the two plain reads around each.

   GB/s of weights read. The tiled loop reads row-major data in tile order: the bytes and the
   access pattern are the tiled layout's, the sums are not (speed only). docs/inference.md at a2b1c1e. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define T __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx2,fma")))
#define LD(p) _mm512_loadu_si512(p)
#define BH(v) ((__m512bh)(v))

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* shipped: one row at a time, x hi and lo loaded beside every weight vector */
T static void bf16_row(const uint16_t *xh, const uint16_t *xl, int64_t K, const uint16_t *w, float *y, int64_t N) {
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wr = w + n * K;
        __m512 c0 = _mm512_setzero_ps(), c1 = c0, d0 = c0, d1 = c0;
        for (int64_t k = 0; k + 64 <= K; k += 64) {
            __m512bh w0 = BH(LD(wr + k)), w1 = BH(LD(wr + k + 32));
            c0 = _mm512_dpbf16_ps(c0, w0, BH(LD(xh + k)));
            d0 = _mm512_dpbf16_ps(d0, w0, BH(LD(xl + k)));
            c1 = _mm512_dpbf16_ps(c1, w1, BH(LD(xh + k + 32)));
            d1 = _mm512_dpbf16_ps(d1, w1, BH(LD(xl + k + 32)));
        }
        y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(d0, d1)));
    }
}

/* four rows at once from row-major: x loaded once for four weight streams */
T static void bf16_four_rows(const uint16_t *xh, const uint16_t *xl, int64_t K, const uint16_t *w, float *y, int64_t N) {
    for (int64_t n = 0; n < N; n += 4) {
        __m512 c[4], d[4];
        for (int r = 0; r < 4; r++) c[r] = d[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            __m512bh h = BH(LD(xh + k)), l = BH(LD(xl + k));
            for (int r = 0; r < 4; r++) {
                __m512bh a = BH(LD(w + (n + r) * K + k));
                c[r] = _mm512_dpbf16_ps(c[r], a, h);
                d[r] = _mm512_dpbf16_ps(d[r], a, l);
            }
        }
        for (int r = 0; r < 4; r++) y[n + r] = _mm512_reduce_add_ps(_mm512_add_ps(c[r], d[r]));
    }
}

/* tiled: 4 rows x 128 inputs a tile, tiles in order; x's 128 inputs (hi, lo) read once a tile */
T static void bf16_tiled(const uint16_t *xh, const uint16_t *xl, int64_t K, const uint16_t *w, float *y, int64_t N) {
    for (int64_t n = 0; n < N; n += 4) {
        const uint16_t *t = w + n * K;
        __m512 c[4], d[4];
        for (int r = 0; r < 4; r++) c[r] = d[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 128, t += 512)
            for (int j = 0; j < 4; j++) {
                __m512bh h = BH(LD(xh + k + 32 * j)), l = BH(LD(xl + k + 32 * j));
                for (int r = 0; r < 4; r++) {
                    __m512bh a = BH(LD(t + (4 * j + r) * 32));
                    c[r] = _mm512_dpbf16_ps(c[r], a, h);
                    d[r] = _mm512_dpbf16_ps(d[r], a, l);
                }
            }
        for (int r = 0; r < 4; r++) y[n + r] = _mm512_reduce_add_ps(_mm512_add_ps(c[r], d[r]));
    }
}

/* shipped int8: x in 16 bits, each weight widened, vpdpwssd */
T static void i8_row(const int16_t *xq, int64_t K, const int8_t *w, float *y, int64_t N) {
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = w + n * K;
        __m512i c0 = _mm512_setzero_si512(), c1 = c0;
        for (int64_t k = 0; k + 64 <= K; k += 64) {
            c0 = _mm512_dpwssd_epi32(c0, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + k))), LD(xq + k));
            c1 = _mm512_dpwssd_epi32(c1, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + k + 32))), LD(xq + k + 32));
        }
        y[n] = _mm512_reduce_add_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(c0, c1)));
    }
}

T static void i8_tiled(const int16_t *xq, int64_t K, const int8_t *w, float *y, int64_t N) {
    for (int64_t n = 0; n < N; n += 4) {
        const int8_t *t = w + n * K;
        __m512i c[4];
        for (int r = 0; r < 4; r++) c[r] = _mm512_setzero_si512();
        for (int64_t k = 0; k < K; k += 128, t += 512)
            for (int j = 0; j < 4; j++) {
                __m512i xv = LD(xq + k + 32 * j);
                for (int r = 0; r < 4; r++)
                    c[r] = _mm512_dpwssd_epi32(c[r], _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(t + (4 * j + r) * 32))), xv);
            }
        for (int r = 0; r < 4; r++) y[n + r] = _mm512_reduce_add_ps(_mm512_cvtepi32_ps(c[r]));
    }
}

/* bf16 with x rounded to bf16 (hi only): one vdpbf16ps per 32 weights, as a bf16 model computes */
T static void bf16_row_hi(const uint16_t *xh, int64_t K, const uint16_t *w, float *y, int64_t N) {
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wr = w + n * K;
        __m512 c0 = _mm512_setzero_ps(), c1 = c0;
        for (int64_t k = 0; k + 64 <= K; k += 64) {
            c0 = _mm512_dpbf16_ps(c0, BH(LD(wr + k)), BH(LD(xh + k)));
            c1 = _mm512_dpbf16_ps(c1, BH(LD(wr + k + 32)), BH(LD(xh + k + 32)));
        }
        y[n] = _mm512_reduce_add_ps(_mm512_add_ps(c0, c1));
    }
}

/* int8 against 8-bit x with one scale per 128 inputs (as llama.cpp's q8 activations): the weights'
   sign bit flipped makes them unsigned (w + 128), so vpdpbusd takes 64 weight/x pairs at once with
   no widening; the 128 * sum(xq) this adds is one number per x, subtracted once per row. */
T static void i8_row_x8(const int8_t *x8, const float *xs8, int64_t K, const int8_t *w, float *y, int64_t N) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = w + n * K;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k + 128 <= K; k += 128) {
            __m512i c0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(LD(wr + k), flip), LD(x8 + k));
            __m512i c1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(LD(wr + k + 64), flip), LD(x8 + k + 64));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(c0, c1)), _mm512_set1_ps(xs8[k >> 7]), acc);
        }
        y[n] = _mm512_reduce_add_ps(acc);
    }
}

/* a plain read of n bf16 elements (4 chains), the reference */
T static float sum_read(const uint16_t *p, int64_t n) {
    __m512 a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k + 128 <= n; k += 128)
        for (int i = 0; i < 4; i++) a[i] = _mm512_add_ps(a[i], _mm512_castsi512_ps(LD(p + k + 32 * i)));
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}

enum { BF16_ROW, BF16_FOUR, BF16_TILED, BF16_HI, I8_ROW, I8_TILED, I8_X8, SUM, NV };
static const char *NAMES[NV] = {"bf16 row-major (shipped)", "bf16 four rows at once", "bf16 tiled 4x128",
                                "bf16 x rounded to bf16", "int8 row-major (shipped)", "int8 tiled 4x128",
                                "int8, 8-bit x, vpdpbusd", "plain read"};
static const int BYTES[NV] = {2, 2, 2, 2, 1, 1, 1, 2};
static volatile float sink;

typedef struct { const uint16_t *xh, *xl; const int16_t *xq; const int8_t *x8; const float *xs8; } X;

static void run(int v, const X *x, int64_t K, const void *w, float *y, int64_t N) {
    switch (v) {
    case BF16_ROW: bf16_row(x->xh, x->xl, K, w, y, N); break;
    case BF16_FOUR: bf16_four_rows(x->xh, x->xl, K, w, y, N); break;
    case BF16_TILED: bf16_tiled(x->xh, x->xl, K, w, y, N); break;
    case I8_ROW: i8_row(x->xq, K, w, y, N); break;
    case I8_TILED: i8_tiled(x->xq, K, w, y, N); break;
    case BF16_HI: bf16_row_hi(x->xh, K, w, y, N); break;
    case I8_X8: i8_row_x8(x->x8, x->xs8, K, w, y, N); break;
    default: sink = sum_read(w, N * K); break;
    }
}

/* one pass of loop v over all nm matrices, rows split between th threads; GB/s of weights */
static double pass(int v, int th, const X *x, int64_t K, void *const *w, int nm, float *y, int64_t N) {
    double t = now();
    for (int m = 0; m < nm; m++) {
#pragma omp parallel num_threads(th)
        {
            int id = omp_get_thread_num();
            int64_t n0 = N * id / th / 4 * 4, n1 = N * (id + 1) / th / 4 * 4;
            run(v, x, K, (const uint8_t *)w[m] + n0 * K * BYTES[v], y + n0, n1 - n0);
        }
    }
    return (double)nm * N * K * BYTES[v] / (now() - t) / 1e9;
}

static void *filled(int64_t bytes) {
    uint8_t *p = aligned_alloc(2 << 20, (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20));
    for (int64_t i = 0; i < bytes; i++) p[i] = (uint8_t)(0x3c + i % 7);  /* small finite bf16, small int8 */
    return p;
}

int main(int argc, char **argv) {
    const int64_t K = 2048;
    X x = {filled(K * 2), filled(K * 2), filled(K * 2), filled(K), filled(K * 4)};
    if (argc > 1 && !strcmp(argv[1], "cache")) {
        for (int64_t N = 128; N <= 2048; N *= 16) {
            void *w = filled(N * K * 2);
            float *y = malloc(N * sizeof(float));
            int reps = N == 128 ? 300 : 50;
            printf("%s, %ld rows, one core (GB/s of weights, best of %d)\n", N == 128 ? "L2" : "L3", (long)N, reps);
            for (int v = 0; v < NV; v++) {
                double best = 1e9;
                for (int r = 0; r < reps; r++) {
                    double t = now();
                    run(v, &x, K, w, y, N);
                    t = now() - t;
                    best = t < best ? t : best;
                }
                printf("  %-26s %6.1f\n", NAMES[v], (double)N * K * BYTES[v] / best / 1e9);
            }
            free(w);
            free(y);
        }
        return 0;
    }
    int rounds = argc > 2 ? atoi(argv[2]) : 5;
    const int64_t N = 5632, nm = 16;
    void *w[16];
    float *y = malloc(N * sizeof(float));
    for (int m = 0; m < nm; m++) w[m] = filled(N * K * 2);
    if (argc > 1 && !strcmp(argv[1], "watch")) {
        static const int order[] = {SUM, BF16_ROW, BF16_TILED, I8_ROW, I8_TILED, SUM};
        printf("# time_s plain bf16_row bf16_tiled int8_row int8_tiled plain  (GB/s of weights, 2 threads)\n");
        double t0 = now(), end = t0 + (argc > 2 ? atof(argv[2]) : 60);
        while (now() < end) {
            printf("%.2f", now() - t0);
            for (int i = 0; i < 6; i++) printf(" %.1f", pass(order[i], 2, &x, K, w, nm, y, N));
            printf("\n");
            fflush(stdout);
        }
        return 0;
    }
    double best[NV][3] = {{0}};
    for (int r = 0; r < rounds; r++)
        for (int th = 1; th <= 2; th++)
            for (int v = 0; v < NV; v++) {
                double gb = pass(v, th, &x, K, w, nm, y, N);
                best[v][th] = gb > best[v][th] ? gb : best[v][th];
            }
    printf("DRAM: %ld matrices of %ld x %ld, best of %d rounds (GB/s of weights; share of the plain read)\n",
           (long)nm, (long)N, (long)K, rounds);
    for (int v = 0; v < NV; v++)
        printf("  %-26s 1 thread %5.1f (%3.0f%%)   2 threads %5.1f (%3.0f%%)\n", NAMES[v], best[v][1],
               100 * best[v][1] / best[SUM][1], best[v][2], 100 * best[v][2] / best[SUM][2]);
    return 0;
}
