"""hf.structure.find_layers: the decoder layers' list, by transformers' layer class and count."""
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from tierlm.hf.structure import find_layers

from ..families import FAMILIES, family_config


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_longcat_flash_layers_are_its_decoder_layers_not_its_attention_sublayers(layers):
    """LongCat-Flash's num_hidden_layers is twice its decoder layers (two attention sublayers each,
    in a list of 2 inside every layer): with one decoder layer that inner list has exactly the count."""
    cfg = family_config("longcat_flash", num_layers=layers)
    assert cfg.num_hidden_layers == 2 * layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    name, mod = find_layers(model)
    assert name == "model.layers" and len(mod) == layers
    assert type(mod[0]).__name__ == "LongcatFlashDecoderLayer"


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt2", "opt"])
def test_a_familys_layers_are_the_base_models_list(family):
    assert family in FAMILIES
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_config(family))
    name, mod = find_layers(model)
    assert len(mod) == model.config.num_hidden_layers
    assert model.get_submodule(name) is mod
    assert all(isinstance(x, GradientCheckpointingLayer) for x in mod)  # transformers' decoder layers


@pytest.mark.parametrize("device", [None, "meta"])
def test_cast_keeps_what_transformers_keeps_fp32_and_tied_weights_tied(device):
    """hf.structure.cast, what the library baseline and the meta forwards cast with: the routers
    and correction biases the family keeps in fp32 in a bf16 model stay fp32 (Inkling 2's forward
    multiplies fp32 by its router; a plain .to(bf16) failed it), everything else is bf16, and a
    head tied to the embedding stays the embedding's tensor."""
    from tierlm.hf.structure import cast
    torch.manual_seed(0)
    m = cast(AutoModelForCausalLM.from_config(family_config("deepseek_v3")), torch.bfloat16, device)
    mlp = m.model.layers[1].mlp
    assert mlp.gate.weight.dtype == torch.float32 and mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert m.model.layers[1].self_attn.o_proj.weight.dtype == torch.bfloat16
    assert {p.device.type for p in m.parameters()} == {device or "cpu"}
    tied = cast(AutoModelForCausalLM.from_config(family_config("qwen2")), torch.bfloat16, device)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.lm_head.weight.dtype == torch.bfloat16
