"""Resident weights: each block's pieces lie back to back in one buffer (huge-page aligned from
2 MiB), in the order its forward reads them, hold the checkpoint's values, and a checkpoint whose
shapes disagree with its config is refused by name."""
import pytest
import torch

from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.infer.weights import Piece, _reader, install_resident
from tierlm.storage.aligned import HUGE, HUGE_BUFFERS, round_up
from ..memory import held_now


def _pieces_of(eng):
    for b in eng.blocks:
        yield b, eng.pieces[b.index]


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_each_resident_block_is_one_buffer_in_read_order(make_model_dir, tmp_path, weights):
    # a layer of 2 MiB and more, so that its buffer is the huge-page aligned kind
    d, model = make_model_dir("llama", hidden_size=768, intermediate_size=2048, num_attention_heads=12,
                              num_key_value_heads=4)
    eng = InferenceEngine(d, InferConfig(cpu_mem="1GiB", weights=weights, nvme_dir=str(tmp_path / "nvme")))
    try:
        assert eng.stream is None
        sd = model.state_dict()
        layers = 0
        for b, pieces in _pieces_of(eng):
            ts = [p.installed() for p in pieces]
            base = ts[0].untyped_storage().data_ptr()
            assert all(t.untyped_storage().data_ptr() == base for t in ts), b.name
            off = ts[0].data_ptr()
            for p, t in zip(pieces, ts):
                assert t.data_ptr() == off and t.is_contiguous(), (b.name, p.key)
                off += round_up(p.nbytes)
            total = sum(round_up(p.nbytes) for p in pieces)
            if b.kind == "layer":
                layers += 1
                assert total >= HUGE
                if HUGE_BUFFERS:
                    assert ts[0].data_ptr() % HUGE == 0, b.name
                # q, k, v, o, gate, up, down: the fused kernel's order
                names = [p.key for p in pieces if "proj" in p.key]
                order = [n.split(".")[-2] for n in names]
                assert order.index("q_proj") < order.index("k_proj") < order.index("o_proj") < \
                    order.index("gate_proj") < order.index("down_proj")
            for p, t in zip(pieces, ts):  # plain parameters hold the checkpoint's values
                if p.spec is not None:
                    assert torch.equal(t, sd[p.key].to(t.dtype)), p.key
        assert layers == 3
    finally:
        eng.close()


def test_a_checkpoint_tensor_of_another_shape_is_refused_by_name():
    holder = torch.nn.Linear(4, 3, bias=False)
    piece = Piece("model.layers.0.mlp.up_proj.weight", [(holder, "weight")], 3 * 4 * 2,
                  _reader("model.layers.0.mlp.up_proj.weight", torch.bfloat16), spec=(torch.bfloat16, (3, 4)))
    with pytest.raises(ValueError, match=r"up_proj.weight.*\(3, 5\).*\(3, 4\).*config.json"):
        install_resident([piece], lambda name: torch.zeros(3, 5))
    ok = torch.arange(12, dtype=torch.float32).view(3, 4)
    install_resident([piece], lambda name: ok)
    assert torch.equal(holder._parameters["weight"], ok.to(torch.bfloat16))


@pytest.mark.parametrize("resident", [None, 0])
def test_what_transformers_keeps_in_fp32_stays_fp32_in_a_bf16_run(tmp_path, resident):
    """A mixture's router weights are in the family's `_keep_in_fp32_modules_strict`: transformers'
    bf16 load keeps them fp32 (its router computes in fp32 from them). tierlm held them in bf16,
    rounding a checkpoint's fp32 router, so routing could pick other experts than transformers'."""
    from transformers import AutoModelForCausalLM
    from tests.families import family_config
    from tierlm.infer.engine import InferConfig, InferenceEngine
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("deepseek_v3")).float()
    name = "model.layers.1.mlp.gate.weight"
    with torch.no_grad():
        model.get_parameter(name).add_(1e-4)        # values bf16 cannot hold
    model.save_pretrained(tmp_path / "m")
    want = model.get_parameter(name).detach()
    assert not torch.equal(want.bfloat16().float(), want)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    assert hf.get_parameter(name).dtype == torch.float32                # what transformers does
    eng = InferenceEngine(tmp_path / "m", InferConfig(cpu_mem="4GiB", dtype="bf16", max_batch=1, max_seq_len=16,
                                                      resident_layers=resident, nvme_dir=str(tmp_path / "nvme")),
                          library_rss=held_now())
    try:
        piece = next(p for p in eng.pieces[next(b.index for b in eng.blocks if b.name.endswith("1"))] if p.key == name)
        assert piece.spec == (torch.float32, tuple(want.shape))
        def held(n):  # the engine installs views of its buffers, not Parameters
            return getattr(eng.model.get_submodule(n.rpartition(".")[0]), "weight")
        logits = eng.step([[5, 9, 17, 3]], [0])[0]
        assert torch.isfinite(logits).all()
        if resident is None:
            assert held("model.layers.1.self_attn.o_proj.weight").dtype == torch.bfloat16
            assert torch.equal(held(name), want)
    finally:
        eng.close()
