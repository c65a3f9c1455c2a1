"""Model directories as the Hugging Face hub publishes them (built here with transformers, then edited
the way real uploads differ): sharded files in fp16 / bf16 / fp32, tied heads present or absent,
weights saved from the base model alone, GPT-NeoX's `embed_out`, several EOS ids, chat templates in
tokenizer_config.json or in chat_template.jinja. The fine-tuning engine and the inference engine
load each one and agree with transformers' own `from_pretrained`; what tierlm saves is the family's
own layout, and transformers loads it back."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.families import family_config
from tierlm.engine.engine import Engine, EngineConfig
from tierlm.hf.safetensors_io import INDEX_NAME, SafetensorsDir
from tierlm.infer.engine import InferConfig, InferenceEngine
from ..memory import held_now

PROBE = torch.tensor([[5, 9, 17, 3, 44, 100, 7, 12], [1, 2, 3, 4, 5, 6, 7, 8]])
SHARD = "20KB"  # the tiny models' files split into several shards, with an index


def _build(fam, seed=0, **over):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family_config(fam, **over)).float().eval()


def _save(model, d, dtype=torch.float32, shard=SHARD):
    model.to(dtype).save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
    model.float()
    return Path(d)


def _keys(d) -> dict[str, str]:
    """{tensor name: file} of a saved directory."""
    d = Path(d)
    if (d / INDEX_NAME).is_file():
        return json.loads((d / INDEX_NAME).read_text())["weight_map"]
    return {k: "model.safetensors" for k in safe_open(str(d / "model.safetensors"), "pt").keys()}


def _edit(d, fn):
    """Rewrite every weights file of `d` through fn({name: tensor}) -> {name: tensor}, index too."""
    d = Path(d)
    files = sorted(set(_keys(d).values()))
    weight_map = {}
    for f in files:
        with safe_open(str(d / f), "pt") as h:
            meta = h.metadata()
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        tensors = fn(tensors)
        save_file(tensors, str(d / f), metadata=meta)
        weight_map.update({k: f for k in tensors})
    if (d / INDEX_NAME).is_file():
        index = json.loads((d / INDEX_NAME).read_text())
        index["weight_map"] = weight_map
        (d / INDEX_NAME).write_text(json.dumps(index))


def _hf_logits(d, dtype=torch.float32):
    m = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
    with torch.no_grad():
        return m(input_ids=PROBE).logits.float()


def _train_logits(d, tmp_path, precision="fp32", save=None):
    eng = Engine.from_pretrained(d, EngineConfig(nvme_dir=str(tmp_path / f"nvme-{precision}"), cpu_mem="1GiB",
                                                 precision=precision))
    try:
        with torch.no_grad():
            out = eng.forward(PROBE).logits.float()
        saved = eng.save_pretrained(save) if save else None
    finally:
        eng.close()
    return out, saved


def _infer_logits(d, tmp_path, dtype="fp32"):
    eng = InferenceEngine(d, InferConfig(dtype=dtype, cpu_mem="1GiB", nvme_dir=str(tmp_path / f"infer-{dtype}"),
                                         max_seq_len=32), library_rss=held_now())
    try:
        return eng.logits_all(PROBE)
    finally:
        eng.close()


def _close(a, b, tol):
    scale = b.abs().max().item()
    torch.testing.assert_close(a, b, rtol=0, atol=tol * scale)


# ---- 1. sharded files in each dtype -------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, "mixed"])
def test_sharded_checkpoint_in_each_dtype_loads_like_transformers(tmp_path, dtype):
    """mixed: bf16 weights with fp32 norms, as some uploads keep them."""
    d = _save(_build("llama", initializer_range=0.2), tmp_path / "m", torch.bfloat16 if dtype == "mixed" else dtype)
    if dtype == "mixed":
        _edit(d, lambda t: {k: v.float() if "norm" in k else v for k, v in t.items()})
    assert (d / INDEX_NAME).is_file() and len(set(_keys(d).values())) > 2
    with SafetensorsDir(d) as st:
        assert {st.info(n)[0] for n in st.names()} == \
            ({torch.bfloat16, torch.float32} if dtype == "mixed" else {dtype})
    # fp32 compute: both engines upcast the file's values exactly, as transformers does with dtype=fp32
    ref = _hf_logits(d, torch.float32)
    assert torch.equal(_train_logits(d, tmp_path)[0], ref)
    _close(_infer_logits(d, tmp_path, "fp32"), ref, 1e-5)
    if dtype != torch.float32:  # in the file's own precision (transformers' default, dtype "auto"): loosely
        ref = _hf_logits(d, "auto")
        _close(_train_logits(d, tmp_path, "bf16")[0], ref, 3e-2)
        _close(_infer_logits(d, tmp_path, "bf16"), ref, 3e-2)


def _agree(d, tmp_path, tol=1e-5):
    """Both engines give transformers' logits for the directory (fp32)."""
    ref = _hf_logits(d)
    assert torch.equal(_train_logits(d, tmp_path)[0], ref)
    _close(_infer_logits(d, tmp_path), ref, tol)
    return ref


