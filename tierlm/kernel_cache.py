"""A bound on the matrix-product kernels oneDNN keeps, set once, when tierlm is imported (tierlm/__init__.py
imports this before torch): the libraries read these variables when they first build a kernel.

oneDNN (PyTorch's bf16 products on CPUs with AVX512-BF16 or AMX) keeps every product it has built,
keyed on its shapes, in two caches: its own primitive cache and ideep's, above it, which holds the
same primitives (up to 1024 each by default). A built product costs ~0.56 MiB of JIT code and
descriptors (576 KiB measured per new row count, 256- and 2048-wide bf16 products, torch 2.13), and
is freed only when both caches have let it go. A dense model's step runs ~15 shapes and builds them
once (a llama's step at a fixed sequence length; another ~15 for the libraries' warm-up). A mixture
of experts' grouped product runs one product per expert whose row count is the tokens routed to it,
so nearly every step builds new ones: a qwen3_moe of 16 experts (6 layers, 64 tokens) built 171, 87
and 30 in its first three steps and its RSS grew by 3-9 MiB in every layer's forward and backward,
132 MiB beyond its --cpu-mem 80MiB after 3 steps, none of it in tensors. Bounded at KERNEL_CACHE_ENTRIES
in both, the same run peaked at 55-62 MiB of its 80 with the same losses.

A product rebuilt costs 0.2-0.4 ms (oneDNN's verbose create times, brgemm bf16): a routed product
that missed the cache paid it anyway. Set either variable to choose another bound (the budget
planner's TRAINING_RESERVE counts KERNEL_CACHE_BYTES)."""
import os as _os

# A dense step's ~15 products and the warm-up's stay cached; a product is rebuilt only where a step
# needs more than this many shapes.
KERNEL_CACHE_ENTRIES = 32
KERNEL_ENTRY_BYTES = 576 << 10
KERNEL_CACHE_BYTES = KERNEL_CACHE_ENTRIES * KERNEL_ENTRY_BYTES


def _bound_kernel_caches() -> None:
    _os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(KERNEL_CACHE_ENTRIES))
    _os.environ.setdefault("LRU_CACHE_CAPACITY", str(KERNEL_CACHE_ENTRIES))  # ideep's


_bound_kernel_caches()
