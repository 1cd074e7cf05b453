#!/usr/bin/env bash
# Installs what dayzero needs to build (Debian/Ubuntu packages), then
# configures and builds it. Idempotent; safe to run again.
#   tools/bootstrap.sh [PRESET]   (default: the "default" preset, CUDA when nvcc is found)
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-default}

pkgs=(build-essential cmake pkg-config nlohmann-json3-dev catch2 libpcre2-dev
      python3 python3-numpy nodejs npm golang-go binutils)
# Rust for the Rust binding's tests: a rustup toolchain when present, else Debian's.
if ! command -v cargo >/dev/null && [ ! -x "$HOME/.cargo/bin/cargo" ]; then pkgs+=(rustc cargo); fi
missing=()
for p in "${pkgs[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  # npm may already be present outside dpkg (e.g. a nodejs install from elsewhere).
  if command -v npm >/dev/null; then missing=("${missing[@]/npm}"); missing=("${missing[@]/nodejs}"); fi
  read -r -a missing <<<"${missing[*]}"
fi
if [ ${#missing[@]} -gt 0 ]; then
  cmd="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
  if [ "$(id -u)" = 0 ]; then
    echo "bootstrap: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo env DEBIAN_FRONTEND=noninteractive sh -c "$cmd"
  else
    echo "bootstrap: missing packages. Run as root:"; echo "  $cmd"; exit 1
  fi
fi
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j"$(nproc)"
