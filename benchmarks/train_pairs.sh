#!/bin/bash
# Issue 43's ratio with the drift between sittings taken out: plain PyTorch in memory and
# `tierlm finetune --cpu-mem 2GiB` alternated, one process at a time, clipping off then on
# (--max-grad-norm 1.0), PAIRS pairs each, on the 271M llama train_peers.sh makes (4x512 tokens,
# bf16, 6 steps a run, steady = steps 3-6). Prints each pair's mean s/step, the steps, tierlm's
# peak RSS and the ratio.
#   benchmarks/train_pairs.sh WORK [PAIRS]     (WORK as for train_peers.sh; PAIRS default 2)
set -euo pipefail
work=${1:?usage: benchmarks/train_pairs.sh WORK [PAIRS]}; pairs=${2:-2}
cd "$(dirname "$0")/.."
model=$work/llama-271m
[ -f "$model/config.json" ] || python -m tierlm init "$model" --arch llama --layers 16 --hidden 1024 --heads 16 \
    --kv-heads 16 --intermediate 2816 --vocab 32000 --max-positions 1024 --dtype bfloat16
[ -f "$work/data.txt" ] || cat docs/*.md > "$work/data.txt"
python -c "from tierlm.bench.machine import machine_kind, machine_line; print(machine_line(machine_kind()))"
common=(--data "$work/data.txt" --steps 6 --batch-size 4 --seq-len 512)
for clip in 0 1.0; do
  for i in $(seq "$pairs"); do
    # the in-memory reference as a user runs it: glibc's malloc settings (as bench train runs it)
    TIERLM_MALLOC=glibc flock /tmp/tierlm-bench.lock python -m tierlm.train.inmemory "$model" "${common[@]}" \
        --max-grad-norm "$clip" --json "$work/pair-mem.json" > /dev/null
    rm -rf "$work/pair-run"
    flock /tmp/tierlm-bench.lock python -m tierlm finetune "$model" "${common[@]}" --output "$work/pair-run" \
        --cpu-mem 2GiB --max-grad-norm "$clip" --overwrite > /dev/null 2>&1
    python - "$work" "$clip" "$i" <<'PY'
import json, sys
work, clip, i = sys.argv[1:]
m = json.load(open(f"{work}/pair-mem.json"))["rows"][2:]
o = [json.loads(line) for line in open(f"{work}/pair-run/metrics.jsonl")][2:]
a, b = (sum(r["s_per_step"] for r in rs) / len(rs) for rs in (m, o))
peak = json.load(open(f"{work}/pair-run/summary.json"))["peak_rss_bytes"] / 2**30
print(f"clip {clip} pair {i}: in memory {a:.2f} s/step {[round(r['s_per_step'], 2) for r in m]}, out-of-core "
      f"{b:.2f} {[round(r['s_per_step'], 2) for r in o]}, peak RSS {peak:.2f} GiB, ratio {b / a:.3f}", flush=True)
PY
    rm -rf "$work/pair-run/nvme"
  done
done
