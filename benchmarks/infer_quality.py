"""Perplexity of int8 / int4 weights against bf16, on real local text.

No trained checkpoint can be downloaded here, and a random-weight model has a flat, meaningless
perplexity, so this script trains a small llama on text that is on every machine (the docstrings
of Python's standard library, held-out modules kept aside), then scores the held-out docstrings and
the plain-text files under /usr/share/doc with the tierlm engine in each weight format.

    flock /tmp/tierlm-bench.lock python benchmarks/infer_quality.py --dir /tmp/ibench/quality --steps 200 --batch 8
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import torch


def stdlib_docstrings() -> tuple[list[str], list[str]]:
    """(train, held-out) docstrings of the standard library; a module is held out by its name's hash."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or "site-packages" in str(path):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        docs = [ast.get_docstring(n) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        text = "\n\n".join(d for d in docs if d and len(d) > 40)
        if text:
            (held if int(hashlib.md5(path.name.encode()).hexdigest(), 16) % 10 == 0 else train).append(text)
    return train, held


def share_doc_text(limit: int = 400_000) -> str:
    """Plain-text READMEs and changelogs under /usr/share/doc (not licences, not compressed)."""
    out, n = [], 0
    for p in sorted(Path("/usr/share/doc").rglob("*")):
        if not p.is_file() or p.suffix in (".gz", ".html", ".png", ".svg", ".js", ".css") or p.name == "copyright":
            continue
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(t)
        n += len(t)
        if n >= limit:
            break
    return "\n\n".join(out)


def train_model(out: Path, text_file: Path, steps: int, seq: int, batch: int, seed: int = 0) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tierlm.hf.init import init_model

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=4096, max_position_embeddings=512,
                         tie_word_embeddings=False)
    init_model(out, config, dtype="float32", tokenizer_text=[str(text_file)], overwrite=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor(tok(text_file.read_text()).input_ids)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    t = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=g)
        x = torch.stack([ids[s: s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            print(json.dumps({"step": step, "loss": round(loss.item(), 3), "s": round(time.perf_counter() - t)}),
                  flush=True)
    model.save_pretrained(out)
    print(json.dumps({"train_tokens": len(ids), "train_s": round(time.perf_counter() - t)}), flush=True)


def main():
    from transformers import AutoTokenizer

    from tierlm.infer.engine import InferConfig, InferenceEngine
    from tierlm.infer.quality import perplexity

    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--window", type=int, default=256,
                   help="tokens scored per forward; 32 or fewer runs the few-row kernels decoding uses "
                        "(int8 and int4 round x there), more runs the prefill path")
    p.add_argument("--decode", action="store_true",
                   help="feed each window a token a step through the KV cache: every product runs the "
                        "one-row loops that generating runs (TIERLM_NATIVE_EXACT_X=1: with x kept to 16 bits)")
    p.add_argument("--formats", nargs="*", default=["fp32", "bf16", "int8", "int4"])
    a = p.parse_args()
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    train, held = stdlib_docstrings()
    text_file = root / "train.txt"
    text_file.write_text("\n\n".join(train))
    model = root / "model"
    if not (model / "model.safetensors").exists() or not (model / "trained").exists():
        train_model(model, text_file, a.steps, a.seq, a.batch)
        (model / "trained").write_text(str(a.steps))
    tok = AutoTokenizer.from_pretrained(model)
    evals = {"held-out stdlib docstrings": "\n\n".join(held), "/usr/share/doc text": share_doc_text()}
    rows = {}
    for name, text in evals.items():
        ids = tok(text).input_ids[: a.eval_tokens]
        for w in a.formats:
            eng = InferenceEngine(model, InferConfig(cpu_mem="2GiB", weights=w, max_seq_len=512,
                                                     nvme_dir=str(root / f"store-{w}")))
            rows[(name, w)] = perplexity(eng, ids, window=a.window, decode=a.decode)
            eng.close()
            print(json.dumps({"text": name, "tokens": len(ids), "weights": w, "ppl": rows[(name, w)]}), flush=True)
    print(f"\nwindows of {a.window} tokens" + (", a token a step" if a.decode else ""))
    if set(a.formats) != {"fp32", "bf16", "int8", "int4"}:
        return
    print("| text | tokens | fp32 | bf16 | int8 (vs bf16) | int4 (vs bf16) |\n|---|---|---|---|---|---|")
    for name, text in evals.items():
        b = rows[(name, "bf16")]
        n = min(len(tok(text).input_ids), a.eval_tokens)
        print(f"| {name} | {n} | {rows[(name, 'fp32')]:.2f} | {b:.2f} | {rows[(name, 'int8')]:.2f} "
              f"({100 * (rows[(name, 'int8')] / b - 1):+.2f}%) | {rows[(name, 'int4')]:.2f} "
              f"({100 * (rows[(name, 'int4')] / b - 1):+.2f}%) |")
    vocab = 4096
    print(f"(a uniform guess over the vocabulary: perplexity {vocab}; ln = {math.log(vocab):.2f} nats)")


if __name__ == "__main__":
    main()
