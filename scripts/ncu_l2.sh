#!/usr/bin/env bash
# L2 traffic of the hd128 ragged prefill, ours against FlashInfer's fa3 (GPU machine, from a
# packed build's src; scripts/on_device.sh sets up the cache and FlashInfer): Nsight Compute on
# one eager call each of scripts/profile_prefill.py, 2 x 8k x 16 heads, causal and not.  The
# question it answers: how close the K/V reads from L2 (8.6 GB per non-causal call) run to the
# L2's peak -- what a 2-CTA cluster with TMA multicast could save.
#   usage: VISIT_DIR=build/runX bash scripts/on_device.sh 'bash scripts/ncu_l2.sh'
set -uo pipefail
M=lts__t_sectors.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum.per_second
M=$M,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct,dram__bytes_read.sum
M=$M,gpu__time_duration.sum,sm__cycles_active.avg
for impl in ours flashinfer; do
  for mode in noncausal causal; do
    timeout 120 ncu --clock-control none --profile-from-start off --metrics "$M" \
      python3 scripts/profile_prefill.py "$impl" "$mode" 128 > "$OUT/ncu_l2_${impl}_$mode.txt" 2>&1
    echo "== $impl $mode"
    grep -E "lts__|dram__|gpu__time|sm__" "$OUT/ncu_l2_${impl}_$mode.txt"
  done
done
