"""Every supported architecture trains out-of-core and saves a directory transformers loads."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig
from tierlm.train.schedule import lr_factor

from .test_exactness import assert_same, batches, run_reference

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trains_exactly_and_saves_loadable_model(make_model_dir, tmp_path, arch, precision):
    model_dir, model = make_model_dir(arch)
    data = batches(3)
    kw = dict(lr=1e-2, wd=0.1, clip=0.5, accum=1, warmup=0, precision=precision)
    ref_model, ref_master, ref_losses, _ = run_reference(model, data, **kw)
    cfg = EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB", precision=precision,
                       optim=AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5),
                       tokens_per_micro_batch=data[0].numel())
    eng = Engine.from_pretrained(model_dir, cfg)
    try:
        losses = []
        sched = lr_factor("cosine", 0, len(data))
        for s, x in enumerate(data):
            eng.set_lr(1e-2 * sched(s))
            loss = eng.forward(x, labels=x).loss
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
        assert losses == ref_losses
        assert_same(ref_master, {n: eng.master(n) for n in eng.names})
        probe = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            ours = eng.forward(probe).logits
        out = eng.save_pretrained(tmp_path / "saved")
    finally:
        eng.close()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == (torch.float32 if precision == "fp32" else torch.bfloat16)
    with torch.no_grad():
        theirs = loaded(input_ids=probe).logits
        ref_logits = ref_model(input_ids=probe).logits
    assert torch.equal(ours, ref_logits)
    if precision == "fp32":
        assert torch.equal(theirs, ours)
    else:
        # transformers' bf16 load also casts the rotary buffers to bf16, so logits differ by rounding
        torch.testing.assert_close(theirs.float(), ours.float(), rtol=2e-2, atol=2e-2)


def test_layers_that_share_weights_are_refused_before_anything_is_written(tmp_path):
    """Zamba's hybrid layers all run one shared transformer block: a weight of layers.1 is run by
    layers.3 too, whose backward comes first. The engine updates a weight when its own layer's
    backward ends, so it would miss the other layer's share of the gradient: refused at
    construction with the layers named, and no store is created. (Layers that hand each other
    tensors with a gradient fine-tune exactly: tests/test_families.py.)"""
    from transformers import AutoConfig
    from tierlm.hf.structure import empty_model
    cfg = AutoConfig.for_model("zamba", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=4, vocab_size=128, attn_layer_period=2,
                               attn_layer_offset=1, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"])
    with pytest.raises(ValueError, match=r"zamba: its decoder layers share weights \(layers\.3 runs "
                                         r"model\.layers\.1\.shared_transf\."):
        Engine(empty_model(cfg), lambda name, out: None,
               EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB", precision="fp32"))
    assert not (tmp_path / "nvme").exists()


@pytest.mark.parametrize("family, fix", [("bert-generation", 'set "is_decoder": true'),
                                         ("cpmant", "tierlm fine-tunes causal language models")])
def test_a_model_whose_tokens_see_later_ones_is_refused_before_anything_is_written(family, fix, tmp_path):
    """BertGeneration's decoder attends both ways unless its config says is_decoder, and CPM-Ant's
    forward lets every token see the whole input (its context mask, all ones unless given): a
    next-token loss would train them to copy their input, silently (CPM-Ant was fine-tuned so,
    "bit-equal to torch"). A tiny copy's logits are probed (the last token changed, the ones before
    must not move) and the model refused, with the fix where there is one; BertGeneration with
    is_decoder (what `tierlm init --arch bert-generation` writes) is built."""
    from tierlm.hf.presets import make_config
    from tierlm.hf.structure import empty_model
    cfg = make_config(family)
    if family == "bert-generation":
        assert cfg.is_decoder
        cfg.is_decoder = False
    with pytest.raises(ValueError, match=rf"{family}: its tokens see later ones .*{fix}"):
        Engine(empty_model(cfg), lambda name, out: None,
               EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB", precision="fp32"))
    assert not (tmp_path / "nvme").exists()


def test_a_recurrent_depth_model_is_refused_before_anything_is_written(tmp_path):
    """Dory runs its middle layers n_recurrent_loops times a forward: the engine, which fetches a
    layer's weights for one forward and one backward a step, waited for a backward that never came
    (`tierlm finetune` hung). Its layers' calls are counted at construction (on a tiny real copy:
    its masks read a value, which meta tensors have not) and it is refused, no store created."""
    from tierlm.hf.presets import make_config
    from tierlm.hf.structure import empty_model
    cfg = make_config("dory")  # input layer, two recurrent ones looped twice, output layer
    with pytest.raises(ValueError, match=r"dory: its forward runs decoder layer 1 2 times"):
        Engine(empty_model(cfg), lambda name, out: None,
               EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB", precision="fp32"))
    assert not (tmp_path / "nvme").exists()


@pytest.mark.parametrize("family, early", [
    ("bloom", ["transformer.word_embeddings_layernorm"]), ("opt", ["model.decoder.project_in"]),
    ("modernbert-decoder", ["model.embeddings.norm"]), ("llama", [])])
def test_weights_used_before_the_layers_are_found_and_go_to_the_embedding_block(family, early):
    """BLOOM's embedding LayerNorm, OPT-350m's project_in and ModernBERT's embedding norm run before
    the first layer, so their backward comes after the last layer's: found by a tiny forward and
    put in the embedding's block, whose engine holds them through the step (fine-tuning them is
    bit-equal to torch: tests/test_families.py)."""
    from tierlm.hf.presets import make_config
    from tierlm.hf.structure import discover_blocks, empty_model, weights_before_layers
    over = dict(word_embed_proj_dim=32) if family == "opt" else {}
    cfg = make_config(family, None, dict(layers=2))
    for k, v in over.items():
        setattr(cfg, k, v)
    assert weights_before_layers(cfg) == early
    blocks, _ = discover_blocks(empty_model(cfg), early)
    embed, head = blocks[0], blocks[-1]
    for mod in early:
        assert any(n.startswith(mod + ".") for n in embed.owns) and not any(n.startswith(mod + ".") for n in head.uses)


def test_fixed_parameters_without_a_value_are_refused_before_anything_is_written(tmp_path):
    """Ernie 4.5 MoE's router holds its score-correction bias as a Parameter with
    requires_grad=False: it gets no gradient, so the engine keeps it as a buffer read from the
    checkpoint (Engine.from_pretrained; tests/engine/test_fixed_params.py). A model handed to the
    engine directly with that parameter still on `meta` has no value for it: refused at
    construction, the parameter named, no store created."""
    from transformers import AutoConfig
    from tierlm.hf.structure import empty_model
    cfg = AutoConfig.for_model("ernie4_5_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    fixed = r"keep model\.layers\.1\.mlp\.gate\.moe_statics\.e_score_correction_bias fixed .*from_pretrained"
    with pytest.raises(ValueError, match=fixed):
        Engine(empty_model(cfg), lambda name, out: None,
               EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB", precision="fp32"))
    assert not (tmp_path / "nvme").exists()
