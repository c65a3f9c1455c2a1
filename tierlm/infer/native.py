"""Our few-row products (kernels/gemv.c), fused decoder layer (kernels/layer.c) and many-row int8/int4
products (kernels/qgemm.c, wrapped by `tierlm.infer.qgemm`), built once per machine and loaded with ctypes.

The C file needs no PyTorch headers, so the build is one compiler call of about a second, cached
under the tierlm cache directory by a hash of the source, the compiler and its flags. Where no C
compiler works, or TIERLM_NATIVE=0, `available()` is False and the callers keep PyTorch's kernels
(the result is the same product; only the speed differs). The library is linked with -fopenmp and
loaded after torch, whose bundled libgomp.so.1 then serves it too: one OpenMP thread pool.

The loops come in instruction-set paths (`ISAS`, each a superset of the one before); the highest
the CPU has runs, or the one TIERLM_NATIVE_ISA names (`supported_isas()` lists this CPU's), so that
every path's loops can be tested on any CPU that has it. Naming a path the CPU lacks is an error.
The amx path (many-row int8/int4 products through AMX-INT8's tiles, kernels/qgemm_amx.c) runs only
where the CPU has AMX-TILE and AMX-INT8, the OS enables the tile state and Linux grants this process
the tile data (`amx_unavailable()` says which failed); the rest of its loops are avx512bf16's. It
has not yet run on a CPU with AMX, so it runs only when named (AMX_BY_DEFAULT).
TIERLM_NATIVE_ISA=amx-emulated runs that same AMX kernel on any x86 CPU, against a software model
of the tiles (kernels/amx_emu.h; slow: for tests of its bits, never for speed), the other loops on
the CPU's highest path below amx; `amx_emulated()` says whether it is on.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

KERNELS = Path(__file__).with_name("kernels")
SRC = [KERNELS / "gemv.c", KERNELS / "layer.c", KERNELS / "qgemm.c", KERNELS / "qgemm_avx2.c",
       KERNELS / "qgemm_amx.c", KERNELS / "qgemm_amx_emu.c"]  # compiled together
HEADERS = [KERNELS / "gemv.h", KERNELS / "qgemm.h", KERNELS / "amx_emu.h"]  # what they share
FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp"]
LIBS = ["-lm"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None
_switched_off = False  # use(False): benchmarks compare against PyTorch's kernels in one process
# kernels/gemv.c's paths, in its order (cpu_level): portable C, AVX2 + FMA, + AVX512-VNNI for one
# int8 row, + AVX512-BF16 for one bf16 row, + AMX-INT8 tiles for many int8/int4 rows
ISAS = ("portable", "avx2", "avx512vnni", "avx512bf16", "amx")
AMX_EMULATED = "amx-emulated"  # TIERLM_NATIVE_ISA's name for the AMX kernel on software tiles
# the switches TIERLM_NATIVE_ISA replaced, and the value that asked for a lower path
_OLD_SWITCHES = {"TIERLM_NATIVE_PORTABLE": ("not 0", "portable"), "TIERLM_NATIVE_VNNI": ("0", "avx2"),
                 "TIERLM_NATIVE_BF16DP": ("0", "avx512vnni")}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cache_root() -> Path:
    return Path(os.environ.get("TIERLM_CACHE_DIR") or Path.home() / ".cache" / "tierlm") / "kernels"


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH; set CC to one")
    src = b"".join(f.read_bytes() for f in SRC + HEADERS)
    tag = hashlib.sha256(src + cc.encode() + " ".join(FLAGS + LIBS).encode()).hexdigest()[:16]
    lib = _cache_root() / f"gemv-{tag}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: two processes building at once both succeed.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        try:
            r = subprocess.run([cc, *FLAGS, *map(str, SRC), "-o", tmp, *LIBS], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed on {' and '.join(str(f) for f in SRC)}: {r.stderr.strip()[-800:]}")
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    dll = ctypes.CDLL(str(lib))
    i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    dll.tierlm_gemv_multi.argtypes = [c_int, p, i64, i64, i64, p, p, p, p, i64, p, c_int, ctypes.c_float, c_int,
                                      i64]
    dll.tierlm_gemv_multi.restype = c_int
    dll.tierlm_gemv_isa.restype = c_int
    dll.tierlm_native_cpu_isa.restype = c_int
    dll.tierlm_native_set_isa.argtypes = [c_int]
    dll.tierlm_native_set_isa.restype = c_int
    dll.tierlm_gemv_set_prefetch.argtypes = [i64]
    dll.tierlm_gemv_set_light_x.argtypes = [c_int]
    dll.tierlm_set_steal.argtypes = [c_int]
    dll.tierlm_steals.restype = i64
    dll.tierlm_dequant_int4.argtypes = [p, p, i64, i64, i64, p, c_int]
    dll.tierlm_dequant_int4.restype = None
    dll.tierlm_layer_decode.argtypes = [p, p, p, p, p, p]
    dll.tierlm_layer_decode.restype = c_int
    dll.tierlm_layers_decode.argtypes = [p, p, i64, p, p, p, p, i64, p]
    dll.tierlm_layers_decode.restype = c_int
    dll.tierlm_layer_scratch_bytes.argtypes = [p, p]
    dll.tierlm_layer_scratch_bytes.restype = i64
    dll.tierlm_qgemm.argtypes = [p, i64, i64, p, p, i64, i64, i64, p, i64, c_int]
    dll.tierlm_qgemm.restype = c_int
    dll.tierlm_qgemm_fast.restype = c_int
    dll.tierlm_native_amx_why.restype = ctypes.c_char_p
    dll.tierlm_qgemm_set_amx_emulated.argtypes = [c_int]
    dll.tierlm_qgemm_set_amx_emulated.restype = c_int
    dll.tierlm_qgemm_amx_emulated.restype = c_int
    _cap_isa(dll)
    dll.tierlm_gemv_isa()  # the CPU checks cache their answers here, before any parallel region asks
    return dll


# The AMX prefill kernel has been checked only against a software model of the tiles, never on a
# CPU with AMX: until it has, a CPU with AMX runs avx512bf16 unless TIERLM_NATIVE_ISA=amx names it
# (the tests name every path the CPU has, so an AMX machine's test run compares it bit for bit).
AMX_BY_DEFAULT = False


def _cap_isa(dll) -> None:
    """The kernels capped at the path TIERLM_NATIVE_ISA names (unnamed: the CPU's highest, amx only
    where AMX_BY_DEFAULT); a ValueError where the CPU lacks it."""
    want = _requested_isa()
    if want is None and not AMX_BY_DEFAULT and dll.tierlm_native_cpu_isa() > ISAS.index("avx512bf16"):
        dll.tierlm_native_set_isa(ISAS.index("avx512bf16"))
    if want == AMX_EMULATED:
        if dll.tierlm_native_cpu_isa() > ISAS.index("avx512bf16"):
            dll.tierlm_native_set_isa(ISAS.index("avx512bf16"))  # the CPU's own tiles stay unused
        if dll.tierlm_qgemm_set_amx_emulated(1) != 1:
            raise ValueError(f"TIERLM_NATIVE_ISA={want}: this CPU has no {want} path (not x86)")
    elif want is not None:
        have = dll.tierlm_native_cpu_isa()
        if ISAS.index(want) > have:
            why = f"; {dll.tierlm_native_amx_why().decode()}" if want == "amx" else ""
            raise ValueError(f"TIERLM_NATIVE_ISA={want}: this CPU has no {want} path (it has "
                             f"{', '.join(ISAS[:have + 1])}{why})")
        dll.tierlm_native_set_isa(ISAS.index(want))


def _requested_isa() -> str | None:
    """The path TIERLM_NATIVE_ISA names (None: the CPU's highest); a ValueError for a name that is
    no path, and for the switches it replaced (which would otherwise be ignored without a word)."""
    for name, (asks, instead) in _OLD_SWITCHES.items():
        v = os.environ.get(name, "")
        if v and (v != "0" if asks == "not 0" else v == asks):
            raise ValueError(f"{name}={v} is no longer read: set TIERLM_NATIVE_ISA={instead}")
    want = os.environ.get("TIERLM_NATIVE_ISA", "").strip().lower()
    if not want:
        return None
    if want not in ISAS + (AMX_EMULATED,):
        raise ValueError(f"TIERLM_NATIVE_ISA={want!r} is none of {', '.join(ISAS + (AMX_EMULATED,))}")
    return want


def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them on first use; None where they cannot be built."""
    global _lib, _failed
    if _lib is not None or _failed is not None:
        return _lib
    with _lock:
        if _lib is None and _failed is None:
            if os.environ.get("TIERLM_NATIVE", "1") == "0":
                _failed = "TIERLM_NATIVE=0"
            else:
                try:
                    _lib = _build()
                except (OSError, RuntimeError) as e:
                    _failed = str(e)
                    print(f"tierlm: own few-row kernels unavailable, using PyTorch's ({e})", file=sys.stderr)
    return _lib


def available() -> bool:
    return not _switched_off and library() is not None


def use(on: bool) -> None:
    """Route the callers to our kernels (where they build) or to PyTorch's from now on."""
    global _switched_off
    _switched_off = not on


def set_light_x(on: bool) -> None:
    """Whether the AVX-512 one-row loops take x rounded lighter (to bf16 against bf16 weights, to
    8 bits a group of 128 against int8: the default) or exactly (TIERLM_NATIVE_EXACT_X=1); for
    side-by-side benchmarks, between calls."""
    lib = library()
    if lib is not None:
        lib.tierlm_gemv_set_light_x(int(bool(on)))


def set_steal(mode: int) -> None:
    """Whether threads that finish their even share of a product's rows (a fused layer's stage, or
    a call of our products) take the back half of the largest share left (1, the default) or wait
    (0); for side-by-side benchmarks, between calls. 2 (tests): as 1, with thread 0 held back before
    each product until another thread takes rows of its share (100 ms at most)."""
    lib = library()
    if lib is not None:
        lib.tierlm_set_steal(int(mode))


def steals() -> int:
    """How many times a thread took rows from another's share since the last call."""
    lib = library()
    return lib.tierlm_steals() if lib is not None else 0


def set_prefetch(nbytes: int) -> None:
    """How far ahead of the row being multiplied the AVX2 kernels prefetch weights (0: not at
    all); the kernels start at 1024 bytes. For side-by-side benchmarks."""
    lib = library()
    if lib is not None:
        lib.tierlm_gemv_set_prefetch(int(nbytes))


def why_unavailable() -> str | None:
    library()
    return _failed


def isa() -> str:
    """The path the products run on (one of ISAS), or "none" where the kernels are unavailable."""
    lib = library()
    return ISAS[lib.tierlm_gemv_isa() & 15] if lib is not None else "none"


def amx_unavailable() -> str | None:
    """Why the amx path cannot run on this CPU (None where it can, or the kernels are unavailable)."""
    lib = library()
    why = lib.tierlm_native_amx_why() if lib is not None else None
    return why.decode() if why else None


def amx_emulated() -> bool:
    """Whether many-row products take the AMX kernel on software tiles (TIERLM_NATIVE_ISA=amx-emulated)."""
    lib = library()
    return lib is not None and bool(lib.tierlm_qgemm_amx_emulated())


def supported_isas() -> list[str]:
    """The paths this CPU can run (TIERLM_NATIVE_ISA may name any of them), lowest first; none
    where the kernels are unavailable."""
    lib = library()
    return list(ISAS[:lib.tierlm_native_cpu_isa() + 1]) if lib is not None else []


def light_x() -> bool:
    """Whether one row's x is rounded lighter for the AVX-512 one-row loops (to bf16 against bf16
    weights, 8 bits a group of 128 against int8): on avx512vnni and avx512bf16 unless
    TIERLM_NATIVE_EXACT_X=1 or set_light_x(False)."""
    lib = library()
    return lib is not None and bool(lib.tierlm_gemv_isa() & 16)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k).to(torch.float32).contiguous()


