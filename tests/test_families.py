"""Every tested family through every verb, on its own transformers modules.

Per family (tests/families.py: rotary variants, q/k norms, sliding windows, soft-capping,
multipliers, fused weights, parallel residuals, tied and untied heads): `init_model` writes it with
a tokenizer; two optimizer steps of the out-of-core engine (fp32, clipping that triggers, two
micro-batches a step) equal a plain PyTorch loop with torch.optim.AdamW bit for bit; the saved
directory is the family's own layout and transformers' logits of it equal the engine's; greedy
decoding of the saved model equals transformers.generate, resident and streamed; and the
OpenAI-compatible server answers a completion with the same tokens.
"""
import json
import socket
import threading
import time
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM

from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig
from tierlm.hf.checks import TESTED, check_model_dir, load_tokenizer
from tierlm.hf.init import init_model
from tierlm.hf.safetensors_io import SafetensorsDir
from tierlm.infer.batcher import Batcher, Request, eos_ids_of
from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.infer.sampling import SamplingParams
from tierlm.serve.server import make_app
from tierlm.train.schedule import lr_factor

from .engine.test_exactness import assert_same, batches, run_reference
from .families import FAMILIES, family_config, greedy_init, inkling2_config
from .memory import held_now

VOCAB = 300          # the byte tokenizer's 256 bytes, its special tokens, a few merges
STEPS, ACCUM = 2, 2
PROMPT = [5, 9, 17, 3, 44, 2, 80]
NEW = 8
LR = 1e-3  # small enough that the trained model still predicts varied tokens


def test_the_tested_families_are_the_ones_declared():
    assert sorted(FAMILIES) == sorted(TESTED)


def _finetune(d, tmp_path, data, activations="auto"):
    cfg = EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB", precision="fp32", grad_accum=ACCUM,
                       activations=activations,
                       optim=AdamWConfig(lr=LR, weight_decay=0.1, max_grad_norm=0.5),
                       tokens_per_micro_batch=data[0].numel())
    eng = Engine.from_pretrained(d, cfg)
    losses = []
    sched = lr_factor("cosine", 0, STEPS)
    try:
        for s in range(STEPS):
            eng.set_lr(LR * sched(s))
            for x in data[s * ACCUM:(s + 1) * ACCUM]:
                loss = eng.forward(x, labels=x).loss
                eng.backward(loss)
                losses.append(loss.item())
            eng.step()
        masters = {n: eng.master(n) for n in eng.names}
        with torch.no_grad():
            logits = eng.forward(torch.tensor([PROMPT])).logits
        out = eng.save_pretrained(tmp_path / "saved", tokenizer_from=d)
    finally:
        eng.close()
    return losses, masters, logits, out


def _aligned(model):
    """The model with its weights copied out of safetensors' memory map: a tensor there starts
    where the file's header leaves it, not on a SIMD boundary, and some kernels round unaligned
    data differently (ZAYA's experts came out 3e-10 apart from the same weights aligned, which the
    engine's buffers are)."""
    for p in model.parameters():
        p.data = p.data.clone()
    return model


def _finetune_beside_torch(d, tmp_path, activations="auto"):
    """The model in d, its masters after torch's AdamW and the engine's (the losses asserted
    equal), the engine's logits of PROMPT and its saved directory."""
    model = AutoModelForCausalLM.from_pretrained(d).float()
    data = batches(STEPS * ACCUM, vocab=VOCAB)
    _, ref_master, ref_losses, _ = run_reference(model, data, lr=LR, wd=0.1, clip=0.5, accum=ACCUM,
                                                 warmup=0, precision="fp32")
    losses, masters, logits, out = _finetune(d, tmp_path, data, activations)
    assert losses == ref_losses
    return model, ref_master, masters, logits, out


def _greedy(d, tmp_path, resident):
    eng = InferenceEngine(d, InferConfig(cpu_mem="1GiB", dtype="fp32", max_batch=1, max_seq_len=32,
                                         resident_layers=resident, nvme_dir=str(tmp_path / f"store-{resident}")),
                          library_rss=held_now())
    try:
        if resident == 0:
            assert eng.placement.streamed == eng.placement.layers
        b = Batcher(eng, load_tokenizer(d), [])
        r = b.submit(Request(list(PROMPT), SamplingParams(max_tokens=NEW)))
        b.run_until_idle()
        return r.out_ids
    finally:
        eng.close()


