"""The MLA wrapper's arguments, normalized and checked before anything is planned or launched:
FlashInfer 0.7.2's three metadata forms (flat CSR, flat dense page table, an ``MLAPlanMetadata``
object), its plan-time contract options, and run()'s two tensor forms (q_nope / q_pe and
ckv / kpe, or ``query=`` / ``kv_cache=`` as a packed 576-wide tensor or a pair).

Errors: ``ValueError`` for bad input (``TypeError`` for a wrong kind of object or a missing
argument, as FlashInfer), ``NotImplementedError`` for what cute_attn does not support yet."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..abi import dtypes
from ..families.mla import HEAD_DIM_CKV, HEAD_DIM_KPE, MAX_HEADS
from ..sched.inputs import as_index_array, check_indptr
from . import common, guards

LN2 = math.log(2.0)
LSE_MODES = ("none", "base2", "basee")
LAYOUTS = (None, "packed", "split")
# FlashInfer's backend names: its own FA2 / FA3 plans are what this wrapper's kernel replaces;
# the others take other inputs at run time (page tables, packed caches, fp8) or are other kernels
OWN_BACKENDS = ("auto", "fa2", "fa3")
OTHER_BACKENDS = ("cutlass", "cutile", "trtllm-gen", "xqa", "cute-dsl", "cute-dsl-monolithic", "cute-dsl-modular")


@dataclass
class MLAPlanMetadata:
    """FlashInfer's ``flashinfer.mla.MLAPlanMetadata``: CSR (``qo_indptr``, ``kv_indptr``,
    ``kv_indices``, ``kv_len_arr``) and / or dense (``cum_seq_lens_q``, ``block_tables``
    [batch, pages], ``seq_lens``, ``max_q_len``) metadata of a plan."""

    qo_indptr: Optional[torch.Tensor] = None
    kv_indptr: Optional[torch.Tensor] = None
    kv_indices: Optional[torch.Tensor] = None
    kv_len_arr: Optional[torch.Tensor] = None
    cum_seq_lens_q: Optional[torch.Tensor] = None
    block_tables: Optional[torch.Tensor] = None
    seq_lens: Optional[torch.Tensor] = None
    max_q_len: Optional[int] = None

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr) -> MLAPlanMetadata:
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)

    @classmethod
    def dense(cls, cum_seq_lens_q, block_tables, seq_lens, max_q_len=None) -> MLAPlanMetadata:
        return cls(cum_seq_lens_q=cum_seq_lens_q, block_tables=block_tables, seq_lens=seq_lens, max_q_len=max_q_len)

    @classmethod
    def dual(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr, *, cum_seq_lens_q, block_tables, seq_lens,
             max_q_len=None) -> MLAPlanMetadata:  # fmt: skip
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr, cum_seq_lens_q, block_tables, seq_lens, max_q_len)


_CSR = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")
_DENSE = ("cum_seq_lens_q", "block_tables", "seq_lens", "max_q_len")


@dataclass(frozen=True)
class Batch:
    """A plan's batch in CSR form: host index arrays (int64) and the page table as given."""

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_lens: np.ndarray
    kv_indices: torch.Tensor  # int32, where the caller had it (CPU or GPU)
    qo_indptr_arg: object  # the caller's arrays, for FlashInfer's CUDA-graph buffer copies
    kv_indptr_arg: object
    kv_lens_arg: object

    @property
    def batch(self) -> int:
        return self.qo_indptr.shape[0] - 1

    @property
    def total_q(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def used_pages(self) -> int:
        return int(self.kv_indptr[-1])


def metadata_fields(metadata, flat: dict) -> dict:
    """The CSR / dense fields of plan()'s metadata: a metadata object (ours, FlashInfer's or
    anything with the same attributes) or the flat arguments, never both."""
    if metadata is not None:
        if any(v is not None for v in flat.values()):
            raise ValueError(
                "Both metadata object and flat metadata arguments were provided; only one representation may be "
                "supplied."
            )
        if not all(hasattr(metadata, n) for n in _CSR + _DENSE):
            raise TypeError(f"metadata must be an MLAPlanMetadata, got {type(metadata).__name__}")
        return {n: getattr(metadata, n) for n in _CSR + _DENSE}
    return flat


def csr_batch(fields: dict, page_size: int) -> Batch:
    """The batch in CSR form from either metadata form (a dense page table [batch, P] becomes
    kv_indptr = b * P and its rows as the page ids; both forms given: the CSR one is used, as
    FlashInfer's FA backends do), checked: indptrs non-decreasing from 0, one kv length per
    request within its pages (``kv_len <= pages * page_size``), a page table covering
    ``kv_indptr[-1]``, page ids >= 0 where they are on the host."""
    csr = [fields[n] is not None for n in _CSR]
    dense = [fields[n] is not None for n in _DENSE[:3]]
    if all(csr):
        qo_arg, kvp_arg, kvl_arg = fields["qo_indptr"], fields["kv_indptr"], fields["kv_len_arr"]
        qo = as_index_array("qo_indptr", qo_arg)
        kvp = as_index_array("kv_indptr", kvp_arg)
        indices = common.int32_tensor(fields["kv_indices"])
    elif any(csr):
        missing = [n for n, have in zip(_CSR, csr) if not have]
        raise TypeError(f"plan() missing required arguments: {', '.join(missing)}")
    elif all(dense):
        tables = fields["block_tables"]
        if not isinstance(tables, torch.Tensor) or tables.dim() != 2:
            raise ValueError(f"block_tables must be a 2-D [batch, pages] tensor, got {type(tables).__name__}")
        qo_arg, kvl_arg = fields["cum_seq_lens_q"], fields["seq_lens"]
        qo = as_index_array("cum_seq_lens_q", qo_arg)
        if tables.shape[0] != qo.shape[0] - 1:
            raise ValueError(f"block_tables has {tables.shape[0]} rows, cum_seq_lens_q says {qo.shape[0] - 1} requests")
        kvp = np.arange(tables.shape[0] + 1, dtype=np.int64) * tables.shape[1]
        kvp_arg = torch.from_numpy(kvp.astype(np.int32))
        indices = tables.to(torch.int32).reshape(-1)
    elif any(dense) or fields["max_q_len"] is not None:
        missing = [n for n, have in zip(_DENSE[:3], dense) if not have]
        raise TypeError(f"plan() missing required arguments: {', '.join(missing)}")
    else:
        raise TypeError("plan() requires metadata or flat metadata arguments.")
    qo_len = check_indptr("qo_indptr", qo)
    pages = check_indptr("kv_indptr", kvp)
    b = qo.shape[0] - 1
    if kvp.shape[0] != b + 1:
        raise ValueError(f"kv_indptr has {kvp.shape[0]} entries, qo_indptr says {b} requests (want {b + 1})")
    kv_lens = as_index_array("kv_len_arr", kvl_arg, b)
    if b and kv_lens.min() < 0:
        i = int(np.argmax(kv_lens < 0))
        raise ValueError(f"kv_len_arr[{i}] is negative ({int(kv_lens[i])})")
    over = kv_lens > pages * page_size
    if over.any():
        i = int(np.argmax(over))
        raise ValueError(
            f"kv_len_arr[{i}] = {int(kv_lens[i])} exceeds request {i}'s {int(pages[i])} pages of {page_size} tokens"
        )
    mq = fields.get("max_q_len")
    if mq is not None and b and int(qo_len.max()) > int(mq):
        raise ValueError(f"max_q_len={mq} is below the longest query ({int(qo_len.max())} tokens)")
    if indices.dim() != 1:
        raise ValueError(f"kv_indices must be 1-D, got shape {tuple(indices.shape)}")
    guards.check_indices_length(indices, int(kvp[-1]), "kv_indices")
    if not indices.is_cuda and int(kvp[-1]) and int(indices[: int(kvp[-1])].min()) < 0:
        i = int(torch.argmax((indices[: int(kvp[-1])] < 0).to(torch.int32)))
        raise ValueError(f"kv_indices[{i}] = {int(indices[i])} is a negative page id")
    return Batch(qo, kvp, kv_lens, indices, qo_arg, kvp_arg, kvl_arg)


def check_heads_dims(num_heads, head_dim_ckv, head_dim_kpe) -> int:
    """The heads and widths the kernel serves: any 1..MAX_HEADS heads, ckv 512 + kpe 64."""
    if head_dim_ckv != HEAD_DIM_CKV or head_dim_kpe != HEAD_DIM_KPE:
        raise NotImplementedError(
            f"head_dim_ckv={head_dim_ckv}, head_dim_kpe={head_dim_kpe}: the MLA kernel is built for "
            f"head_dim_ckv={HEAD_DIM_CKV} and head_dim_kpe={HEAD_DIM_KPE} (DeepSeek-V2/V3's latent and RoPE widths)"
        )
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or not 1 <= num_heads <= MAX_HEADS:
        raise ValueError(f"num_heads must be an int in [1, {MAX_HEADS}], got {num_heads!r}")
    return int(num_heads)


def plan_dtype(q_data_type, kv_data_type, output_dtype) -> tuple:
    """(q dtype, cache dtype): q = output float16 or bfloat16; the cache of the q dtype, or an
    fp8 latent cache (float8_e4m3fn / float8_e5m2: both ckv and kpe, read by the fp8 kernel)."""
    q = common.as_dtype(q_data_type, "q_data_type")
    kv = common.as_dtype(kv_data_type, "kv_data_type")
    o = common.as_dtype(output_dtype, "output_dtype") or q
    if q in common.FP8:
        raise NotImplementedError(f"fp8 queries (q_data_type {q}) are not supported by MLA: float16 / bfloat16 only")
    if common.dtype_name(q) is None or (kv != q and dtypes.name_of(kv, dtypes.FP8) is None):
        raise ValueError(
            f"q_data_type must be float16 or bfloat16 and kv_data_type the same or float8_e4m3fn / float8_e5m2, "
            f"got {q} / {kv}"
        )
    if o != q:
        raise NotImplementedError(f"output_dtype {o} must be the q dtype ({q})")
    return q, kv


def check_contract(use_profiler, query_layout, kv_cache_layout, lse_mode, output_scale, scale_mode, skip_softmax,
                   use_sinks) -> None:  # fmt: skip
    """plan()'s run-contract options: the values this kernel implements, else an error."""
    for name, v in (("query_layout", query_layout), ("kv_cache_layout", kv_cache_layout)):
        if v not in LAYOUTS:
            raise ValueError(f"{name} must be 'packed' or 'split', got {v!r}")
    if lse_mode not in LSE_MODES:
        raise ValueError(f"lse_mode must be one of {LSE_MODES}, got {lse_mode!r}")
    unsupported = (
        ("use_profiler", bool(use_profiler), "True"),
        ("output_scale", output_scale != "none", output_scale),
        ("scale_mode", scale_mode != "default", scale_mode),
        ("skip_softmax", bool(skip_softmax), "True"),
        ("use_sinks", bool(use_sinks), "True"),
    )
    for name, bad, value in unsupported:
        if bad:
            raise NotImplementedError(f"plan({name}={value!r}) is not supported by cute_attn's MLA kernel")


# ---- run() --------------------------------------------------------------------------------
def split_pair(name: str, a, b, packed, widths=(HEAD_DIM_CKV, HEAD_DIM_KPE)):
    """(nope, pe) of run()'s two forms: the separate tensors, or ``packed`` (``query=`` /
    ``kv_cache=``): one tensor whose last dim holds both (576 wide: views, no copy) or a pair.
    A 4-D packed cache [pages, 1, page_size, 576] (FlashInfer's trtllm form) drops its 1."""
    if packed is not None:
        if a is not None or b is not None:
            raise ValueError(f"pass {name}= or its two tensors, not both")
        if isinstance(packed, (tuple, list)):
            if len(packed) != 2:
                raise ValueError(f"{name}= must be a tensor or a pair of tensors, got {len(packed)} items")
            return packed[0], packed[1]
        if not isinstance(packed, torch.Tensor):
            raise TypeError(f"{name}= must be a tensor or a pair of tensors, got {type(packed).__name__}")
        if packed.dim() == 4 and packed.shape[1] == 1:
            packed = packed[:, 0]
        if packed.dim() != 3 or packed.shape[-1] != sum(widths):
            raise ValueError(f"a packed {name} must be 3-D [..., {sum(widths)}], got {tuple(packed.shape)}")
        return packed[..., : widths[0]], packed[..., widths[0] :]
    if a is None or b is None:
        raise TypeError(f"run() needs both {name} tensors (or {name}=)")
    return a, b


def check_operand(name: str, t, shape, dtype, device) -> None:
    """A run() tensor: its shape (None: any), dtype, device and the layout the kernel reads
    (last dim contiguous, other strides whole 16-byte vectors, a 16-byte aligned start)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    ok = t.dim() == len(shape) and all(w is None or w == g for w, g in zip(shape, t.shape))
    if not ok or t.dtype != dtype or t.device != device:
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name} must be {dtype} {want} on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    vec = 16 // t.element_size()
    bad_stride = any(s % vec for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    if (t.shape[-1] > 1 and t.stride(-1) != 1) or bad_stride or t.data_ptr() % 16:
        raise ValueError(
            f"{name}: the kernel reads rows of 16-byte vectors: the last dim must be contiguous, the other strides "
            f"multiples of {vec} elements and the data 16-byte aligned; got strides {tuple(t.stride())}"
            + (f", data at {t.data_ptr() % 16} bytes past 16-byte alignment" if t.data_ptr() % 16 else "")
        )


def out_and_lse(q_nope, out, lse, heads: int, device):
    """run()'s ``out`` [tokens, heads, 512] (q dtype) and ``lse`` [tokens, heads] (fp32): new
    tensors or the caller's, checked."""
    tokens = q_nope.shape[0]
    if out is None:
        out = torch.empty((tokens, heads, HEAD_DIM_CKV), dtype=q_nope.dtype, device=device)
    else:
        check_operand("out", out, (tokens, heads, HEAD_DIM_CKV), q_nope.dtype, device)
    if lse is None:
        lse = torch.empty((tokens, heads), dtype=torch.float32, device=device)
    elif not isinstance(lse, torch.Tensor) or lse.shape != (tokens, heads) or lse.dtype != torch.float32:
        raise ValueError(
            f"lse must be float32 [{tokens}, {heads}] on {device}, got "
            f"{getattr(lse, 'dtype', None)} {tuple(getattr(lse, 'shape', ()))}"
        )
    elif lse.device != device:
        raise ValueError(f"lse must be on {device}, got {lse.device}")
    return out, lse


def reject_run_options(**named) -> None:
    """run() arguments of FlashInfer's other backends (page tables, fp8 scales, sinks, the
    profiler): None only."""
    for name, value in named.items():
        if value is not None:
            raise NotImplementedError(f"run({name}=...) is not supported by cute_attn's MLA kernel")
