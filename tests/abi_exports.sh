#!/usr/bin/env bash
# Usage: abi_exports.sh LIB HEADER. Checks that LIB exports only dz_* symbols,
# exports every function the header declares, and has SONAME libdayzero.so.<ABI>.
set -euo pipefail
lib=$1 header=$2
exported=$(nm -D --defined-only "$lib" | awk '$2 ~ /[TDBRVW]/ {print $3}' | sed 's/@.*//' | sort -u)
bad=$(echo "$exported" | grep -v '^dz_' || true)
if [ -n "$bad" ]; then echo "non-dz symbols exported:"; echo "$bad" | head -20; exit 1; fi
declared=$(grep -oE 'DZ_API [^(]*\b(dz_[a-z0-9_]+)\(' "$header" | grep -oE 'dz_[a-z0-9_]+\($' | tr -d '(' | sort -u)
missing=$(comm -23 <(echo "$declared") <(echo "$exported"))
if [ -n "$missing" ]; then echo "declared but not exported:"; echo "$missing"; exit 1; fi
abi=$(grep -E '#define DZ_ABI_VERSION' "$header" | awk '{print $3}')
soname=$(objdump -p "$lib" | awk '/SONAME/ {print $2}')
[ "$soname" = "libdayzero.so.$abi" ] || { echo "SONAME is '$soname', want libdayzero.so.$abi"; exit 1; }
echo "abi ok: $(echo "$exported" | wc -l) dz_* symbols, all $(echo "$declared" | wc -l) declared functions exported, SONAME $soname"
