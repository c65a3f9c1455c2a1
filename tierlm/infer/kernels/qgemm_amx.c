/* Products of many rows with int8 or int4 weights through AMX-INT8's tiles: qgemm.c's operations
   (its header comment) in the same order, so the same bits as its other paths.

   x comes rounded by qgemm.c (xq [Mp, K], Mp a multiple of AMX_MB here, int8 not shifted: TDPBSSD
   takes both operands signed) and is read by the tiles in place: an A tile is 16 rows of x by kc
   bytes (64, or 32 where the group is an odd multiple of 32). A panel of QG_NP = 32 weight rows is
   packed as the VNNI path packs its panels (pack_words: word (kq, c) is inputs 4kq..4kq+3 of row
   c), which is AMX's B layout: a B tile is kc/4 word rows of 16 columns, the panel's two halves
   side by side (stride 128 bytes). C tiles 0-3 take a 32 x 32 block's int32 sums of one group
   (int8: TDPBSSD; int4: TDPBSUD, x signed and q in 0..15 unsigned), exact; they are zeroed for each
   group and stored, and the group's fp32 step runs on the stored sums, output by output:
   acc = fma(isum, xs, acc) (int8), or acc = fma(isum, scale * xs, acc), acc = fma(lo, xsum, acc)
   (int4), group after group, then y = acc * s (int8): the portable loop's operations.

   The source is compiled twice. As is, with the CPU's tile instructions: gemv.c's cpu_level runs it
   only where tl_amx_usable() found AMX-TILE and AMX-INT8 in CPUID, the tile state enabled by the OS
   (XCR0 bits 17, 18) and Linux's permission for this process's tile data. And by qgemm_amx_emu.c
   against amx_emu.h's software tiles (symbols ending _emu), which any x86 CPU runs
   (TIERLM_NATIVE_ISA=amx-emulated), so that the tests check this kernel's bits without AMX. */
#define _DEFAULT_SOURCE /* syscall() */
#include "qgemm.h"

#include <omp.h>
#include <stdio.h>

#include "amx_emu.h"

#define AMX_MB TL_AMX_ROWS /* rows of x a block: two A tiles of 16 */

#if HAVE_X86 && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define AMX_CC 1 /* the compiler has the tile intrinsics */
#else
#define AMX_CC 0
#endif

#if defined(TL_AMX_EMULATED) && HAVE_X86
#define AMX_BUILT 1
#define TARGET_AMX
#define AMX_FN(f) f##_emu
#define T_CONFIG(p) emu_loadconfig(p)
#define T_RELEASE() emu_release()
#define T_ZERO(t) emu_zero(t)
#define T_LOAD(t, p, stride) emu_loadd(t, p, stride)
#define T_STORE(t, p, stride) emu_stored(t, p, stride)
#define T_DPSS(c, a, b) emu_dp(c, a, b, 1, 1)
#define T_DPSU(c, a, b) emu_dp(c, a, b, 1, 0)
#elif !defined(TL_AMX_EMULATED) && AMX_CC
#define AMX_BUILT 1
#define TARGET_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
#define AMX_FN(f) f
#define T_CONFIG(p) _tile_loadconfig(p)
#define T_RELEASE() _tile_release()
#define T_ZERO(t) _tile_zero(t)
#define T_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define T_STORE(t, p, stride) _tile_stored(t, p, stride)
#define T_DPSS(c, a, b) _tile_dpbssd(c, a, b)
#define T_DPSU(c, a, b) _tile_dpbsud(c, a, b)
#else
#define AMX_BUILT 0
#endif

#if AMX_BUILT
/* Palette 1: C tiles 0-3 (rows 0-15 x columns 0-15, 0-15 x 16-31, 16-31 x 0-15, 16-31 x 16-31 of a
   block), A tiles 4 and 5 (rows 0-15 and 16-31 of x, kc bytes), B tiles 6 and 7 (the panel's
   columns 0-15 and 16-31, kc/4 word rows). */
static void amx_config(tl_tilecfg *c, int kc) {
    memset(c, 0, sizeof(*c));
    c->palette = 1;
    for (int t = 0; t < 8; t++) {
        c->rows[t] = (uint8_t)(t < 6 ? 16 : kc / 4);
        c->colsb[t] = (uint16_t)(t == 4 || t == 5 ? kc : 64);
    }
}

/* Inputs k0..k1 (one group) of rows m0..m0+31 of x against the panel P: the exact int32 sums into
   C [32][32] (row-major, a row of x a row). */
