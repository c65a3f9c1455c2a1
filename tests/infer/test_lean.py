"""The lean decode path computes what transformers' forward computes, and is the one that runs.
These tests run its per-product calls (fused=False); test_fused.py runs its fused layers."""
import pytest
import torch

from tierlm.infer.engine import InferConfig, InferenceEngine
from ..memory import held_now

SPREAD = {"initializer_range": 0.3}
# sliding windows shorter than the sequences, so the per-layer masks matter
OVER = {
    "llama": {},
    "mistral": {"sliding_window": 4},
    "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    "qwen3": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},  # + per-head q/k norms
    "gemma": {},  # (1 + w) norms, embeddings scaled by sqrt(hidden), tanh-approximated gelu
}
ARCHS = list(OVER)
# families whose tiny configs are tests/families.py's (conftest's TINY has the first three)
FAMILY_ARCHS = ("qwen3", "gemma")


def make_model(arch: str, seed: int = 0, **over):
    """A tiny fp32 model of `arch`. The new families' norm weights are drawn away from their
    initial ones and zeros, where weight and 1 + weight (Gemma's) would be told apart only by a
    constant."""
    if arch not in FAMILY_ARCHS:
        from tests.conftest import tiny_model
        return tiny_model(arch, seed, **over)
    from transformers import AutoModelForCausalLM

    from tests.families import family_config
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(arch, **over)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _engine(d, tmp_path, lean, **kw):
    cfg = InferConfig(dtype="fp32", cpu_mem="1GiB", nvme_dir=str(tmp_path / "nvme"), max_batch=2,
                      max_seq_len=32, lean=lean, fused=False, **kw)
    return InferenceEngine(d, cfg, library_rss=held_now())


def _run(eng):
    """Two rows of different lengths: a prefill each, then decode steps of both together on fixed
    tokens (so engines that round differently see the same inputs); the logits of every step."""
    prompts = [[5, 9, 17, 3, 44, 8, 2], [100, 7]]
    eng.step(prompts, [0, 0])
    starts = [len(p) for p in prompts]
    out = []
    for t in range(8):
        out.append(eng.step([[(13 * t + 1) % 128], [(29 * t + 5) % 128]], starts))
        starts = [s + 1 for s in starts]
    return torch.stack(out)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("resident", [None, 1])
def test_lean_decode_equals_transformers_forward(arch, resident, tmp_path):
    d = tmp_path / f"{arch}-model"
    make_model(arch, **SPREAD, **OVER[arch]).save_pretrained(d)
    ref_eng = _engine(d, tmp_path, False, resident_layers=resident)
    lean_eng = _engine(d, tmp_path, True, resident_layers=resident)
    try:
        assert ref_eng.lean is None and lean_eng.lean is not None
        if resident == 1:
            assert lean_eng.lean.streamed  # the streamed layers go through the lean path too
        calls = []
        lean_eng.base.register_forward_hook(lambda *a: calls.append(1))
        ref, got = _run(ref_eng), _run(lean_eng)
    finally:
        ref_eng.close()
        lean_eng.close()
    assert len(calls) == 1  # the prefill only: every decode step ran on the lean path
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert len(set(ref.argmax(-1).flatten().tolist())) > 2  # the steps differ: a real comparison


def test_gpt2_keeps_transformers_forward(make_model_dir, tmp_path):
    d, _ = make_model_dir("gpt2")
    eng = _engine(d, tmp_path, True)
    try:
        assert eng.lean is None
    finally:
        eng.close()


def _err(a, ref):
    return ((a - ref).abs().max() / ref.abs().max()).item()


def _mean_err(a, ref):
    """Each step's and row's error against its logits' size, averaged: the largest of 16 (_err)
    is one draw of the rounding, which of two paths errs more there goes either way (gemma: the
    lean path's largest was 1.07-1.36 times transformers' over 4 seeds, its mean 0.87-1.16)."""
    return ((a - ref).abs().amax(-1) / ref.abs().amax(-1)).mean().item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma"])  # qwen2: biases on q, k, v
