"""int8 per-channel and int4 group-wise weights: close to the full-precision model, the same
tokens resident or streamed, and a perplexity that costs little."""
import pytest
import torch

from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.infer.quality import perplexity
from tierlm.infer.quant import QLinear
from ..memory import held_now

# hidden 128: int4's groups (32..256 input elements) need widths they divide
WIDE = {"hidden_size": 128, "intermediate_size": 256, "initializer_range": 0.05}


def _engine(d, tmp_path, weights, **kw):
    kw.setdefault("cpu_mem", "1GiB")
    return InferenceEngine(d, InferConfig(dtype="fp32", weights=weights, max_seq_len=64,
                                          nvme_dir=str(tmp_path / f"nvme-{weights}"), **kw), library_rss=held_now())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("weights, tol", [("int8", 0.03), ("int4", 0.4)])
def test_quantised_logits_are_close_and_streaming_changes_nothing(arch, weights, tol, make_model_dir, tmp_path):
    over = dict(WIDE, n_embd=128) if arch == "gpt2" else dict(WIDE)
    if arch == "gpt2":
        over.pop("hidden_size"), over.pop("intermediate_size")
    d, model = make_model_dir(arch, **over)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with torch.no_grad():
        ref = model(ids).logits[0]
    eng = _engine(d, tmp_path, weights)
    try:
        q = [m for m in eng.model.modules() if isinstance(m, QLinear)]
        assert q and all(m.mode == weights for m in q)
        got = eng.logits_all(ids)[0]
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < tol, f"{arch} {weights}: relative logit error {rel:.4f}"
        resident_step = eng.step([ids[0].tolist()], [0])
    finally:
        eng.close()
    eng = _engine(d, tmp_path, weights, resident_layers=0)
    try:
        assert eng.stream is not None
        assert torch.equal(eng.step([ids[0].tolist()], [0]), resident_step)
    finally:
        eng.close()


def test_perplexity_of_formats_is_ordered_and_close(make_model_dir, tmp_path):
    d, model = make_model_dir("llama", **WIDE)
    # text the model "knows" (its own greedy continuation), so the perplexity is well below the vocab's
    with torch.no_grad():
        ids = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=120, do_sample=False,
                             pad_token_id=0)[0].tolist()
    ppl = {}
    for w in ("fp32", "int8", "int4"):
        eng = _engine(d, tmp_path, w)
        try:
            ppl[w] = perplexity(eng, ids, window=64)
        finally:
            eng.close()
    assert ppl["fp32"] < 128  # better than uniform over the vocabulary: the text is the model's own
    assert abs(ppl["int8"] / ppl["fp32"] - 1) < 0.01
    assert abs(ppl["int4"] / ppl["fp32"] - 1) < 0.10


@pytest.mark.parametrize("k", [24, 100, 128])
@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("ours", [True, False])
def test_int8_products_of_any_width_equal_the_dequantised_product(k, rows, ours, monkeypatch):
    """Widths PyTorch's int8 kernel reads past (24 crashed the process on a Zen 5 and gave inf at
    one row; 100 on AVX2) multiply right on every path: our kernels', and without them (ours False:
    no compiler) PyTorch's where the width allows, else the dequantised weights."""
    from tierlm.infer import native
    if not ours:
        monkeypatch.setattr(native, "available", lambda: False)
    torch.manual_seed(0)
    q = QLinear(k, 64, "int8")
    for name, t in q.quantize(torch.randn(64, k) * 0.05, None, torch.bfloat16).items():
        setattr(q, name, t)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    w = q.qweight.float() * q.scales.float()[:, None]
    ref = x.float() @ w.t()
    got = q(x).float()
    assert torch.isfinite(got).all()
    # bf16 output, and x rounded to 8 bits a group on the integer path
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.parametrize("ours", [True, False])
def test_int4_without_our_kernels_leaves_widths_torch_cannot_pack(ours, monkeypatch):
    """PyTorch's int4 packing (the layout without our kernels) refuses 24 outputs; such a map stays
    in the compute dtype there, and is held in int4 where our kernels build."""
    from torch import nn

    from tierlm.infer import native
    from tierlm.infer.quant import quantizable, replace_linears
    if not ours:
        monkeypatch.setattr(native, "available", lambda: False)
    elif not native.available():
        pytest.skip("our kernels do not build here")
    layer = nn.Module()
    layer.narrow, layer.wide = nn.Linear(64, 24, bias=False), nn.Linear(64, 32, bias=False)
    assert set(quantizable(layer, "int4")) == ({"narrow", "wide"} if ours else {"wide"})
    for name, (q, _, old) in replace_linears(layer, "int4", 32).items():
        for n, t in q.quantize(old.weight.detach(), None, torch.bfloat16).items():
            setattr(q, n, t)
        x = torch.randn(3, 64, dtype=torch.bfloat16)
        assert torch.isfinite(q(x)).all()


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.o_proj = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)


class _ReadsAWeight(torch.nn.Module):
    """A layer whose forward reads a descendant's weight, as Ergo's reads its attention output's dtype."""

    def __init__(self):
        super().__init__()
        self.self_attn, self.gate = _Attention(), torch.nn.Linear(64, 64)

    def forward(self, x):
        dtype = self.self_attn.o_proj.weight.dtype
        return self.gate.weight.sum() + x.to(dtype)


def test_maps_whose_weight_a_module_reads_stay_in_the_compute_dtype():
    """Their forward reads `.weight` (a QLinear has none): its own child's or a descendant's by path."""
    from tierlm.infer.quant import quantizable
    for mode in ("int8", "int4"):
        assert set(quantizable(_ReadsAWeight(), mode)) == {"self_attn.q_proj"}


class _OwnMaths(torch.nn.Linear):
    """A linear of its own maths (DeepSeek-V4's grouped output projection: its input split into
    groups of in_features, each multiplied by its block of the weight)."""

    def __init__(self):
        super().__init__(32, 64, bias=False)

    def forward(self, x):
        g = x.reshape(-1, 2, 32).transpose(0, 1)
        return torch.bmm(g, self.weight.view(2, -1, 32).transpose(1, 2)).transpose(0, 1).reshape(*x.shape[:-2], -1)


class _BiasApart(torch.nn.Linear):
    """x W^T, its bias added apart (Falcon's FalconLinear): what QLinear computes."""

    def forward(self, x):
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


def test_linear_subclasses_are_quantised_only_where_they_compute_a_linear_map():
    from tierlm.infer.quant import quantizable
    layer = torch.nn.Module()
    layer.o_a_proj, layer.dense, layer.plain = _OwnMaths(), _BiasApart(32, 64), torch.nn.Linear(32, 64)
    for device in ("cpu", "meta"):  # the engine plans on meta: nothing computed there
        assert set(quantizable(layer.to(device), "int8")) == {"dense", "plain"}
