"""The published-results check: tierlm's plan on the LoHan (Fuyou) paper's machine against the
throughput that paper reports. Pure arithmetic (models on `meta`); runs in seconds anywhere.

    python benchmarks/plan_lohan.py

Liao et al. 2024 report ~156 TFLOPS fine-tuning a 13B GPT-3 at batch 64 and ~87 TFLOPS for GPT-3
175B at batch 16 on one RTX 4090, 768 GB DDR4 and 12 NVMe drives in RAID-0 (catalog system `lohan`).
"""
from __future__ import annotations

from tierlm.plan.catalog import Catalog
from tierlm.plan.planner import Task, plan
from tierlm.advise.models import model_shape

CASES = [("gpt3-13b", 64, 156.0), ("llama-2-13b", 64, 156.0), ("gpt3-175b", 16, 87.0)]


def main() -> None:
    hw = Catalog().parse("lohan")
    print(f"lohan = {hw.describe()}; seq 1024, bf16, activations auto\n")
    print("| model | batch | published TFLOPS | planned TFLOPS | planned / published | s/step | binding | "
          "gpu | cpu | dram | pcie | ssd (s) | activations |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, batch, published in CASES + [("gpt3-175b", 8, None), ("gpt3-13b", 16, None)]:
        p = plan(model_shape(model), hw, Task(batch=batch, seq_len=1024))
        d = p.devices_s
        a = p.activations
        ratio = f"{p.tflops / published:.2f}" if published else "-"
        print(f"| {model} | {batch} | {published or '-'} | {p.tflops:.1f} | {ratio} | {p.step_s:.1f} | {p.binding} | "
              + " | ".join(f"{d.get(k, 0):.1f}" for k in ("gpu", "cpu", "dram", "pcie", "ssd"))
              + f" | RAM {a['in_ram']}, NVMe {a['on_nvme']}, recomputed {a['recomputed']} |")
    for model, batch in (("gpt3-175b", 16),):
        p = plan(model_shape(model), hw, Task(batch=batch, seq_len=1024, state_cache=False))
        print(f"\nwithout optimizer state in RAM ({model}, batch {batch}): {p.tflops:.1f} TFLOPS, binding {p.binding}, "
              f"ssd {p.devices_s['ssd']:.1f} s, gpu {p.devices_s['gpu']:.1f} s")


if __name__ == "__main__":
    main()
