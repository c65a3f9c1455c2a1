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

# oneDNN's kernel caches bounded (read when the first product is built): a mixture of experts
# builds new products every step, and kept, they grew past --cpu-mem (kernel_cache.py)
from . import kernel_cache as _kernel_cache  # noqa: E402,F401

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


# glibc's thresholds under _tame_malloc (tierlm.heap relaxes them while an engine trains or infers)
from .malloc import MALLOC_TAMED, TAME_MMAP_THRESHOLD, TAME_TRIM_THRESHOLD  # noqa: E402,F401  (at import: budgets)

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
        from .train.options import FinetuneConfig
        return FinetuneConfig
    raise AttributeError(name)
