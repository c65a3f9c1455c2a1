"""The engine's fixed costs: what a training step and a decode step cost beyond FLOPs and bytes.

A step of a tiny model (hidden 64, 8 tokens) moves almost no bytes and does almost no arithmetic,
so its time is the machinery: Python and autograd per layer, the hooks, the thread hand-offs, a
dozen small reads and writes per layer, the commit's syncfs and manifest. Timing two depths (2 and
8 layers) separates a per-layer part (the slope) from a per-step part (the intercept). The planner
adds both to its predictions on `--hardware this`; they are measured here, on models unrelated to
any benchmark, so nothing is fitted to the runs the planner is then compared with.
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..engine.engine import Engine, EngineConfig
from ..infer.engine import InferConfig, InferenceEngine

SHALLOW, DEEP = 2, 8
_TINY = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64)


def _tiny(layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", num_hidden_layers=layers, **_TINY)
    return AutoModelForCausalLM.from_config(cfg).float()


def _train_step_s(layers: int, root: Path, steps: int, activations: str) -> float:
    eng = Engine.from_model(_tiny(layers), EngineConfig(nvme_dir=str(root / f"t{layers}{activations}"),
                                                        cpu_mem="512MiB", activations=activations,
                                                        tokens_per_micro_batch=8))
    ids = torch.randint(0, _TINY["vocab_size"], (1, 8))
    times = []
    try:
        for _ in range(steps + 1):  # the first step pays for first reads and kernel selection
            t0 = time.perf_counter()
            eng.backward(eng.forward(ids, labels=ids).loss)
            eng.finish()
            eng.commit()
            times.append(time.perf_counter() - t0)
    finally:
        eng.close()
    return statistics.median(times[1:])


def _decode_step_s(layers: int, root: Path, steps: int, stream: bool) -> float:
    d = root / f"m{layers}"
    if not d.exists():
        _tiny(layers).save_pretrained(d)
    cfg = InferConfig(cpu_mem="256MiB", max_batch=1, max_seq_len=64, nvme_dir=str(root / f"s{layers}"),
                      resident_layers=0 if stream else None)
    eng = InferenceEngine(str(d), cfg)
    times = []
    try:
        eng.step([[1, 2, 3]], starts=[0])
        for i in range(steps + 1):
            t0 = time.perf_counter()
            eng.step([[5]], starts=[3 + i])
            times.append(time.perf_counter() - t0)
    finally:
        close = getattr(eng, "close", None)
        if close:
            close()
    return statistics.median(times[1:])


def bench_overhead(directory: str | Path, steps: int = 6) -> dict:
    """Per-step and per-layer overhead of a training step (commit included) and of a decode step
    (resident and streamed), in seconds. `directory` should be on the NVMe the engine will use: the
    commit's syncfs is part of what is measured."""
    root = Path(tempfile.mkdtemp(prefix=".tierlm-overhead-", dir=directory))
    out: dict = {"layers": [SHALLOW, DEEP], "tokens": 8}
    try:
        for acts in ("keep", "recompute"):
            t = {n: _train_step_s(n, root, steps, acts) for n in (SHALLOW, DEEP)}
            per_layer = max(0.0, (t[DEEP] - t[SHALLOW]) / (DEEP - SHALLOW))
            sfx = "" if acts == "keep" else "_recompute"
            out[f"train_per_layer{sfx}_s"] = per_layer
            out[f"train_per_step{sfx}_s"] = max(0.0, t[SHALLOW] - SHALLOW * per_layer)
        for mode in ("resident", "streamed"):
            d = {n: _decode_step_s(n, root, 4 * steps, mode == "streamed") for n in (SHALLOW, DEEP)}
            per_layer = max(0.0, (d[DEEP] - d[SHALLOW]) / (DEEP - SHALLOW))
            out[f"decode_{mode}_per_layer_s"] = per_layer
            out[f"decode_{mode}_per_step_s"] = max(0.0, d[SHALLOW] - SHALLOW * per_layer)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out