TARGET_AMX static void group_sums(int int4, const int8_t *xq, int64_t K, const int32_t *P, int64_t m0, int64_t k0,
                                  int64_t k1, int kc, int32_t *C) {
    T_ZERO(0);
    T_ZERO(1);
    T_ZERO(2);
    T_ZERO(3);
    for (int64_t k = k0; k < k1; k += kc) {
        T_LOAD(4, xq + m0 * K + k, K);
        T_LOAD(5, xq + (m0 + 16) * K + k, K);
        T_LOAD(6, P + k / 4 * QG_NP, QG_NP * 4);
        T_LOAD(7, P + k / 4 * QG_NP + 16, QG_NP * 4);
        if (int4) {
            T_DPSU(0, 4, 6);
            T_DPSU(1, 4, 7);
            T_DPSU(2, 5, 6);
            T_DPSU(3, 5, 7);
        } else {
            T_DPSS(0, 4, 6);
            T_DPSS(1, 4, 7);
            T_DPSS(2, 5, 6);
            T_DPSS(3, 5, 7);
        }
    }
    T_STORE(0, C, QG_NP * 4);
    T_STORE(1, C + 16, QG_NP * 4);
    T_STORE(2, C + 16 * QG_NP, QG_NP * 4);
    T_STORE(3, C + 16 * QG_NP + 16, QG_NP * 4);
}

/* Group g's fp32 step on a block's accumulators f [32][32] from its sums C. */
TARGET_AMX static void group_step(int int4, const int32_t *C, const float *xs, const float *xsum, int64_t G,
                                  int64_t g, int64_t m0, const float *sc, const float *lo, float *f) {
    for (int r = 0; r < AMX_MB; r++) {
        float xv = xs[(m0 + r) * G + g], *fr = f + r * QG_NP;
        const int32_t *cr = C + r * QG_NP;
        if (int4) {
            float xm = xsum[(m0 + r) * G + g];
            for (int c = 0; c < QG_NP; c++) {
                fr[c] = fmaf((float)cr[c], sc[g * QG_NP + c] * xv, fr[c]);
                fr[c] = fmaf(lo[g * QG_NP + c], xm, fr[c]);
            }
        } else {
            for (int c = 0; c < QG_NP; c++) fr[c] = fmaf((float)cr[c], xv, fr[c]);
        }
    }
}

/* Weight rows n0..n0+nr-1 packed into P ([K/4][QG_NP] words), with int4's scale and lo per group. */
TARGET_AMX static void pack(int int4, const void *w, const float *s, int64_t K, int64_t G, int64_t n0, int64_t nr,
                            int32_t *P, uint8_t *rows, float *sc, float *lo) {
    const uint8_t *src[QG_NP];
    panel_sources(int4, w, s, K, G, n0, nr, QG_NP, rows, src, sc, lo);
#ifdef TL_AMX_EMULATED
    if (!tl_use_vnni()) {  /* the emulation on a CPU without AVX-512: the same words, a word at a time */
        for (int64_t kq = 0; kq < K / 4; kq++)
            for (int64_t c = 0; c < QG_NP; c++) memcpy(P + kq * QG_NP + c, src[c] + 4 * kq, 4);
        return;
    }
#endif
    pack_words(src, K / 4, P);
}

/* Rows m0..m0+31 of x against a packed panel, into outputs n0..n0+nr-1 of the rows below M. */
TARGET_AMX static void block(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                             int64_t xg, int kc, const int32_t *P, const float *sc, const float *lo, const float *s,
                             int64_t m0, int64_t n0, int64_t nr, float *y, int64_t ldy, int32_t *C, float *f) {
    int64_t G = K / xg;
    memset(f, 0, AMX_MB * QG_NP * sizeof(float));
    for (int64_t g = 0; g < G; g++) {
        group_sums(int4, xq, K, P, m0, g * xg, (g + 1) * xg, kc, C);
        group_step(int4, C, xs, xsum, G, g, m0, sc, lo, f);
    }
    for (int64_t r = 0; r < AMX_MB && m0 + r < M; r++)
        for (int64_t c = 0; c < nr; c++) {
            float v = f[r * QG_NP + c];
            y[(m0 + r) * ldy + n0 + c] = int4 ? v : v * s[n0 + c];
        }
}

/* qgemm.c's tierlm_qgemm after x is rounded (Mp a multiple of AMX_MB): the threads share the
   panels, each loading the tile configuration before its first tile instruction and releasing the
   tiles after its last. Returns -1 where a thread's buffers cannot be had, -2 for Mp not a
   multiple of AMX_MB. */
