"""Parameters that get a gradient in some micro-batches of a step and not in others.

A module whose use depends on the data (sparse-attention indexers that only some batches reach, a
branch a batch skips) leaves its parameters' `.grad` None in the micro-batches that skip it. torch
accumulates only the gradients that exist: the first one that arrives becomes `.grad`, later ones
add to it, and AdamW skips a parameter whose `.grad` is still None at the step. The engine must do
the same: a micro-batch after skipped ones starts from zero (not from an accumulator an earlier
step wrote), and a gradient accumulated early in the step is applied even when the last
micro-batch skips the parameter.
"""
import pytest
import torch
from transformers.models.llama import modeling_llama

from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig

from .test_exactness import assert_same, batches

ACCUM = 3
# per step, per micro-batch: does the MLP run (True) or is it skipped (False)?
PATTERN = [
    [True, True, True],     # accumulators written for every parameter
    [False, True, True],    # the MLPs' first gradient in the second micro-batch: none to read
    [True, True, False],    # accumulated, then the last micro-batch skips them: still applied
    [False, False, False],  # no gradient at all this step: AdamW leaves them (and their step count)
    [True, False, True],    # an accumulator carried across a skipping micro-batch
]
USE = {"mlp": True}


@pytest.fixture
def skippable_mlp(monkeypatch):
    """LlamaMLP's forward returns zeros, outside the graph of its weights, where USE says skip."""
    real = modeling_llama.LlamaMLP.forward

    def forward(self, x):
        return real(self, x) if USE["mlp"] else torch.zeros_like(x)
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", forward)
    yield
    USE["mlp"] = True


def _reference(model, data, *, lr, clip):
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=True)
    losses, norms = [], []
    for s, uses in enumerate(PATTERN):
        for m, use in enumerate(uses):
            USE["mlp"] = use
            x = data[s * ACCUM + m]
            loss = model(input_ids=x, labels=x).loss
            (loss / ACCUM).backward()
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        opt.zero_grad()
    steps = {n: int(opt.state[p]["step"]) if p in opt.state else 0 for n, p in model.named_parameters()}
    return {n: p.detach() for n, p in model.named_parameters()}, losses, norms, steps


def _engine(model_dir, tmp_path, data, *, lr, clip, **knobs):
    cfg = EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB", precision="fp32", grad_accum=ACCUM,
                       optim=AdamWConfig(lr=lr, weight_decay=0.1, max_grad_norm=clip),
                       tokens_per_micro_batch=data[0].numel(), **knobs)
    eng = Engine.from_pretrained(model_dir, cfg)
    losses, norms = [], []
    try:
        for s, uses in enumerate(PATTERN):
            for m, use in enumerate(uses):
                USE["mlp"] = use
                x = data[s * ACCUM + m]
                loss = eng.forward(x, labels=x).loss
                eng.backward(loss)
                losses.append(loss.item())
            norms.append(eng.step().grad_norm)
        masters = {n: eng.master(n) for n in eng.names}
        steps = dict(eng.optimizer.steps)
    finally:
        eng.close()
    return masters, losses, norms, steps


@pytest.mark.parametrize("knobs", [dict(clip_path="hold"), dict(clip_path="speculate"),
                                   dict(clip_path="auto", commit_every="3"), dict(state_cache=False)],
                         ids=["hold", "speculate", "commit-every-3", "state-on-disk"])
def test_gradients_missing_from_some_micro_batches_accumulate_as_torch_does(make_model_dir, tmp_path,
                                                                            skippable_mlp, knobs):
    model_dir, model = make_model_dir("llama")
    data = batches(len(PATTERN) * ACCUM)
    ref_master, ref_losses, ref_norms, ref_steps = _reference(model, data, lr=1e-2, clip=0.5)
    masters, losses, norms, steps = _engine(model_dir, tmp_path, data, lr=1e-2, clip=0.5, **knobs)
    assert losses == ref_losses
    assert norms == ref_norms
    assert_same(ref_master, masters)
    # the step with no MLP gradient counted for the others only (the MLPs' and the norms before
    # them), as torch's state does
    assert steps == ref_steps
    assert {n for n, k in steps.items() if k < len(PATTERN)} >= {n for n in masters if ".mlp." in n}
