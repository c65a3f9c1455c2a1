"""One decoder layer's training compute through the engine against the same layer in plain PyTorch
(issue 43: a layer's compute within 5% of plain PyTorch's).

    flock /tmp/tierlm-bench.lock python benchmarks/layer_vs_torch.py [--pairs 12 --warmup 5 \
        --work /tmp/layer_vs_torch --recompute --profile]

The 271M llama's layer (hidden 1024, 16 heads, kv 16, ffn 2816, vocab 32000) at 4x512 tokens in
bf16 (`--precision bf16`: bf16 weights and activations), the model's own transformers decoder layer
with its rotary embeddings, called with the arguments the model's forward gives it:

  A  plain PyTorch: bf16 parameters that require grad, an input that requires grad; the layer's
     forward, then backward of a gradient of its output; the input's and the parameters' gradients
     (set to None before each pair, as an in-memory training step's zero_grad does).
  B  the engine: an Engine on a one-layer copy of the model (weights from its window, which keeps
     them all on this budget) and the layer's own wrapped forward (block_fn.wrap_layer ->
     BlockFunction: weights loaded and released, saved tensors packed by ParamRefHooks, the
     activation policy, the timeline and the profile), then backward through BlockFunction.backward
     (weights loaded again, the kept graph run backward, post-accumulate-grad hooks taking each
     gradient: Engine._on_grad). Where _on_grad hands a gradient to the optimizer (_hand_over), it
     is kept here and its norm taken, as OutOfCoreAdamW.grad_ready takes it on this thread with one
     micro-batch a step; the optimizer's own update, on its own thread, is not layer compute.
  C  (--recompute) B with the layer's policy 'recompute': the forward keeps only its input and
     backward runs it again.

Arms alternate (A B [C], the order swapped every pair) after warm-up pairs, in one process, on
torch's threads. Prints the machine, the median and spread of each arm, its minor page faults, the
ratio B/A (C/A), that ratio less the engine's gradient norms (timed inside B), and whether the
gradients (input and every parameter) are bit-equal. --profile: torch.profiler's per-op table of
one more call of each arm. Other processes on the cores stretch the medians (the small parallel
reductions of the norms most): the fastest calls and the per-pair ratios are the steadier figures.
"""
import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tierlm from this checkout
import tierlm  # noqa: E402,F401  (first, as in `tierlm finetune`: its allocator and oneDNN settings)
import torch  # noqa: E402

from tierlm.bench.machine import machine_line
from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.grad_norm import grad_norm
from tierlm.engine.optimizer import AdamWConfig
from tierlm.hf.init import init_model
from tierlm.hf.presets import make_config
from tierlm.hf.structure import find_layers

SHAPE = {"layers": 1, "hidden": 1024, "heads": 16, "kv_heads": 16, "intermediate": 2816, "vocab": 32000,
         "max_positions": 1024, "dtype": "bfloat16"}


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=None, help="model and store directory (default: a temporary one)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--cpu-mem", default="6GiB")
    ap.add_argument("--recompute", action="store_true", help="also time the layer with its activations recomputed")
    ap.add_argument("--profile", action="store_true", help="per-op profile of one more call of each arm")
    return ap.parse_args()


def build_engine(work: Path, a) -> Engine:
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        init_model(model_dir, make_config("llama", overrides=SHAPE), seed=0, tokenizer=False)
    cfg = EngineConfig(nvme_dir=str(work / "nvme"), cpu_mem=a.cpu_mem, precision="bf16", activations="keep",
                       tokens_per_micro_batch=a.batch * a.seq_len, micro_batch_size=a.batch,
                       optim=AdamWConfig(lr=1e-5, max_grad_norm=None))
    return Engine.from_pretrained(model_dir, cfg, overwrite=True)


def layer_call(eng: Engine, layer, ids: torch.Tensor):
    """The arguments the model's own forward passes the layer (rotary cos/sin, mask, positions)."""
    got = {}

    def hook(mod, args, kwargs):
        got["args"], got["kwargs"] = args, dict(kwargs)
    h = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            eng.forward(ids)
    finally:
        h.remove()
    args, kwargs = list(got["args"]), got["kwargs"]
    x = args.pop(0) if args else kwargs.pop("hidden_states")
    return x.detach().clone(), tuple(args), kwargs


def plain_layer(eng: Engine, blk, layer_name: str, layer):
    """A fresh decoder layer of the same class with the engine's working (bf16) weights."""
    eng._load(blk.uses)
    try:
        state = {n[len(layer_name) + 1:]: eng.params[n].data.clone() for n in blk.uses}
    finally:
        eng._unload(blk.uses)
    plain = type(layer)(eng.config, layer_idx=0)
    plain.load_state_dict(state, strict=True)
    return plain.to(torch.bfloat16).train()


