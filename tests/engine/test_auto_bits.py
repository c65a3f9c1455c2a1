"""`--activations auto` chooses from timings (each layer's measured forward and backward, the drive's
rates), so what it chooses may differ between two runs of one command: that must never change bits.
Here the planner is made to choose another mix at every step, as a noisy machine could, and the
weights still equal plain PyTorch's bit for bit, in bf16 with gradient accumulation and clipping."""
import itertools

import torch

from tierlm.plan import activations as P
from tierlm.engine.activations import ActivationSwapper

from .test_exactness import batches, run_engine, run_reference

MIXES = ["keep", "recompute", "swap"]


def test_auto_choosing_another_mix_every_step_gives_the_reference_bits(make_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(ActivationSwapper, "min_bytes", 0)  # tiny tensors swap too
    monkeypatch.setattr(P, "SETTLE_TOLERANCE", -1.0)  # never settled: re-planned after every step
    monkeypatch.setattr(P, "MAX_PROFILED_STEPS", 10 ** 6)
    turn = itertools.count()
    chosen = []

    def choose(layers, allowance, pool, rates, base, can_swap=True):
        k = next(turn)
        pols = {p.index: MIXES[(k + i) % len(MIXES)] if can_swap else ("keep", "recompute")[(k + i) % 2]
                for i, p in enumerate(layers)}
        chosen.append(tuple(pols.values()))
        return P.Plan(pols, P.predict(layers, pols, rates, base), allowance, pool, "test: a new mix each step")

    monkeypatch.setattr(P, "choose", choose)
    model_dir, model = make_model_dir("llama")
    data = batches(10, seq=16)
    hp = dict(lr=1e-3, wd=0.01, clip=0.5, accum=2, warmup=1, precision="bf16")
    ref_model, ref_masters, ref_losses, _ = run_reference(model, data, **hp)
    masters, weights, losses, _ = run_engine(model_dir, tmp_path, data, activations="auto", **hp)
    assert len(set(chosen)) >= 3  # the plan really changed between steps
    assert losses == ref_losses
    for n, p in ref_model.named_parameters():
        assert torch.equal(masters[n], ref_masters[n]), n
        assert torch.equal(weights[n], p.detach()), n
