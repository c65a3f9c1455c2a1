"""Parameters a family's modules keep fixed (`requires_grad=False`: the routers' score-correction
biases of Ernie 4.5 MoE, Laguna and AFMoE) stay as the checkpoint has them through fine-tuning and
its save, while they steer which experts each token reaches: the steps equal torch's AdamW, which
gives them no gradient. tests/test_families.py runs these families through every verb at their
initial (zero) bias; here it is random, so a bias lost or trained would change the routing."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.test_exactness import assert_same, batches, run_reference
from tests.families import family_config
from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig
from tierlm.train.schedule import lr_factor


@pytest.mark.parametrize("family", ["ernie4_5_moe", "laguna", "afmoe"])
def test_a_fixed_router_bias_steers_and_stays(family, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family, initializer_range=0.3)).float().eval()
    fixed = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert fixed and all("bias" in n for n in fixed)
    with torch.no_grad():
        for n in fixed:
            dict(model.named_parameters())[n].copy_(torch.randn_like(dict(model.named_parameters())[n]) * 3)
    model.save_pretrained(tmp_path / "m")
    data = batches(4, vocab=model.config.vocab_size)
    _, ref, ref_losses, _ = run_reference(model, data, lr=1e-2, wd=0.1, clip=0.5, accum=2, warmup=0,
                                          precision="fp32")
    cfg = EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB", precision="fp32", grad_accum=2,
                       optim=AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5),
                       tokens_per_micro_batch=data[0].numel())
    eng = Engine.from_pretrained(tmp_path / "m", cfg)
    losses = []
    try:
        assert not set(fixed) & set(eng.names)  # no optimizer state, no gradient awaited
        sched = lr_factor("cosine", 0, 2)  # the reference's schedule
        for s in range(2):
            eng.set_lr(1e-2 * sched(s))
            for x in data[2 * s:2 * s + 2]:
                loss = eng.forward(x, labels=x).loss
                eng.backward(loss)
                losses.append(loss.item())
            eng.step()
        masters = {n: eng.master(n) for n in eng.names}
        out = eng.save_pretrained(tmp_path / "saved")
    finally:
        eng.close()
    assert losses == ref_losses
    assert_same({n: t for n, t in ref.items() if n not in fixed}, masters)
    saved = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    for n in fixed:
        assert torch.equal(saved[n], dict(model.named_parameters())[n])
