#!/usr/bin/env bash
# The test command: installs dependencies, builds (CUDA code compiled when nvcc
# is present), runs every test, then re-runs the loader and KV tests under
# AddressSanitizer/UBSan.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh default
ctest --preset default -j"$(nproc)" -LE asan
bash tools/bootstrap.sh asan
ctest --preset asan -j"$(nproc)" -L asan
