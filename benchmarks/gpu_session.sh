#!/usr/bin/env bash
# The checks a lent GPU machine is for, as one prepared command (device time is short: 15 minutes
# a session, start included). Run from the repository root there:
#     bash benchmarks/gpu_session.sh [OUT_DIR]
# In order of what matters most if the loan ends early:
# 1. every CUDA test in one run: the training engine bit-exact against the GPU model with CPU AdamW
#    (tests/engine/test_cuda*.py), generation against transformers.generate on the GPU
#    (tests/infer/test_device_layers.py), NCCL gradient buckets (tests/dist/test_buckets.py);
# 2. benchmarks/plan_vs_gpu.py: the host link and device memory rates beside the catalog's, and the
#    plan's serving bounds at both;
# 3. benchmarks/gpu_decode.py: resident decode against device memory bandwidth, streamed decode
#    against the pinned host-to-device rate;
# 4. bench train Qwen2.5-0.5B at 8x1024 tokens under --cpu-mem 6GiB with --activations auto (the
#    planner may choose GPU activation swapping: the timeline's d2h/h2d lanes show it): step against
#    the I/O bound, peak RSS against the budget;
# 5. the same at --cpu-mem 24GiB (optimizer state and weights resident in RAM), if time is left;
# before 4, what CUDA's lazily loaded kernels add to host memory at this batch.
# GPU_SKIP="decode train24" (words: tests plan decode train6 train24) leaves parts out.
# Packages the GPU machine lacks (transformers >= 5.20, fastcrc) travel as wheels in .whl/, fetched here
# with `pip download --no-deps --only-binary=:all:` for that machine's Python (3.12, manylinux x86_64).
set -o pipefail
OUT=${1:-${OUT:-/tmp/gpu-session}}
mkdir -p "$OUT"
REPO=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
nproc; free -g | head -2

skip() { [[ " ${GPU_SKIP:-} " == *" $1 "* ]]; }

skip tests || timeout 300 python3 -m pytest -p no:cacheprovider tests/engine/test_cuda*.py \
    tests/infer/test_device_layers.py tests/dist/test_buckets.py 2>&1 | tee "$OUT/test_cuda.log"
skip plan || timeout 120 python3 benchmarks/plan_vs_gpu.py --model llama-3.1-8b --gpu-mem 8GiB \
    --out "$OUT/plan_vs_gpu.json" 2>&1 | tee "$OUT/plan_vs_gpu.log"

W=${GPU_WORK:-/tmp/gpu-work}
mkdir -p "$W" && cd "$W" || exit 1
python3 -m tierlm init qwen --preset qwen2.5-0.5b >init.log 2>&1 || { cat init.log; exit 1; }
python3 -c "from pathlib import Path; from tierlm.demo import stdlib_corpus; stdlib_corpus(Path('corpus.txt'))"
skip decode || timeout 300 python3 "$REPO/benchmarks/gpu_decode.py" --preset qwen2.5-1.5b --layers 0 --dir "$W/gpu-decode" \
    --json "$OUT/gpu_decode.json" 2>&1 | tee "$OUT/gpu_decode.log"
rm -rf "$W/gpu-decode"
ARGS="--seq-len 1024 --batch-size 8 --max-grad-norm 0 --lr 1e-5 --activations auto"
# what CUDA's lazily loaded kernels add to host memory at this batch (budget.warm_kernels)
python3 - <<'PY' 2>&1 | tee "$OUT/kernels.log"
import torch
from transformers import AutoConfig
from tierlm.engine import budget as B
cfg = AutoConfig.from_pretrained("qwen")
a = B.library_baseline(cfg, torch.bfloat16, "cuda")
b = B.library_baseline(cfg, torch.bfloat16, "cuda", (8, 1024))
print(f"library baseline {a / 2**20:.0f} MiB; after one layer and the head at 8x1024 {b / 2**20:.0f} MiB "
      f"(+{(b - a) / 2**20:.0f} MiB)")
PY
for mem in ${GPU_CPU_MEMS:-6GiB 24GiB}; do
    skip "train${mem%GiB}" && continue
    timeout "${GPU_BENCH_TIMEOUT:-220}" python3 -m tierlm bench train qwen --data corpus.txt --cpu-mem "$mem" \
        --steps 3 --work "w-$mem" --finetune-args "$ARGS" 2>&1 | tee "$OUT/bench-$mem.log"
    cp "w-$mem/outofcore/timeline.png" "$OUT/timeline-$mem.png" 2>/dev/null
    cp "w-$mem/outofcore/plan.json" "$OUT/plan-$mem.json" 2>/dev/null  # the activation policies chosen
    rm -rf "w-$mem"
done
