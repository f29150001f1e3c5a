"""Build FlashInfer 0.7.2.post1's sm_90a fp8 prefill module (``fa3``, e4m3 q / k / v, bf16 output,
head dim 128, int32 indices: what its ragged wrapper plans for the fp8 attention bench) on this CPU
machine and pack it into an overlay of the trimmed FlashInfer tree, as ``fi_mla_overlay.py``
does for MLA (same steps, same work folder layout; only the generated module differs).

    MAX_JOBS=2 python scripts/fi_fp8_overlay.py build/fi   # 11 nvcc units: ~40 min on one core

Output: ``WORK/fi_fp8_overlay.tar.xz``; unpack it over the trimmed tree on the GPU machine after
``setup.sh`` (``tar -xJf ... -C $FI_WORK/site``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fi_mla_overlay as base  # noqa: E402

MODULE = """
import flashinfer, flashinfer.prefill
from flashinfer.jit.attention.modules import gen_batch_prefill_module
E4, BF = torch.float8_e4m3fn, torch.bfloat16
spec = gen_batch_prefill_module("fa3", E4, E4, BF, torch.int32, 128, 128, 0, False, False, False)
"""


def main():
    base.main(base.gen_script(MODULE), "fi_fp8_overlay.tar.xz")


if __name__ == "__main__":
    main()
