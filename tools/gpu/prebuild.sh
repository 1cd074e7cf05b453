#!/usr/bin/env bash
# Build dayzero for sm_90a on a machine with the build dependencies and nvcc but
# no GPU, and stage what tools/gpu/run_all.sh needs into one folder (default
# .gpubin) for a GPU machine that lacks those dependencies:
#   tools/gpu/prebuild.sh [DIR]      then on the GPU machine, with DIR copied along:
#   DZ_PREBUILT=DIR tools/gpu/run_all.sh OUTDIR   (or copy DIR.tar.xz and unpack it there first)
# The GPU machine needs a glibc/libstdc++ at least as new as this one's, and
# libcublasLt.so.13 (CUDA 13 toolkit or the nvidia-cublas Python package).
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.gpubin}
export PATH=/usr/local/cuda/bin:$PATH
cmake --preset gpu >/dev/null  # build-gpu/ (sm_90a), beside the default build/
cmake --build build-gpu -j"$(nproc)" --target dz dz_tests dayzero
mkdir -p "$DIR"
cp build-gpu/dz build-gpu/tests/dz_tests "$DIR"/
cp -P build-gpu/libdayzero.so* "$DIR"/  # the Python binding (tools/gpu/profile_decode.py)
# The HBM access-pattern probe (tools/bench/dram_pattern.cu; driver API for its tensor maps).
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Ikernels tools/bench/dram_pattern.cu \
  -L/usr/local/cuda/lib64/stubs -lcuda -o "$DIR"/dram_pattern
# One token's expert bytes through two dependent launches with no arithmetic (tools/bench/one_token_stream.cu).
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Ikernels tools/bench/one_token_stream.cu \
  -o "$DIR"/one_token_stream
# Symbol tables are not needed there (a sixth of the bytes to copy).
strip "$DIR"/dz "$DIR"/dz_tests "$DIR"/one_token_stream
strip --strip-unneeded "$DIR"/libdayzero.so.*.*
# Shared libraries that a CUDA image may not have (everything else is static or system).
for lib in $(ldd build-gpu/dz build-gpu/tests/dz_tests | awk '/pcre2/ {print $3}' | sort -u); do cp -L "$lib" "$DIR"/; done
ls -la "$DIR"
# The same, packed (about a quarter of the bytes) for a GPU machine reached through a size-limited copy:
# there, `tar xJf DIR.tar.xz` restores DIR.
tar cJf "$DIR.tar.xz" "$DIR"
ls -la "$DIR.tar.xz"
