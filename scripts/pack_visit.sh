#!/usr/bin/env bash
# Here (CPU machine): pack what one GPU visit needs into build/run (ignored; carry it):
# the kernel cache slimmed to what running needs (aot.tar.xz), HEAD's tree (src/, its commit in
# commit), FlashInfer's trimmed tree from ../shared/tools/flashinfer and any overlays given
# (scripts/fi_*_overlay.py outputs).  Commit first: the visit runs HEAD, not the working tree.
#   usage: [VISIT_DIR=build/run2 VISIT_REV=REV] scripts/pack_visit.sh CACHE_DIR [OVERLAY.tar.xz ...]
# Then: run(command="bash scripts/on_device.sh '<commands>'", carry=["build/run"]).
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${1:?usage: [VISIT_DIR=... VISIT_REV=...] scripts/pack_visit.sh CACHE_DIR [OVERLAY.tar.xz ...]}; shift
run=${VISIT_DIR:-build/run}  # VISIT_DIR: pack a second visit tree (another commit) beside the first
mkdir -p "$run"
rm -rf "$run/src" "$run/aot_slim" "$run"/*.tar.xz
python3 scripts/slim_cache.py "$cache" "$run/aot_slim"
tar -cJf "$run/aot.tar.xz" -C "$run" --transform 's/^aot_slim/aot/' aot_slim
rm -rf "$run/aot_slim"
mkdir -p "$run/src" && git archive "${VISIT_REV:-HEAD}" | tar -x -C "$run/src"
git rev-parse --short "${VISIT_REV:-HEAD}" > "$run/commit"
[ -n "$(git status --porcelain --untracked-files=no)" ] && echo "note: uncommitted changes are not in the visit's src/"
if [ -d ../shared/tools/flashinfer ] && [ ! -d "$run/flashinfer" ]; then cp -r ../shared/tools/flashinfer "$run/flashinfer"; fi
for o in "$@"; do cp "$o" "$run/"; done
du -sh "$run" && du -sh "$run"/* | sort -h | tail -4
