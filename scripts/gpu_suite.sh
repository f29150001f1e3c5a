#!/usr/bin/env bash
# On a GPU machine, from a prebuilt cache (scripts/compile_aot.sh; the DSL is not needed here):
# run the GPU tests, then the benchmarks.  Logs and results.json go to LOG_DIR.
#   usage: scripts/gpu_suite.sh [CACHE_DIR=build/aot] [LOG_DIR=${OUT:-build/gpu_logs}] [bench args...]
set -uo pipefail
cd "$(dirname "$0")/.."
cache=$(realpath "${1:-build/aot}"); logs=${2:-${OUT:-build/gpu_logs}}; shift $(( $# > 2 ? 2 : $# ))
mkdir -p "$logs"
export CUTE_ATTN_CACHE_DIR=$cache PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -m cute_attn info 2>&1 | tee "$logs/info.log"
python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests 2>&1 | tee "$logs/gpu_tests.log"
rc=${PIPESTATUS[0]}
python3 -m cute_attn bench --json "$logs/results.json" "$@" 2>&1 | tee "$logs/bench.log"
exit $rc