INT8, BF16, INT4, FP32 = 0, 1, 2, 3


NORM_BF16, NORM_ONE_PLUS = 1, 2  # kernels/gemv.h's TL_NORM_*


def norm_flags(weight: torch.Tensor, one_plus: bool = False) -> int:
    """The kernels' flags for an RMSNorm weight (fp32 or bf16): its dtype, and whether the norm
    scales by (1 + weight) (Gemma's) rather than by the weight."""
    return (NORM_BF16 if weight.dtype == torch.bfloat16 else 0) | (NORM_ONE_PLUS if one_plus else 0)


def _norm_args(norm: tuple | None):
    """(pointer, flags, eps, the tensor to keep alive) of an RMSNorm (weight, eps[, one_plus]) for
    the kernel."""
    if norm is None:
        return None, 0, 0.0, None
    t, eps = norm[0], norm[1]
    one_plus = len(norm) > 2 and bool(norm[2])
    if t.dtype not in (torch.float32, torch.bfloat16) or not t.is_contiguous():
        t = t.float().contiguous()
    return t.data_ptr(), norm_flags(t, one_plus), eps, t


def products(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor] | None = None,
             concat: bool = False, norm: tuple | None = None, group: int = 0
             ) -> list[torch.Tensor] | torch.Tensor:
    """x [..., K] times each weight [N_j, K]^T, in one parallel region: int8 weights with fp32
    scales [N_j] (one per output row), else bf16 weights; with `group`, int4 weights [N_j, K/2]
    (uint8, kernels/gemv.c's nibble order) with fp32 (scale, lo) pairs [N_j, K/group, 2]. fp32
    accumulation; returns fp32 [rows, N_j] each, or with `concat` one [rows, sum N_j] (the outputs
    side by side, written in place).

    With `norm` = (weight [K] fp32 or bf16, eps) the kernel first RMS-normalises each row and
    scales it by the weight (a decoder layer's norm, at no torch op of its own); with
    (weight, eps, True) by 1 + weight (Gemma's norms). One row against
    int8 weights is rounded to 16 bits; every row against int4 weights to 8 bits a group (groups of
    a multiple of 64) or 16 bits (kernels/gemv.c)."""
    k = weights[0].shape[1] * (2 if group else 1)
    xf = _rows(x, k)
    m, n = xf.shape[0], len(weights)
    kind = INT4 if group else INT8 if scales is not None else BF16
    ws = [w.contiguous() for w in weights]
    ss = [t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous() for t in scales] \
        if scales is not None else []
    sizes = [w.shape[0] for w in ws]
    if concat:
        out = torch.empty(m, sum(sizes), dtype=torch.float32)
        offs = [0]
        for s in sizes[:-1]:
            offs.append(offs[-1] + s)
        yp, ldy = [out.data_ptr() + 4 * o for o in offs], out.shape[1]
    else:
        ys = [torch.empty(m, s, dtype=torch.float32) for s in sizes]
        yp, ldy = [y.data_ptr() for y in ys], 0
    nw, nw_flags, eps, _keep = _norm_args(norm)
    ptr = ctypes.c_void_p * n
    sp = ptr(*[t.data_ptr() for t in ss]) if ss else None
    rc = library().tierlm_gemv_multi(kind, xf.data_ptr(), m, k, n, ptr(*[w.data_ptr() for w in ws]), sp,
                                     ptr(*yp), (ctypes.c_int64 * n)(*sizes), ldy, nw, nw_flags, eps,
                                     torch.get_num_threads(), group)
    _check(rc, m, k, group)
    return out if concat else ys


