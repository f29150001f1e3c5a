#!/usr/bin/env bash
# Compile the kernel presets for the given arches into a cache directory that can be shipped to
# GPU machines (no GPU needed here; needs nvidia-cutlass-dsl).
#   usage: scripts/compile_aot.sh [OUT_DIR=build/aot] [PRESET=all] [ARCH ...]
# (preset `all`: everything the GPU tests and benchmarks load; $JOBS workers per arch, default 2)
set -euo pipefail
out=${1:-build/aot}; preset=${2:-all}; shift $(( $# > 2 ? 2 : $# ))
archs=("$@"); [ ${#archs[@]} -gt 0 ] || archs=(sm_90a sm_100a)
arch_flags=(); for a in "${archs[@]}"; do arch_flags+=(--arch "$a"); done
exec python3 -m cute_attn compile "${arch_flags[@]}" --preset "$preset" --out "$out" --jobs "${JOBS:-2}"
