"""The fused decoder layer (one C call a layer, kernels/layer.c) computes what transformers' forward
computes, and is the one that runs."""
import pytest
import torch

from tierlm.infer import native
from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.infer.fused import FusedLayer, FusedStack

from .test_lean import OVER, SPREAD, make_model
from .tolerances import fp32_sum_tol
from ..memory import held_now

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no kernels: {native.why_unavailable()}")


@pytest.fixture
def fused_calls(monkeypatch):
    """Each layer run on the fused kernel: a FusedLayer call, or each layer of a FusedStack call
    (every layer in one call where none is streamed)."""
    calls = []
    real, real_stack = FusedLayer.__call__, FusedStack.__call__

    def counting(self, *a, **kw):
        calls.append(self)
        return real(self, *a, **kw)

    def counting_stack(self, *a, **kw):
        calls.extend(self.layers)
        return real_stack(self, *a, **kw)
    monkeypatch.setattr(FusedLayer, "__call__", counting)
    monkeypatch.setattr(FusedStack, "__call__", counting_stack)
    return calls


def _engine(d, tmp_path, lean=True, fused=True, rows=2, **kw):
    cfg = InferConfig(cpu_mem="1GiB", nvme_dir=str(tmp_path / "nvme"), max_batch=rows, max_seq_len=32, lean=lean,
                      fused=fused, **kw)
    return InferenceEngine(d, cfg, library_rss=held_now())


PROMPTS = [[5, 9, 17, 3, 44, 8, 2], [100, 7]]


def _run(eng, rows=2, steps=8):
    """`rows` sequences of different lengths: a prefill each, then decode steps of all together on
    fixed tokens (engines that round differently see the same inputs); every step's logits."""
    prompts = PROMPTS[:rows]
    eng.step(prompts, [0] * rows)
    starts = [len(p) for p in prompts]
    out = []
    for t in range(steps):
        out.append(eng.step([[(13 * t + 1 + 16 * r) % 128] for r in range(rows)], starts))
        starts = [s + 1 for s in starts]
    eng.close()
    return torch.stack(out)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
@pytest.mark.parametrize("resident", [None, 1])
def test_fused_decode_equals_transformers_forward(arch, resident, tmp_path, fused_calls):
    """fp32 weights on the fused kernel against transformers' forward on the same engine: the
    rotary embedding, GQA grouping, per-row cache positions, sliding-window masks (mistral, and
    qwen2's and qwen3's sliding and full layers), per-head q/k norms (qwen3), gemma's (1 + w)
    norms, scaled embeddings and gelu, and streamed layers (resident=1)."""
    d = tmp_path / f"{arch}-model"
    model = make_model(arch, **SPREAD, **OVER[arch])
    model.save_pretrained(d)
    ref = _run(_engine(d, tmp_path, lean=False, dtype="fp32", resident_layers=resident))
    eng = _engine(d, tmp_path, dtype="fp32", resident_layers=resident)
    fused_calls.clear()  # (the lean path's self-check on a tiny copy, at build)
    got = _run(eng)
    layers = model.config.num_hidden_layers
    assert len(fused_calls) == 8 * layers  # every decode step, every layer, on the fused kernel
    # fp32 sums in another order than PyTorch's (tolerances.fp32_sum_tol) of the widest product's K
    # terms, whose magnitudes sum to ~sqrt(K) times their sum for these random weights, once a
    # layer: ~1e-4 of the logits' size (~3e-6 seen); a wrong rotation, head grouping, position or
    # mask errs by the logits' own size
    k = max(model.config.hidden_size, model.config.intermediate_size)
    assert (got - ref).abs().max() <= layers * fp32_sum_tol(k, torch.tensor(k ** 0.5)) * ref.abs().max()
    assert len(set(ref.argmax(-1).flatten().tolist())) > 2  # the steps differ: a real comparison


def _err(a, ref):
    return ((a - ref).abs().max() / ref.abs().max()).item()


def _bf16_model(arch, d):
    """A bf16 model whose widths are multiples of 64 (int4 groups of 64 round x to 8 bits a group),
    with biases where the architecture has them (qwen2's q, k, v) set to something to get wrong."""
    model = make_model(arch, intermediate_size=128, **SPREAD, **OVER[arch])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    model.to(torch.bfloat16).save_pretrained(d)
    return model.config


