"""Custom masks in FlashInfer's conventions, for every wrapper: per request a row-major
``[qo_len, kv_len]`` bool block, bit-packed per request (little bit order), ``mask_indptr`` =
byte offset per request.  Decode's mask is the ``qo_len = 1`` case of prefill's."""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

from ..variants.builtins import CustomMask, mask_kv_bounds


def pack_custom_mask(custom_mask, qo_lens, kv_lens) -> Tuple[torch.Tensor, np.ndarray]:
    """FlashInfer's ``segment_packbits``: the flat bool mask (request b's row-major
    ``[qo_len, kv_len]`` block after request b-1's) bit-packed per request, little bit order;
    returns (packed uint8 on the CPU, byte indptr [batch + 1])."""
    n = np.asarray(qo_lens, dtype=np.int64) * np.asarray(kv_lens, dtype=np.int64)
    flat = custom_mask.reshape(-1).to(device="cpu", dtype=torch.bool).numpy()
    if flat.size != n.sum():
        raise ValueError(f"custom_mask has {flat.size} entries, expected sum(qo_len * kv_len) = {int(n.sum())}")
    offs = np.concatenate([[0], np.cumsum(n)])
    packed = [np.packbits(flat[offs[b] : offs[b + 1]], bitorder="little") for b in range(n.shape[0])]
    indptr = np.concatenate([[0], np.cumsum((n + 7) // 8)]).astype(np.int64)
    return torch.from_numpy(np.concatenate(packed + [np.zeros(1, np.uint8)])), indptr


def packed_mask(custom_mask, packed, qo_len, kv_lens) -> Tuple[torch.Tensor, np.ndarray]:
    """The plan's mask bits: ``custom_mask`` packed, or ``packed`` (``packed_custom_mask``)
    checked (uint8, at least the bytes the lengths need); (flat uint8 of at least one byte,
    byte indptr [batch + 1])."""
    if packed is None:
        packed, indptr = pack_custom_mask(custom_mask, qo_len, kv_lens)
    else:
        nbits = np.asarray(qo_len, dtype=np.int64) * np.asarray(kv_lens, dtype=np.int64)
        indptr = np.concatenate([[0], np.cumsum((nbits + 7) // 8)])
        if packed.numel() < indptr[-1]:
            raise ValueError(
                f"packed_custom_mask has {packed.numel()} bytes, the lengths need {int(indptr[-1])} "
                f"(per request ceil(qo_len * kv_len / 8), FlashInfer's segment_packbits)"
            )
        if packed.dtype != torch.uint8:
            raise ValueError(f"packed_custom_mask must be uint8, got {packed.dtype}")
    packed = packed.reshape(-1)
    if packed.numel() == 0:
        packed = torch.zeros(1, dtype=torch.uint8)
    return packed, indptr


def device_mask(packed, indptr, qo_len, kv_lens, device) -> CustomMask:
    """The ``CustomMask`` of a plan outside CUDA-graph mode: new tensors on ``device``."""
    qo_h = np.concatenate([[0], np.cumsum(qo_len)]).astype(np.int32)
    words = CustomMask.words(packed, device=device)
    return CustomMask(
        packed_custom_mask=words,
        mask_indptr=torch.from_numpy(indptr.astype(np.int32)).to(device, non_blocking=True),
        qo_indptr=torch.from_numpy(qo_h).to(device, non_blocking=True),
        kv_bounds=mask_kv_bounds(words.view(torch.uint8)[: packed.numel()], indptr, qo_len, kv_lens),
    )
