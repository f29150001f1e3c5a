"""Build FlashInfer 0.7.2.post1's sm_90a fp8 prefill module (``fa3``, e4m3 q / k / v, bf16 output,
head dim 128, int32 indices: what its ragged wrapper plans for the fp8 attention bench) on this CPU
machine and pack it into an overlay of the trimmed FlashInfer tree, as ``fi_mla_overlay.py``
does for MLA (same steps, same work folder layout; only the generated module differs).

    python scripts/fi_fp8_overlay.py build/fi          # nvcc on one core

Output: ``WORK/fi_fp8_overlay.tar.xz``; unpack it over the trimmed tree on the GPU machine after
``setup.sh`` (``tar -xJf ... -C $FI_WORK/site``)."""

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
import flashinfer, flashinfer.prefill
from flashinfer.jit.attention.modules import gen_batch_prefill_module
E4, BF = torch.float8_e4m3fn, torch.bfloat16
spec = gen_batch_prefill_module("fa3", E4, E4, BF, torch.int32, 128, 128, 0, False, False, False)
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
    (work / "fi_mla_overlay.tar.xz").rename(work / "fi_fp8_overlay.tar.xz")
    print(f"-> {work / 'fi_fp8_overlay.tar.xz'}")


if __name__ == "__main__":
    main()