def _serve_once(d, tmp_path) -> dict:
    """One greedy completion from the OpenAI-compatible server, over HTTP."""
    import uvicorn

    tok = load_tokenizer(d)
    eng = InferenceEngine(d, InferConfig(cpu_mem="1GiB", dtype="fp32", max_batch=2, max_seq_len=32,
                                         nvme_dir=str(tmp_path / "serve")), library_rss=held_now())
    batcher = Batcher(eng, tok, eos_ids_of(tok, d))
    batcher.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(make_app(batcher, tok, "m"), host="127.0.0.1", port=port,
                                        log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < deadline and th.is_alive(), "server did not start"
            time.sleep(0.02)
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
            return json.loads(resp.read())
    finally:
        srv.should_exit = True
        th.join(timeout=10)
        batcher.stop()
        eng.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_finetunes_exactly_saves_its_layout_generates_and_serves(family, tmp_path):
    # a wide init: peaked, varied next-token distributions, so a wrong token shows
    d = init_model(tmp_path / "model", family_config(family, vocab_size=VOCAB, initializer_range=greedy_init(family)), seed=3)
    check_model_dir(d)
    model, ref_master, masters, logits, out = _finetune_beside_torch(d, tmp_path)
    # parameters the modules keep fixed (requires_grad=False: a router's score-correction bias) are
    # no master of the engine's; the reference (whose from_pretrained made them trainable) leaves
    # them too, as no gradient reaches them, and the saved model holds them as they were
    fixed = set(ref_master) - set(masters)
    assert fixed == {n for n, p in AutoModelForCausalLM.from_config(model.config).named_parameters()
                     if not p.requires_grad}
    assert_same({n: t for n, t in ref_master.items() if n not in fixed}, masters)
    for n in fixed:
        assert torch.equal(ref_master[n], dict(model.named_parameters())[n])

    # the family's own layout: the same tensor names as transformers' save of the same model (a
    # mixture of experts: one tensor per expert and projection)
    model.save_pretrained(tmp_path / "hf-saved")
    assert set(SafetensorsDir(out).names()) == set(SafetensorsDir(tmp_path / "hf-saved").names())
    assert set(SafetensorsDir(d).names()) == set(SafetensorsDir(tmp_path / "hf-saved").names())
    reloaded = _aligned(AutoModelForCausalLM.from_pretrained(out).float().eval())
    for n in fixed:  # under the family's own file names
        assert torch.equal(dict(reloaded.named_parameters())[n], dict(model.named_parameters())[n])
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=torch.tensor([PROMPT])).logits, logits)

    ref = reloaded.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(PROMPT):].tolist()
    assert len(set(ref)) > 1  # a real comparison, not one token repeated
    for resident in (None, 0):
        assert _greedy(out, tmp_path, resident) == ref, f"resident_layers={resident}"

    answer = _serve_once(out, tmp_path)
    tok = load_tokenizer(out)
    n = answer["usage"]["completion_tokens"]
    assert n == NEW or ref[n] in eos_ids_of(tok, out)  # stopped at an end-of-sequence token (not counted)
    assert answer["choices"][0]["text"] == tok.decode(ref[:n], skip_special_tokens=True)


