"""`tierlm demo`: the whole story on a small model, offline, in a few minutes.

It writes a text corpus from the docstrings of Python's own standard library (always on the
machine, read with `ast`, nothing imported or downloaded), creates a random llama-shaped model with a
tokenizer trained on that text, fine-tunes every parameter with weights and optimizer states on disk
under a RAM budget smaller than the training state, and generates from the result.
"""
from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from . import validate as V
from .config import check, option
from .units import fmt_bytes, parse_bytes


def stdlib_corpus(out: Path, max_bytes: int = 3_000_000) -> Path:
    """Docstrings of the standard library's modules, functions and classes, in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for f in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    parts.append(doc.strip())
                    size += len(doc)
        if size >= max_bytes:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    return out


# Per compute precision (tierlm.precision: bf16 only where this CPU multiplies bf16 fast): decoder
# layers and the budget. fp32 working weights and scratch need more RAM, so the fp32 demo takes a
# deeper model to keep the training state well beyond the budget.
SETUPS = {"bf16": (8, "160MiB"), "fp32": (20, "256MiB")}


@dataclass
class DemoConfig:
    """`tierlm demo`'s options: its flags and its --config file's keys (tierlm.config)."""
    dir: str = option("runs/demo", help="where the demo model, data and run go")
    cpu_mem: str | None = option(None, help="the RAM budget (default: 160MiB in bf16, 256MiB in fp32)")
    steps: int = option(30, help="optimizer steps")

    RANGES = V.DEMO


def run_demo(cfg: DemoConfig | None = None) -> dict:
    from .hf.init import init_model
    from .hf.presets import make_config, param_count
    from .precision import resolve

    cfg = cfg or DemoConfig()
    check(cfg)  # a config made in Python skips the ranges the command line's went through
    d, steps = Path(cfg.dir), cfg.steps
    precision, why = resolve("auto")
    print(why)
    layers, default_mem = SETUPS[precision]
    cpu_mem = cfg.cpu_mem or default_mem
    corpus = stdlib_corpus(d / "data" / "stdlib_docstrings.txt")
    print(f"corpus: {corpus} ({fmt_bytes(corpus.stat().st_size)} of standard-library docstrings)")
    config = make_config("llama", None, {"layers": layers, "hidden": 512, "heads": 8, "kv_heads": 4,
                                         "intermediate": 1408, "vocab": 4096, "max_positions": 512})
    n = param_count(config)
    model_dir = d / "model"
    init_model(model_dir, config, seed=0, tokenizer_text=[str(corpus)], overwrite=True)
    state = (16 if precision == "bf16" else 12) * n  # fp32 master, m, v (+ bf16 working weights)
    budget = parse_bytes(cpu_mem)
    print(f"model: {model_dir}, llama, {n / 1e6:.1f}M parameters; {precision} training state {fmt_bytes(state)} "
          f"= {state / budget:.1f}x the --cpu-mem budget of {fmt_bytes(budget)}")
    run = d / "run"
    shutil.rmtree(run, ignore_errors=True)
    # A process of its own, so that its peak RSS is the fine-tune's and nothing else's.
    cmd = [sys.executable, "-m", "tierlm", "finetune", str(model_dir), "--data", str(corpus),
           "--output", str(run), "--cpu-mem", cpu_mem, "--precision", precision, "--seq-len", "128", "--batch-size", "4",
           "--steps", str(steps), "--lr", "2e-3", "--schedule", "cosine", "--warmup-steps", "3",
           "--weight-decay", "0.01", "--max-grad-norm", "1.0", "--sample-prompt", "Return the",
           "--sample-tokens", "30", "--sample-temperature", "0.8"]
    print("$ tierlm finetune " + " ".join(cmd[4:]), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"demo: the fine-tune failed (its error is above); the run directory is {run}")
    summary = json.loads((run / "summary.json").read_text())
    beyond = summary["peak_rss_bytes"] - summary["library_rss_bytes"]
    print(f"\ndemo: {n / 1e6:.1f}M parameters, training state {fmt_bytes(state)} on disk "
          f"({state / budget:.1f}x --cpu-mem {cpu_mem}); peak RSS beyond the libraries {fmt_bytes(beyond)}; "
          f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}")
    return summary