# ---- 2. tied heads: absent from the file, or present anyway; untied ------------------------------
@pytest.mark.parametrize("fam", ["qwen2", "qwen3", "gemma"])
def test_tied_head_absent_from_the_file(tmp_path, fam):
    model = _build(fam, tie_word_embeddings=True, initializer_range=0.2)
    d = _save(model, tmp_path / "m")
    assert not any("lm_head" in k for k in _keys(d))
    ref = _agree(d, tmp_path)
    with torch.no_grad():
        assert torch.equal(model(input_ids=PROBE).logits, ref)


def test_untied_head_is_read_from_the_file(tmp_path):
    model = _build("qwen2", tie_word_embeddings=False, initializer_range=0.2)
    d = _save(model, tmp_path / "m")
    assert "lm_head.weight" in _keys(d)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    _agree(d, tmp_path)


@pytest.mark.parametrize("only", [False, True])
def test_tied_head_present_in_the_file_anyway(tmp_path, only):
    """Some hub uploads of tied models carry lm_head.weight too (a copy of the embedding), a few only
    it (no embedding): it loads as transformers loads it, as the tied weight, and a save writes
    the family's layout again (the embedding, no head)."""
    d = _save(_build("qwen2", tie_word_embeddings=True, initializer_range=0.2), tmp_path / "m", shard=None)
    embed = "model.embed_tokens.weight"
    _edit(d, lambda t: {**{k: v for k, v in t.items() if not (only and k == embed)},
                        "lm_head.weight": t[embed].clone()})
    assert "lm_head.weight" in _keys(d) and (embed in _keys(d)) != only
    ref = _hf_logits(d)
    out, saved = _train_logits(d, tmp_path, save=tmp_path / "saved")
    assert torch.equal(out, ref)
    _close(_infer_logits(d, tmp_path), ref, 1e-5)
    assert "lm_head.weight" not in _keys(saved) and embed in _keys(saved)
    assert torch.equal(_hf_logits(saved), ref)


