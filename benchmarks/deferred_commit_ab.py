"""A/B of the deferred commit: the same Engine steps with defer_commit on and off, alternating.

    python benchmarks/deferred_commit_ab.py MODEL_DIR NVME_DIR   (prints each run's steps and the steady means)
"""
import time, sys, torch
from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig
res = {}
for defer in (True, False, True, False):
    cfg = EngineConfig(nvme_dir=sys.argv[2], cpu_mem="4GiB", precision="fp32", tokens_per_micro_batch=128,
                       optim=AdamWConfig(lr=1e-5, max_grad_norm=None), defer_commit=defer)
    eng = Engine.from_pretrained(sys.argv[1], cfg, overwrite=True)
    g = torch.Generator().manual_seed(0)
    ts = []
    for s in range(3):
        x = torch.randint(0, 150000, (1, 128), generator=g)
        t0 = time.perf_counter()
        eng.backward(eng.forward(x, labels=x).loss); eng.step()
        ts.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); eng.settle(); tail = time.perf_counter() - t0
    eng.close()
    res.setdefault(defer, []).append(sum(ts[1:]) / 2)
    print(f"defer={defer}: steps {['%.2f' % t for t in ts]} s, final settle {tail:.2f} s", flush=True)
print({k: sum(v) / len(v) for k, v in res.items()})
