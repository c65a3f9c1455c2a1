import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tierlm.hf.init import init_model
from tierlm.hf.presets import ARCHS, make_config, param_count
from tierlm.hf.safetensors_io import SafetensorsDir

ARCH_LIST = list(ARCHS)


@pytest.mark.parametrize("arch", ARCH_LIST)
def test_created_model_loads_and_matches_files(tmp_path, arch):
    config = make_config(arch)
    out = init_model(tmp_path / arch, config, max_shard_bytes="64KB")
    assert (out / "model.safetensors.index.json").exists()  # sharded at this size
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size) and torch.isfinite(logits).all()

    files = SafetensorsDir(out)
    sd = model.state_dict()
    tied = config.tie_word_embeddings
    assert ("lm_head.weight" in files) == (not tied)
    assert not any("inv_freq" in n for n in files.names())
    assert len(files) == len(sd) - tied
    for name in files.names():
        assert torch.equal(files.read(name), sd[name]), name
    if tied:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    cfg = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == tok.eos_token_id and cfg["pad_token_id"] is None
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    assert gen["pad_token_id"] == tok.pad_token_id
    assert cfg["dtype"] == "float32"


def _stats(t: torch.Tensor) -> tuple[float, float]:
    t = t.float()
    return t.mean().item(), (t.std().item() if t.numel() > 1 else 0.0)


@pytest.mark.parametrize("arch", ARCH_LIST)
def test_initialisation_matches_transformers_statistics(tmp_path, arch):
    config = make_config(arch, overrides={"hidden": 256, "layers": 2, "vocab": 1024})
    out = init_model(tmp_path, config, seed=1, tokenizer=False)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config).state_dict()
    files = SafetensorsDir(out)
    for name in files.names():
        ours, theirs = _stats(files.read(name)), _stats(ref[name])
        assert abs(ours[0] - theirs[0]) < 2e-3, (name, ours, theirs)
        assert ours[1] == pytest.approx(theirs[1], rel=0.1, abs=1e-6), (name, ours, theirs)
        if theirs[1] == 0:  # norms (ones) and biases (zeros) are exact
            assert torch.equal(files.read(name), ref[name]), name


