"""Build FlashInfer 0.7.2.post1's sm_90a module behind its tensor-core decode at head dim 64
(``fa2`` batch prefill, bf16, int32 indices, no sliding window / soft-cap: what
``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`` plans for gpt-oss's 64 / 8 heads)
on this CPU machine and pack it into an overlay of the trimmed FlashInfer tree, as
``fi_mla_overlay.py`` does for MLA (same steps and work folder; only the generated module
differs).

    python scripts/fi_decode_overlay.py build/fi          # nvcc on one core

Output: ``WORK/fi_decode_overlay.tar.xz``; unpack it over the trimmed tree on the GPU machine
after ``setup.sh`` (``tar -xJf ... -C $FI_WORK/site``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fi_mla_overlay as base  # noqa: E402

MODULE = """
import flashinfer, flashinfer.decode, flashinfer.prefill
from flashinfer.prefill import _gen_batch_prefill_primary_module
BF = torch.bfloat16
spec = _gen_batch_prefill_primary_module("fa2", BF, BF, BF, torch.int32, 64, 64, 0, False, False, False)
"""


def main():
    base.main(base.gen_script(MODULE), "fi_decode_overlay.tar.xz")


if __name__ == "__main__":
    main()