def _check(rc: int, m: int, k: int, group: int) -> None:
    if rc == -2:
        raise ValueError(f"int4 group {group} must be a multiple of 32 that divides the {k} inputs")
    if rc != 0:
        raise MemoryError(f"tierlm's few-row kernel could not allocate {m} rows of {k} inputs")


class KeptCall:
    """`products(x, weights, scales, concat=True, norm=...)` for the same modules every call (a
    decoder layer's q/k/v, say), with the argument arrays kept between calls: a decode step makes
    ~90 calls, and building them (and converting bf16 int8 scales to fp32) took ~30-40 us of each.
    The arrays are rebuilt when a weight moves (a streamed layer installed in another buffer); the
    fp32 scales are converted once, since these are always the same modules' scales."""

    def __init__(self):
        self._key = None
        self._scales = None

    def __call__(self, x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor] | None = None,
                 norm: tuple | None = None, group: int = 0) -> torch.Tensor:
        # int4's (scale, lo) pairs are as large as a sixteenth of the weights: used where they
        # are (fp32 already), so they are part of the key
        key = tuple(w.data_ptr() for w in weights) + (tuple(t.data_ptr() for t in scales) if group else ())
        if key != self._key:
            if any(not w.is_contiguous() for w in weights) or \
                    group and any(t.dtype != torch.float32 or not t.is_contiguous() for t in scales):
                return products(x, weights, scales, concat=True, norm=norm, group=group)
            n = len(weights)
            if group:
                self._scales = list(scales)
            elif scales is not None and self._scales is None:
                # a copy even when already fp32: a streamed layer's scales live in a window buffer
                # that later holds another layer's
                self._scales = [t.to(torch.float32, copy=True).contiguous() for t in scales]
            self._w = (ctypes.c_void_p * n)(*key[:n])
            self._s = (ctypes.c_void_p * n)(*[t.data_ptr() for t in self._scales]) if scales is not None else None
            sizes = [w.shape[0] for w in weights]
            self._n = (ctypes.c_int64 * n)(*sizes)
            self._offs = [4 * sum(sizes[:j]) for j in range(n)]
            self._total, self._ptrs = sum(sizes), ctypes.c_void_p * n
            self._k = weights[0].shape[1] * (2 if group else 1)
            self._kind = INT4 if group else INT8 if scales is not None else BF16
            self._key = key
        k = self._k
        xf = x if x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() else _rows(x, k)
        m = xf.shape[0]
        out = torch.empty(m, self._total, dtype=torch.float32)
        base = out.data_ptr()
        nw, nw_flags, eps, _keep = _norm_args(norm)
        rc = library().tierlm_gemv_multi(self._kind, xf.data_ptr(), m, k, len(weights), self._w, self._s,
                                         self._ptrs(*[base + o for o in self._offs]), self._n, self._total,
                                         nw, nw_flags, eps, torch.get_num_threads(), group)
        _check(rc, m, k, group)
        return out