class Arms:
    def __init__(self, eng: Engine, blk, layer_name: str, layer, plain, call, grad_out):
        self.eng, self.blk, self.layer, self.plain = eng, blk, layer, plain
        self.x0, self.args, self.kwargs = call
        self.grad_out = grad_out
        self.handed: dict[str, torch.Tensor] = {}
        self.norm_s = 0.0  # seconds of the gradients' norms in the engine's last call
        self.names = {n: n[len(layer_name) + 1:] for n in blk.uses}
        eng._hand_over = self._hand_over  # the gradients the optimizer would take, kept for the check

    def _hand_over(self, name: str, g: torch.Tensor, held: bool = False) -> None:
        t0 = time.perf_counter()
        grad_norm(g)  # what grad_ready does on this thread with one micro-batch a step
        self.norm_s += time.perf_counter() - t0
        self.handed[self.names[name]] = g

    def plain_step(self) -> dict:
        for p in self.plain.parameters():
            p.grad = None
        x = self.x0.detach().requires_grad_(True)
        out = self.plain(x, *self.args, **self.kwargs)
        torch.autograd.backward(out, self.grad_out)
        return {"input": x.grad, **{n: p.grad for n, p in self.plain.named_parameters()}}

    def engine_step(self, policy: str = "keep") -> dict:
        self.eng.acts.policies[self.blk.index] = policy
        self.handed, self.norm_s = {}, 0.0
        x = self.x0.detach().requires_grad_(True)
        out = self.layer(x, *self.args, **self.kwargs)
        torch.autograd.backward(out, self.grad_out)
        return {"input": x.grad, **self.handed}


def timed(fn) -> tuple[float, int]:
    """Seconds of `fn` and the minor page faults it took (fresh pages the kernel zeroed)."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def same_bits(a: dict, b: dict) -> tuple[bool, list[str]]:
    bad = [k for k in a if k not in b or b[k] is None or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    return not bad and set(a) == set(b), bad + sorted(set(b) - set(a))


def profile(name: str, fn) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    with prof(activities=[ProfilerActivity.CPU], record_shapes=False) as p:
        fn()
    print(f"\n--- per-op profile: {name} ---")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def summary(ts: list[float]) -> str:
    return f"median {statistics.median(ts):.4f} s (min {min(ts):.4f}, max {max(ts):.4f}, n={len(ts)})"


def make_arms(eng: Engine, a) -> tuple[Arms, dict]:
    """The arms to time, by name, on one micro-batch of random tokens and a random output gradient."""
    list_name, layers = find_layers(eng.model)
    layer, layer_name = layers[0], f"{list_name}.0"
    blk = next(b for b in eng.blocks if b.kind == "layer")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, eng.config.vocab_size, (a.batch, a.seq_len), generator=g)
    call = layer_call(eng, layer, ids)
    grad_out = (torch.randn(call[0].shape, generator=g) * 1e-3).to(call[0].dtype)
    arms = Arms(eng, blk, layer_name, layer, plain_layer(eng, blk, layer_name, layer), call, grad_out)
    run = {"A plain": arms.plain_step, "B engine": arms.engine_step}
    if a.recompute:
        run["C engine, recompute"] = lambda: arms.engine_step("recompute")
    return arms, run


def time_pairs(arms: Arms, run: dict, warmup: int, pairs: int) -> dict:
    """{arm: {"s": [seconds], "faults": [minor faults], "norm_s": [seconds of gradient norms]}},
    the arms alternating, their order swapped every pair, warm-up pairs left out."""
    out = {k: {"s": [], "faults": [], "norm_s": []} for k in run}
    order = list(run)
    for i in range(warmup + pairs):
        for k in (order if i % 2 == 0 else order[::-1]):
            t, f = timed(run[k])
            if i >= warmup:
                out[k]["s"].append(t)
                out[k]["faults"].append(f)
                out[k]["norm_s"].append(arms.norm_s if k != "A plain" else 0.0)
    return out


def report(res: dict) -> None:
    med = statistics.median
    for k, r in res.items():
        print(f"{k:22s} {summary(r['s'])}; minor faults a call: median {med(r['faults']):.0f}"
              + (f"; gradient norms in it: median {med(r['norm_s']) * 1e3:.1f} ms, "
                 f"min {min(r['norm_s']) * 1e3:.1f}" if k != "A plain" else ""))
    a = res["A plain"]["s"]
    for k, r in list(res.items())[1:]:
        ratios = [b / p for b, p in zip(r["s"], a)]
        print(f"ratio {k} / A: medians {med(r['s']) / med(a):.4f}, fastest calls {min(r['s']) / min(a):.4f}; "
              f"per pair: median {med(ratios):.4f}, min {min(ratios):.4f}, max {max(ratios):.4f}")
        # the norms are small parallel reductions: the part of the engine's work that other
        # processes on the cores stretch most
        rest = [(b - n) / p for b, n, p in zip(r["s"], r["norm_s"], a)]
        print(f"  less its gradient norms: per pair median {med(rest):.4f}")


def main() -> int:
    a = parse()
    tmp = tempfile.TemporaryDirectory(prefix="layer_vs_torch-") if a.work is None else None
    eng = build_engine(Path(a.work or tmp.name), a)
    try:
        arms, run = make_arms(eng, a)
        print(f"machine: {machine_line()}")
        print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; layer {type(arms.layer).__name__} "
              f"{a.batch}x{a.seq_len} tokens, bf16; heap guard {'on' if eng.heap.open else 'off'}")
        ref = arms.plain_step()
        for k, fn in list(run.items())[1:]:
            ok, bad = same_bits(ref, fn())
            print(f"gradients bit-equal, {k} vs A: {ok}" + (f" (differ: {', '.join(bad)})" if bad else ""))
        report(time_pairs(arms, run, a.warmup, a.pairs))
        if a.profile:
            for k, fn in run.items():
                profile(k, fn)
        return 0
    finally:
        eng.close()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
