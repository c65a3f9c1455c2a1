"""A/B of one of the engine's on/off knobs (an EngineConfig field; early_tied: the tied head's early
update; next_rows: the next lookup's embedding rows kept from the update, Engine.expect): the same
Engine steps with it on and off, alternating, on real text (which rows a batch looks up depends on
its tokens; pack_below: tensors under that many bytes live in RAM and reach the drive in one pack a
commit, storage/packed.py; io_threads: reads and writes in flight).

    python benchmarks/engine_knob_ab.py MODEL_DIR CORPUS NVME_DIR --knob early_tied \
        [--cpu-mem 3.75GiB --seq-len 448 --batch 2]
    python benchmarks/engine_knob_ab.py MODEL_DIR CORPUS NVME_DIR --knob pack_below \
        --order 1MiB,64KiB,1MiB,64KiB --precision bf16 --cpu-mem 4GiB --seq-len 32 --batch 1 --steps 6

Prints each run's step times, SSD GiB read and written a step (steady), and the steady means
(steps 2 on). At a small batch the early update costs a read: the embedding updated at the start of
backward cannot wait in the weight window for the next forward, as the one updated last does.
Also how many layers recomputed or swapped their activations in the last step.
"""
import argparse
import time

from transformers import AutoTokenizer

from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig
from tierlm.units import parse_bytes

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("corpus")
ap.add_argument("nvme")
ap.add_argument("--knob", required=True, choices=["early_tied", "next_rows", "pack_below", "io_threads"])
ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
ap.add_argument("--cpu-mem", default="3.75GiB")
ap.add_argument("--seq-len", type=int, default=448)
ap.add_argument("--batch", type=int, default=2)
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--order", default="on,off,on,off", help="the arms in turn: on/off, sizes for pack_below, counts for io_threads")
a = ap.parse_args()
tok = AutoTokenizer.from_pretrained(a.model)
ids = tok(open(a.corpus, encoding="utf-8").read()[:2_000_000], return_tensors="pt").input_ids[0]
n = a.seq_len * a.batch
batches = [ids[i * n:(i + 1) * n].reshape(a.batch, a.seq_len) for i in range(a.steps)]


def value(mode: str):
    if a.knob == "pack_below":
        return parse_bytes(mode)
    return int(mode) if a.knob == "io_threads" else mode == "on"


res = {}
for mode in a.order.split(","):
    cfg = EngineConfig(nvme_dir=a.nvme, cpu_mem=a.cpu_mem, precision=a.precision, tokens_per_micro_batch=n,
                       micro_batch_size=a.batch, optim=AdamWConfig(lr=1e-5, max_grad_norm=None),
                       **{a.knob: value(mode)})
    eng = Engine.from_pretrained(a.model, cfg, overwrite=True)
    ts, io = [], []
    for i, x in enumerate(batches):
        io.append(eng.store.stats.snapshot())
        t0 = time.perf_counter()
        loss = eng.forward(x, labels=x).loss
        if i + 1 < len(batches):
            eng.expect(batches[i + 1])  # what `tierlm finetune` does; a no-op with next_rows off
        eng.backward(loss)
        eng.step()
        ts.append(time.perf_counter() - t0)
    eng.settle()
    io.append(eng.store.stats.snapshot())
    eng.close()
    pols = list(eng.acts.history[-1]["policies"].values())
    pol = ", ".join(f"{p} {pols.count(p)}" for p in sorted(set(pols)))
    rd, wr = ((io[-1][k] - io[1][k]) / (len(io) - 2) / 2**30 for k in ("bytes_read", "bytes_written"))
    res.setdefault(mode, []).append(sum(ts[1:]) / len(ts[1:]))
    print(f"{a.knob}={mode}: layers {pol}; steps {['%.2f' % t for t in ts]} s, SSD a step: read {rd:.2f} GiB, write {wr:.2f} GiB", flush=True)
print({k: round(sum(v) / len(v), 2) for k, v in res.items()})
