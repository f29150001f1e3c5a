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
    flat = bool_mask(custom_mask).reshape(-1).numpy()
    if flat.size != n.sum():
        raise ValueError(f"custom_mask has {flat.size} entries, expected sum(qo_len * kv_len) = {int(n.sum())}")
    offs = np.concatenate([[0], np.cumsum(n)])
    packed = [np.packbits(flat[offs[b] : offs[b + 1]], bitorder="little") for b in range(n.shape[0])]
    indptr = np.concatenate([[0], np.cumsum((n + 7) // 8)]).astype(np.int64)
    return torch.from_numpy(np.concatenate(packed + [np.zeros(1, np.uint8)])), indptr


def check_mask_type(mask, name: str = "custom_mask") -> None:
    """A mask argument is a bool (or 0 / 1 integer) tensor: a floating one is refused -- an
    additive mask (0 = visible, -inf = masked) cast to bool would come out inverted."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (bool), got {type(mask).__name__}")
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(
            f"{name} must be bool (True: the key is visible), got {mask.dtype}; an additive mask "
            f"converts as (mask == 0)"
        )


def check_single_mask(custom_mask, qo_len: int, kv_len: int) -> None:
    """A single request's ``custom_mask``: flat, or ``[qo_len, kv_len]`` (a transposed mask has
    the right number of entries, so its shape is what tells), of a mask type."""
    if custom_mask is None:
        return
    check_mask_type(custom_mask)
    if custom_mask.dim() != 1 and tuple(custom_mask.shape) != (qo_len, kv_len):
        raise ValueError(
            f"custom_mask must be [qo_len, kv_len] = [{qo_len}, {kv_len}] (or flat), got {tuple(custom_mask.shape)}"
        )


def bool_mask(mask, name: str = "custom_mask") -> torch.Tensor:
    """A mask argument as a CPU bool tensor of its shape: True = the key is visible (bool, or
    integers that are all 0 / 1: ``check_mask_type``)."""
    check_mask_type(mask, name)
    out = mask.detach().to("cpu")
    if out.dtype != torch.bool:
        if out.numel() and not bool(((out == 0) | (out == 1)).all()):
            raise ValueError(f"{name} of {mask.dtype} must hold only 0 / 1 (or be bool)")
        out = out.to(torch.bool)
    return out


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


def plan_custom_mask(w, custom_mask, packed, qo_len, kv_lens) -> CustomMask:
    """A prefill wrapper ``w``'s plan's ``CustomMask`` (FlashInfer's layout).  With ``use_cuda_graph``
    the offsets go into the constructor's ``mask_indptr_buf`` and the bits into an int32
    twin of ``custom_mask_buf`` (the kernels read words; the uint8 buffer only sizes it): a
    captured run() reads them there."""
    packed, indptr = packed_mask(custom_mask, packed, qo_len, kv_lens)
    if not w._use_cuda_graph:
        return device_mask(packed, indptr, qo_len, kv_lens, w._device)
    indptr_t = torch.from_numpy(indptr.astype(np.int32))
    qo_h = np.concatenate([[0], np.cumsum(qo_len)]).astype(np.int32)
    mbuf, ibuf = w._mask_buf, w._mask_indptr_buf
    if mbuf is None or ibuf is None:
        raise ValueError(
            "use_cuda_graph=True with a custom mask needs custom_mask_buf (uint8) and "
            "mask_indptr_buf (int32) in the constructor, as in FlashInfer"
        )
    if packed.numel() > mbuf.numel() or indptr_t.numel() > ibuf.numel():
        raise ValueError(
            f"the packed mask ({packed.numel()} bytes, {indptr_t.numel()} offsets) exceeds "
            f"custom_mask_buf / mask_indptr_buf ({mbuf.numel()} / {ibuf.numel()})"
        )
    if w._mask_words_buf is None:  # the kernel reads words: a fixed int32 twin
        w._mask_words_buf = torch.zeros(mbuf.numel() // 4 + 1, dtype=torch.int32, device=w._device)
    if w._mask_bounds_buf is None:  # the first plan fixes the query tokens
        w._mask_bounds_buf = torch.zeros((max(int(qo_h[-1]), 1), 2), dtype=torch.int32, device=w._device)
        w._mask_qo_buf = torch.zeros(w._qo_indptr_buf.numel(), dtype=torch.int32, device=w._device)
    if qo_h[-1] > w._mask_bounds_buf.shape[0] or qo_h.size > w._mask_qo_buf.numel():
        raise ValueError(
            f"use_cuda_graph=True: {int(qo_h[-1])} query tokens / batch {qo_h.size - 1} exceed "
            f"the first plan's {w._mask_bounds_buf.shape[0]} / {w._mask_qo_buf.numel() - 1}"
        )
    if mbuf.dtype != torch.uint8:
        raise ValueError(f"custom_mask_buf must be uint8 (FlashInfer's packed bytes), got {mbuf.dtype}")
    # the constructor's buffer holds the plan's bytes, as FlashInfer's does (engines read it
    # back as ``_custom_mask_buf``); the kernels read the word twin, so a captured run() sees
    # the mask as planned
    mbuf[: packed.numel()].copy_(packed.reshape(-1), non_blocking=True)
    ibuf[: indptr_t.numel()].copy_(indptr_t, non_blocking=True)
    w._mask_qo_buf[: qo_h.size].copy_(torch.from_numpy(qo_h), non_blocking=True)
    words = CustomMask.words(packed, w._mask_words_buf)
    return CustomMask(
        packed_custom_mask=words,
        mask_indptr=ibuf,
        qo_indptr=w._mask_qo_buf,
        kv_bounds=mask_kv_bounds(
            words.view(torch.uint8)[: packed.numel()], indptr, qo_len, kv_lens, out=w._mask_bounds_buf
        ),
    )
