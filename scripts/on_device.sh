#!/usr/bin/env bash
# There (GPU machine, from the checkout's root, build/run carried; scripts/pack_visit.sh made it):
# unpack the kernel cache, make FlashInfer importable (with the overlays packed beside it), point
# cute_attn at the cache and the packed commit, then run the commands in build/run/src with
# logs under $OUT.
#   usage: bash scripts/on_device.sh 'python3 -m cute_attn bench --only prefill --json $OUT/r.json'
set -uo pipefail
R=$(pwd)/${VISIT_DIR:-build/run}  # VISIT_DIR: a second pack carried beside the first
W=/tmp/visit; mkdir -p "$W"
tar -xJf "$R/aot.tar.xz" -C "$W"
if [ -f "$R/flashinfer/setup.sh" ]; then
  . "$R/flashinfer/setup.sh" > "$OUT/flashinfer_setup.log" 2>&1
  for o in "$R"/fi_*_overlay.tar.xz; do [ -f "$o" ] && tar -xJf "$o" -C "$FI_WORK/site"; done
fi
export CUTE_ATTN_CACHE_DIR=$W/aot CUTE_ATTN_COMMIT=$(cat "$R/commit") PYTHONUNBUFFERED=1
export PYTHONPATH=$R/src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/smi.txt" 2>&1
cd "$R/src" && bash -c "$1"
