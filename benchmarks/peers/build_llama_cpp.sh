#!/usr/bin/env bash
# Builds llama.cpp (the peer for the inference benchmarks) OUTSIDE the repo from the
# llama.cpp vendored in the llama-cpp-python sdist, and installs what its HF->GGUF
# converter needs. Nothing here is a tierlm requirement.
#
#   benchmarks/peers/build_llama_cpp.sh [SDIST] [PREFIX]
#
# SDIST   llama_cpp_python-*.tar.gz   (default /tmp/dl/llama_cpp_python-0.3.36.tar.gz)
# PREFIX  where the source and build go (default /work/peers); binaries land in
#         PREFIX/llama.cpp/bin, and PREFIX/llama.cpp/CMakeCache.txt names the source dir
#         (where convert_hf_to_gguf.py lives), which is how benchmarks/peers/llamacpp.py
#         finds the converter from --llama-cpp PREFIX/llama.cpp.
set -euo pipefail
SDIST=${1:-/tmp/dl/llama_cpp_python-0.3.36.tar.gz}
PREFIX=${2:-/work/peers}
JOBS=${JOBS:-2}
name=$(basename "$SDIST" .tar.gz)
mkdir -p "$PREFIX/src"
[ -d "$PREFIX/src/$name" ] || tar xzf "$SDIST" -C "$PREFIX/src"
SRC="$PREFIX/src/$name/vendor/llama.cpp"
BUILD="$PREFIX/llama.cpp"
# GGML_NATIVE: -march=native, so the CPU's own AVX-512 / VNNI / BF16 paths are compiled in.
# Only the CPU backend and the two tools the benchmark runs (no server, tests, examples).
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
  -DCMAKE_RUNTIME_OUTPUT_DIRECTORY="$BUILD/bin"
nice -n 19 cmake --build "$BUILD" -j "$JOBS" --target llama-bench llama-quantize
# llama-system-info: the CPU features ggml was compiled with and detects (llama_print_system_info;
# llama-bench does not print them), so a benchmark can say which of its paths ran.
printf '#include <stdio.h>\n#include "llama.h"\nint main(void) { ggml_backend_load_all(); puts(llama_print_system_info()); return 0; }\n' \
  > "$BUILD/system_info.c"
g++ -x c "$BUILD/system_info.c" -x none -I"$SRC/include" -I"$SRC/ggml/include" -o "$BUILD/bin/llama-system-info" \
  "$BUILD/src/libllama.a" "$BUILD/ggml/src/libggml.a" "$BUILD/ggml/src/libggml-cpu.a" "$BUILD/ggml/src/libggml-base.a" \
  -fopenmp -lm -lpthread
# The converter's own python package (gguf) from the same source, so its format matches
# the binaries; sentencepiece/numpy/safetensors come with the project's environment.
python -m pip install --quiet "$SRC/gguf-py"
"$BUILD/bin/llama-bench" --help >/dev/null
"$BUILD/bin/llama-system-info"
echo "llama.cpp built: $BUILD/bin (source $SRC)"
