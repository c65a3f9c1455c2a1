"""glibc's allocator set for budgets, once, when tierlm is imported (tierlm/__init__.py imports this
first): the engines' heap guard (tierlm/heap.py) reads and restores these settings."""
import os as _os

TAME_MMAP_THRESHOLD = 64 * 1024
TAME_TRIM_THRESHOLD = 1 << 20


def _tame_malloc() -> bool:
    """Fewer glibc arenas (tokenizers' and the I/O threads' each keep their own, and freed memory
    in them stays in RSS) and large blocks returned to the OS on free. Budgets are promises.

    TIERLM_MALLOC=glibc leaves glibc's defaults: `bench train`'s in-memory run is plain PyTorch,
    and these settings cost it ~9% (fresh pages zeroed for every large tensor: Qwen2.5-0.5B 4x448
    bf16, 25.6 against 28.0 s/step, docs/benchmarks.md at a2b1c1e, a 2-vCPU Zen 4 VM)."""
    if _os.environ.get("TIERLM_MALLOC") == "glibc":
        return False
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
    libc.mallopt(M_ARENA_MAX, 2)
    libc.mallopt(M_MMAP_THRESHOLD, TAME_MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, TAME_TRIM_THRESHOLD)
    return True


MALLOC_TAMED = _tame_malloc()
