"""Run by torchrun in tests/dist/test_partial_grads.py: data-parallel steps where the MLPs run on
some ranks' micro-batches and not others (test_partial_grads.PATTERN)."""
import json
import sys
from pathlib import Path

import torch
from transformers.models.llama import modeling_llama

from tierlm.dist import from_env
from tierlm.dist.data import split_batch
from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig


def main(model_dir, out, bucket):
    from tests.dist.test_partial_grads import ACCUM, BSZ, CLIP, LR, PATTERN, SEQ, batches, skipping
    dist = from_env(60, "cpu", None)
    dist.bucket_bytes = bucket  # 0: a reduction a parameter (grads.py); else buckets (buckets.py)
    data = batches()
    cfg = EngineConfig(nvme_dir=str(Path(out) / "nvme" / f"rank{dist.rank}"), cpu_mem="1GiB", precision="fp32",
                       grad_accum=ACCUM, optim=AdamWConfig(lr=LR, weight_decay=0.1, max_grad_norm=CLIP),
                       tokens_per_micro_batch=BSZ * SEQ)
    eng = Engine.from_pretrained(model_dir, cfg, dist=dist)
    use = skipping(modeling_llama)
    norms = []
    for s, micro in enumerate(PATTERN):
        for m, ranks in enumerate(micro):
            use["mlp"] = ranks[dist.rank]
            x = data[s * ACCUM + m]
            ids, labels, w = split_batch(dist, x, x)
            eng.backward(eng.forward(ids, labels=labels).loss * w)
        norms.append(eng.step().grad_norm)
    owned = {n: eng.master(n) for n in eng.names if eng._owned(n)}
    steps = {n: eng.optimizer.steps[n] for n in owned}
    torch.save({"masters": owned, "norms": norms, "steps": steps}, Path(out) / f"rank{dist.rank}.pt")
    eng.close()
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    print(json.dumps({"ok": True}))