FORMATS = (("int8", "fp32"), ("int4", "fp32"), ("bf16", "bf16"))


def _weights(prods, signed=False):
    """(|W|, |W'|) of a lean Products' modules side by side [N, K] in float64: W' is the part
    multiplied by the kernel's rounded x (int4: scale * q; its lo multiplies the sum of x itself).
    signed: W itself."""
    from tierlm.infer.quant import QLinear, dequant_int4
    full, rounded = [], []
    for m in prods.mods:
        if isinstance(m, QLinear) and m.mode == "int8":
            w = m.qweight.float() * m.scales.float()[:, None]
            full.append(w)
            rounded.append(w)
        elif isinstance(m, QLinear):
            sl = m.scales.float()
            full.append(dequant_int4(m.qweight, sl, m.group))
            rounded.append(dequant_int4(m.qweight, torch.stack([sl[..., 0], torch.zeros_like(sl[..., 0])], -1),
                                        m.group))
        else:
            full.append(m.weight.float())
            rounded.append(full[-1])
    w = torch.cat(full).double()
    return w if signed else (w.abs(), torch.cat(rounded).double().abs())


def _layer_tolerance(seen, prods, att_fused=None, act_fn=torch.nn.functional.silu):
    """How far the fused layer's output may be from the per-product layer's, from the formats.
    The two run the same product loops on inputs that differ by fp32 rounding (attention and silu in
    C against torch's). Where a product rounds its x (tolerances.x_step), an input within those ulp
    of a rounding boundary lands one step away in one of the two: the output moves by that step
    times the input's effect on it, which is computed here in float64 from the per-product layer's
    own values (o and down are linear: the largest |W'| times the step; a step of one of gate/up's
    inputs, each in turn, through act(g) * u and down). FLIPS such moves are allowed: an input
    flips with the chance of a few ulp against a step (2^-24 * 127 for 8 bits), so two in a layer
    are already rare. Beside them, fp32 sums in another order (tolerances.fp32_sum_tol). With a
    bf16 cache the per-product attention runs in bf16 (q and output rounded to bf16) where the
    fused one runs in fp32: `att_fused`, the fp32 attention of the same q and cache (as the fused
    layer takes it), against the per-product one, carried through o, the residual, the norm and the
    MLP in float64; twice that, as torch's fp32 attention stands in for the C one (their bf16
    roundings of x can differ by a step too)."""
    from tierlm.infer import native
    from .tolerances import FLIPS, fp32_sum_tol, x_step
    qkv, o, gu, down = prods
    isa, light = native.isa(), native.light_x()
    kind = qkv.kind if qkv.kind in ("int8", "int4", "bf16") else "fp32"
    (wo, wo_r), (wgu, _), (wd, wd_r) = _weights(o), _weights(gu), _weights(down)
    att, xmid, act = seen["o"][0].double(), seen["gu"][0].double(), seen["down"][0].double()
    ln2 = seen["gu"][2]
    wgu_s, wd_s = _weights(gu, signed=True), _weights(down, signed=True)
    inter = wgu_s.shape[0] // 2

    def mlp(xn):  # float64, xn [..., H] already normalised
        gu_ = xn @ wgu_s.T
        return act_fn(gu_[..., :inter]) * gu_[..., inter:] @ wd_s.T

    xn = xmid * torch.rsqrt(xmid.pow(2).mean(-1, keepdim=True) + ln2.eps) * ln2.scale().double()
    def step(x, prods):  # each stage's int4 group its own
        return x_step(kind, x.float(), getattr(prods.mods[0], "group", 0), light, isa)
    s_gu = step(xn, gu)
    through_gu = 0.0
    if s_gu:  # each input of each row moved by a step, all at once as a batch
        h = xn.shape[1]
        moved = xn[:, None, :] + s_gu * torch.eye(h, dtype=torch.float64)
        through_gu = (mlp(moved) - mlp(xn)[:, None, :]).abs().max().item()
    flips = wo_r.max().item() * step(att, o) + through_gu + wd_r.max().item() * step(act, down)
    sums = sum(fp32_sum_tol(w.shape[1], w.sum(1).max() * x.abs().max()).item()
               for w, x in ((wo, att), (wgu, xn), (wd, act)))
    attention = 0.0
    if att_fused is not None:
        wo_s = _weights(o, signed=True)
        x0 = xmid - att @ wo_s.T

        def tail(a):
            xm = x0 + a @ wo_s.T
            return xm + mlp(xm * torch.rsqrt(xm.pow(2).mean(-1, keepdim=True) + ln2.eps) * ln2.scale().double())
        attention = (tail(att_fused.double()) - tail(att)).abs().max().item()
    return FLIPS * flips + sums + 2 * attention


