"""The head-dim-64 decode case alone (gpt-oss: 64 q / 8 kv heads, bs 64 x 4k, page 16), ours and
FlashInfer's in turns, recorded as ``python -m cute_attn bench`` records it.

    python scripts/bench_decode_hd64.py OUT.json   # the decode preset's hd64 bf16 modules in the cache
"""

import sys

from cute_attn.bench import decode
from cute_attn.bench.common import Results

res = Results()
decode.bench_decode(res, False, cases=[c for c in decode.shape_cases() if c[5] == 64])
res.merge_into(sys.argv[1])
