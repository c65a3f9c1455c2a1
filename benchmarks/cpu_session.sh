#!/usr/bin/env bash
# Issue 43's side-by-side tables on the CPU this session has, as one command (the CPU model changes
# between sessions: an AMX Xeon, a Zen 4 with AVX512-BF16, an AVX2-only EPYC have all been seen).
#     bash benchmarks/cpu_session.sh [OUT_DIR]      (from the repository root; ~40 min on 2 cores)
# 1. the machine: CPU model, the ISA tierlm's kernels run (AMX, AVX512-BF16, VNNI, AVX2), cores;
# 2. training (benchmarks/train_peers.sh): the 271M llama at 4x512 bf16 in memory, DeepSpeed ZeRO-3
#    on NVMe (when importable) and tierlm finetune --cpu-mem 2GiB, clipping off, 8 steps;
# 3. the ratio without the drift between sittings (benchmarks/train_pairs.sh): in memory and tierlm
#    alternated, clipping off then on (--max-grad-norm 1.0), 2 pairs each;
# 4. serving (benchmarks/peer_llamacpp.py): llama.cpp and tierlm per format (bf16, int8 / Q8_0,
#    int4 / Q4_0) on the TinyLlama-1.1B shape at every core, when llama.cpp is built; on a CPU with
#    AMX, the AMX prefill path's bit tests and then int8/int4 again with it named.
# Decode is memory-bound, and a VM's bandwidth can change state for minutes (a Zen 4 VM flipped
# between ~34 and ~63 GB/s): benchmarks/decode_split.py --pairs N alternates the two decoders with
# the read rate logged beside each pair, for a ratio from pairs in the same state.
# Peers are optional: llama.cpp is built from the llama-cpp-python sdist when one is at hand
# ($LLAMA_CPP_SDIST, default /tmp/dl/llama_cpp_python-0.3.36.tar.gz) and PEERS (default /work/peers)
# has no build; DeepSpeed is used where `import deepspeed` works. CPU_SKIP="train pairs serve" leaves
# parts out. Everything timed runs under `flock /tmp/tierlm-bench.lock`: run nothing else meanwhile.
set -o pipefail
OUT=${1:-${OUT:-/tmp/cpu-session}}
WORK=${CPU_WORK:-/tmp/cpu-work}
PEERS=${PEERS:-/work/peers}
SDIST=${LLAMA_CPP_SDIST:-/tmp/dl/llama_cpp_python-0.3.36.tar.gz}
mkdir -p "$OUT" "$WORK"
cd "$(dirname "$0")/.." || exit 1
skip() { [[ " ${CPU_SKIP:-} " == *" $1 "* ]]; }

{
    date -u
    lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket)" | sed 's/  */ /g'
    python3 -c "
from tierlm.bench.machine import machine_kind, machine_line
from tierlm.precision import cpu_bf16_isa
from tierlm.infer import native
print(machine_line(machine_kind()))
print('bf16 products:', cpu_bf16_isa())
print('native kernels:', native.isa() if native.available() else native.why_unavailable())"
    python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>/dev/null || echo "deepspeed: not importable (training table without it)"
} 2>&1 | tee "$OUT/machine.log"

LLAMA=$PEERS/llama.cpp
if ! skip serve && [ ! -x "$LLAMA/bin/llama-bench" ]; then
    if [ -f "$SDIST" ]; then
        nice -n 19 bash benchmarks/peers/build_llama_cpp.sh "$SDIST" "$PEERS" > "$OUT/llama_cpp_build.log" 2>&1 \
            || echo "llama.cpp build failed: $OUT/llama_cpp_build.log"
    else
        echo "llama.cpp: no build at $LLAMA and no sdist at $SDIST (set LLAMA_CPP_SDIST): serving without the peer"
    fi
fi

skip train || bash benchmarks/train_peers.sh "$WORK" 2>&1 | tee "$OUT/train_peers.log"
rm -rf "$WORK/bench"
skip pairs || bash benchmarks/train_pairs.sh "$WORK" 2 2>&1 | tee "$OUT/train_pairs.log"
rm -rf "$WORK/pair-run"
if ! skip serve; then
    if [ -x "$LLAMA/bin/llama-bench" ]; then
        flock /tmp/tierlm-bench.lock python3 benchmarks/peer_llamacpp.py --llama-cpp "$LLAMA" \
            --preset tinyllama-1.1b --threads "$(nproc)" --reps 2 --json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.log"
    else
        echo "serving beside llama.cpp skipped: no llama-bench at $LLAMA/bin" | tee "$OUT/serve.log"
    fi
    # The AMX prefill path runs only when named until it has run on AMX (native.AMX_BY_DEFAULT):
    # where the CPU has it, its bits against every other path first, then its speed.
    if python3 -c "from tierlm.infer import native; raise SystemExit('amx' not in native.supported_isas())"; then
        if flock /tmp/tierlm-bench.lock python3 -m pytest -q -p no:cacheprovider tests/infer/test_qgemm.py \
                tests/infer/test_native.py 2>&1 | tee "$OUT/amx_tests.log" && [ -x "$LLAMA/bin/llama-bench" ]; then
            TIERLM_NATIVE_ISA=amx flock /tmp/tierlm-bench.lock python3 benchmarks/peer_llamacpp.py \
                --llama-cpp "$LLAMA" --preset tinyllama-1.1b --formats int8 int4 --threads "$(nproc)" --reps 2 \
                --json "$OUT/serve_amx.json" 2>&1 | tee "$OUT/serve_amx.log"
        fi
    fi
fi
echo "logs: $OUT"
