"""The plan's GPU rates and serving bounds against this machine's GPU.

On a GPU machine: measures pinned host->device and device->host copy rates (the host link the
activation swapper and streamed decode use) and the device memory's read bandwidth, and prints
them beside the catalog's published datasheet values for this GPU, the rates the plan uses
(datasheet x cost.Efficiency), and `tierlm plan --task serve`'s GPU decode bounds for a preset
model, resident and streamed under a small --gpu-mem, from the plan's rates and from the measured
ones. Without a GPU it stops with exit 2.

    python benchmarks/plan_vs_gpu.py [--model llama-3.1-8b] [--gpu h100-80g] [--gpu-mem 8GiB] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tierlm from this checkout

from tierlm.advise.models import model_shape
from tierlm.advise.report import text
from tierlm.engine.link_probe import measure_link
from tierlm.plan import cost as C
from tierlm.plan.catalog import GB, GiB, Catalog
from tierlm.plan.planner import Task, plan
from tierlm.units import parse_bytes

# Which catalog entry a device name is (torch.cuda.get_device_name), most specific first.
NAMES = [("H100 PCIe", "h100-pcie"), ("H100", "h100-80g"), ("H200", "h200"), ("H800", "h800-80g"),
         ("A100-SXM4-40GB", "a100-40g"), ("A100-PCIE-40GB", "a100-40g"), ("A100", "a100-80g"),
         ("L4", "l4"), ("4090", "rtx4090"), ("V100", "v100-32g")]


def catalog_name(device_name: str) -> str | None:
    for key, name in NAMES:
        if key.lower() in device_name.lower():
            return name
    return None


def device_read_rate(dev: torch.device, nbytes: int = 4 * GiB, repeats: int = 5) -> float:
    """Bytes/s of reading device memory once (a sum over bf16 elements: one read, no write), the
    best of `repeats` after one untimed."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
    torch.cuda.synchronize(dev)
    x.sum()
    torch.cuda.synchronize(dev)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    del x
    return nbytes / best


def at_rates(rec: dict, hbm: float, link: float) -> dict:
    """The plan's GPU decode record with its bytes over other rates (the measured ones)."""
    if rec.get("why"):
        return rec
    b = dict(rec["bounds_s"], hbm=rec["device_read"] / hbm, link=rec["streamed"] / link if rec["streamed"] else 0.0)
    step = max(b.values())
    return {**rec, "bounds_s": b, "step_s": step, "binding": max(b, key=b.get),
            "decode_tokens_per_s": rec["batch"] / step, "rates": dict(rec["rates"], hbm=hbm, link=link)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a preset (tierlm init --help)")
    ap.add_argument("--gpu", default=None, help="catalog GPU name (default: from the device's name)")
    ap.add_argument("--gpu-mem", default="8GiB", help="the streamed case's --gpu-mem")
    ap.add_argument("--out", default=None, help="also write the figures as JSON")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("plan_vs_gpu: no CUDA GPU here (torch.cuda.is_available() is False): run it on a GPU machine",
              file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(dev)
    gpu = a.gpu or catalog_name(name)
    if gpu is None or gpu not in Catalog().gpus:
        print(f"plan_vs_gpu: {name!r} is no catalog GPU; pass --gpu NAME (one of {', '.join(sorted(Catalog().gpus))})",
              file=sys.stderr)
        return 2
    g, eff = Catalog().gpus[gpu], C.Efficiency()
    link = {n: measure_link(dev, n) for n in (64 << 20, 1 << 30)}
    hbm = device_read_rate(dev)
    out = {"device": name, "catalog": gpu,
           "measured": {"d2h_64MiB": link[64 << 20][0], "h2d_64MiB": link[64 << 20][1],
                        "d2h_1GiB": link[1 << 30][0], "h2d_1GiB": link[1 << 30][1], "hbm_read": hbm},
           "datasheet": {"link": g.link_gbps * GB, "hbm": g.mem_gbps * GB},
           "plan_rates": {"link": g.link_gbps * GB * eff.link, "hbm": g.mem_gbps * GB * eff.memory}}
    m, d, p = out["measured"], out["datasheet"], out["plan_rates"]
    print(f"{name} as catalog {gpu!r} (datasheet values, not measured; the plan applies cost.Efficiency)")
    print(f"  {'':<26}{'measured':>12}{'datasheet':>12}{'plan uses':>12}{'measured/datasheet':>20}")
    for label, val, key in (("host->device (64 MiB)", m["h2d_64MiB"], "link"), ("host->device (1 GiB)", m["h2d_1GiB"], "link"),
                            ("device->host (1 GiB)", m["d2h_1GiB"], "link"), ("device memory read", hbm, "hbm")):
        print(f"  {label:<26}{val / 1e9:>9.1f} GB/s{d[key] / 1e9:>7.0f} GB/s{p[key] / 1e9:>7.0f} GB/s{val / d[key]:>19.0%}")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # this machine's: streamed layers from RAM
    spec = f"{gpu}+{max(ram // GiB, 1)}GiB"
    shape = model_shape(a.model)
    for case, task in (("resident", Task(kind="serve")), ("streamed", Task(kind="serve", gpu_mem=parse_bytes(a.gpu_mem)))):
        pl = plan(shape, Catalog().parse(spec), task).extra["gpu_decode"]
        ms = at_rates(pl, hbm, min(m["h2d_1GiB"], m["h2d_64MiB"]))
        out[case] = {"plan": pl, "with_measured_rates": ms}
        print(f"{a.model} {case} decode on {spec}" + (f" --gpu-mem {a.gpu_mem}" if task.gpu_mem else "") + ":")
        for label, rec in (("plan (datasheet x efficiency)", pl), ("bounds at the measured rates", ms)):
            if rec.get("why"):
                print(f"  {label}: {rec['why']}")
                continue
            print(f"  {label}: {rec['resident_layers']}/{rec['layers']} layers resident, hbm {rec['bounds_s']['hbm'] * 1e3:.2f} ms, "
                  f"link {rec['bounds_s']['link'] * 1e3:.2f} ms -> {rec['decode_tokens_per_s']:,.1f} tokens/s "
                  f"({rec['binding']}-bound)")
    print(text(plan(shape, Catalog().parse(spec), Task(kind="serve", gpu_mem=parse_bytes(a.gpu_mem)))))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
