#!/usr/bin/env bash
# Compile the kernel presets for the given arches into a cache directory that can be shipped to
# GPU machines (no GPU needed here; needs nvidia-cutlass-dsl).
#   usage: scripts/compile_aot.sh [OUT_DIR=build/aot] [PRESET=default] [ARCH ...]
set -euo pipefail
out=${1:-build/aot}; preset=${2:-default}; shift $(( $# > 2 ? 2 : $# ))
archs=("$@"); [ ${#archs[@]} -gt 0 ] || archs=(sm_90a sm_100a)
arch_flags=(); for a in "${archs[@]}"; do arch_flags+=(--arch "$a"); done
exec python3 -m cute_attn compile "${arch_flags[@]}" --preset "$preset" --out "$out"
