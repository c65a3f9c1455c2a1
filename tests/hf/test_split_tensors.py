"""Parameters cut from one fused checkpoint tensor (hf.split_tensors): Sarvam-MoE's q, k and v
from `query_key_value` (grouped-query sizes), LARA's four input projections from `in_proj`. Each
parameter reads its own rows of the file transformers' save wrote and gets what `from_pretrained`
gives it; the whole family round trip (init, fine-tune, save, reload) is tests/test_families.py's
(sarvam_moe) and tests/infer/test_states.py's (lara_mini)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.families import family_config
from tests.infer.test_states import state_config
from tierlm.hf.names import model_to_checkpoint
from tierlm.hf.safetensors_io import SafetensorsDir, SafetensorsWriter
from tierlm.hf.split_tensors import Part, part_of, parts
from tierlm.hf.stacked import file_tensors, file_writes, read_param


@pytest.mark.parametrize("cfg, fused, cut", [
    (lambda: family_config("sarvam_moe"), "model.layers.1.attention.query_key_value.weight",
     ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
      "model.layers.1.self_attn.v_proj.weight"]),
    (lambda: state_config("lara_mini"), "model.layers.0.linear_attn.in_proj.weight",
     [f"model.layers.0.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]),
])
def test_each_parameter_reads_its_rows_of_the_fused_tensor(cfg, fused, cut, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg()).float()
    model.save_pretrained(tmp_path)
    st = SafetensorsDir(tmp_path)
    assert fused in st.names() and not any(n in st.names() for n in cut)
    params = dict(model.named_parameters())
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(model.config)
    in_file = model_to_checkpoint(empty, st.names(), params)
    assert set(in_file) == set(params)                      # every parameter found
    sizes = [params[n].shape[0] for n in cut]
    assert len(set(sizes)) > 1 or len(cut) == 2             # unequal cuts (GQA): sized by the model
    start = 0
    for n, s in zip(cut, sizes):
        assert in_file[n] == Part(n, fused, 0, start, start + s, sum(sizes), tuple(cut)) == part_of(empty, n)
        start += s
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).float()
    for n, p in loaded.named_parameters():
        assert torch.equal(read_param(st, in_file[n]), p), n
        out = torch.empty(p.shape, dtype=torch.bfloat16)     # into a buffer of another dtype
        assert torch.equal(read_param(st, in_file[n], out), p.to(torch.bfloat16)), n

    # written back a parameter at a time: the fused tensor declared once, each part its rows
    files = {f: shape for n in params for f, shape in file_tensors(empty, n, params[n].shape, torch.float32).items()}
    assert files[fused] == tuple(st.info(fused)[1])
    w = SafetensorsWriter(tmp_path / "again", [(f, torch.float32, s) for f, s in files.items()])
    for n in reversed(list(params)):
        for f, t, row in file_writes(empty, n, params[n].detach()):
            w.write(f, t, row)
    w.close()
    again = SafetensorsDir(tmp_path / "again")
    assert set(again.names()) <= set(st.names())          # (the file also holds the router's buffers)
    assert torch.equal(again.read(fused), st.read(fused))


def test_a_fused_tensor_of_another_shape_is_refused_with_the_reason(tmp_path):
    model = AutoModelForCausalLM.from_config(family_config("sarvam_moe")).float()
    model.save_pretrained(tmp_path)
    wider = family_config("sarvam_moe", num_key_value_heads=4)   # the config of another model
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(wider)
    st = SafetensorsDir(tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    entry = model_to_checkpoint(empty, st.names(), [name])[name]
    with pytest.raises(ValueError, match="query_key_value.* has shape .*does config.json belong"):
        read_param(st, entry, torch.empty(empty.get_parameter(name).shape))


def test_a_cut_tierlm_cannot_make_a_slice_at_a_time_is_refused_by_name():
    from transformers.core_model_loading import Chunk, WeightConverter
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_config("sarvam_moe"))
    conv = WeightConverter(source_patterns="query_key_value", target_patterns=["q_proj", "k_proj"],
                           operations=[Chunk(dim=0, num_shards_attribute="num_key_value_heads")])
    with pytest.raises(ValueError, match="does not run a parameter at a time"):
        parts(model, "model.layers.0.attention.query_key_value.weight", "model.layers.0.self_attn.q_proj.weight", conv)
