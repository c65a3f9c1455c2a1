#!/usr/bin/env bash
# The checks a lent GPU machine is for, as one prepared command (device time is short: 15 minutes
# a session, start included). Run from the repository root there:
#     bash benchmarks/gpu_session.sh [OUT_DIR]
# 1. tests/engine/test_cuda.py: the GPU engine bit-exact against the GPU model with CPU AdamW;
# 2. bench train Qwen2.5-0.5B at 8x1024 tokens under --cpu-mem 6GiB: step against the I/O bound,
#    and peak RSS against the budget (the CUDA reserve in the split was never measured on a GPU);
# 3. the same at --cpu-mem 24GiB (optimizer state and weights resident in RAM), if time is left;
# before them, what CUDA's lazily loaded kernels add to host memory at this batch.
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

timeout 200 python3 -m pytest -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log"

W=${GPU_WORK:-/tmp/gpu-work}
mkdir -p "$W" && cd "$W" || exit 1
python3 -m tierlm init qwen --preset qwen2.5-0.5b >init.log 2>&1 || { cat init.log; exit 1; }
python3 -c "from pathlib import Path; from tierlm.demo import stdlib_corpus; stdlib_corpus(Path('corpus.txt'))"
ARGS="--seq-len 1024 --batch-size 8 --max-grad-norm 0 --lr 1e-5"
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
    timeout "${GPU_BENCH_TIMEOUT:-220}" python3 -m tierlm bench train qwen --data corpus.txt --cpu-mem "$mem" \
        --steps 3 --work "w-$mem" --finetune-args "$ARGS" 2>&1 | tee "$OUT/bench-$mem.log"
    cp "w-$mem/outofcore/timeline.png" "$OUT/timeline-$mem.png" 2>/dev/null
    rm -rf "w-$mem"
done