def test_lean_on_our_kernels_is_as_close_to_fp32_as_transformers_forward(arch, tmp_path):
    """bf16 and int8 weights run on our kernels with fp32 activations. Against the fp32 forward of
    the same (bf16-exact) weights, the lean path's logits must be about as close as those of
    transformers' forward on the same engine, which rounds activations to bf16. "About": the lean
    path keeps bf16 keys and values, and where the CPU has AVX512-BF16, transformers' bf16 products
    (oneDNN) lose less than on AVX2, so which of the two errs less depends on the weights (on a
    Zen 4 EPYC, llama 0.049 against transformers' 0.043, qwen2 0.020 against 0.028): compared on
    the mean of the steps' errors (_mean_err), the largest bounded on its own."""
    from tierlm.infer import native
    if not native.available():
        pytest.skip(f"no kernels: {native.why_unavailable()}")
    d = tmp_path / "bf16-model"
    model = make_model(arch, **SPREAD, **OVER[arch])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # initialised to zero: give them something to get wrong
                p.normal_(0, 0.3)
    model.to(torch.bfloat16).save_pretrained(d)
    ref = _logits(d, tmp_path, True, dtype="fp32")
    for weights in ("bf16", "int8"):
        hf = _logits(d, tmp_path, False, weights=weights)
        lean = _logits(d, tmp_path, True, weights=weights, kind="int8" if weights == "int8" else "bf16")
        assert _mean_err(lean, ref) <= _mean_err(hf, ref) * 1.25, weights
        # a wrong layer (rotary, head grouping, bias) errs by the logits' own size; bf16 keys and
        # values in the cache (~5% here, with this test's wide weights) and int8 weights (~7%) less
        assert _err(lean, ref) < (0.1 if weights == "bf16" else 0.2), weights
    # int4's own rounding is coarse at these widths (~0.7 of the logits' size here, for both paths):
    # the lean path must compute what transformers' forward computes on the same int4 weights, up to
    # that forward's bf16 activations, which the kernel then rounds to 8 bits a group (0.14-0.21
    # apart here; the lean path without its folded norm is 1.4-1.8 apart, checked)
    hf = _logits(d, tmp_path, False, weights="int4")
    lean = _logits(d, tmp_path, True, weights="int4", kind="int4")
    assert _err(lean, hf) < 0.4
    assert _mean_err(lean, ref) < _mean_err(hf, ref) * 1.15


def _logits(d, tmp_path, lean, dtype="bf16", weights="auto", kind=None):
    cfg = InferConfig(dtype=dtype, weights=weights, cpu_mem="1GiB", nvme_dir=str(tmp_path / "nvme"),
                      max_batch=2, max_seq_len=32, lean=lean, fused=False)
    eng = InferenceEngine(d, cfg, library_rss=held_now())
    try:
        if kind:
            assert {p.kind for layer in eng.lean.layers for p in layer[1:5]} == {kind}
        return _run(eng)
    finally:
        eng.close()


def test_many_rows_take_the_modules_path_and_agree(tmp_path):
    """Past the rows our kernels serve (int8: 32), the lean step calls each module's own forward
    (PyTorch's kernel): the logits still match transformers' forward on the same engine."""
    from tests.conftest import tiny_model
    d = tmp_path / "bf16-model"
    tiny_model("llama", **SPREAD).to(torch.bfloat16).save_pretrained(d)
    rows = 34
    out = {}
    for lean in (False, True):
        cfg = InferConfig(weights="int8", cpu_mem="1GiB", nvme_dir=str(tmp_path / "nvme"), max_batch=rows,
                          max_seq_len=16, lean=lean, fused=False)
        eng = InferenceEngine(d, cfg, library_rss=held_now())
        try:
            eng.step([[3 + r % 50, 7] for r in range(rows)], [0] * rows)
            out[lean] = eng.step([[(5 * r) % 128] for r in range(rows)], [2] * rows)
        finally:
            eng.close()
    torch.testing.assert_close(out[True], out[False], rtol=0.05, atol=0.05 * out[False].abs().max().item())


NATIVE_FAMILIES = {"llama", "mistral", "qwen2", "qwen3", "gemma", "ministral", "seed_oss", "internlm3", "iquestcoder", "cwm"}


