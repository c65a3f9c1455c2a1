"""Does torch's AdamW leave a row with zero gradient and zero moments bit-identical (weight decay 0)?

    python benchmarks/adamw_zero_rows.py

Fused, foreach and single kernels; gradients +0 and -0; weights 0, -0, subnormals, infinities, random;
steps 0..1000, lr 0..5, eps 1e-8 and 1e-30; and torch.optim.AdamW on a stacked [experts, ...]
parameter whose last rows never get a gradient. The case tierlm's engine leaves such an expert alone
in (tierlm/engine/expert_state.py)."""
import torch
from torch.optim.adamw import adamw
vals = [0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-38, 1.17e-38, 3.0, -2.5, 1e30, -1e-30, 6.5e4, float("inf"), -float("inf")]
p0 = torch.tensor(vals * 3, dtype=torch.float32)
p0 = torch.cat([p0, torch.randn(4096)])
bad = []
for impl in ("fused", "foreach", "single"):
    flags = {"fused": dict(fused=True, foreach=False), "foreach": dict(fused=False, foreach=True), "single": dict(fused=False, foreach=False)}[impl]
    for gsign in (0.0, -0.0):
        for step in (0, 1, 7, 1000):
            for lr in (1e-3, 0.0, 5.0):
                for eps in (1e-8, 1e-30):
                    p = p0.clone(); g = torch.full_like(p, gsign); m = torch.zeros_like(p); v = torch.zeros_like(p)
                    adamw([p], [g], [m], [v], [], [torch.tensor(float(step))], lr=lr, beta1=0.9, beta2=0.999,
                          weight_decay=0.0, eps=eps, amsgrad=False, maximize=False, **flags)
                    same = torch.equal(p.view(torch.int32), p0.view(torch.int32))
                    mz = torch.equal(m.view(torch.int32), torch.zeros_like(m).view(torch.int32))
                    vz = torch.equal(v.view(torch.int32), torch.zeros_like(v).view(torch.int32))
                    if not (same and mz and vz):
                        bad.append((impl, gsign, step, lr, eps, same, mz, vz))
    # wd != 0 moves the row (the skip must not apply)
    p = p0.clone(); g = torch.zeros_like(p); m = torch.zeros_like(p); v = torch.zeros_like(p)
    adamw([p], [g], [m], [v], [], [torch.tensor(0.0)], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8,
          amsgrad=False, maximize=False, **flags)
    print(impl, "wd=0.1 moves the zero-gradient row:", not torch.equal(p.view(torch.int32), p0.view(torch.int32)))
# torch.optim.AdamW on a stacked [E, ...] parameter with bf16 copy: rows with zero grad from the start stay bit-equal
for impl in ("fused", "foreach", "single"):
    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True), "single": dict(foreach=False)}[impl]
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 64, 32)); w0 = w.detach().clone()
    opt = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.0, **flags)
    for s in range(5):
        g = torch.randn(8, 64, 32); g[3:] = 0.0; g[5] = -0.0
        w.grad = g; opt.step()
    st = opt.state[w]
    print(impl, "stacked rows 3..7 untouched:", torch.equal(w.detach()[3:].view(torch.int32), w0[3:].view(torch.int32)),
          "moments +0:", torch.equal(st["exp_avg"][3:].view(torch.int32), torch.zeros(5, 64, 32).view(torch.int32)),
          torch.equal(st["exp_avg_sq"][3:].view(torch.int32), torch.zeros(5, 64, 32).view(torch.int32)),
          "bf16 copy same:", torch.equal(w.detach()[3:].bfloat16(), w0[3:].bfloat16()))
print("cases where a zero-gradient, zero-moment row changed:", len(bad))
for b in bad[:20]: print(b)
