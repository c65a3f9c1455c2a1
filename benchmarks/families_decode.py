"""Decode of every tested family at one size: tokens/s and share of the memory bandwidth, on the
path `tierlm generate` takes (native where the family's layers are llama-like, else generic) and on
the generic path (transformers' modules) for the same model, side by side (numbers for
docs/families.md).

    flock /tmp/tierlm-bench.lock python benchmarks/families_decode.py --hidden 2048 --layers 8

Each family's model is made by `tierlm.hf.init.init_model` from its default config at the given
shape (`make_config(family, overrides=...)`: the family's own options, such as soft-capping or
sliding windows, stay), bf16, every layer resident, batch 1, 2 threads. A round is one
generation between two reads of memory (infer_bench.read_gbps); its share is the weight and KV
bytes it read per second over the faster probe. The median round of `--rounds` is reported; the
generic-to-native ratio is of shares measured in alternating rounds on one engine.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infer_bench import run  # noqa: E402

from tests.families import FAMILIES  # noqa: E402
from tierlm.hf.init import init_model  # noqa: E402
from tierlm.hf.presets import make_config, param_count  # noqa: E402
from tierlm.bench.rooflines import machine_rates  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the models go (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    root = Path(args.dir or tempfile.mkdtemp(prefix="tierlm-families-"))
    rates = machine_rates()
    print(f"machine: {open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()}, "
          f"{torch.get_num_threads()} threads; memory read {rates['mem_gbps']:.1f} GB/s (cached probe)", flush=True)
    rows = []
    for fam in args.families:
        over = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
                "intermediate": args.intermediate, "vocab": args.vocab, "dtype": "bf16", "max_positions": 2048}
        if fam in ("gpt2", "gpt_neox", "falcon", "phi"):  # families without grouped KV heads in their config
            over["kv_heads"] = args.heads
        d = root / fam
        try:
            config = make_config(fam, overrides=over)
        except ValueError:
            over.pop("kv_heads")
            config = make_config(fam, overrides=over)
        if not (d / "config.json").exists():
            init_model(d, config, seed=0)
        res = run(d, "bf16", 1, args.tokens, 16, "16GiB", root / "store", rates, [args.threads],
                  path="fused", rounds=args.rounds, compare={"path": ["default", "hf"]})
        by = {r.get("path", "default"): r for r in res}
        row = {"family": fam, "params": param_count(config), "default": by.get("default", res[0]),
               "generic": by.get("hf")}
        rows.append(row)
        d_share = row["default"]["probe_share"]
        g = row["generic"]
        print(f"{fam}: {row['default']['layers']} {row['default']['decode_tok_s']:.1f} tok/s "
              f"({100 * d_share:.0f}% of memory bandwidth)"
              + (f"; generic {g['decode_tok_s']:.1f} tok/s ({100 * g['probe_share']:.0f}%), "
                 f"generic/default {g['probe_share'] / d_share:.2f}" if g else ""), flush=True)
        shutil.rmtree(root / "store", ignore_errors=True)
    print("\n| family | parameters | decode path | tok/s | share of memory bandwidth | generic path: tok/s, share | generic / native |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        d, g = r["default"], r["generic"]
        native = d["layers"] != "transformers"
        print(f"| {r['family']} | {r['params'] / 1e6:.0f}M | {'native' if native else 'generic'} | "
              f"{d['decode_tok_s']:.1f} | {100 * d['probe_share']:.0f}% | "
              + (f"{g['decode_tok_s']:.1f}, {100 * g['probe_share']:.0f}% | "
                 + (f"{g['probe_share'] / d['probe_share']:.2f} |" if native else "- |") if g else "- | - |"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
