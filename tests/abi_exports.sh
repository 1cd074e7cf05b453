#!/usr/bin/env bash
# Usage: abi_exports.sh LIB HEADER. Checks that LIB exports only dz_* symbols,
# exports every function the header declares (the *_init ones as well as the
# *_init_sized their macros call), and has SONAME libdayzero.so.<ABI>.
set -euo pipefail
lib=$1 header=$2
exported=$(nm -D --defined-only "$lib" | awk '$2 ~ /[TDBRVW]/ {print $3}' | sed 's/@.*//' | sort -u)
bad=$(echo "$exported" | grep -v '^dz_' || true)
if [ -n "$bad" ]; then echo "non-dz symbols exported:"; echo "$bad" | head -20; exit 1; fi
# A declaration names its function plainly, `DZ_API T dz_f(`, or in parentheses,
# `DZ_API T (dz_f)(`, when a macro of the same name stands in front of it.
declared=$(grep -oE 'DZ_API [^(;]*(\bdz_[a-z0-9_]+|\(dz_[a-z0-9_]+\))\(' "$header" | grep -oE 'dz_[a-z0-9_]+\)?\($' | tr -d '()' | sort -u)
missing=$(comm -23 <(echo "$declared") <(echo "$exported"))
if [ -n "$missing" ]; then echo "declared but not exported:"; echo "$missing"; exit 1; fi
# Every *_init is a macro passing sizeof *(p) to its exported *_init_sized, and
# the function of the macro's name stays declared (parenthesized) and exported.
inits=$(echo "$declared" | grep -E '_init$' || true)
[ -n "$inits" ] || { echo "no *_init functions found in $header"; exit 1; }
for f in $inits; do
  grep -qE "^DZ_API void \($f\)\(" "$header" || { echo "$f is not declared as 'DZ_API void ($f)(...)'"; exit 1; }
  grep -qxF "#define $f(p) ${f}_sized((p), sizeof *(p))" "$header" ||
    { echo "no '#define $f(p) ${f}_sized((p), sizeof *(p))' in $header"; exit 1; }
  echo "$declared" | grep -qx "${f}_sized" || { echo "${f}_sized is not declared"; exit 1; }
done
abi=$(grep -E '#define DZ_ABI_VERSION' "$header" | awk '{print $3}')
soname=$(objdump -p "$lib" | awk '/SONAME/ {print $2}')
[ "$soname" = "libdayzero.so.$abi" ] || { echo "SONAME is '$soname', want libdayzero.so.$abi"; exit 1; }
echo "abi ok: $(echo "$exported" | wc -l) dz_* symbols, all $(echo "$declared" | wc -l) declared functions exported ($(echo "$inits" | wc -l) *_init macros over *_init_sized), SONAME $soname"
