/* qgemm_amx.c's kernel a second time, against amx_emu.h's software tiles (tl_qgemm_amx_emu): the
   AMX path's bits on any x86 CPU (TIERLM_NATIVE_ISA=amx-emulated), for the tests. */
#define TL_AMX_EMULATED 1
#include "qgemm_amx.c"
