#!/bin/bash
# Issue 43's training table, one command: plain PyTorch in memory, DeepSpeed ZeRO-3 offloaded to NVMe
# (where deepspeed is importable) and tierlm finetune out-of-core, side by side with `tierlm bench
# train`, on a 271.1M llama (16 layers, hidden 1024, 16 heads, ffn 2816, vocab 32000), 4x512 tokens,
# bf16, 8 steps (steady: steps 3-8), clipping off in all three; the machine is printed first.
#   benchmarks/train_peers.sh WORK [more `tierlm bench train` flags, e.g. --cpu-mem 2GiB --peers none]
set -euo pipefail
work=${1:?usage: benchmarks/train_peers.sh WORK [tierlm bench train flags]}; shift
cd "$(dirname "$0")/.."
model=$work/llama-271m
mkdir -p "$work"
[ -f "$model/config.json" ] || python -m tierlm init "$model" --arch llama --layers 16 --hidden 1024 --heads 16 \
    --kv-heads 16 --intermediate 2816 --vocab 32000 --max-positions 1024 --dtype bfloat16
[ -f "$work/data.txt" ] || cat docs/*.md > "$work/data.txt"
exec flock /tmp/tierlm-bench.lock python -m tierlm bench train "$model" --data "$work/data.txt" --steps 8 \
    --cpu-mem 2GiB --work "$work/bench" --finetune-args "--batch-size 4 --seq-len 512 --max-grad-norm 0" "$@"
