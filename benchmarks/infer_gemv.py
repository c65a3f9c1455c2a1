"""Which kernel reads the weights fastest at decode (M rows of activations, weights far past the caches).

    flock /tmp/tierlm-bench.lock python benchmarks/infer_gemv.py

Per thread count and M: GB/s of weight bytes for bf16 F.linear (what nn.Linear runs), torch.mv,
PyTorch's int8 / int4 weight-only kernels and tierlm's own few-row kernels (tierlm.infer.native:
"ours_bf16", "ours_int8"), next to a plain read (sum) of as many bytes. Then a prefill-sized product (64 rows): bf16 F.linear against
tierlm's GemvLinear (which converts to fp32 on CPUs without fast bf16 kernels), side by side.
Best of 5 repetitions: the machine is shared.
"""
from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F

from tierlm.infer import native
from tierlm.infer.gemv import GemvLinear, bf16_matmul_is_slow
from tierlm.infer.quant import QLinear, _int4


def best(f, n=5):
    f()
    t_best = 1e9
    for _ in range(n):
        t = time.perf_counter()
        f()
        t_best = min(t_best, time.perf_counter() - t)
    return t_best


def main():
    n, k, count = 5632, 2048, 24  # TinyLlama's MLP shape; 24 of them = 550 MB of bf16
    torch.manual_seed(0)
    ws = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(count)]
    q8, q4 = [], []  # q4: our layout where our kernels build (QLinear's choice)
    for w in ws[: count // 2]:
        for mode, dst in (("int8", q8), ("int4", q4)):
            lin = QLinear(k, n, mode, 128 if mode == "int4" else 0)
            for name, t in lin.quantize(w, None, torch.bfloat16).items():
                setattr(lin, name, t)
            dst.append(lin)
    # PyTorch's int4 kernel takes only its own packing
    q4_torch = [_int4(w, torch.bfloat16, 128, "torch") for w in ws[: count // 2]]
    big = torch.ones(128 << 20, dtype=torch.float32)
    numel = sum(w.numel() for w in ws)
    print(json.dumps({"load_before": os.getloadavg(), "own_kernels": native.isa()}))
    for th in (1, os.cpu_count()):
        torch.set_num_threads(th)
        out = {"threads": th, "read_sum_gbps": big.numel() * 4 / best(big.sum) / 1e9}
        for m in (1, 4, 8, 16, 32):
            a = torch.randn(m, k, dtype=torch.bfloat16)
            if m in (1, 8):
                out[f"M{m}_F.linear_bf16"] = numel * 2 / best(lambda: [F.linear(a, w) for w in ws]) / 1e9
            if m == 1:
                out["M1_mv_bf16"] = numel * 2 / best(lambda: [torch.mv(w, a[0]) for w in ws]) / 1e9
            out[f"M{m}_int8"] = numel / 2 / best(lambda: [torch.ops.aten._weight_int8pack_mm(a, q.qweight, q.scales)
                                                          for q in q8]) / 1e9
            if m in (1, 8):
                out[f"M{m}_int4"] = numel / 4 / best(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(
                    a, q["qweight"], 128, q["scales"]) for q in q4_torch]) / 1e9
            if native.available():
                out[f"M{m}_ours_bf16"] = numel * 2 / best(lambda: [native.gemv_bf16(a, w) for w in ws]) / 1e9
                out[f"M{m}_ours_int8"] = numel / 2 / best(lambda: [native.gemv_int8(a, q.qweight, q.scales)
                                                                   for q in q8]) / 1e9
                if q4[0].layout == "tierlm":
                    out[f"M{m}_ours_int4"] = numel / 4 / best(lambda: [native.gemv_int4(a, q.qweight, q.scales, 128)
                                                                       for q in q4]) / 1e9
        print(json.dumps({k2: round(v, 2) if isinstance(v, float) else v for k2, v in out.items()}), flush=True)
        lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16).requires_grad_(False)
        lin.__class__ = GemvLinear
        a = torch.randn(64, k, dtype=torch.bfloat16)
        plain = best(lambda: [F.linear(a, w) for w in ws[:4]], 3)
        lin_ws = [w for w in ws[:4]]

        def ours():
            for w in lin_ws:
                lin.weight.data = w
                lin(a)
        mine = best(ours, 3)
        print(json.dumps({"threads": th, "M64_F.linear_bf16_ms": round(plain / 4 * 1e3, 1),
                          "M64_tierlm_GemvLinear_ms": round(mine / 4 * 1e3, 1), "speedup": round(plain / mine, 2),
                          "fp32_conversion": bf16_matmul_is_slow()}), flush=True)
    print(json.dumps({"load_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
