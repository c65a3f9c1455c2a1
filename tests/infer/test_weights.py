"""Resident weights: each block's pieces lie back to back in one buffer (huge-page aligned from
2 MiB), in the order its forward reads them, hold the checkpoint's values, and a checkpoint whose
shapes disagree with its config is refused by name."""
import pytest
import torch

from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.infer.weights import Piece, _reader, install_resident
from tierlm.storage.aligned import HUGE, HUGE_BUFFERS, round_up


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
