/* AMX's palette-1 tile configuration (what qgemm_amx.c loads with LDTILECFG), and, with
   TL_AMX_EMULATED, a software model of the tile registers and of the instructions qgemm_amx.c
   uses, so that the AMX kernel's source also runs, compiled a second time, on a CPU without AMX:
   its integer sums, and so its outputs, can then be checked bit for bit against the other paths.

   The model follows the Intel SDM's pseudocode (LDTILECFG, TILELOADD, TILESTORED, TILEZERO,
   TDPBSSD/TDPBSUD/TDPBUSD/TDPBUUD, TILERELEASE) for palette 1: 8 tiles of at most 16 rows of 64
   bytes, each tile's rows and bytes a row taken from the loaded configuration; a load fills `rows`
   rows of `colsb` bytes and zeroes the rest of the tile, a dot product adds, for each of C's rows
   and 4-byte columns, the products of 4 byte pairs (each byte sign- or zero-extended as the
   instruction's letters say) to the int32 in place, wrapping around on overflow, and zeroes C
   beyond its configured shape. The state is per thread, as the registers are. Where the CPU
   would fault (#GP: a bad configuration; #UD: tiles used unconfigured, shapes that do not match,
   a tile named twice in one product) the model stops the process with a message instead. What it
   cannot tell: speed, alignment or page faults, and whether the compiler's tile instructions
   encode what the source names (only the real CPU runs those). */
#ifndef TIERLM_AMX_EMU_H
#define TIERLM_AMX_EMU_H
#include <stdint.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];  /* bytes a row of tile i */
    uint8_t rows[16];
} tl_tilecfg;

#ifdef TL_AMX_EMULATED
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EMU_TILES 8
#define EMU_ROWS 16
#define EMU_COLSB 64

typedef struct {
    int valid;  /* a palette-1 configuration is loaded */
    tl_tilecfg cfg;
    uint8_t t[EMU_TILES][EMU_ROWS][EMU_COLSB];
} emu_tiles;
static _Thread_local emu_tiles emu;

static void emu_fault(const char *what, int t) {
    fprintf(stderr, "tierlm: emulated AMX fault (the CPU would raise an exception): %s (tile %d)\n", what, t);
    abort();
}

static void emu_release(void) { memset(&emu, 0, sizeof(emu)); }

static void emu_loadconfig(const void *p) {
    tl_tilecfg c;
    memcpy(&c, p, sizeof(c));
    if (c.palette == 0) {  /* palette 0: back to the initial state */
        emu_release();
        return;
    }
    if (c.palette != 1) emu_fault("palette other than 0 or 1", -1);
    for (int i = 0; i < 14; i++)
        if (c.reserved[i]) emu_fault("reserved configuration bytes not zero", -1);
    for (int i = 0; i < 16; i++) {
        int beyond = i >= EMU_TILES;  /* palette 1 names 8 tiles; the rest must be zero */
        if (beyond ? c.rows[i] || c.colsb[i] : c.rows[i] > EMU_ROWS || c.colsb[i] > EMU_COLSB)
            emu_fault("tile shape beyond the palette", i);
        if (!c.rows[i] != !c.colsb[i]) emu_fault("a tile with rows but no bytes, or bytes but no rows", i);
    }
    memset(&emu, 0, sizeof(emu));
    emu.cfg = c;
    emu.cfg.start_row = 0;
    emu.valid = 1;
}

static void emu_check(int t) {
    if (!emu.valid) emu_fault("tile instruction with no configuration loaded", t);
    if (t < 0 || t >= EMU_TILES || !emu.cfg.rows[t]) emu_fault("tile not configured", t);
}

static void emu_zero(int t) {
    emu_check(t);
    memset(emu.t[t], 0, sizeof(emu.t[t]));
}

static void emu_loadd(int t, const void *base, int64_t stride) {
    emu_check(t);
    int rows = emu.cfg.rows[t], colsb = emu.cfg.colsb[t];
    memset(emu.t[t], 0, sizeof(emu.t[t]));
    for (int r = 0; r < rows; r++) memcpy(emu.t[t][r], (const uint8_t *)base + r * stride, (size_t)colsb);
}

static void emu_stored(int t, void *base, int64_t stride) {
    emu_check(t);
    for (int r = 0; r < emu.cfg.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, emu.t[t][r], emu.cfg.colsb[t]);
}

/* C[m][n] += sum over k < A's colsb / 4, i < 4 of A.byte[m][4k + i] * B.byte[k][4n + i]; a_signed and
   b_signed: TDPBSSD (1, 1), TDPBSUD (1, 0), TDPBUSD (0, 1), TDPBUUD (0, 0). */
static void emu_dp(int c, int a, int b, int a_signed, int b_signed) {
    emu_check(c);
    emu_check(a);
    emu_check(b);
    if (c == a || c == b || a == b) emu_fault("a tile named twice in one product", c);
    const tl_tilecfg *g = &emu.cfg;
    if (g->colsb[a] % 4 || g->colsb[c] % 4) emu_fault("bytes a row not a multiple of 4", a);
    if (g->colsb[a] / 4 != g->rows[b]) emu_fault("A's 4-byte columns differ from B's rows", b);
    if (g->colsb[c] != g->colsb[b]) emu_fault("C's bytes a row differ from B's", c);
    if (g->rows[c] != g->rows[a]) emu_fault("C's rows differ from A's", c);
    uint8_t out[EMU_ROWS][EMU_COLSB];
    memset(out, 0, sizeof(out));
    for (int m = 0; m < g->rows[c]; m++)
        for (int n = 0; n < g->colsb[c] / 4; n++) {
            int32_t v;
            memcpy(&v, emu.t[c][m] + 4 * n, 4);
            uint32_t acc = (uint32_t)v;  /* unsigned: the sum wraps around as the CPU's does */
            for (int k = 0; k < g->colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++) {
                    uint8_t x = emu.t[a][m][4 * k + i], y = emu.t[b][k][4 * n + i];
                    int32_t xv = a_signed ? (int32_t)(int8_t)x : (int32_t)x;
                    int32_t yv = b_signed ? (int32_t)(int8_t)y : (int32_t)y;
                    acc += (uint32_t)(xv * yv);
                }
            memcpy(out[m] + 4 * n, &acc, 4);
        }
    memcpy(emu.t[c], out, sizeof(out));
}
#endif
#endif
