"""tierlm: fine-tune and serve language models larger than memory.

GPU memory, CPU RAM and NVMe SSD as one hierarchy: weights and optimizer states live on the SSD,
stream through a bounded window, and an out-of-core AdamW consumes each layer's gradients as
backward produces them.
"""
import os as _os
import resource as _resource

# Tensors of 2 MiB and more on transparent huge pages (PyTorch's switch, read at its first
# allocation, hence before importing torch; a no-op where THP is off). glibc gives every large
# tensor fresh pages (_tame_malloc below), and faulting them in 4 KiB at a time took the compute
# threads 11.6 of 85 CPU-s in a Qwen2.5-0.5B out-of-core step (4x448 tokens, fp32, 2 vCPUs); with
# huge pages 6.8, and the step 52.0 -> 46.1-46.5 s at the same peak RSS (docs/benchmarks.md at a2b1c1e, H).
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# torch is not imported here: `tierlm --help` and the argument errors of every verb answer without
# it (its import takes seconds). The verbs and the API import it when they run, after the settings
# above and below are in place. Budgets start from budget.library_baseline, measured by the run.
_torch_rss: int | None = None


def torch_rss() -> int:
    """Peak RSS right after torch's import (bytes), importing it now if nothing has yet: the
    footprint of the library alone where this is the first to import it."""
    global _torch_rss
    if _torch_rss is None:
        import torch  # noqa: F401
        _torch_rss = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss * 1024
    return _torch_rss


# glibc's thresholds under _tame_malloc (tierlm.engine.heap relaxes them while an Engine trains)
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

__version__ = "0.1.0"


def finetune(*args, **kwargs):
    """Fine-tune out-of-core; see tierlm.train.finetune.FinetuneConfig for the options."""
    from .train.finetune import finetune as _finetune
    return _finetune(*args, **kwargs)


def __getattr__(name):
    if name == "TORCH_RSS":  # the former import-time constant
        return torch_rss()
    if name in ("Engine", "EngineConfig", "AdamWConfig"):
        from .engine import engine as _engine
        return getattr(_engine, name)
    if name == "FinetuneConfig":
        from .train.finetune import FinetuneConfig
        return FinetuneConfig
    raise AttributeError(name)
