#!/usr/bin/env bash
# Usage: consumer.sh pkgconfig|cmake PREFIX WORKDIR SIMPLE_C MODEL_DIR CC
# Builds examples/simple/simple.c (C89) against the dayzero installed in
# PREFIX, the way a downstream project would (pkg-config, or CMake's
# find_package; with pkg-config also statically), then runs it: greedy generation on the tiny model, and a bad
# path that must fail with the library's message.
set -euo pipefail
mode=$1 prefix=$2 work=$3 src=$4 model=$5 cc=$6
rm -rf "$work" && mkdir -p "$work"
pc=$(find "$prefix" -name dayzero.pc -path '*pkgconfig*' | head -1)
[ -n "$pc" ] || { echo "no dayzero.pc under $prefix"; exit 1; }
libdir=$(dirname "$(dirname "$pc")")
case $mode in
  pkgconfig)
    export PKG_CONFIG_PATH=$(dirname "$pc")
    flags=$(pkg-config --cflags --libs dayzero)
    echo "pkg-config --cflags --libs dayzero: $flags"
    # shellcheck disable=SC2086
    "$cc" -std=c89 -pedantic -Wall -Wextra -Werror "$src" $flags -o "$work/simple"
    export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    # Static: libdayzero.a with Libs.private (pkg-config --static) must link and run too.
    static_libs=$(pkg-config --static --libs dayzero | sed 's/-ldayzero\b//')
    echo "static: $libdir/libdayzero.a $static_libs"
    # shellcheck disable=SC2086
    "$cc" -std=c89 -pedantic -Wall -Werror "$src" $(pkg-config --cflags dayzero) "$libdir/libdayzero.a" $static_libs \
      -o "$work/simple_static"
    if ldd "$work/simple_static" | grep -q libdayzero; then echo "simple_static loads a shared libdayzero"; exit 1; fi
    "$work/simple_static" "$model" 8 2 17 300 | grep -q '^generated:' || { echo "simple_static failed"; exit 1; }
    ;;
  cmake)
    cmake -S "$(dirname "$0")/cmake" -B "$work/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
      -DDZ_SIMPLE_SOURCE="$src" -DCMAKE_BUILD_TYPE=Release >"$work/configure.log" ||
      { cat "$work/configure.log"; exit 1; }
    cmake --build "$work/build" >"$work/build.log" || { cat "$work/build.log"; exit 1; }
    cp "$work/build/simple" "$work/simple"
    ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
# The program must use the installed library, not the build tree's.
deps=$(ldd "$work/simple")
grep -q "=> $libdir/libdayzero.so" <<<"$deps" ||
  { echo "simple does not load libdayzero from $libdir:"; echo "$deps"; exit 1; }
out=$("$work/simple" "$model" 8 2 17 300)
echo "$out"
ids=$(echo "$out" | sed -n 's/^generated://p')
[ "$(echo "$ids" | wc -w)" = 8 ] || { echo "expected 8 generated ids"; exit 1; }
if err=$("$work/simple" "$work/no-such-model" 2>&1); then echo "bad path succeeded"; exit 1; fi
echo "$err"
echo "$err" | grep -q "DZ_ERR_IO: .*$work/no-such-model" || { echo "bad path error lacks status/path"; exit 1; }
echo "$mode consumer ok"
