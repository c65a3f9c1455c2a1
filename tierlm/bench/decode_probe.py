"""The decode probe: weight bytes/s of a batch-1 decode step on the inference engine's own decode
path, per weight format (what the serve plan divides a decode step's weight bytes by)."""
from __future__ import annotations

import copy

import torch

from ..hf.fields import put
from ..infer.kvcache import SlotKVCache
from ..infer.lean import LeanDecoder, model_refusal
from ..infer.quant import QLinear, replace_linears
from .timing import GB, best_seconds

DECODE_FORMATS = ("bf16", "int8", "int4")


def _one_layer_model(config, hidden: int):
    """A bf16 model of one decoder layer: `config`'s family and shapes (a small vocabulary, since
    the head is not what is timed), else a llama layer of `hidden`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if config is not None:
        # a model's own layers (`tierlm plan --task serve --hardware this`): its family's code
        # and shapes; a small vocabulary, since the head is not what is timed here
        from transformers import AutoModelForCausalLM
        cfg = copy.deepcopy(config)
        put(cfg, "layers", 1)
        cfg.vocab_size, cfg.max_position_embeddings = 256, 64
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
        why = model_refusal(model)
        if why:  # timing LeanDecoder on it would leave part of its maths out
            raise ValueError(f"{config.model_type} decodes on the generic path ({why}); this probe times "
                             "the native one")
        return model
    inter = hidden * 8 // 3 // 64 * 64
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=hidden // 64,
                      num_key_value_heads=max(1, hidden // 256), num_hidden_layers=1, vocab_size=256,
                      max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _decode_step(model, fmt: str, total_bytes: int):
    """(weight bytes, one decode step, its decoder): the model's layer in `fmt`, copied until the
    copies hold `total_bytes`, decoding one token at position 32 on LeanDecoder."""

    layer = model.model.layers[0]
    if fmt != "bf16":
        for q, _conv, old in replace_linears(layer, fmt).values():
            for name, t in q.quantize(old.weight.data, None, torch.bfloat16).items():
                setattr(q, name, t)
    nbytes = sum(t.numel() * t.element_size() for m in layer.modules()
                 for t in ([m.qweight, m.scales] if isinstance(m, QLinear) else
                           [m.weight] if isinstance(m, torch.nn.Linear) else []))
    n = max(2, total_bytes // nbytes)
    model.model.layers = torch.nn.ModuleList([layer] + [copy.deepcopy(layer) for _ in range(n - 1)])
    put(model.config, "layers", n)  # layer_types (Qwen3, Gemma 3) repeated to match
    dec = LeanDecoder(model, torch.bfloat16, None, {})
    cache = SlotKVCache(model.config, 1, 64, torch.bfloat16)
    pos, mask = cache.begin_step([32], [1])
    ids = torch.ones(1, 1, dtype=torch.long)
    step = (lambda dec=dec, cache=cache, pos=pos, mask=mask, ids=ids: dec.logits(ids, pos, mask, cache))
    return n * nbytes, step, dec


def bench_decode(formats=DECODE_FORMATS, hidden: int = 2048, total_bytes: int = 256 << 20, repeats: int = 30,
                 config=None) -> dict:
    """Weight bytes/s of a batch-1 decode step through llama decoder layers on the inference
    engine's own decode path (`tierlm.infer.lean`: each layer one C call where our kernels build),
    per weight format: what the plan divides a decode step's weight bytes by. Far below the
    large-GEMM rate on a CPU, and not one matrix's rate either: the engine's step also normalises,
    rotates, attends and adds between the products.

    Layers of `hidden` (heads of 64, a quarter as many KV heads, SwiGLU of 8/3), as many as make
    `total_bytes` of distinct weights in the format: one layer timed again and again would stay in
    the last-level cache (32 MiB on an EPYC's core complex) and read faster than memory delivers.
    They are copies of one random, quantised layer: the products' speed does not depend on the
    values. Each format's best of `repeats` rounds (~1 s in all), interleaved across the formats:
    one format's rounds back to back took a tenth of a second, and on a 2-vCPU Zen 4 VM the memory rate
    switches between states for seconds at a time (bf16 once probed at 21 GB/s beside int8 at 28,
    35 a run before). A probe still lands in one state: three in a row read 29.6, 36.5, 29.2 GB/s."""
    steps, path = {}, None  # format -> (weight bytes, one decode step)
    for fmt in formats:
        model = _one_layer_model(config, hidden)
        nbytes, step, dec = _decode_step(model, fmt, total_bytes)
        with torch.no_grad():
            step()  # warm-up
        steps[fmt] = (nbytes, step)
        if path is None:
            path = "fused" if dec.fused is not None and dec.fused[0].ready(1) else "per-product"
        del model
    best = dict.fromkeys(steps, float("inf"))
    with torch.no_grad():
        for _ in range(repeats):
            for fmt, (_, step) in steps.items():
                best[fmt] = min(best[fmt], best_seconds(step, 1))
    rates = {fmt: nbytes / best[fmt] / GB for fmt, (nbytes, _) in steps.items()}
    return {"decode_gbps": rates, "decode_path": path,
            "decode_hidden": config.hidden_size if config is not None else hidden}
