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

GEN = """
import json, os, sys, torch
ROOT = os.path.realpath(sys.argv[1]); opened = set()
def hook(ev, a):
    if ev == "open" and a and isinstance(a[0], (str, bytes, os.PathLike)):
        p = os.path.realpath(os.fsdecode(a[0]))
        if p.startswith(ROOT + os.sep): opened.add(os.path.relpath(p, ROOT))
sys.addaudithook(hook)
import flashinfer, flashinfer.decode, flashinfer.prefill
from flashinfer.prefill import _gen_batch_prefill_primary_module
BF = torch.bfloat16
spec = _gen_batch_prefill_primary_module("fa2", BF, BF, BF, torch.int32, 64, 64, 0, False, False, False)
if sys.argv[3] == "build" and not spec.aot_path.exists():
    import shutil
    from flashinfer.jit.core import build_jit_specs
    build_jit_specs([spec])
    spec.aot_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(spec.jit_library_path, spec.aot_path)
mods = [m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)]
py = [os.path.relpath(os.path.realpath(f), ROOT) for f in mods if os.path.realpath(f).startswith(ROOT + os.sep)]
json.dump(dict(files=sorted(set(py) | opened), so=os.path.relpath(spec.aot_path, ROOT)), open(sys.argv[2], "w"))
"""


def main():
    base.GEN = GEN
    base.main()
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "build/fi").resolve()
    (work / "fi_mla_overlay.tar.xz").rename(work / "fi_decode_overlay.tar.xz")
    print(f"-> {work / 'fi_decode_overlay.tar.xz'}")


if __name__ == "__main__":
    main()
