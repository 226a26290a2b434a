#!/usr/bin/env bash
# Build and run the C++ unit test of the Python-free core under AddressSanitizer and
# UBSan. Usage: bash csrc/tests/run.sh   (from anywhere; CXX overrides the compiler)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cxx="${CXX:-g++}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

"$cxx" -std=c++17 -O1 -g -Wall -Wextra -Werror -pthread \
    -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer \
    -I"$root/csrc" "$root"/csrc/kvpush/*.cpp "$root/csrc/tests/test_core.cpp" \
    -o "$out/test_core"

# LeakSanitizer is on; where a container forbids ptrace it cannot run, and
# ASAN_OPTIONS=detect_leaks=0 turns it off.
ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" \
UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}" \
    "$out/test_core"
