#!/usr/bin/env bash
# Every kernel family under the four compute-sanitizer tools, on small cases
# (scripts/sanitize_cases.py), on a GPU machine with a kernel cache (no DSL needed).
#   usage: scripts/sanitize.sh [CACHE_DIR=build/aot] [LOG_DIR=${OUT:-build/sanitize}]
# Prints one line per tool: its error summary.  memcheck, racecheck and synccheck instrument only
# our kernels (--kernel-name-exclude skips PyTorch's own: their names hold "native").
set -uo pipefail
cd "$(dirname "$0")/.."
cache=$(realpath "${1:-build/aot}"); logs=${2:-${OUT:-build/sanitize}}
mkdir -p "$logs"
export CUTE_ATTN_CACHE_DIR=$cache PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
rc=0
for tool in memcheck racecheck initcheck synccheck; do
  # initcheck instruments every kernel: the writes of kernels it skips would not count, and the
  # inputs PyTorch's kernels wrote would read as uninitialized (4096 false reports seen)
  extra=(--kernel-name-exclude kns=native)
  [ "$tool" = memcheck ] && extra+=(--leak-check no)
  [ "$tool" = initcheck ] && extra=()
  compute-sanitizer --tool "$tool" "${extra[@]}" --print-limit 20 \
      python3 scripts/sanitize_cases.py > "$logs/sanitize_$tool.log" 2>&1
  code=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$logs/sanitize_$tool.log" | tail -1)
  cases=$(grep -c "^case .*: ran" "$logs/sanitize_$tool.log")
  echo "$tool: exit $code, $cases cases ran, ${summary:-no summary}"
  [ $code -ne 0 ] && rc=1
done
exit $rc
