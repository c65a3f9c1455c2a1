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
