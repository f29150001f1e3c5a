"""Example of a user-defined variant (documented in docs/variants.md, tested on the GPU).

A learned relative-position bias, as in T5-style models: every query head has a table of
``num_buckets`` biases; a key at distance ``q_pos - kv_pos`` from the query adds
``bias_table[qo_head, min(distance // bucket_size, num_buckets - 1)]`` to its logit.
``bucket_size`` and ``num_buckets`` are static (compiled in); the table is a runtime tensor.
"""

from __future__ import annotations

from cute_attn.variants import TensorParam, Variant, dsl


class RelativePositionBias(Variant):
    static = {"bucket_size": 16, "num_buckets": 32}
    runtime = (TensorParam("bias_table", "f32", 2, rows="num_qo_heads"),)  # [num_qo_heads, num_buckets]

    def bias(self, ctx, scale):  # an additive logit: the prefill kernel loads it before the QK wait
        dist = ctx.q_pos - ctx.kv_pos  # >= 0 for causal/decode keys
        bucket = dsl.select(dist < 0, 0, dist // self.bucket_size)
        bucket = dsl.select(bucket > self.num_buckets - 1, self.num_buckets - 1, bucket)
        return ctx.args.bias_table[ctx.qo_head, bucket] * scale
