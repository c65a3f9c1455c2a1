"""The page faults and the huge pages the kernel zeroes in each out-of-core step (Engine alone).

    flock /tmp/tierlm-bench.lock python benchmarks/step_faults.py MODEL_DIR CORPUS NVME_DIR \\
        --cpu-mem 4GiB --seq-len 448 --batch-size 4 --steps 3

Per step: wall time, minor faults (getrusage), 2 MiB pages faulted in (/proc/vmstat's
thp_fault_alloc, machine-wide: run nothing beside it), the heap guard's trims (tierlm/heap.py) and
the peak RSS so far. Run it from another checkout (PYTHONPATH=...) to compare code side by side.
"""
import argparse
import resource
import time


def thp_faults() -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("thp_fault_alloc "):
                return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("corpus")
    ap.add_argument("nvme")
    ap.add_argument("--cpu-mem", default="4GiB")
    ap.add_argument("--seq-len", type=int, default=448)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--precision", default="bf16")
    a = ap.parse_args()

    import tierlm
    from transformers import AutoTokenizer
    from tierlm import rss
    from tierlm.engine.engine import Engine, EngineConfig
    from tierlm.engine.optimizer import AdamWConfig

    tok = AutoTokenizer.from_pretrained(a.model)
    n = a.seq_len * a.batch_size
    with open(a.corpus, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids[0]
    if len(ids) < n * a.steps:
        raise SystemExit(f"{a.corpus}: {len(ids)} tokens, {n * a.steps} needed")
    cfg = EngineConfig(nvme_dir=a.nvme, cpu_mem=a.cpu_mem, precision=a.precision, tokens_per_micro_batch=n,
                       micro_batch_size=a.batch_size, optim=AdamWConfig(lr=1e-5, max_grad_norm=None))
    eng = Engine.from_pretrained(a.model, cfg, overwrite=True)
    print(f"tierlm {tierlm.__file__}; split {eng.split}; heap kept: {getattr(getattr(eng, 'heap', None), 'active', None)}")
    try:
        for i in range(a.steps):
            x = ids[i * n:(i + 1) * n].reshape(a.batch_size, a.seq_len)
            f0, h0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, thp_faults(), time.perf_counter()
            eng.backward(eng.forward(x, labels=x).loss)
            eng.step()
            dt = time.perf_counter() - t0
            print(f"step {i + 1}: {dt:.2f} s, {(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 1e3:.0f}K "
                  f"faults, {(thp_faults() - h0) * 2 / 1024:.1f} GiB of huge pages, "
                  f"heap trims {getattr(getattr(eng, 'heap', None), 'trims', None)}, "
                  f"peak RSS {rss.peak_rss() / 2**20:.0f} MiB", flush=True)
    finally:
        eng.close()


if __name__ == "__main__":
    main()
