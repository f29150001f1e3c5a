"""What a wrapper's ``plan()`` leaves for ``run()``: one frozen record per plan, replaced whole
by the next ``plan()`` (a plan that fails part-way leaves the previous one intact)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch


@dataclass(frozen=True)
class DecodePlanState:
    plan: Any  # sched.Plan: the work lists, uploaded into the workspace
    batch: int
    hq: int
    hk: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    sm_scale: float
    window_left: int
    num_ctas: int
    hpi: int  # kv heads per work item
    max_page: int  # the largest page id in use (-1: unknown), checked against the cache in run()
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    variant: Any  # the traced variant (every option: the decode kernel has no static flags)
    decode: Any  # the decode module
    merge: Any  # the merge_partials module
    binding: Any  # variants.binding.VariantBinding: run()'s module and variant values
    options: Any = None  # plan()'s variant options (forward() rebuilds the variant from them)
    arch: str = ""
    family: str = ""
    sm_scale_arg: Optional[float] = None  # plan()'s sm_scale as given (FlashInfer's _sm_scale)
    logits_soft_cap: float = 0.0  # as planned (0.0: off)
    kv_lens: Any = None  # host kv lengths of the plan
    kv_dtype: Any = None  # the cache's torch dtype (the q dtype, or fp8)


@dataclass(frozen=True)
class PrefillInputs:
    """The plan's index arrays on the device and what run() checks the KV against."""

    kv_indptr: torch.Tensor  # ragged: kv token offsets; paged: page indptr
    kv_indices: torch.Tensor  # paged: page ids; ragged: a one-element dummy
    qo_indptr: Optional[torch.Tensor] = None  # read by the KV pass only
    kv_tok_indptr: Optional[torch.Tensor] = None  # KV pass gather: token offsets of the gathered K / V
    no_indices: Optional[torch.Tensor] = None  # KV pass gather: the kernel's dummy page ids
    kv_total: int = 0  # ragged: kv_indptr[-1]
    page_size: int = 1
    max_page: int = -1  # paged: the largest page id in use (-1: unknown)
    kv_tokens: int = 0  # paged: sum of kv lengths
    used_pages: int = 0  # paged: indptr[-1], the page ids the kernel reads


@dataclass(frozen=True)
class PrefillPlanState:
    plan: Any  # sched.Plan
    arch: str
    family: str  # the prefill backend's kernel family
    tile: int  # packed query rows per work item
    attn: Any  # the prefill module
    merge: Any  # the merge_partials module
    batch: int
    total_q: int
    dtype: torch.dtype
    group: int
    num_ctas: int
    hq: int
    hk: int
    head_dim: int
    causal: bool
    sm_scale: float
    soft_cap: float  # the launch scalar: 0 when off or when the soft-cap is in the traced variant
    window_left: int
    variant: Any  # the traced variant beyond the static flags (None: the plain kernel)
    spec_kw: dict  # the prefill kernel's spec parameters, without the variant's
    pass_module: Any  # the KV pass module or None
    pass_variant: Any  # the KV pass's variant: the key transform, if the pass applies it
    pass_grid: int  # the KV pass's CTAs
    gather: Any  # kv_gather.Gather: where the KV pass writes contiguous K / V, or None
    kv_lens: np.ndarray
    inputs: Optional[PrefillInputs] = None
    binding: Any = None  # VariantBinding of the prefill module
    pass_binding: Any = None  # VariantBinding of the KV pass, or None
    gathered: Optional[tuple] = field(default=None)  # (K, V) views of the gather region
    options: Any = None  # plan()'s variant options (forward() rebuilds the kernel choice from them)
    sm_scale_arg: Optional[float] = None  # plan()'s sm_scale as given
    logits_soft_cap: float = 0.0  # as planned (0.0: off)
    kv_dtype: Any = None  # the cache's torch dtype (the q dtype, or fp8: the KV pass dequantizes it)
    head_dim_vo: int = 0  # V's and the output's head dim (head_dim unless plan(head_dim_vo=...) differs)
    fp8: Any = None  # fp8 attention (fp8 queries): wrappers/prefill_fp8.Fp8Plan, else None
    kv8_pass: Optional[tuple] = None  # (state, plan) of the pass inside the kernel (kv_gather.pass_plan)

    @property
    def page_size(self) -> int:
        return self.inputs.page_size

    @property
    def kv_indptr(self):
        return self.inputs.kv_indptr

    @property
    def kv_indices(self):
        return self.inputs.kv_indices
