"""Host memory probes: the bandwidth of a large copy, and the read rate the way batch-1 decode reads
its weights (the roofline the inference plan divides by)."""
from __future__ import annotations

import torch

from ..storage.aligned import aligned_empty
from .timing import GB, best_seconds


def bench_memory(size_bytes: int = 512 << 20, repeats: int = 5) -> dict:
    """Host memory bandwidth of a large tensor copy (read + write counted), torch's threads."""
    src = torch.empty(size_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = best_seconds(lambda: dst.copy_(src), repeats)
    return {"mem_gbps": 2 * size_bytes / t / GB, "copy_bytes": size_bytes}


READ_K = 4096  # columns of the read probe's int8 matrix: rows of 4 KiB, as a large layer's


def bench_read(size_bytes: int = 512 << 20, repeats: int = 6) -> dict:
    """Host memory read bandwidth the way batch-1 decode reads its weights: our one-row product
    (tierlm.infer.native, the kernels decode runs) over a `size_bytes` int8 matrix, far past the
    last-level cache, in one buffer on huge pages (aligned_empty, as the inference engine's
    install_resident allocates its layers), on torch's threads (which our kernels' OpenMP region
    uses too), int8 and bf16 weights. Each way's best of `repeats`; the rate is the best of the ways tried, PyTorch's
    fp32 sum over the same bytes too (what the kernels fall back on), on one thread and on all:
    the roofline is what the memory can deliver to decode, not the average disturbance of a
    shared machine.

    A generic probe alone (a torch sum on 4 KiB pages) read 10.4 GB/s on a Xeon whose decode
    moved 19.4: a roofline share of 160%, which says the probe is wrong, not the decode."""
    from ..infer import native

    n = max(1, size_bytes // READ_K)
    buf = aligned_empty(n * READ_K)
    w = buf.view(torch.int8).view(n, READ_K)
    w.fill_(1)  # touched: first-touch page faults outside the timings
    ways = {}
    threads = torch.get_num_threads()
    if native.available():
        scales, x = torch.ones(n), torch.ones(1, READ_K)
        ways[f"native int8 one-row product, {threads} threads"] = lambda: native.products(x, [w], [scales])
        wb = buf.view(torch.bfloat16).view(n, READ_K // 2)  # 0x0101: small finite numbers
        xb = torch.ones(1, READ_K // 2)
        ways[f"native bf16 one-row product, {threads} threads"] = lambda: native.products(xb, [wb])
    f32 = buf.view(torch.float32)
    ways[f"torch fp32 sum, {threads} threads"] = lambda: f32.sum()
    if threads > 1:
        def one_thread():
            torch.set_num_threads(1)
            try:
                f32.sum()
            finally:
                torch.set_num_threads(threads)
        ways["torch fp32 sum, 1 thread"] = one_thread
    by = {}
    for name, fn in ways.items():
        fn()  # warm-up: kernel selection, the library's first call
        by[name] = n * READ_K / best_seconds(fn, repeats) / GB
    best = max(by, key=by.get)
    return {"read_gbps": by[best], "read_how": best, "read_gbps_by_way": by, "read_bytes": n * READ_K,
            "read_huge_pages": bool(buf.data_ptr() % (2 << 20) == 0)}
