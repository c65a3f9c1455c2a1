"""Where an inference run's weights live under `--gpu-mem` when its layers compute on a GPU.

Pure arithmetic beside `plan.inference.plan_placement` (the host side). The device holds the
embeddings and the head, the KV cache and the compute scratch first, then as many whole decoder
layers as fit; the rest stream from host memory (pinned), each copied on a side stream while the
layer before it computes, so the device keeps room for two streamed layers: the one computing and
the next one arriving. The host places the streamed layers under `--cpu-mem` as it places any
layers: resident in RAM while they fit, the rest read from the NVMe store through a window.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..storage import BudgetError
from ..units import fmt_bytes

DEVICE_WINDOW_LAYERS = 2  # the streamed layer computing and the next one being copied


@dataclass
class DevicePlacement:
    budget: int         # --gpu-mem
    fixed: int          # embeddings, final norm, head
    kv: int
    scratch: int
    layer_bytes: int    # the largest decoder layer
    layers: int
    resident: int       # decoder layers kept in device memory
    window: int         # device room for streamed layers (0 when every layer is resident)
    kv_name: str = "KV cache"  # what `kv` holds (plan.inference.cache_name)

    @property
    def streamed(self) -> int:
        return self.layers - self.resident

    def describe(self) -> str:
        return (f"{self.resident}/{self.layers} layers in device memory, {self.streamed} copied from the host "
                f"a step; --gpu-mem {fmt_bytes(self.budget)} = embeddings/head {fmt_bytes(self.fixed)} + layers "
                f"{fmt_bytes(self.resident * self.layer_bytes)} + copy window {fmt_bytes(self.window)} + {self.kv_name} "
                f"{fmt_bytes(self.kv)} + compute {fmt_bytes(self.scratch)}")


def plan_device_placement(budget: int, fixed: int, layer_bytes: int, layers: int, kv: int, scratch: int,
                          want: int | None = None, kv_name: str = "KV cache") -> DevicePlacement:
    """`want`: at most this many layers resident (--resident-layers; None: as many as fit)."""
    avail = budget - fixed - kv - scratch
    want = layers if want is None else max(0, min(want, layers))
    if want == layers and layers * layer_bytes <= avail:
        return DevicePlacement(budget, fixed, kv, scratch, layer_bytes, layers, layers, 0, kv_name)
    window = DEVICE_WINDOW_LAYERS * layer_bytes
    if avail < window:
        need = budget - avail + window
        raise BudgetError(
            f"--gpu-mem {fmt_bytes(budget)} cannot run this model on the GPU: at least {fmt_bytes(need)} is needed "
            f"(embeddings and head {fmt_bytes(fixed)}, {kv_name} {fmt_bytes(kv)} for --max-batch x --max-seq-len, "
            f"compute {fmt_bytes(scratch)}, a copy window of {DEVICE_WINDOW_LAYERS} layers {fmt_bytes(window)}). "
            f"Raise --gpu-mem to {fmt_bytes(need * 1.05)}, or lower --max-batch / --max-seq-len / --step-tokens, "
            f"or use --weights int8 or int4, or --device cpu")
    resident = min(want, (avail - window) // max(layer_bytes, 1))
    return DevicePlacement(budget, fixed, kv, scratch, layer_bytes, layers, int(resident), window, kv_name)
