#!/usr/bin/env bash
# Here (CPU machine): pack several builds for one GPU visit's A/B (scripts/ab_builds.py). For each
# TAG=REV: the checkout at REV (git archive) and a kernel cache compiled by that checkout's own code
# (cache keys hash the kernel sources: a cache serves only the checkout that built it), slimmed, in
# build/run/ab/TAG/{src,aot.tar.xz,commit}. The arguments after -- go to the compile CLI.
#   usage: scripts/pack_ab.sh TAG=REV [TAG=REV ...] -- COMPILE_ARGS...
#   e.g.   scripts/pack_ab.sh before=1b54152 main=HEAD -- --arch sm_90a --preset prefill_mma
# Then: run(command="bash scripts/ab_on_device.sh 3 before main", carry=["build/run"]).
set -euo pipefail
cd "$(dirname "$0")/.."
builds=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do builds+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#builds[@]} -gt 0 ] && [ $# -gt 0 ] || { echo "usage: scripts/pack_ab.sh TAG=REV ... -- COMPILE_ARGS..."; exit 2; }
root=build/run/ab
for b in "${builds[@]}"; do
  tag=${b%%=*} rev=${b#*=}
  d=$root/$tag
  rm -rf "$d" && mkdir -p "$d/src"
  git archive "$rev" | tar -x -C "$d/src"
  git rev-parse --short "$rev" > "$d/commit"
  (cd "$d/src" && PYTHONPATH=. python3 -m cute_attn compile "$@" --out "$PWD/../aot_full")
  python3 scripts/slim_cache.py "$d/aot_full" "$d/aot_slim"
  tar -cJf "$d/aot.tar.xz" -C "$d" --transform 's/^aot_slim/aot/' aot_slim
  rm -rf "$d/aot_full" "$d/aot_slim"
done
du -sh "$root"/*
