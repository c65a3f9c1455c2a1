"""Run by torchrun in tests/dist: N engine steps on each rank's slice of the global batches.
Optional last arguments: the device (cpu, cuda) and the gradient bucket bytes (buckets.py; on the CPU
set on the rank by hand, as from_env keeps the CPU path per parameter)."""
import json
import sys
from pathlib import Path

import torch

from tierlm.dist import from_env
from tierlm.dist.data import global_losses, split_batch
from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig

LR = 1e-3  # the update of a fine-tune; at 1e-2 one step moves the tiny model's weights by half
           # their size and Adam amplifies the last-bit gradient differences into 2e-6


def main(model_dir, out, steps, accum, bsz, seq, clip, precision, device="cpu", bucket=None):
    dist = from_env(60, device, bucket)
    if bucket is not None and dist.device.type == "cpu":
        dist.bucket_bytes = bucket
    from tests.dist.test_data_parallel import NAN_STEP, global_batches
    data = global_batches(steps * accum, bsz, seq)
    cfg = EngineConfig(nvme_dir=str(Path(out) / "nvme" / f"rank{dist.rank}"), cpu_mem="1GiB",
                       precision=precision, grad_accum=accum,
                       optim=AdamWConfig(lr=LR, weight_decay=0.1, max_grad_norm=clip),
                       tokens_per_micro_batch=bsz * seq, device=str(dist.device))
    eng = Engine.from_pretrained(model_dir, cfg, dist=dist)
    results, losses = [], []
    for s in range(steps):
        weighted = []
        for x in data[s * accum:(s + 1) * accum]:
            ids, labels, w = split_batch(dist, x, x)
            loss = eng.forward(ids, labels=labels).loss * w
            if s == NAN_STEP and dist.rank == 1:
                loss = loss * float("nan")  # one rank's non-finite gradients: every rank skips the step
            eng.backward(loss)
            weighted.append(loss.item())
        losses += global_losses(dist, weighted)
        r = eng.step()
        results.append([r.grad_norm, r.redone, r.finite])
    owned = {n: eng.master(n) for n in eng.names if eng._owned(n)}
    weights = {n: eng.weights(n) for n in eng.names}
    torch.save({"masters": owned, "weights": weights, "results": results, "losses": losses},
               Path(out) / f"rank{dist.rank}.pt")
    eng.close()
    dist.close()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), float(a[6]) if a[6] != "none" else None, a[7],
         *a[8:9], *(int(b) for b in a[9:10]))
    print(json.dumps({"ok": True}))
