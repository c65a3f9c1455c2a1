"""The measurements: NVMe sequential bandwidth through tierlm's own store, host memory bandwidth,
matmul throughput per dtype, and the AdamW kernel the optimizer runs.

Each kind of probe has a file of its own: io_probes.py (the drive, through the store),
memory_probes.py (copy and decode-style read bandwidth), compute_probes.py (matmul, AdamW, a
reference layer, CRC32C) and decode_probe.py (a decode step on the inference engine's path). This
module is where callers find them all (`measure.bench_io`, ...), with the machine's description.
"""
from __future__ import annotations

import os
import time

import psutil
import torch

from .compute_probes import (REF_HIDDEN, REF_SEQ, REF_TOKENS, bench_checksum, bench_compute, bench_layer,
                             layer_train_flops, ref_layer_config)
from .decode_probe import DECODE_FORMATS, bench_decode
from .io_probes import (BLOCKS, DEPTHS, PROBE_FLOOR, PROBE_SHARE, SMALL_BYTES, bench_block_size, bench_io,
                        bench_queue_depth, pick_queue_depth, probe_size)
from .memory_probes import READ_K, bench_memory, bench_read
from .timing import GB, best_seconds

__all__ = ["BLOCKS", "DECODE_FORMATS", "DEPTHS", "GB", "PROBE_FLOOR", "PROBE_SHARE", "READ_K", "REF_HIDDEN",
           "REF_SEQ", "REF_TOKENS", "SMALL_BYTES", "bench_block_size", "bench_checksum", "bench_compute",
           "bench_decode", "bench_io", "bench_layer", "bench_memory", "bench_queue_depth", "bench_read",
           "best_seconds", "layer_train_flops", "machine", "pick_queue_depth", "probe_size", "ref_layer_config"]


def machine() -> dict:
    return {"cores": psutil.cpu_count(logical=False) or os.cpu_count(), "logical_cpus": os.cpu_count(),
            "ram_bytes": psutil.virtual_memory().total, "torch": torch.__version__,
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}
