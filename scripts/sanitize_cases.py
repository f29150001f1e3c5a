"""Small cases of every kernel family, one launch each, for compute-sanitizer
(``scripts/sanitize.sh``): merge_states, merge_pair (masked and not), paged decode (plain, head
packing, a traced variant, split-KV with its merge_partials), batch prefill ragged / paged (TMA
page boxes and the cp.async gather) causal and not, the KV pass (a gathered paged cache, RoPE
keys), the cascade and the block-sparse wrapper.  Prints one line per case that ran (the GPU
tests check the results; this only gives the sanitizer every kernel to watch)."""

from __future__ import annotations

import sys

import torch

import cute_attn

DEV, BF = "cuda", torch.bfloat16
GEN = torch.Generator().manual_seed(0)


def rnd(*shape, dtype=BF):
    return torch.randn(*shape, generator=GEN).to(DEV, dtype)


def paged(kv_lens, ps, hk, d):
    pages = [(n + ps - 1) // ps for n in kv_lens]
    total = sum(pages) + 2
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    indices = torch.randperm(total, generator=GEN)[: int(indptr[-1])].to(torch.int32)
    last = torch.tensor([n - (p - 1) * ps if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return (rnd(total, ps, hk, d), rnd(total, ps, hk, d)), indptr, indices, last


def ws(mb=64):
    return torch.empty(mb << 20, dtype=torch.uint8, device=DEV)


def case_merge():
    v, s = rnd(64, 3, 4, 128), rnd(64, 3, 4, dtype=torch.float32)
    cute_attn.merge_states(v, s)
    va, sa, vb, sb = rnd(64, 4, 128), rnd(64, 4, dtype=torch.float32), rnd(64, 4, 128), rnd(64, 4, dtype=torch.float32)
    cute_attn.merge_state(va, sa, vb, sb)
    cute_attn.merge_state_in_place(va, sa, vb, sb, mask=torch.rand(64, generator=GEN).to(DEV) > 0.5)


def case_decode(kv_lens, ps, heads_per_item=None, **plan_kw):
    hq, hk, d = 16, 4, 128
    cache, indptr, indices, last = paged(kv_lens, ps, hk, d)
    if "kv_data_type" in plan_kw:
        cache = tuple(t.to(plan_kw["kv_data_type"]) for t in cache)
    w = cute_attn.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, hq, hk, d, ps, q_data_type=BF, heads_per_item=heads_per_item, **plan_kw)
    w.run(rnd(len(kv_lens), hq, d), cache)


def case_prefill(paged_ps, causal, kv_pass=None):
    hq, hk, d = 8, 2, 128
    qo, kv = [17, 130, 1], [40, 300, 65]
    q = rnd(sum(qo), hq, d)
    qo_ind = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32)
    if paged_ps:
        cache, indptr, indices, last = paged(kv, paged_ps, hk, d)
        w = cute_attn.BatchPrefillWithPagedKVCacheWrapper(ws(128))
        w.plan(qo_ind, indptr, indices, last, hq, hk, d, paged_ps, causal=causal, q_data_type=BF, kv_pass=kv_pass)
        w.run(q, cache)
    else:
        kv_ind = torch.tensor([0] + torch.tensor(kv).cumsum(0).tolist(), dtype=torch.int32)
        w = cute_attn.BatchPrefillWithRaggedKVCacheWrapper(ws())
        w.plan(qo_ind, kv_ind, hq, hk, d, causal=causal, q_data_type=BF, pos_encoding_mode="NONE")
        w.run(q, rnd(sum(kv), hk, d), rnd(sum(kv), hk, d))


def case_rope_ragged():
    hq, hk, d, qo, kv = 8, 2, 128, [33], [90]
    w = cute_attn.BatchPrefillWithRaggedKVCacheWrapper(ws())
    ind_q, ind_k = torch.tensor([0, 33], dtype=torch.int32), torch.tensor([0, 90], dtype=torch.int32)
    w.plan(ind_q, ind_k, hq, hk, d, causal=True, q_data_type=BF, pos_encoding_mode="ROPE_LLAMA")
    w.run(rnd(sum(qo), hq, d), rnd(sum(kv), hk, d), rnd(sum(kv), hk, d))


def case_cascade():
    hq, hk, d, ps, b = 8, 2, 128, 16, 4
    cache, p_indptr, p_indices, p_last = paged([64], ps, hk, d)
    own = [(i * 16) % ps or ps for i in range(b)]
    n_pages = cache[0].shape[0]
    own_indices = torch.arange(b, dtype=torch.int32) % n_pages
    w = cute_attn.MultiLevelCascadeAttentionWrapper(2, ws(192))
    w.plan(
        [torch.tensor([0, b], dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32)],
        [p_indptr, torch.arange(b + 1, dtype=torch.int32)],
        [p_indices, own_indices],
        [p_last, torch.tensor(own, dtype=torch.int32)],
        hq,
        hk,
        d,
        ps,
        q_data_type=BF,
    )
    w.run(rnd(b, hq, d), cache)


def case_sparse():
    hq, hk, d, R, C, M, N = 8, 2, 128, 16, 16, 64, 64
    indptr = torch.tensor([0, 2, 3, 3, 4], dtype=torch.int32)
    indices = torch.tensor([0, 2, 1, 3], dtype=torch.int32)
    w = cute_attn.BlockSparseAttentionWrapper(ws())
    w.plan(indptr, indices, M, N, R, C, hq, hk, d, q_data_type=BF)
    w.run(rnd(M, hq, d), rnd(N, hk, d), rnd(N, hk, d))


CASES = {
    "merge": case_merge,
    "decode_plain": lambda: case_decode([1, 33, 300], 16, 1),
    "decode_packed4": lambda: case_decode([64] * 8, 16, 4),
    "decode_page1_split": lambda: case_decode([5000, 7], 1, 1),
    "decode_softcap_window": lambda: case_decode([200, 9], 16, 1, logits_soft_cap=30.0, window_left=50),
    "decode_fp8_split": lambda: case_decode([5000, 7, 130], 16, 1, kv_data_type=torch.float8_e4m3fn),
    "decode_fp8_packed4_page1": lambda: case_decode([64] * 8, 1, 4, kv_data_type=torch.float8_e5m2),
    "prefill_ragged": lambda: case_prefill(0, False),
    "prefill_ragged_causal": lambda: case_prefill(0, True),
    "prefill_page16_boxes": lambda: case_prefill(16, True, kv_pass=False),
    "prefill_page1_gather": lambda: case_prefill(1, False, kv_pass=False),
    "prefill_page1_kv_pass": lambda: case_prefill(1, True, kv_pass=True),
    "prefill_rope_kv_pass": case_rope_ragged,
    "cascade": case_cascade,
    "sparse": case_sparse,
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(CASES)
    for name in names:
        CASES[name]()
        torch.cuda.synchronize()
        print(f"case {name}: ran", flush=True)
