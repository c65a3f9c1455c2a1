"""Data parallelism where a parameter gets a gradient on some ranks and not others (a module the
data skips): every rank still takes part in every reduction, and the owner updates it as one
process updates it on the whole batch; a parameter no rank had a gradient for is left alone, as
torch's AdamW leaves a parameter whose `.grad` is None (tests/engine/test_partial_grads.py is the
one-process case)."""
import pytest
import torch

from .test_data_parallel import rel
from .util import torchrun

ACCUM, BSZ, SEQ, CLIP, LR = 2, 4, 12, 0.5, 1e-3
# per step, per micro-batch: does each rank's half of the batch run the MLPs?
PATTERN = [
    [(True, True), (True, True)],
    [(True, False), (False, True)],    # used on one rank in each micro-batch
    [(False, False), (False, False)],  # no rank: the MLPs (and the norms before them) are left alone
    [(False, True), (False, False)],   # one rank once, then none: the sum still applies
]


def batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (BSZ, SEQ), generator=g) for _ in range(len(PATTERN) * ACCUM)]


def skipping(modeling):
    """LlamaMLP's forward returns zeros, outside its weights' graph, where the returned dict says."""
    use = {"mlp": True}
    real = modeling.LlamaMLP.forward
    modeling.LlamaMLP.forward = lambda self, x: real(self, x) if use["mlp"] else torch.zeros_like(x)
    return use


def _reference(model):
    """Plain PyTorch on the whole batch: each half's loss (weighted by its share of the tokens, as
    split_batch weighs it) with the MLPs on or off as that rank had them."""
    from transformers.models.llama import modeling_llama
    real = modeling_llama.LlamaMLP.forward
    use = skipping(modeling_llama)
    try:
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, fused=True)
        data, norms = batches(), []
        for s, micro in enumerate(PATTERN):
            for m, ranks in enumerate(micro):
                x = data[s * ACCUM + m]
                for half, on in zip(torch.tensor_split(x, 2), ranks):
                    use["mlp"] = on
                    (model(input_ids=half, labels=half).loss * (half.numel() / x.numel()) / ACCUM).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
            opt.step()
            opt.zero_grad()
        steps = {n: int(opt.state[p]["step"]) if p in opt.state else 0 for n, p in model.named_parameters()}
        return {n: p.detach() for n, p in model.named_parameters()}, norms, steps
    finally:
        modeling_llama.LlamaMLP.forward = real


@pytest.mark.parametrize("bucket", [0, 4096], ids=["per-parameter", "buckets"])
def test_a_gradient_some_ranks_lack_is_summed_and_none_leaves_it_alone(make_model_dir, tmp_path, bucket):
    model_dir, model = make_model_dir("llama")
    r = torchrun(2, "tests/dist/partial_worker.py", model_dir, tmp_path, bucket)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    ref_master, ref_norms, ref_steps = _reference(model)
    masters = {**ranks[0]["masters"], **ranks[1]["masters"]}
    steps = {**ranks[0]["steps"], **ranks[1]["steps"]}
    assert masters.keys() == ref_master.keys()
    assert steps == ref_steps  # the step no rank ran the MLPs in does not count for them
    assert any(k < len(PATTERN) for k in steps.values())
    # (the two halves' gradients add in another order than one backward adds them: rounding, which
    # Adam's division amplifies in an element here and there)
    worst = max(rel(masters[n], t) for n, t in ref_master.items())
    assert worst < 1e-6, f"relative difference {worst:.2e}"
    for got in (ranks[0]["norms"], ranks[1]["norms"]):
        assert got == pytest.approx(ref_norms, rel=1e-5)
