"""SSD bytes a fine-tuning step moves: a small mixture of experts against a dense model of the same
total parameter count, both through `tierlm finetune` with the state on the drive.

    flock /tmp/tierlm-bench.lock python benchmarks/moe_state_bytes.py --dir /tmp/moe-bytes --json moe_bytes.json
    (--nvme DIR: the runs' state there, each deleted after its run)

Models (random weights, tierlm.hf.init): qwen3_moe with hidden 512, 4 layers, 32 experts of
moe_intermediate 256 (2 a token), and a llama of hidden 512, 4 layers whose intermediate size
(8192) gives the same total parameters. Each runs --steps steps of --seq-len tokens on a local
text file under --cpu-mem (small, so master and moments live on the drive); the metrics rows give
each step's SSD bytes read and written, and for the mixture its experts' optimizer-state bytes
and the experts left alone (tierlm/engine/expert_io.py). The steps after the first (which creates
the state files) are averaged. Prints the commands, the machine and a markdown table.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tierlm from this checkout

from tierlm.bench.machine import machine_line  # noqa: E402
from tierlm.units import fmt_bytes  # noqa: E402

COMMON = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
              vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False)
MEDIUM = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
              vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)
SHAPES = {  # --shape: (the mixture, the dense model of the same total parameters)
    "small": {"qwen3_moe": dict(COMMON, num_experts=32, num_experts_per_tok=2, moe_intermediate_size=256,
                                intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[]),
              "llama": dict(COMMON, intermediate_size=8192)},
    # Qwen3-MoE's routing (64 experts, 8 a token, width 512) at hidden 1024: 479M parameters
    "medium": {"qwen3_moe": dict(MEDIUM, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
                                 intermediate_size=2816, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
               "llama": dict(MEDIUM, intermediate_size=32790)},
}
MODELS = SHAPES["small"]


def make_models(root: Path, shape: str = "small") -> dict[str, tuple[Path, int]]:
    from transformers import AutoConfig
    from tierlm.hf.init import init_model
    from tierlm.hf.structure import empty_model

    out = {}
    for arch, kw in SHAPES[shape].items():
        cfg = AutoConfig.for_model(arch, **kw)
        d = root / arch
        if not (d / "config.json").exists():
            init_model(d, cfg, seed=0, dtype="bfloat16" if shape != "small" else None)
        out[arch] = (d, sum(p.numel() for p in empty_model(cfg).parameters()))
    return out


def text_file(root: Path) -> Path:
    p = root / "text.txt"
    if not p.exists():
        words = "the state of every expert moves through the drive each step unless no token reached it".split()
        p.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(400)))
    return p


def run(model: Path, data: Path, out: Path, a) -> list[dict]:
    cmd = [sys.executable, "-m", "tierlm", "finetune", str(model), "--data", str(data), "--output", str(out),
           "--cpu-mem", a.cpu_mem, "--steps", str(a.steps), "--seq-len", str(a.seq_len), "--lr", "1e-4",
           "--weight-decay", "0", "--overwrite"] + (["--nvme", str(Path(a.nvme) / model.name)] if a.nvme else [])
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    if a.nvme:
        shutil.rmtree(Path(a.nvme) / model.name, ignore_errors=True)  # room for the next model's state
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steady(rows: list[dict], key, sub=None) -> float:
    later = rows[1:] or rows
    vals = [(r.get(key) or {}).get(sub, 0) if sub else r[key] for r in later]
    return sum(vals) / len(vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/moe-bytes")
    ap.add_argument("--cpu-mem", default="320MiB")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--nvme", default=None, help="where the runs keep their state (default: in each run's directory)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small",
                    help="small: 54M parameters; medium: 479M (hidden 1024, 64 experts, 8 a token)")
    a = ap.parse_args()
    root = Path(a.dir) / a.shape
    root.mkdir(parents=True, exist_ok=True)
    models, data = make_models(root, a.shape), text_file(root)
    result = {"machine": machine_line(), "shape": a.shape, "cpu_mem": a.cpu_mem, "seq_len": a.seq_len, "steps": a.steps,
              "runs": {}}
    for arch, (d, params) in models.items():
        rows = run(d, data, root / f"run-{arch}", a)
        result["runs"][arch] = {
            "params": params, "ssd_read_bytes": steady(rows, "ssd_read_bytes"),
            "ssd_write_bytes": steady(rows, "ssd_write_bytes"), "s_per_step": steady(rows, "s_per_step"),
            "expert_state_read_bytes": steady(rows, "experts", "read_bytes"),
            "expert_state_written_bytes": steady(rows, "experts", "written_bytes"),
            "experts_untouched": [(r.get("experts") or {}).get("idle", 0) for r in rows],
            "shards_left_alone": [(r.get("experts") or {}).get("shards_left_alone", 0) for r in rows]}
    print(result["machine"])
    print(f"\n--cpu-mem {a.cpu_mem}, {a.seq_len} tokens a step, mean of steps 2..{a.steps}\n")
    print("| model | parameters | SSD read / step | SSD write / step | experts' state read / written "
          "| experts untouched, steps 1.. | expert shards left alone, steps 1.. | s/step |")
    print("|---|---|---|---|---|---|---|---|")
    for arch, r in result["runs"].items():
        exp = (f"{fmt_bytes(r['expert_state_read_bytes'])} / {fmt_bytes(r['expert_state_written_bytes'])}"
               if arch != "llama" else "-")
        print(f"| {arch} | {r['params'] / 1e6:.1f}M | {fmt_bytes(r['ssd_read_bytes'])} | {fmt_bytes(r['ssd_write_bytes'])} "
              f"| {exp} | {r['experts_untouched'] if arch != 'llama' else '-'} "
              f"| {r['shards_left_alone'] if arch != 'llama' else '-'} | {r['s_per_step']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
