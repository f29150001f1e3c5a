#!/usr/bin/env bash
# There (GPU machine, from the checkout's root, build/run carried; scripts/pack_ab.sh made
# build/run/ab): unpack each build's cache, run scripts/ab_builds.py for the builds in turns
# (ROUNDS rounds: A, B, ..., A, B, ...; each build's code from its own src/ and cache), every
# output checked against the first build's first run, then compare (ratios to the first TAG).
# Logs and JSON under $OUT. AB_ONLY narrows the cases (see ab_builds.py); AB_RUN_TIMEOUT (s, 300)
# ends one build's run that hangs (a kernel that deadlocks) so the others still run.
#   usage: bash scripts/ab_on_device.sh ROUNDS TAG [TAG ...]
set -uo pipefail
rounds=${1:?usage: bash scripts/ab_on_device.sh ROUNDS TAG [TAG ...]}
shift
R=$(pwd)/build/run/ab W=/tmp/ab first=$1
for t in "$@"; do mkdir -p "$W/$t" && tar -xJf "$R/$t/aot.tar.xz" -C "$W/$t"; done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/smi.txt" 2>&1
for r in $(seq 1 "$rounds"); do
  for t in "$@"; do
    ref=()
    [ "$t.$r" != "$first.1" ] && ref=("$OUT/$first.1.json")
    PYTHONPATH=$R/$t/src CUTE_ATTN_CACHE_DIR=$W/$t/aot CUTE_ATTN_COMMIT=$(cat "$R/$t/commit") PYTHONUNBUFFERED=1 \
      timeout "${AB_RUN_TIMEOUT:-300}" python3 scripts/ab_builds.py run "$t" "$OUT/$t.$r.json" ${ref[@]+"${ref[@]}"} >> "$OUT/ab_$t.log" 2>&1 ||
      echo "build $t, round $r: failed (see ab_$t.log)"
  done
done
files=()
for t in "$@"; do files+=("$OUT/$t".*.json); done
python3 scripts/ab_builds.py compare "${files[@]}" | tee "$OUT/compare.txt"