TARGET_AMX int AMX_FN(tl_qgemm_amx)(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t M,
                                    int64_t Mp, int64_t K, int64_t xg, const void *w, const float *s, float *y,
                                    int64_t ldy, int64_t N, int threads) {
    if (Mp % AMX_MB) return -2;
    int64_t G = K / xg, panels = (N + QG_NP - 1) / QG_NP;
    int kc = xg % 64 ? 32 : 64, failed = 0;
#pragma omp parallel num_threads(threads)
    {
        size_t pb = (size_t)K * QG_NP, rb = (size_t)K * (QG_NP + 1), gb = (size_t)G * QG_NP * 4;
        size_t cb = (size_t)AMX_MB * QG_NP * 4;
        char *buf = (char *)aligned_alloc(64, (pb + rb + 2 * gb + 2 * cb + 63) / 64 * 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            int32_t *P = (int32_t *)buf, *C = (int32_t *)(buf + pb + rb + 2 * gb);
            float *sc = (float *)(buf + pb + rb), *lo = sc + G * QG_NP, *f = (float *)(buf + pb + rb + 2 * gb + cb);
            tl_tilecfg cfg;
            amx_config(&cfg, kc);
            T_CONFIG(&cfg);
#pragma omp for schedule(dynamic, 1)
            for (int64_t p = 0; p < panels; p++) {
                int64_t n0 = p * QG_NP, nr = N - n0 < QG_NP ? N - n0 : QG_NP;
                pack(int4, w, s, K, G, n0, nr, P, (uint8_t *)(buf + pb), sc, lo);
                for (int64_t m0 = 0; m0 < Mp; m0 += AMX_MB)
                    block(int4, xq, xs, xsum, M, K, xg, kc, P, sc, lo, s, m0, n0, nr, y, ldy, C, f);
            }
            T_RELEASE();
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
#elif defined(TL_AMX_EMULATED)
int tl_qgemm_amx_emu(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t Mp,
                     int64_t K, int64_t xg, const void *w, const float *s, float *y, int64_t ldy, int64_t N,
                     int threads) {
    return -3;  /* not an x86 build: qgemm.c never asks */
}
#else
int tl_qgemm_amx(int int4, const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t Mp, int64_t K,
                 int64_t xg, const void *w, const float *s, float *y, int64_t ldy, int64_t N, int threads) {
    return -3;  /* no tile intrinsics in this compiler: tl_amx_usable() says no, so never asked */
}
#endif

#ifndef TL_AMX_EMULATED
/* Whether this process may run the tile instructions: asked once (gemv.c's cpu_level, before any
   product), and tl_amx_why() says why not. */
#if HAVE_X86 && defined(__linux__)
#include <cpuid.h>
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifndef ARCH_REQ_XCOMP_PERM
#define ARCH_REQ_XCOMP_PERM 0x1023
#endif
#define XFEATURE_XTILEDATA 18
#endif
static char amx_why[200];
static int amx_checked = -1;

static int amx_check(void) {
#if !HAVE_X86
    snprintf(amx_why, sizeof(amx_why), "not an x86 CPU");
    return 0;
#elif !AMX_CC
    snprintf(amx_why, sizeof(amx_why), "this C compiler has no AMX intrinsics (gcc 11 or clang 12 and later have)");
    return 0;
#elif !defined(__linux__)
    snprintf(amx_why, sizeof(amx_why), "tile data is asked for through Linux's arch_prctl; this is not Linux");
    return 0;
#else
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) {
        snprintf(amx_why, sizeof(amx_why), "the CPU has no AMX-TILE and AMX-INT8 (CPUID leaf 7)");
        return 0;
    }
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) {
        snprintf(amx_why, sizeof(amx_why), "the OS has not enabled XSAVE (CPUID.1:ECX.OSXSAVE)");
        return 0;
    }
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo >> 17 & 3) != 3) {
        snprintf(amx_why, sizeof(amx_why), "the OS does not enable the tile state (XCR0 bits 17 and 18)");
        return 0;
    }
    /* Linux hands out the 8 KiB tile data only to a process that asks (once; for all its threads) */
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        snprintf(amx_why, sizeof(amx_why), "Linux refused this process the tile data (arch_prctl "
                 "ARCH_REQ_XCOMP_PERM: %s)", strerror(errno));
        return 0;
    }
    return 1;
#endif
}

int tl_amx_usable(void) {
    if (amx_checked < 0) amx_checked = amx_check();
    return amx_checked;
}
/* Why the AMX path cannot run here (NULL where it can). */
const char *tierlm_native_amx_why(void) { return tl_amx_usable() ? NULL : amx_why; }
#endif