def test_bf16_seed_and_reuse(tmp_path):
    config = make_config("llama")
    a = init_model(tmp_path / "a", config, seed=3, dtype="bf16", tokenizer=False)
    b = init_model(tmp_path / "b", config, seed=3, dtype=torch.bfloat16, tokenizer=False)
    c = init_model(tmp_path / "c", config, seed=4, dtype="bf16", tokenizer=False)
    fa, fc = SafetensorsDir(a), SafetensorsDir(c)
    name = "model.layers.0.mlp.up_proj.weight"
    assert fa.info(name)[0] == torch.bfloat16
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert not torch.equal(fa.read(name), fc.read(name))
    assert json.loads((a / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.bfloat16)
    assert torch.equal(model.state_dict()[name], fa.read(name))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        init_model(a, config)
    init_model(a, config, seed=4, dtype="bf16", tokenizer=False, overwrite=True)
    assert torch.equal(SafetensorsDir(a).read(name), fc.read(name))


def test_values_a_constructor_sets_and_init_weights_leaves_are_kept(tmp_path):
    """Apertus's xIELU activation sets alpha_p, alpha_n, beta and eps in its constructor, and
    `_init_weights` never rewrites them: built on meta they were whatever the allocator's memory
    held (a model whose logits were all 0 in one run and finite garbage in another). Now they are the
    constructor's, and two runs write the same bytes."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("apertus", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    a = init_model(tmp_path / "a", cfg, seed=3, tokenizer=False)
    b = init_model(tmp_path / "b", cfg, seed=3, tokenizer=False)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    ref = AutoModelForCausalLM.from_config(cfg).state_dict()
    got = SafetensorsDir(a)
    consts = [n for n in got.names() if ".act_fn." in n]
    assert len(consts) == 8
    for n in consts:
        assert torch.equal(got.read(n), ref[n].float()), n


def test_weights_a_constructor_draws_and_init_weights_leaves_are_drawn(tmp_path):
    """OpenAI GPT's Conv1D draws its weight in its own constructor, which ran on meta, and the
    family's `_init_weights` does not touch Conv1D: its weights were whatever the allocator held (a
    layer all NaN, so fine-tuning it read NaN losses). They are drawn as the convention is (normal,
    the config's initializer_range; zero biases), the same bytes each run."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("openai-gpt", n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    a = init_model(tmp_path / "a", cfg, seed=3, tokenizer=False)
    b = init_model(tmp_path / "b", cfg, seed=3, tokenizer=False)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    got = SafetensorsDir(a)
    for n in got.names():
        t = got.read(n)
        assert torch.isfinite(t).all(), n
        if n.endswith("c_attn.weight") or n.endswith("c_fc.weight"):
            assert abs(t.std().item() - cfg.initializer_range) < 0.1 * cfg.initializer_range, n
        if n.endswith("c_attn.bias"):
            assert not t.any(), n
    model = AutoModelForCausalLM.from_pretrained(a)
    ids = torch.tensor([[3, 5, 7, 9]])
    assert torch.isfinite(model(ids, labels=ids).loss)


def test_a_family_whose_config_requires_a_pad_id_keeps_one(tmp_path):
    """init leaves pad_token_id out of config.json (a Llama-style model would freeze the row of
    its padding_idx); ModernBERT's decoder requires an int there and raised. It gets the
    tokenizer's pad."""
    import json
    d = init_model(tmp_path / "m", make_config("modernbert-decoder", None, {}), seed=0)
    pad = json.loads((d / "config.json").read_text())["pad_token_id"]
    assert isinstance(pad, int) and pad == json.loads((d / "generation_config.json").read_text())["pad_token_id"]
    assert json.loads((init_model(tmp_path / "l", make_config("llama", None, {}), seed=0) / "config.json")
                      .read_text()).get("pad_token_id") is None


def test_preset_shrunk_with_trained_tokenizer(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("<|im_start|> is special but this is plain text, repeated.\n" * 40)
    config = make_config(preset="qwen2.5-0.5b", overrides={"layers": 1, "hidden": 64, "vocab": 400})
    out = init_model(tmp_path / "m", config, tokenizer_text=[str(text)])
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) <= 400
    model = AutoModelForCausalLM.from_pretrained(out)
    gen = model.generate(**tok("plain text", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert gen.shape[1] >= 3


_CHILD = textwrap.dedent("""
    import json, resource, sys
    import torch, transformers
    from transformers import AutoModelForCausalLM
    from tierlm.hf.init import init_model
    from tierlm.hf.presets import make_config
    if sys.argv[1] == "create":
        config = make_config("llama", overrides=json.loads(sys.argv[3]))
        init_model(sys.argv[2], config, dtype="float32", tokenizer=False)
    else:  # same code loaded (tierlm, modeling_llama), no model
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(make_config("llama"))
    try:  # peak RSS of this program's own address space
        with open("/proc/self/status") as f:
            print(next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")))
    except OSError:
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
""")
# Why VmHWM before ru_maxrss: Linux carries ru_maxrss across fork/vfork + exec, so a child of this
# (big) pytest process would report the parent's RSS as its own peak. VmHWM belongs to the address
# space exec creates, so it measures the child alone.


def test_peak_memory_is_about_one_piece_not_the_model(tmp_path):
    shape = {"hidden": 1024, "layers": 12, "vocab": 32000, "kv_heads": 4}
    n_bytes = 4 * param_count(make_config("llama", overrides=shape))
    assert n_bytes > 700e6  # ~196M params in float32

    # Both children at once (they are independent processes; 2 cores) to keep the suite fast.
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, *args], stdout=subprocess.PIPE, text=True)
             for args in (["baseline"], ["create", str(tmp_path / "m"), json.dumps(shape)])]
    outs = [p.communicate()[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    baseline, created = (int(o.strip().splitlines()[-1]) for o in outs)
    assert SafetensorsDir(tmp_path / "m").total_bytes() == n_bytes
    grown = created - baseline
    # The largest piece is the 131 MB embedding (17% of the model); allow for allocator slack.
    print(f"peak RSS grew {grown / 1e6:.0f} MB for a {n_bytes / 1e6:.0f} MB model")
    assert grown < 0.4 * n_bytes, f"peak RSS grew {grown / 1e6:.0f} MB for a {n_bytes / 1e6:.0f} MB model"
