"""The Hopper prefill kernel's shapes per head dim (``prefill_sm90.py``): keys per block and
K / V stages, where items run back to back or P is pinned, and the
registers each warpgroup gets -- what fits 227 KB of shared memory and keeps ptxas's wgmmas
asynchronous, chosen by measurement on the H200 (the figures beside each table)."""

ROW_RING = 3  # blocks of page lookups the gather producer stages in smem (prefill_sm90_producer)
SMEM_MAX = 232448  # bytes of shared memory per block on sm_90

# (tile_n, stages) per (head dim, cp.async gather): what fits 227 KB of shared memory next to the Q
# and output tiles and leaves ptxas enough registers to keep the wgmmas asynchronous: at hd128 x
# 128 keys (and hd256 x 80) without ``pin_p`` it serializes every wgmma ("C7512 ... insufficient
# register resources"), which costs ~30 %.
KV_TILES = {
    (64, False): (128, 4),
    (64, True): (128, 4),
    (80, False): (128, 4),
    (80, True): (128, 4),
    (96, False): (112, 4),  # 128 keys: serialized wgmmas with the page boxes' and the gather's registers
    (96, True): (112, 4),
    (128, False): (112, 2),
    (128, True): (96, 2),
    (256, False): (64, 2),
    (256, True): (48, 2),
}
# the same per (head_dim_qk, head_dim_vo, gather) of the asymmetric kernels: at 192 / 128 the
# registers are hd128's (the QK GEMM's K-dimension lives in shared memory) and 112 keys of K
# (2 x 42 KB), V (2 x 28 KB), Q (48 KB) and O (32 KB) fill 220 KB
KV_TILES_VO = {
    (192, 128, False): (112, 2),
    (192, 128, True): (96, 2),
}
# keys per block where items run back to back by default (``overlap_items``: two Q buffers, P
# pinned), per (head dim, gather): hd128 x 128 keys ran 1.02 / 1.08 / 1.10x main's speed on the
# H200 (ragged 2 x 8k non-causal / causal, the varlen32 batch; 112 keys back to back 0.97 / 0.95 /
# 0.93x: the causal diagonal of a 128-row tile is one 128-key block, two of 112)
OVERLAP_TILES = {(128, False): 128}
# where plain kernels pin P by default besides items back to back, per (head dim, gather): hd256
# pinned ran 1.07x / 1.05x unpinned (ragged 2 x 8k non-causal / causal, H200).  Storing the output
# from registers to free the staging tile for longer blocks (FA3's 80 keys at hd256, 144-192 at
# hd128; tried in 2695d23, removed) lost: 0.955x / 0.971x at hd256, 0.99-0.89x at hd128
PINNED = {(256, False)}
# registers per thread after setmaxnreg, (producer, consumers): 3 warpgroups share 64512
# registers (168 each at launch); the TMA producer needs few, the cp.async gather more.  With one
# consumer warpgroup the pool is ample.
REGS = {(2, False): (24, 240), (2, True): (56, 224), (1, False): (56, 256), (1, True): (56, 256)}


def smem_bytes(k, q_bufs: int) -> int:
    """Shared memory of a prefill kernel ``k``'s tiles (its ``host``'s ``Smem``, alignment padding
    included) with ``q_bufs`` Q buffers."""
    w = k.dtype.width // 8
    tiles = (
        q_bufs * k.tile_q * k.head_dim,
        k.stages * k.tile_n * k.head_dim,
        k.stages * k.tile_n * k.head_dim_vo,
        k.tile_q * k.o_cols,
    )
    rows = 2 * k.tile_n * ROW_RING * 8 if k.gather else 8
    return sum(-(-t * w // 1024) * 1024 for t in tiles) + 1024 + rows + 32 * k.stages