def gemv_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] int8 * scales [N])^T in fp32 accumulation; returns fp32 [rows, N]."""
    return products(x, [qweight], [scales])[0]


def gemv_int4(x: torch.Tensor, qweight: torch.Tensor, scale_lo: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] @ W^T for int4 W (qweight [N, K/2], scale_lo [N, K/group, 2] fp32); fp32 [rows, N]."""
    return products(x, [qweight], [scale_lo], group=group)[0]


def dequant_int4(qweight: torch.Tensor, scale_lo: torch.Tensor, group: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Our int4 layout back to fp32 [N, K] (quant.dequant_int4's result, at memory speed), into
    `out` (N * K fp32 elements, contiguous) when given."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if k % group or group % 32 or scale_lo.dtype != torch.float32:
        raise ValueError(f"int4 group {group} must be a multiple of 32 that divides the {k} inputs (fp32 scales)")
    qw, sl = qweight.contiguous(), scale_lo.contiguous()
    if out is None:
        out = torch.empty(n, k, dtype=torch.float32)
    elif out.numel() != n * k or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"dequant_int4 needs {n} x {k} contiguous fp32 elements to write into")
    out = out.view(n, k)
    library().tierlm_dequant_int4(qw.data_ptr(), sl.data_ptr(), n, k, group, out.data_ptr(), torch.get_num_threads())
    return out


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K] (bf16)^T in fp32 accumulation; returns fp32 [rows, N]."""
    return products(x, [weight])[0]