def _init_fine_tune_and_reload(family, over, tmp_path):
    """`tierlm init --arch family` (with overrides), fine-tuned beside torch's AdamW bit for bit, its
    saved layout the family's own and transformers' reload of it equal to the trained model; the
    trained model's directory."""
    from tierlm.hf.presets import make_config
    cfg = make_config(family, None, dict(over, vocab=VOCAB))
    cfg.initializer_range = greedy_init(family)
    d = init_model(tmp_path / "model", cfg, seed=3)
    model, ref_master, masters, logits, out = _finetune_beside_torch(d, tmp_path)
    assert_same(ref_master, masters)
    model.save_pretrained(tmp_path / "hf-saved")
    assert set(SafetensorsDir(out).names()) == set(SafetensorsDir(tmp_path / "hf-saved").names())
    reloaded = _aligned(AutoModelForCausalLM.from_pretrained(out).float().eval())
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=torch.tensor([PROMPT])).logits, logits)
    return out


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba"])
def test_a_model_without_attention_fine_tunes_exactly(family, tmp_path):
    """State-space models have no attention heads: the activation budget and the layer's FLOPs
    counted none (they read the config's heads, which Mamba's has not, and fine-tuning died)."""
    _init_fine_tune_and_reload(family, {}, tmp_path)


def test_zamba2_from_init_fine_tunes_exactly(tmp_path):
    """`tierlm init --arch zamba2`: Mamba-2 layers and a hybrid one running a shared attention
    block with its own adapters. The small config kept the widths its class derives from
    hidden_size at their published sizes (640-wide Mamba heads in a 64-wide model), and the first
    forward failed; they are made again from the small sizes (hf.fields.rederive)."""
    _init_fine_tune_and_reload("zamba2", {}, tmp_path)


@pytest.mark.parametrize("activations", ["keep", "recompute", "swap"])
def test_layers_that_hand_later_layers_tensors_with_a_gradient_fine_tune_exactly(activations, tmp_path):
    """Gemma 4's E2B/E4B shapes: each layer reads its slice of per-layer embeddings projected
    before the layers (a tensor with a gradient beside the hidden states), and the last
    num_kv_shared_layers attend with the keys and values an earlier layer left in
    shared_kv_states. The engine runs each layer's backward on its own; those tensors are carried
    in and left out of its autograd boundary (engine.block_fn.BlockCall), so their gradients reach
    the projection and the earlier layer: bit-equal to torch's AdamW whether a layer's
    activations are kept, recomputed in backward or swapped to the drive. (Before, the engine
    refused these shapes; without the boundary's carrying, the backward needed an unloaded weight.)"""
    cfg = family_config("gemma4_text", hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
                        vocab_size=VOCAB, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                        num_kv_shared_layers=2)
    cfg.initializer_range = greedy_init("gemma4_text")
    d = init_model(tmp_path / "model", cfg, seed=3)
    model, ref_master, masters, logits, out = _finetune_beside_torch(d, tmp_path, activations)
    assert_same(ref_master, masters)
    assert any("per_layer" in n for n in masters)
    reloaded = _aligned(AutoModelForCausalLM.from_pretrained(out).float().eval())
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=torch.tensor([PROMPT])).logits, logits)


def test_layers_that_read_every_earlier_blocks_output_fine_tune_to_torchs_rounding(tmp_path):
    """Inkling 2's layers attend over the outputs of every earlier block of layers (block_states,
    concatenated by the model between layers), beside their hidden states. Carried across each
    layer's autograd boundary, their gradients reach every earlier layer; autograd then adds a
    layer's output's gradients in another order than one graph of the whole model does, so the
    run equals torch's to fp32 rounding, not to the bit: the forward is bit-equal (the first
    losses), later losses within 1e-6 and every master within 1e-4 of its largest value after two
    steps. (Its head is unpadded on load by a conversion that reads the config: hf.stacked.)"""
    cfg = inkling2_config(VOCAB)
    d = init_model(tmp_path / "model", cfg, seed=3)
    model = AutoModelForCausalLM.from_pretrained(d).float()
    data = batches(STEPS * ACCUM, vocab=VOCAB)
    _, ref_master, ref_losses, _ = run_reference(model, data, lr=LR, wd=0.1, clip=0.5, accum=ACCUM, warmup=0,
                                                 precision="fp32")
    losses, masters, _, _ = _finetune(d, tmp_path, data)
    assert losses[:ACCUM] == ref_losses[:ACCUM]
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert set(masters) == set(ref_master)
    for n, m in masters.items():
        torch.testing.assert_close(m, ref_master[n], rtol=0, atol=1e-4 * ref_master[n].abs().max().item())