# ---- 3. saved from the base model alone (no `model.` / `transformer.` prefix) --------------------
@pytest.mark.parametrize("fam,prefix", [("gpt2", "transformer."), ("llama", "model.")])
def test_checkpoint_of_the_base_model_alone(tmp_path, fam, prefix):
    """openai-community/gpt2's files name `h.0.attn.c_attn.weight`, `wte.weight`, ... (and carry the
    old attention-mask buffers `h.N.attn.bias`): the prefix is found, extra buffers are ignored, and
    a save writes the full names again."""
    d = _save(_build(fam, initializer_range=0.2), tmp_path / "m")

    def strip(t):
        out = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in t.items()}
        if fam == "gpt2" and "h.0.ln_1.weight" in out:
            out["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64, dtype=torch.bool)).to(torch.uint8)
        return out
    ref = _hf_logits(d)
    _edit(d, strip)
    assert not any(k.startswith(prefix) for k in _keys(d))
    assert torch.equal(_hf_logits(d), ref)  # transformers reads it too
    out, saved = _train_logits(d, tmp_path, save=tmp_path / "saved")
    assert torch.equal(out, ref)
    _close(_infer_logits(d, tmp_path), ref, 1e-5)
    assert all(k.startswith(prefix) or k == "lm_head.weight" for k in _keys(saved))
    assert torch.equal(_hf_logits(saved), ref)


# ---- 4. GPT-NeoX: `embed_out` in files, `lm_head` in the module ----------------------------------
def test_gpt_neox_embed_out_loads_and_saves_as_embed_out(tmp_path):
    """(Pythia's files also carry buffers of older transformers, which are ignored.)"""
    d = _save(_build("gpt_neox", initializer_range=0.2), tmp_path / "m", shard=None)
    keys = _keys(d)
    _edit(d, lambda t: {**t, "gpt_neox.layers.0.attention.rotary_emb.inv_freq": torch.ones(4),
                        "gpt_neox.layers.0.attention.masked_bias": torch.tensor(-1e9)})
    assert "embed_out.weight" in keys and "lm_head.weight" not in keys
    ref = _hf_logits(d)
    out, saved = _train_logits(d, tmp_path, save=tmp_path / "saved")
    assert torch.equal(out, ref)
    _close(_infer_logits(d, tmp_path), ref, 1e-5)
    keys = _keys(saved)
    assert "embed_out.weight" in keys and "lm_head.weight" not in keys
    assert set(keys) == {k for k in _keys(d) if "attention.rotary_emb" not in k and "masked_bias" not in k}
    assert torch.equal(_hf_logits(saved), ref)


def test_a_conversion_of_whole_tensors_loads_and_saves_in_the_familys_layout(tmp_path):
    """OLMo-Hybrid's q, k and v convolutions are three file tensors that transformers' conversion
    concatenates into one conv1d weight: read as a stack of experts, the engine refused it ("the
    checkpoint holds 1 experts where the model's config makes 192"). Its training forward equals
    transformers' and its save has the family's file names."""
    from transformers import AutoConfig
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("olmo_hybrid", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                               max_position_embeddings=64, initializer_range=0.2, pad_token_id=0)
    d = _save(AutoModelForCausalLM.from_config(cfg).float().eval(), tmp_path / "m", shard=None)
    assert any("conv" in k for k in _keys(d))
    ref = _hf_logits(d)
    out, saved = _train_logits(d, tmp_path, save=tmp_path / "saved")
    assert torch.equal(out, ref)
    assert set(_keys(saved)) == set(_keys(d))
    assert torch.equal(_hf_logits(saved), ref)


# ---- 5. several EOS ids (generation_config.json's list), or none ---------------------------------
class _Tok:
    """Just enough of a tokenizer for the batcher when the test speaks in ids (and no eos of its own)."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _first_new(seq, after):
    """The first index > after whose token does not occur earlier in seq."""
    return next(i for i in range(after + 1, len(seq)) if seq[i] not in seq[:i])


def test_generation_stops_at_any_of_several_eos_ids(tmp_path):
    from tierlm.infer.batcher import Batcher, Request, eos_ids_of
    from tierlm.infer.sampling import SamplingParams

    d = _save(_build("llama", initializer_range=0.3), tmp_path / "m", shard=None)
    prompt = [5, 9, 17, 3, 44]
    eng = InferenceEngine(d, InferConfig(dtype="fp32", cpu_mem="1GiB", nvme_dir=str(tmp_path / "nvme"),
                                         max_seq_len=40), library_rss=held_now())
    try:
        def greedy(eos):
            b = Batcher(eng, _Tok(), eos)
            r = b.submit(Request(list(prompt), SamplingParams(max_tokens=16)))
            b.run_until_idle()
            return r.out_ids, r.finish_reason
        ref, why = greedy([])
        assert why == "length"
        early = _first_new(ref, 1)
        late = _first_new(ref, early)
        unused = next(t for t in range(128) if t not in ref)
        for listed, stop in (([ref[late], ref[early]], early), ([unused, ref[late]], late)):
            (d / "generation_config.json").write_text(json.dumps({"eos_token_id": listed, "bos_token_id": 1}))
            eos = eos_ids_of(_Tok(), d)
            assert eos == sorted(listed)
            assert greedy(eos) == (ref[:stop], "stop"), listed  # the eos token itself is not output
    finally:
        eng.close()


def test_generation_config_without_eos(tmp_path, tiny):
    """A generation_config.json without eos_token_id adds none (as in transformers' generate); a
    directory without one takes config.json's. `tierlm generate` and the fine-tuning engine's sample
    run either way, to the token limit where nothing ends them."""
    from tierlm.cli import main
    from tierlm.hf.checks import load_tokenizer
    from tierlm.infer.batcher import eos_ids_of
    from tierlm.infer.sampling import generate, generate_ids

    d = tmp_path / "tiny"
    shutil.copytree(tiny, d)
    (d / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = [0, 2]
    (d / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(d)
    assert hf.generation_config.eos_token_id is None
    assert eos_ids_of(_Tok(), d) == []
    tok = load_tokenizer(d)
    assert eos_ids_of(tok, d) == [tok.eos_token_id]
    (d / "generation_config.json").unlink()
    assert AutoModelForCausalLM.from_pretrained(d).generation_config.eos_token_id == [0, 2]
    assert eos_ids_of(_Tok(), d) == [0, 2]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert eos_ids_of(_Tok(), d) == []

    rep = tmp_path / "gen.json"
    assert main(["generate", str(d), "--prompt", "hi", "--max-new-tokens", "4", "--weights", "fp32",
                 "--nvme", str(tmp_path / "store"), "--cpu-mem", "1GiB", "--json", str(rep)]) == 0
    assert 1 <= json.loads(rep.read_text())["completion_tokens"][0] <= 4

    eng = Engine.from_pretrained(d, EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB"))
    try:
        assert isinstance(generate(eng, tok, "hi", 4), str)
        ids = tok("hi", return_tensors="pt").input_ids
        ref = generate_ids(eng, ids, 6)[0, ids.shape[1]:].tolist()
        early = _first_new(ref, 0)
        late = _first_new(ref, early)
        got = generate_ids(eng, ids, 6, eos_token_id=[ref[late], ref[early]])[0, ids.shape[1]:].tolist()
        assert got == ref[:early + 1]  # stops at either id, which it keeps
    finally:
        eng.close()


# ---- 6. chat templates in tokenizer_config.json or in chat_template.jinja ------------------------
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def chat_dirs(tiny, tmp_path_factory):
    """The same model with its template in chat_template.jinja (what transformers 5 saves, and
    `tierlm init`) and in tokenizer_config.json's "chat_template" (older uploads)."""
    root = tmp_path_factory.mktemp("chat")
    jinja, config = root / "jinja", root / "config"
    shutil.copytree(tiny, jinja)
    shutil.copytree(tiny, config)
    assert (jinja / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((jinja / "tokenizer_config.json").read_text())
    cfg = json.loads((config / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (config / "chat_template.jinja").read_text()
    (config / "tokenizer_config.json").write_text(json.dumps(cfg))
    (config / "chat_template.jinja").unlink()
    return {"jinja": jinja, "config": config}


def test_transformers_reads_the_template_from_either_file(chat_dirs, tmp_path):
    from tierlm.hf.tokenizer import CHATML_TEMPLATE
    for d in chat_dirs.values():
        assert AutoTokenizer.from_pretrained(d).chat_template == CHATML_TEMPLATE
    # both there: this transformers takes the .jinja file's
    both = shutil.copytree(chat_dirs["config"], tmp_path / "both")
    (both / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert AutoTokenizer.from_pretrained(both).chat_template == "{{ messages[0]['content'] }}"
    # named templates, as a list in tokenizer_config.json (older tool-use uploads): "default" is used
    named = shutil.copytree(chat_dirs["config"], tmp_path / "named")
    cfg = json.loads((named / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": cfg["chat_template"]},
                            {"name": "tool_use", "template": "TOOLS"}]
    (named / "tokenizer_config.json").write_text(json.dumps(cfg))
    from tierlm.serve.run import _chat_ids
    assert _chat_ids(AutoTokenizer.from_pretrained(named), MESSAGES) == \
        _chat_ids(AutoTokenizer.from_pretrained(chat_dirs["jinja"]), MESSAGES)
    none = shutil.copytree(chat_dirs["jinja"], tmp_path / "none")
    (none / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template.*plain prompt"):
        _chat_ids(AutoTokenizer.from_pretrained(none), MESSAGES)


def test_chat_prompt_and_chat_data_from_either_file(chat_dirs, tmp_path):
    from tierlm.hf.checks import load_tokenizer
    from tierlm.serve.run import _chat_ids
    from tierlm.train.data import load_dataset

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": MESSAGES + [{"role": "assistant", "content": "hello"}]}) + "\n")
    got = {}
    for kind, d in chat_dirs.items():
        tok = load_tokenizer(d)
        ids = _chat_ids(tok, MESSAGES)
        ds = load_dataset(data, tok, 64)
        got[kind] = ids, ds[0][0].tolist(), ds[0][1].tolist()
    ids = got["jinja"][0]
    tok = load_tokenizer(chat_dirs["jinja"])
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert got["config"] == got["jinja"]


def test_tierlm_chat_and_the_chat_endpoint_use_either_file(chat_dirs, tmp_path):
    import asyncio
    import io

    from tierlm.cli import build_parser
    from tierlm.hf.checks import load_tokenizer
    from tierlm.infer.batcher import Batcher, eos_ids_of
    from tierlm.config import from_args
    from tierlm.serve.options import ChatConfig
    from tierlm.serve.run import _chat_ids, chat_cmd
    from tierlm.serve.server import ChatBody, make_app

    for kind, d in chat_dirs.items():
        args = from_args(ChatConfig, build_parser().parse_args([
            "chat", str(d), "--weights", "fp32", "--cpu-mem", "1GiB", "--nvme", str(tmp_path / f"store-{kind}"),
            "--max-new-tokens", "3", "--max-seq-len", "64", "--system", "Be brief."]))
        out, err = io.StringIO(), io.StringIO()
        assert chat_cmd(args, inp=io.StringIO("hi\n/exit\n"), out=out, err=err) == 0
        assert "has no chat template" not in err.getvalue() and "token" in err.getvalue()

    eng = InferenceEngine(chat_dirs["jinja"], InferConfig(dtype="fp32", cpu_mem="1GiB", max_seq_len=64,
                                                          nvme_dir=str(tmp_path / "serve")), library_rss=held_now())
    try:
        for kind, d in chat_dirs.items():
            tok = load_tokenizer(d)
            batcher = Batcher(eng, tok, eos_ids_of(tok, d))
            batcher.start()
            try:
                app = make_app(batcher, tok, "m")
                endpoint = next(r.endpoint for r in app.routes if getattr(r, "path", "") == "/v1/chat/completions")
                r = asyncio.run(endpoint(ChatBody(messages=MESSAGES, max_tokens=3, temperature=0)))
            finally:
                batcher.stop()
            assert r["object"] == "chat.completion", kind
            assert r["usage"]["prompt_tokens"] == len(_chat_ids(tok, MESSAGES)), kind
    finally:
        eng.close()


# ---- 7. what Engine.save_pretrained writes beside the weights ------------------------------------
def test_saved_directory_keeps_tokenizer_templates_and_generation_config(chat_dirs, tmp_path):
    """The template travels in whichever file the source has it (chat_template.jinja, named extras in
    additional_chat_templates/, tokenizer_config.json), with generation_config.json; transformers
    loads the saved directory as model and tokenizer."""
    src = shutil.copytree(chat_dirs["jinja"], tmp_path / "src")
    tok = AutoTokenizer.from_pretrained(src)
    tok.chat_template = {"default": tok.chat_template, "tool_use": "TOOLS {{ messages[0]['content'] }}"}
    tok.save_pretrained(src)
    assert (src / "additional_chat_templates" / "tool_use.jinja").is_file()
    ids = torch.tensor([[1, 87, 85, 71, 2, 201]])
    outs = {}
    for kind, d in (("jinja", src), ("config", chat_dirs["config"])):
        eng = Engine.from_pretrained(d, EngineConfig(nvme_dir=str(tmp_path / f"nvme-{kind}"), cpu_mem="1GiB"))
        try:
            with torch.no_grad():
                ours = eng.forward(ids).logits
            saved = eng.save_pretrained(tmp_path / f"saved-{kind}")
        finally:
            eng.close()
        outs[kind] = saved
        for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (saved / f).read_bytes() == (d / f).read_bytes(), f
        assert (saved / "chat_template.jinja").is_file() == (kind == "jinja")
        hf = AutoModelForCausalLM.from_pretrained(saved)
        with torch.no_grad():
            assert torch.equal(hf(input_ids=ids).logits, ours)
        assert hf.generation_config.eos_token_id == json.loads((d / "generation_config.json").read_text())["eos_token_id"]
        want, got = AutoTokenizer.from_pretrained(d), AutoTokenizer.from_pretrained(saved)
        assert got.chat_template == want.chat_template
        assert got.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == \
            want.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        assert got("hi there").input_ids == want("hi there").input_ids
    assert AutoTokenizer.from_pretrained(outs["jinja"]).chat_template["tool_use"].startswith("TOOLS")
