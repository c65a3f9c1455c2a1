"""What a family keeps in fp32 in a bf16 model (`_keep_in_fp32_modules_strict`: a mixture's router
weights, whose modules compute in fp32) is trained in fp32 in a bf16 run: its working weights are
fp32, the rest bf16, bit for bit as a mixed-precision loop over the model transformers' bf16 load
makes, and a bf16 export saves them in fp32 as transformers' save of that model does."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from tierlm.hf.init import init_model
from tierlm.hf.safetensors_io import SafetensorsDir

from ..families import family_config
from .test_exactness import assert_same, batches, run_engine, run_reference

VOCAB = 300  # the byte tokenizer init_model writes needs 259


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_bf16_run_trains_the_kept_fp32_weights_in_fp32(family, tmp_path):
    d = init_model(tmp_path / "model", family_config(family, vocab_size=VOCAB), seed=1)
    bf16 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    kept = {n for n, p in bf16.named_parameters() if p.dtype == torch.float32 and p.requires_grad}
    assert kept and all(n.endswith("mlp.gate.weight") for n in kept)  # the routers

    model = AutoModelForCausalLM.from_pretrained(d).float()
    data = batches(4, vocab=VOCAB)
    kw = dict(lr=5e-3, wd=0.1, clip=0.5, accum=2, warmup=1, precision="bf16")
    ref_model, ref_master, ref_losses, _ = run_reference(model, data, keep_fp32=kept, **kw)
    masters, weights, losses, _ = run_engine(d, tmp_path, data, **kw)
    assert losses == ref_losses
    assert_same(ref_master, masters)
    ref_weights = {n: p.detach() for n, p in ref_model.named_parameters() if n in masters}
    assert {n for n, w in weights.items() if w.dtype == torch.float32} == kept
    assert_same(ref_weights, weights)
    for n in kept:  # the working weights are the master itself
        assert torch.equal(weights[n], masters[n])


def test_bf16_export_saves_the_kept_weights_in_fp32(tmp_path):
    from tierlm.engine.engine import Engine, EngineConfig

    d = init_model(tmp_path / "model", family_config("deepseek_v3", vocab_size=VOCAB), seed=1)
    eng = Engine.from_pretrained(d, EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB", precision="bf16",
                                                 tokens_per_micro_batch=16))
    try:
        out = eng.save_pretrained(tmp_path / "saved", dtype=torch.bfloat16)
    finally:
        eng.close()
    AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).save_pretrained(tmp_path / "hf")
    ours, theirs = SafetensorsDir(out), SafetensorsDir(tmp_path / "hf")
    dtypes = lambda s: {n: s.info(n)[0] for n in s.names()}  # noqa: E731
    assert dtypes(ours) == dtypes(theirs)
    assert {n for n, t in dtypes(ours).items() if t == torch.float32} >= {"model.layers.1.mlp.gate.weight"}


def test_a_state_whose_routers_were_bf16_is_refused_by_name(tmp_path):
    """A state committed before the routers' working weights were fp32 holds them in bf16 files:
    resuming names the difference instead of failing on a file's size."""
    import json

    from tierlm.engine.engine import Engine, EngineConfig
    from tierlm.storage.commit import list_manifests

    d = init_model(tmp_path / "model", family_config("deepseek_v3", vocab_size=VOCAB), seed=1)
    cfg = EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB", precision="bf16", tokens_per_micro_batch=16)
    Engine.from_pretrained(d, cfg).close()
    manifest = list_manifests(tmp_path / "nvme")[0]
    content = json.loads(manifest.read_text())
    assert content["fingerprint"]["fp32_weights"] == ["model.layers.1.mlp.gate.weight"]
    del content["fingerprint"]["fp32_weights"]
    manifest.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"kept in fp32: 0 there .* 1 here"):
        Engine.from_pretrained(d, cfg, resume=True)