def test_each_family_runs_lean_or_says_why_not():
    """Every family of tests/families.py: the llama-like ones whose maths the lean step computes
    pass, the rest are refused with a reason, whether their modules show it (gemma2's norms after
    blocks, phi3's fused projections, olmo's LayerNorms) or only their numbers do (granite's
    multipliers live in the layer's and model's forward: the self-check on a tiny copy)."""
    from transformers import AutoModelForCausalLM

    from tests.families import FAMILIES, family_config
    from tierlm.infer import lean
    for family in FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config(family)).eval()
        why = lean.model_refusal(model)
        if family in NATIVE_FAMILIES:
            assert why is None, (family, why)
        else:
            assert isinstance(why, str) and why, family
    granite = AutoModelForCausalLM.from_config(family_config("granite"))
    assert lean.structure_refusal(granite) is None  # a llama by its modules ...
    assert "differ" in lean.model_refusal(granite)  # ... but not by its numbers


def test_the_self_check_catches_maths_the_modules_do_not_show(monkeypatch):
    """A norm taken for the other formula (weight for Gemma's 1 + weight) still looks right by the
    modules; the self-check's logits refuse it."""
    from transformers import AutoModelForCausalLM

    from tests.families import family_config
    from tierlm.infer import fused, lean
    real = lean.norm_of

    def swapped(mod, n):
        got = real(mod, n)
        return None if got is None else fused.Norm(got.mod, got.eps, not got.one_plus)
    model = AutoModelForCausalLM.from_config(family_config("gemma")).eval()
    assert lean.model_refusal(model) is None
    monkeypatch.setattr(lean, "_CHECKS", {})
    monkeypatch.setattr(lean, "norm_of", swapped)
    assert lean.structure_refusal(model) is None
    assert "differ" in lean.model_refusal(model)


def test_an_engine_on_granite_keeps_transformers_forward_and_says_why(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.families import family_config
    from tierlm.infer.lean import LeanDecoder
    d = tmp_path / "granite"
    AutoModelForCausalLM.from_config(family_config("granite")).save_pretrained(d)
    eng = _engine(d, tmp_path, True)
    try:
        assert eng.lean is None
        assert "differ" in LeanDecoder.refusal(eng)
    finally:
        eng.close()
    d = tmp_path / "llama-model"
    make_model("llama").save_pretrained(d)
    eng = _engine(d, tmp_path, True)
    try:
        assert eng.lean is not None and LeanDecoder.refusal(eng) is None
    finally:
        eng.close()


def test_the_self_check_holds_every_kind_of_layer_the_config_lists(tmp_path):
    """SmolLM3 leaves rotary out of every fourth layer (no_rope_layers). The self-check's tiny
    copy kept the first two layers, both with rotary, passed, and the fused path then rotated the
    fourth layer's keys: decode logits 1.6 away from transformers' (of 7.3). The copy now keeps as
    many layers as it takes to hold each kind the per-layer lists make."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tierlm.hf.fields import shrunk
    cfg = AutoConfig.for_model("smollm3", hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                               max_position_embeddings=64, initializer_range=0.3, pad_token_id=0)
    assert cfg.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]
    assert shrunk(cfg, layers=2).num_hidden_layers == 2
    tiny = shrunk(cfg, layers=2, every_kind=True)
    assert tiny.num_hidden_layers == 4 and tiny.no_rope_layers[:4] == [1, 1, 1, 0] and len(tiny.layer_types) == 4
    # `tierlm init --arch smollm3 --layers 8` keeps the default's 36-long list, indexed by layer
    from tierlm.hf.presets import make_config
    preset = make_config("smollm3", None, {"layers": 8, "hidden": 64, "heads": 4, "kv_heads": 2})
    assert len(preset.no_rope_layers) == 36 and shrunk(preset, layers=2, every_kind=True).num_hidden_layers == 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    d = tmp_path / "smollm3"
    model.save_pretrained(d)
    prompt = [5, 9, 17, 3, 44, 2, 80]
    with torch.no_grad():
        ref = model(torch.tensor([prompt + [7]])).logits[0, -1]
    eng = InferenceEngine(d, InferConfig(cpu_mem="1GiB", dtype="fp32", max_batch=1, max_seq_len=40,
                                         nvme_dir=str(tmp_path / "nvme")), library_rss=held_now())
    try:
        assert eng.lean is None and "differ" in eng.decode_path()
        eng.step([prompt], [0])
        torch.testing.assert_close(eng.step([[7]], [len(prompt)])[0], ref, atol=1e-4, rtol=1e-4)
    finally:
        eng.close()
