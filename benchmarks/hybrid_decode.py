"""Decode of a model whose layers keep recurrent states (Qwen3.5's Gated DeltaNet beside attention,
by default), tierlm against transformers' own loop on the same model in memory, side by side.

    flock /tmp/tierlm-bench.lock python benchmarks/hybrid_decode.py --family qwen3_5_text --hidden 2048 --layers 8

Both run transformers' modules for the recurrent layers (tierlm keeps their states in its slots,
infer/states.py); the attention layers read tierlm's KV cache, and the products run on tierlm's
kernels where `tierlm generate` puts them. The model: the family's default config at the given
shape (its own layer pattern), random bf16 weights, every layer resident, batch 1, greedy. A round decodes `--new` tokens
after a `--prompt`-token prompt on each side, alternating; the median round's tokens/s of each and
their ratio are printed with the machine line.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierlm.bench.machine import machine_line  # noqa: E402
from tierlm.hf.init import init_model  # noqa: E402
from tierlm.hf.presets import param_count  # noqa: E402
from tierlm.infer.engine import InferConfig, InferenceEngine  # noqa: E402


def _tierlm_round(eng, prompt: list[int], new: int) -> tuple[float, list[int]]:
    out, n = [], len(prompt)
    logits = eng.step([prompt], [0])[0]
    t0 = time.perf_counter()
    for i in range(new):
        tok = int(logits.argmax())
        out.append(tok)
        logits = eng.step([[tok]], [n + i])[0]
    return new / (time.perf_counter() - t0), out


@torch.no_grad()
def _hf_round(model, prompt: list[int], new: int) -> tuple[float, list[int]]:
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
    out = []
    t0 = time.perf_counter()
    for _ in range(new):
        tok = int(logits.argmax())
        out.append(tok)
        logits = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True).logits[0, -1]
    return new / (time.perf_counter() - t0), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen3_5_text")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="fp32: both sides' tokens must agree (bf16 products on different kernels round apart)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM
    from transformers import AutoConfig
    # the family's own layer pattern at this depth (Qwen3.5: three Gated DeltaNet layers, then attention)
    config = AutoConfig.for_model(a.family, hidden_size=a.hidden, num_hidden_layers=a.layers,
                                  intermediate_size=a.intermediate, vocab_size=a.vocab, initializer_range=0.2,
                                  tie_word_embeddings=False)
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="tierlm-hybrid-") as tmp:
        dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
        d = init_model(Path(tmp) / "m", config, dtype="bfloat16" if a.dtype == "bf16" else "float32")
        model = AutoModelForCausalLM.from_pretrained(d, dtype=dt).eval()
        eng = InferenceEngine(d, InferConfig(cpu_mem="16GiB", weights=a.dtype, max_batch=1,
                                             max_seq_len=a.prompt + a.new + 8, threads=a.threads))
        print(f"{a.family}: {param_count(config) / 1e6:.0f}M parameters, {eng.describe()}")
        prompt = torch.randint(3, a.vocab, (a.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        ours, theirs = [], []
        try:
            for r in range(a.rounds):
                t, out_t = _tierlm_round(eng, prompt, a.new)
                h, out_h = _hf_round(model, prompt, a.new)
                same = next((i for i, (x, y) in enumerate(zip(out_t, out_h)) if x != y), a.new)
                print(f"round {r}: tierlm {t:.2f} tok/s, transformers {h:.2f} tok/s (the first {same} of {a.new} "
                      f"tokens the same)")
                ours.append(t)
                theirs.append(h)
        finally:
            eng.close()
    t, h = statistics.median(ours), statistics.median(theirs)
    print(f"median: tierlm {t:.2f} tok/s, transformers in memory {h:.2f} tok/s: {t / h:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
