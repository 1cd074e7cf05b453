#!/usr/bin/env bash
# Build dayzero for sm_90a on a machine with the build dependencies and nvcc but
# no GPU, and stage what tools/gpu/run_all.sh needs into one folder (default
# .gpubin) for a GPU machine that lacks those dependencies:
#   tools/gpu/prebuild.sh [DIR]      then on the GPU machine, with DIR copied along:
#   DZ_PREBUILT=DIR tools/gpu/run_all.sh OUTDIR
# The GPU machine needs a glibc/libstdc++ at least as new as this one's, and
# libcublasLt.so.13 (CUDA 13 toolkit or the nvidia-cublas Python package).
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.gpubin}
export PATH=/usr/local/cuda/bin:$PATH
cmake --preset default -DDZ_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a >/dev/null
cmake --build build -j"$(nproc)" --target dz dz_tests dayzero
mkdir -p "$DIR"
cp build/dz build/tests/dz_tests "$DIR"/
cp -P build/libdayzero.so* "$DIR"/  # the Python binding (tools/gpu/profile_decode.py)
# Symbol tables are not needed there (a sixth of the bytes to copy).
strip "$DIR"/dz "$DIR"/dz_tests
strip --strip-unneeded "$DIR"/libdayzero.so.*.*
# Shared libraries that a CUDA image may not have (everything else is static or system).
for lib in $(ldd build/dz build/tests/dz_tests | awk '/pcre2/ {print $3}' | sort -u); do cp -L "$lib" "$DIR"/; done
ls -la "$DIR"