# qwen2: q/k/v biases, a sliding and a full layer; qwen3: q/k norms; gemma: (1 + w) norms, gelu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma"])
@pytest.mark.parametrize("weights,dtype", FORMATS)
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_layer_equals_the_per_product_layer(arch, weights, dtype, rows, tmp_path):
    """Each layer from the same x and cache: the fused call against lean's per-product layer (the
    same product loops; torch ops for norms, rotary, SDPA, the activation): outputs and the keys and values
    written. Rows at different positions (3 rows: one padded slot position apart)."""
    from tierlm.infer import lean
    from tierlm.infer.fused import StepArgs
    _bf16_model(arch, tmp_path / "m")
    eng = _engine(tmp_path / "m", tmp_path, weights=weights, dtype=dtype, rows=rows)
    try:
        c, lv = eng.cache, eng.lean
        g = torch.Generator().manual_seed(1)
        for t in c.k + c.v:
            t.copy_(torch.randn(t.shape, generator=g))
        starts = [5, 9, 2][:rows]
        pos, mask = c.begin_step(starts, [1] * rows, eng._window, eng._sliding)
        x0 = torch.randn(rows, eng.config.hidden_size, generator=g)
        cos, sin = lv.rotary(x0[:, None], pos)
        half = sin.shape[-1] // 2
        folded = torch.cat((-sin[..., :half], sin[..., half:]), -1)
        args = StepArgs(cos, sin, mask, c, {})
        for i, (layer, qkv, o, gu, down, sliding) in enumerate(lv.layers):
            k0, v0 = c.k[i].clone(), c.v[i].clone()
            m = mask if not isinstance(mask, dict) else mask["sliding_attention" if sliding else "full_attention"]
            seen = {}

            def tap(name, f):
                def call(x, norm=None):
                    y = f(x, norm=norm)
                    seen[name] = (x, y, norm)
                    return y
                return call
            want = lean._layer(layer, i, x0.clone(), cos, folded, half, m, c, tap("qkv", qkv), tap("o", o),
                               tap("gu", gu), tap("down", down))
            want_k, want_v = c.k[i].clone(), c.v[i].clone()
            att_fused = None
            if dtype == "bf16":  # the attention as the fused layer computes it: fp32 on the bf16 cache
                hd, kvh, y = layer.self_attn.head_dim, c.k[i].shape[1], seen["qkv"][1]
                qk = y[:, :y.shape[1] - kvh * hd].view(rows, -1, hd)
                qn, kn = lv.norms[i][2:]
                if qn is not None:
                    qk = torch.cat((qn(qk[:, :-kvh]), kn(qk[:, -kvh:])), 1)
                q = (qk * cos + torch.roll(qk, half, -1) * folded)[:, :-kvh].reshape(rows, kvh, -1, hd)
                att_fused = torch.nn.functional.scaled_dot_product_attention(
                    q, *(t[:rows, :, :m.shape[-1]].float() for t in (want_k, want_v)), attn_mask=m,
                    scale=layer.self_attn.scaling).reshape(rows, -1)
                if rows == 1 and native.light_x() and native.isa() in ("avx512bf16", "amx"):
                    att_fused = att_fused.bfloat16().float()  # o's one row of x, rounded to bf16
            c.k[i].copy_(k0)
            c.v[i].copy_(v0)
            if not lv.fused[i].ready(rows):
                assert weights == "bf16" and rows > 1  # bf16 matrix products fast here: PyTorch's
                pytest.skip("bf16 rows beyond one stay on PyTorch's products on this CPU")
            got = x0.clone()
            lv.fused[i](got, args, sliding, c.k[i], c.v[i])
            # _layer_tolerance: rounding steps of x, fp32 sums, bf16 attention; a wrong rotation,
            # mask or bias errs by about the output's own size
            tol = _layer_tolerance(seen, (qkv, o, gu, down), att_fused, layer.mlp.act_fn)
            err = (got - want).abs().max().item()
            assert err <= tol, (i, err, tol)
            assert tol < 0.1 * want.abs().max().item(), (i, tol)  # and the bound can catch those
            if lv.norms[i][2] is None:
                torch.testing.assert_close(c.k[i], want_k, rtol=0, atol=0)
            else:  # the per-head norm's sum in C's order against torch's: keys a few ulp apart
                ulp = 2.0 ** (-7 if c.k[i].dtype == torch.bfloat16 else -21)
                torch.testing.assert_close(c.k[i], want_k, rtol=ulp, atol=ulp * want_k.abs().max().item())
            torch.testing.assert_close(c.v[i], want_v, rtol=0, atol=0)
            assert not torch.equal(want_k, k0)  # the new keys were written
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma"])
def test_fused_decode_on_quantised_weights_runs_every_layer(arch, tmp_path, fused_calls):
    """Through the engine: every decode step's layers go to the fused kernel for int8, int4 and
    bf16 weights, one row and two. int8 in an fp32 engine agrees with the per-product path to fp32
    rounding (x rounded to 16 bits at one row); int4's 8-bit x and these wide random weights
    amplify last-bit differences across 8 steps (chaotic here: int4 errs by ~0.85 of the logits'
    size against fp32), so it must only be as close to the fp32 forward as the per-product path;
    bf16 differs by the bf16 attention of the per-product path, and from the fp32 forward by no
    more than transformers' own bf16 forward does (one row's x rounded to bf16, as it rounds its
    activations; ~0.15 of the logits' size here for llama, and for both)."""
    config = _bf16_model(arch, tmp_path / "m")
    d = tmp_path / "m"
    for rows in (1, 2):
        ref = _run(_engine(d, tmp_path, lean=False, dtype="fp32", rows=rows), rows)
        for weights, dtype in FORMATS:
            eng = _engine(d, tmp_path, weights=weights, dtype=dtype, rows=rows)
            fused_calls.clear()  # (the lean path's self-check on a tiny copy, at build)
            fused = _run(eng, rows)
            if weights == "bf16" and rows > 1 and not fused_calls:
                continue  # bf16 matrix products are fast on this CPU: two rows stay on PyTorch's
            assert len(fused_calls) == 8 * config.num_hidden_layers, (weights, rows)
            per_product = _run(_engine(d, tmp_path, fused=False, weights=weights, dtype=dtype, rows=rows), rows)
            apart, e_fused, e_per = _err(fused, per_product), _err(fused, ref), _err(per_product, ref)
            if weights == "int8" and not (rows == 1 and native.light_x() and config.intermediate_size % 128 == 0):
                # x in fp32, or one row's to 16 bits: a step of one input is 2^-15 of the row's
                # largest, and a few over 8 steps stay far below 1e-3
                assert apart < 1e-3, (rows, apart)
            elif weights in ("int8", "int4"):  # 8 bits a group somewhere (int8: down's one row, light x)
                assert e_fused < e_per * 1.15, (rows, e_fused, e_per)
            else:
                hf = _run(_engine(d, tmp_path, lean=False, weights=weights, dtype=dtype, rows=rows), rows)
                assert apart < 0.05 and e_fused < max(0.1, 1.15 * _err(hf, ref)), (rows, apart, e_fused, _err(hf, ref))


@pytest.mark.parametrize("weights,dtype", FORMATS + (("fp32", "fp32"),))
def test_rows_taken_from_another_thread_give_the_same_results(weights, dtype, tmp_path):
    """A fused layer's thread that finishes its share of a product takes the back half of another's
    (layer.c, share): whoever computes a row, the results are the same bit for bit. Thread 0 held
    back before each product (set_steal(2)) makes the other take its rows."""
    from tests.conftest import tiny_model
    model = tiny_model("llama", hidden_size=256, intermediate_size=2048, num_attention_heads=4,
                       num_key_value_heads=2, num_hidden_layers=2)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "m")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = {}
        for mode in (0, 1, 2):
            native.set_steal(mode)
            native.steals()
            out[mode] = _run(_engine(tmp_path / "m", tmp_path, weights=weights, dtype=dtype, rows=1), rows=1)
            out[f"steals{mode}"] = native.steals()
    finally:
        native.set_steal(1)
        torch.set_num_threads(threads)
    assert out["steals0"] == 0 and out["steals2"] > 0, out
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])
    assert len(set(out[0].argmax(-1).flatten().tolist())) > 2
