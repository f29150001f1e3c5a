"""What the ragged and paged prefill wrappers share: argument checks, planning (limits, the
planner, the kernels, the KV pass), the custom mask's CUDA-graph buffers and the launch.

The kernels come from the arch -> backend table (``families.backends``): a ``prefill``
backend per batch (``choose_prefill_backend``: on Hopper ``kernels/prefill_sm90.py``, wgmma,
except where the portable kernel is faster; elsewhere ``kernels/prefill_mma.py``, mma.sync,
which reads a 16-bit cache itself: an fp8 cache needs the Hopper kernel's KV pass; ``plan(
prefill_backend=...)`` names one) and the ``kv_pass`` backend.  ``plan()`` runs the CPU
scheduler (``cute_attn.sched``) with query tiles of the backend's sizes (the planner's tile
rule, 16 / 32 / 64 / 128 packed rows, mapped onto the smallest tile of the kernel that holds
it) and
uploads the work lists into the user's ``float_workspace_buffer`` at fixed offsets.
``run()`` launches the prefill kernel and, when the plan split some KV (or in CUDA-graph mode,
where a later plan may split), the persistent ⊕ merge kernel (``merge_partials``, the same one
decode uses, specialized for the prefill tile).

Both wrappers feed the same kernel ABI as decode (``families/decode.py``: ``decode_abi_fixed``):

* paged: K/V are the cache as strided ``[pages, page_size, kv_heads, head_dim]`` views (NHD,
  HND, ``(k, v)`` tuples and ``[pages, 2, ...]`` tensors, exactly as decode passes them),
  ``mKvIndptr`` / ``mKvIndices`` the page indptr / page ids;
* ragged: K/V are passed as ``[1, total_kv_tokens, kv_heads, head_dim]`` views (an HND ragged
  ``[kv_heads, total, head_dim]`` tensor is transposed first, no copy), ``mKvIndptr`` the
  ragged kv_indptr in tokens, ``mKvIndices`` a one-element dummy.

Variants (docs/variants.md): ``causal``, ``window_left`` and ``logits_soft_cap`` are the
kernel's static flags (its fast paths); the rest becomes a traced variant
(``options.resolve_variant``).  What is not supported yet raises ``NotImplementedError`` from
one place (``common.reject_unsupported``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from ..families.backends import NoBackend, backend_for, backends_for, choose_prefill_backend, kv_pass_pays
from ..families.base import variant_params
from ..families.kv_pass import kv_pass_spec
from ..families.merge import merge_partials_spec
from ..families.prefill import (
    FIXED_SPLIT_TILE,
    KV8_PASS_PAGED,
    KV8_PASS_RAGGED,
    keys_pretransformed,
    page_box_for,
    regular_gather,
)
from ..families.prefill_mma import BATCH_PREFILL_MMA, Q_SMEM_TILES
from ..runtime.arch import arch_of_index, sm_count_of_index
from ..runtime.loader import KernelNotAvailable, kernel
from ..sched import Planner, WorkspaceLayout
from ..sched.cost import choose_cta_tile_q
from ..variants import base as vbase
from ..variants.binding import VariantBinding
from . import common, compat, guards, kv_gather, prefill_fp8, scales
from .masks import plan_custom_mask
from .options import check_options, resolve_variant
from .plans import PrefillInputs, PrefillPlanState
from .prefill_engine import PrefillEngineAPI
from .prefill_sizes import check_head_dims, partial_limits, round_rows


def _check_portable(backend, arch, kv_name, kv_pass) -> None:
    """What the portable kernel cannot serve yet: it reads 16-bit K / V itself (the KV pass that
    dequantizes an fp8 cache or gathers pages first runs only before the Hopper kernel)."""
    if kv_name is not None:
        raise NotImplementedError(
            f"an fp8 KV cache in prefill on {arch} ({backend.name}): the dequantizing KV pass serves only the "
            f"Hopper prefill kernel"
        )
    if kv_pass:
        raise NotImplementedError(f"kv_pass=True with {backend.name}: it reads the pages itself")


def _variant_kw(v) -> dict:
    return variant_params(v) if v is not None else {}


class BatchPrefillBase(PrefillEngineAPI, common.WrapperBase):
    """What the ragged and paged wrappers share: planning, limits, the launch."""

    _PAGED = False
    grows_workspace = False  # a wrapper that grows its workspace when a plan needs more
    # shrink the partial-output room to what fits the workspace (``partial_rows_that_fit``);
    # False: the full room or an error (the cascade's levels: each slice is sized for split KV)
    fit_partials = True

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str,
        use_cuda_graph: bool,
        jit_args=None,
        custom_mask_buf: Optional[torch.Tensor] = None,
        mask_indptr_buf: Optional[torch.Tensor] = None,
    ):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        common.reject_unsupported(jit_args=jit_args)
        self._fixed = None  # CUDA-graph mode: what the first plan fixed (a captured run() bakes it)
        self._max_rows = None  # CUDA-graph mode: query tokens, fixed by the first plan (as FlashInfer)
        self._qo_indptr_buf = None  # CUDA-graph mode: FlashInfer's qo_indptr buffer (the subclasses')
        self._mask_buf, self._mask_indptr_buf = custom_mask_buf, mask_indptr_buf
        # CUDA-graph mode, a custom mask: the int32 twin of custom_mask_buf (the kernels read
        # words) and the kv bounds / query offsets, sized by the first plan that has a mask
        self._mask_words_buf = None
        self._mask_bounds_buf = None
        self._mask_qo_buf = None

    # what tests and scripts inspect of the current plan
    @property
    def _tile(self):
        return self._state.tile

    @property
    def _spec_kw(self):
        return self._state.spec_kw

    @property
    def _gathered(self):
        return None if self._state is None else self._state.gathered

    @property
    def _custom_mask_buf(self):
        """FlashInfer's attribute (engines test it for None): the current plan's packed custom
        mask on the device (uint8, zero-padded to whole 32-bit words), None when the plan has
        none; in CUDA-graph mode the constructor's ``custom_mask_buf``, which plan() fills.  A
        captured run() reads the mask as planned: bytes written into this buffer afterwards are
        not seen -- plan() again (it re-derives the blocks each row may skip)."""
        if self._use_cuda_graph:
            return self._mask_buf
        st = self._state
        mask = None if st is None or st.options is None else st.options.get("custom_mask")
        return None if mask is None else mask.values["packed_custom_mask"].view(torch.uint8)

    @property
    def _kv_pass(self):
        return self._state.pass_binding

    @property
    def _qo_indptr(self):
        return self._state.inputs.qo_indptr

    @property
    def _kv_tok_indptr(self):
        return self._state.inputs.kv_tok_indptr

    # -- plan -----------------------------------------------------------------------------
    def _check_common(
        self,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        head_dim_vo,
        q_data_type,
        kv_data_type,
        o_data_type,
        window_left,
        logits_soft_cap,
        fixed_split_size,
        split_unit,
        pos_encoding_mode="NONE",
        variant=None,
        **unsupported,
    ):
        """Argument checks shared by both plans; returns (q dtype, kv dtype, head_dim_qk,
        head_dim_vo, arch): the cache is of the query dtype or fp8 (``kv_gather``: the KV pass
        dequantizes it)."""
        if prefill_fp8.is_fp8_query(q_data_type):  # fp8 attention: its own checks
            return prefill_fp8.check_plan(self, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, q_data_type,
                                          kv_data_type, o_data_type, window_left, logits_soft_cap, fixed_split_size,
                                          split_unit, pos_encoding_mode, variant, **unsupported)  # fmt: skip
        common.check_plan_not_captured()
        q_dtype, kv_dtype = common.plan_kv_dtype(q_data_type, kv_data_type, o_data_type, **unsupported)
        kv_gather.kv_name(kv_dtype, q_dtype)  # the fp8 formats served
        check_options(pos_encoding_mode, variant)
        arch = arch_of_index(self._dev)
        try:
            backend_for("prefill", arch)
        except NoBackend as e:
            raise NoBackend(f"batch prefill cannot run on cuda:{self._dev} ({arch}): {e}") from None
        d, dv = check_head_dims(backends_for("prefill", arch), num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo)
        if dv != d and kv_dtype != q_dtype:
            raise NotImplementedError(
                f"an fp8 KV cache with head_dim_vo ({dv}) != head_dim_qk ({d}) is not supported yet (the "
                f"dequantizing KV pass reads K and V of one head dim)"
            )
        common.check_plan_scalars(window_left, logits_soft_cap, fixed_split_size, split_unit)
        return q_dtype, kv_dtype, d, dv, arch

    def _arch_for_plan(self) -> str:
        arch = arch_of_index(self._dev)
        try:
            backend_for("prefill", arch)
        except NoBackend as e:
            raise NoBackend(f"batch prefill cannot run on cuda:{self._dev} ({arch}): {e}") from None
        return arch

    def _plan_common(
        self,
        qo_h,
        kv_lens,
        *,
        arch,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        q_dtype,
        causal,
        page_size,
        window_left,
        logits_soft_cap,
        sm_scale,
        split_tokens,
        disable_split_kv,
        head_dim_vo=None,
        pos_encoding_mode="NONE",
        rope_scale=None,
        rope_theta=None,
        custom_mask=None,
        packed_custom_mask=None,
        variant=None,
        kv_pass=None,
        kv_dtype=None,
        prefill_backend=None,
    ) -> PrefillPlanState:
        """Validate lengths, (re)make the planner, plan + upload, pick the kernels. Returns the
        plan's state without its device inputs (``_commit`` adds them once their copies are
        queued).  ``kv_pass`` (paged): gather the cache by the KV pass first (True), never
        (False) or when it pays (None).  An fp8 ``kv_dtype``: a ragged cache at head dim 128
        is widened by the kernel itself (``kv_pass=True``: by the pass instead); any other
        runs the pass, which dequantizes it for the 16-bit kernel.  ``head_dim_vo``: V's and the
        output's head dim (None: ``head_dim``); the kernels never transform keys or queries
        (RoPE) at other than the power-of-two head dims, and the KV pass gathers K / V only of
        equal head dims.  ``prefill_backend``: the kernel by its backend name
        (``families.backends``), None: ``choose_prefill_backend``."""
        if q_dtype in common.FP8:  # fp8 attention: its own kernels, pass and plan (wrappers/prefill_fp8.py)
            return prefill_fp8.plan_state(
                self, qo_h, kv_lens, arch=arch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, q_dtype=q_dtype, causal=causal, page_size=page_size, sm_scale=sm_scale,
                split_tokens=split_tokens, disable_split_kv=disable_split_kv, custom_mask=custom_mask,
                packed_custom_mask=packed_custom_mask, kv_pass=kv_pass, kv_dtype=kv_dtype,
            )  # fmt: skip
        hq, hk, d = int(num_qo_heads), int(num_kv_heads), head_dim
        dv = d if head_dim_vo is None else int(head_dim_vo)
        qo_len = np.diff(qo_h)
        batch = int(qo_len.shape[0])
        mask_v = None
        if custom_mask is not None or packed_custom_mask is not None:
            mask_v = plan_custom_mask(self, custom_mask, packed_custom_mask, qo_len, kv_lens)
        causal, cap_flag, _, var = resolve_variant(
            causal=causal,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            pos_encoding_mode=pos_encoding_mode,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            custom_mask=mask_v,
            variant=variant,
        )
        hooks = vbase.Hooks(var)
        if (hooks.has_transform_k or hooks.has_transform_q) and (dv != d or not regular_gather(d)):
            raise NotImplementedError(
                f"key / query transforms (RoPE: pos_encoding_mode='ROPE_LLAMA') at head_dim_qk {d}, head_dim_vo "
                f"{dv} are not supported yet (head dims 64, 128, 256)"
            )
        if dv != d and kv_pass:
            raise NotImplementedError(
                f"kv_pass=True with head_dim_vo ({dv}) != head_dim_qk ({d}) is not supported yet (the KV pass "
                f"gathers K and V of one head dim; the kernel reads the pages itself)"
            )
        if hooks.has_output:
            disable_split_kv = True  # an output transform must see whole rows, not partial states
        # causal with qo_len > kv_len (bottom-right aligned, as FlashInfer): the leading query rows
        # of such a request see no key; the planner still gives them a work item (build_tiles: a
        # tile of kv extent 0, or rows of a tile whose causal limit is below key 0), and the
        # kernel writes o = 0, lse = -inf for a row without keys
        total_q = int(qo_h[-1])
        group = hq // hk
        soft_cap = float(logits_soft_cap) if logits_soft_cap and cap_flag else 0.0
        window_left = int(window_left)
        kv_name = kv_gather.kv_name(kv_dtype or q_dtype, q_dtype)  # an fp8 cache's spec name, else None
        batch_invariant = split_tokens is not None  # fixed_split_size: nothing may depend on the batch
        with_q = int(np.count_nonzero(qo_len))
        if self._use_cuda_graph and self._fixed is not None:  # the captured kernel's
            prefill_backend = self._fixed["backend"]
        backend = choose_prefill_backend(
            arch,
            total_q * group / max(with_q, 1),
            name=prefill_backend,
            needs_pass=kv_name is not None or bool(kv_pass),
            batch_invariant=batch_invariant,
            gathers=self._PAGED and not page_box_for(True, int(page_size)),
            head_dims=(d, dv),
        )
        portable = backend.family == BATCH_PREFILL_MMA.name
        if portable:
            _check_portable(backend, arch, kv_name, kv_pass)
        launch = dict(
            backend=backend.name,
            dtype=common.dtype_name(q_dtype),
            head_dim=d,
            head_dim_vo=dv,
            causal=bool(causal),
            soft_cap=soft_cap > 0,
            window=window_left >= 0,
            hq=hq,
            hk=hk,
            sm_scale=guards.launch_sm_scale(sm_scale, d),
            soft_cap_value=soft_cap,
            window_left=window_left,
            variant=vbase.encode(var),
            kv_dtype=kv_name,
            # the KV pass may change it; an fp8 cache always takes the pass, so the kernel never
            # reads its pages (CUDA-graph mode compares this with the first plan's, after the pass)
            page_box=page_box_for(self._PAGED and kv_name is None and not portable, int(page_size)),
        )

        if batch_invariant:  # the tile may not depend on the batch either
            tile = min(FIXED_SPLIT_TILE, max(backend.tiles_for(d)))
        elif portable and hooks.has_transform_k:
            tile = min(backend.tiles)  # the portable kernel rotates keys in-kernel with whole K fragments only
        else:  # the planner's rule, onto the kernel's tiles
            want, tiles = choose_cta_tile_q(total_q * group, with_q), backend.tiles_for(d)
            if portable and hooks.has_transform_q:  # (rotated in the Q fragments it holds)
                tiles = tuple(t for t in tiles if t not in Q_SMEM_TILES)
            tile = min([t for t in tiles if t >= want] or [max(tiles)])
        if disable_split_kv:
            split_tokens = common.NO_SPLIT

        num_sms, per_sm = sm_count_of_index(self._dev), backend.ctas_for(d)  # the kernel fills the SM's smem
        num_ctas = num_sms * per_sm
        if self._use_cuda_graph:
            if self._fixed is None:
                self._max_rows = max(total_q, 1)
            else:
                # kv8 and an fp8 plan's page_box are known only once the kernels are chosen (below)
                late = ("tile_q", "kv8") + (("page_box",) if kv_name is not None else ())
                changed = [k for k in self._fixed if k not in late and self._fixed[k] != launch[k]]
                if changed:
                    raise ValueError(
                        f"use_cuda_graph=True: plan() changed {changed} since the first plan; a captured "
                        f"run() bakes them (kernel specialization and launch scalars). Keep them "
                        f"fixed or use another wrapper."
                    )
                tile = self._fixed["tile_q"]  # the captured kernel's tile
            common.check_capture_rows(self, total_q, "query tokens")
            if total_q > self._max_rows:
                raise ValueError(
                    f"use_cuda_graph=True: qo_indptr[-1] = {total_q} exceeds the {self._max_rows} query "
                    f"tokens of the first plan (which fixes the workspace layout, as in FlashInfer)"
                )
        lim, grow = self._choose_limits(batch, total_q, hq, hk, dv, num_ctas)  # partial rows of dv
        gather = None  # kv_gather.Gather: where the KV pass writes contiguous K / V
        # an fp8 cache the kernel widens itself, where that pays (kv_gather.widens)
        kv8 = not portable and kv_gather.widens(
            self, launch, kv_pass, (d, dv), var, int(page_size), (qo_len, kv_lens, hq, hk, bool(causal), window_left),
            tile, num_sms, batch_invariant,
        )  # fmt: skip
        try:  # a cache built without the widening kernel still serves the plan by the pass
            k = self._kernels(arch, backend, num_sms, launch, tile, d, var, page_size, None, kv8=True) if kv8 else None
        except KernelNotAvailable:
            if kv_pass is False:
                raise
            kv8 = False
        launch["kv8"] = kv8
        if (self._PAGED or launch["kv_dtype"] is not None) and not portable and not kv8:
            # batch-invariant plans take the pass only when asked: the model weighs the whole batch;
            # K and V of different head dims never (the pass has one)
            want = False if (kv_pass is None and batch_invariant) or dv != d else kv_pass
            transform = hooks.has_transform_k
            boxes = bool(page_box_for(True, int(page_size)))  # else the kernel's cp.async gather
            pays = lambda: kv_pass_pays(  # noqa: E731
                qo_len, kv_lens, hq, hk, d, bool(causal), transform, q_dtype.itemsize, window_left, boxes
            )
            fp8 = launch["kv_dtype"] is not None
            gather = kv_gather.gather_region(
                self, want, fp8, lim, num_ctas, int(kv_lens.sum()), hk * d * q_dtype.itemsize, pays
            )
        # the fp8 pass inside the kernel where it serves the plan (kv_gather.pass_in_kernel)
        inline = gather is not None and kv_gather.pass_in_kernel(self, launch, tile, (d, dv), var)
        if inline:
            try:
                k = self._kernels(arch, backend, num_sms, launch, tile, d, var, page_size, gather, inline=True)
            except KernelNotAvailable:  # a cache built without it: the standalone pass
                inline = False
        # modules first (loaded here, outside any capture): a missing one must fail before the
        # new plan overwrites the workspace that the previous plan's state still describes
        try:
            if not kv8 and not inline:
                k = self._kernels(arch, backend, num_sms, launch, tile, d, var, page_size, gather)
        except KernelNotAvailable:
            if gather is None or kv_pass or launch["kv_dtype"] is not None:
                raise
            # the pass was the model's choice, not the caller's: a cache built without its
            # kernels (an older `compile --preset`) still serves the plan by the in-kernel gather
            gather = None
            k = self._kernels(arch, backend, num_sms, launch, tile, d, var, page_size, gather)
        if self._use_cuda_graph and self._fixed is not None and self._fixed["page_box"] != launch["page_box"]:
            raise ValueError("use_cuda_graph=True: plan() changed ['page_box'] since the first plan (run() bakes it)")
        spec_kw, pass_var, pass_module, pass_grid, attn = k
        ms = merge_partials_spec(arch, launch["dtype"], dv, tile)
        merge = kernel(ms.family, arch, **ms.pdict)
        planner = self._install_planner(lim, num_sms, per_sm, backend.planner, grow)
        plan = planner.plan(
            qo_h,
            kv_lens,
            causal=bool(causal),
            page_size=int(page_size) if spec_kw["paged"] else 1,
            num_qo_heads=hq,
            num_kv_heads=hk,
            cta_tile_q=tile,
            kv_split_size=split_tokens,
        )
        planner.upload(self._plan_buf)
        if self._use_cuda_graph and self._fixed is None:
            self._fixed = dict(launch, tile_q=tile)
        return PrefillPlanState(
            plan=plan,
            arch=arch,
            family=backend.family,
            tile=tile,
            attn=attn,
            merge=merge,
            batch=batch,
            total_q=total_q,
            dtype=q_dtype,
            group=group,
            num_ctas=planner.num_ctas,
            hq=hq,
            hk=hk,
            head_dim=d,
            head_dim_vo=dv,
            causal=launch["causal"],
            sm_scale=launch["sm_scale"],
            soft_cap=launch["soft_cap_value"],
            window_left=launch["window_left"],
            variant=var,
            spec_kw=spec_kw,
            pass_module=pass_module,
            pass_variant=pass_var,
            pass_grid=pass_grid,
            gather=gather,
            kv_lens=kv_lens,
            kv8_pass=kv_gather.pass_plan(self, plan, kv_lens, hk) if inline else None,
            kv_dtype=kv_dtype or q_dtype,
            options=dict(
                pos_encoding_mode=pos_encoding_mode,
                rope_scale=rope_scale,
                rope_theta=rope_theta,
                custom_mask=mask_v,
                variant=variant,
            ),
            sm_scale_arg=sm_scale,
            logits_soft_cap=float(logits_soft_cap or 0.0),
        )

    def _kernels(self, arch, backend, num_sms, launch, tile, d, var, page_size, gather, kv8=False, inline=False):
        """Load the plan's modules: (the kernel's spec params (``paged``: it reads a paged cache
        itself), the KV pass's variant, the pass module or None, the pass's grid, the attention
        module); sets ``launch["page_box"]``.  ``kv8``: the kernel reads (and widens) the fp8 cache
        itself, no pass; ``inline``: the kernel runs the pass itself (``kv8_pass``)."""
        paged = self._PAGED and gather is None  # the kernel reads the cache itself
        portable = backend.family == BATCH_PREFILL_MMA.name  # every page size; keys rotated in-kernel
        launch["page_box"] = 0 if portable else page_box_for(paged, int(page_size))
        spec_kw = dict(
            dtype=launch["dtype"],
            head_dim=d,
            tile_q=tile,
            paged=paged,
            causal=launch["causal"],
            soft_cap=launch["soft_cap"],
            window=launch["window"],
        )
        if launch["head_dim_vo"] != d:  # a parameter only where it differs (the symmetric keys stay)
            spec_kw["head_dim_vo"] = launch["head_dim_vo"]
        if launch["page_box"]:
            spec_kw["page_box"] = launch["page_box"]
        if kv8 or inline:
            spec_kw["kv_dtype"] = launch["kv_dtype"]
        if inline:  # the kernel itself reads the ragged 16-bit copy; its pass reads the cache
            spec_kw["kv8_pass"] = KV8_PASS_PAGED if self._PAGED else KV8_PASS_RAGGED
        pretransformed = keys_pretransformed(paged, var) and not portable
        if pretransformed:
            spec_kw["keys_transformed"] = True
        pass_var = var if pretransformed else None  # the pass's variant: K's transform
        gathers = self._PAGED and gather is not None  # the pass reads the page table
        pass_spec = None
        if not inline:
            pass_spec = kv_pass_spec(arch, launch["dtype"], d, gathers, pass_var, None if kv8 else launch["kv_dtype"])
        pass_module, pass_grid = None, 0
        if pass_spec is not None:
            kv_backend = backend_for("kv_pass", arch)
            pass_module = kernel(kv_backend.family, arch, **pass_spec.pdict)
            pass_grid = num_sms * kv_backend.ctas_for(d)
        attn = kernel(backend.family, arch, **spec_kw, **_variant_kw(var))
        return spec_kw, pass_var, pass_module, pass_grid, attn

    def _choose_limits(self, batch, total_q, hq, hk, d, num_ctas):
        """The planner limits for this plan and the bytes the workspace must grow to (0: it
        fits); no side effects (a kernel that fails to load leaves the previous plan intact).
        ``d``: the partial outputs' head dim (head_dim_vo)."""
        have = self._workspace.numel()

        def limits(max_batch, max_q):
            room = 1 << 62 if self.grows_workspace or not self.fit_partials else have
            return partial_limits(room, num_ctas, max_batch, max_q, hq, hk, d)

        if self._use_cuda_graph:  # fixed by the buffers and the first plan: offsets never move
            cands = [limits(self._batch_capacity(batch), self._max_rows)]
        else:
            prev = self._planner.limits if self._planner is not None else None
            same_heads = prev is not None and (prev.num_qo_heads, prev.num_kv_heads, prev.head_dim) == (hq, hk, d)
            grow_b = max(batch, prev.max_batch) if same_heads else batch
            grow_q = max(round_rows(total_q), prev.max_total_q_tokens) if same_heads else round_rows(total_q)
            if same_heads and prev.max_batch >= batch and prev.max_total_q_tokens >= total_q:
                cands = [prev]
            else:  # grow with headroom; exact sizes if the headroom does not fit the workspace
                cands = [limits(grow_b, grow_q), limits(batch, total_q)]
        lim = next((c for c in cands if WorkspaceLayout(c, num_ctas).total_bytes <= have), None)
        if lim is not None:
            return lim, 0
        need = WorkspaceLayout(cands[-1], num_ctas).total_bytes
        if not self.grows_workspace:
            raise ValueError(
                f"float_workspace_buffer has {have} bytes; this plan needs {need} (batch {batch}, "
                f"{total_q} query tokens, {hq} qo heads, head_dim {d})"
            )
        return cands[-1], need

    def _install_planner(self, lim, num_sms, per_sm, cost, grow) -> Planner:
        """Make ``lim``'s planner current (growing the workspace to ``grow`` bytes if set);
        ``cost``: the backend's planner parameters."""
        if grow:
            self._workspace = torch.empty(grow, dtype=torch.uint8, device=self._device)
            self._views = None
        return common.install_planner(self, lim, num_sms, per_sm, cost)

    def _batch_capacity(self, batch) -> int:
        cap = self._qo_indptr_buf.numel() - 1
        if batch > cap:
            raise ValueError(f"batch {batch} exceeds the CUDA-graph buffers' capacity {cap} (qo_indptr_buf)")
        return cap

    def _commit(self, st: PrefillPlanState, inputs: PrefillInputs) -> None:
        """Make ``st`` (with its device ``inputs``) the current plan."""
        info = {
            "num_qo_heads": st.hq,
            "num_kv_heads": st.hk,
            "head_dim": st.head_dim,
            "sm_scale": st.sm_scale,
            "device": self._device,
            "batch": st.batch,
        }
        family, arch, spec_kw = st.family, st.arch, st.spec_kw
        binding = VariantBinding(st.variant, info, st.attn, lambda v: kernel(family, arch, **spec_kw, **_variant_kw(v)))
        # the KV pass: the plan's key transform, if any (run()'s sinks do not touch keys)
        pass_binding = None if st.pass_module is None else VariantBinding(st.pass_variant, info, st.pass_module, None)
        # the pass's output: contiguous K / V (the workspace, or the wrapper's own buffer)
        gathered = None if st.gather is None else st.gather.views(st.dtype, st.hk, st.head_dim)
        self._state = replace(st, inputs=inputs, binding=binding, pass_binding=pass_binding, gathered=gathered)
        self._out_dim = None if st.head_dim_vo == st.head_dim else st.head_dim_vo  # torch.compile's out

    def _to_device(self, t, buf, name):
        return common.to_device(t, buf, name, self._device)

    # -- run ------------------------------------------------------------------------------
    def _check_run(self, q, out, lse, args, **unsupported):
        st = self._require_plan()
        if args and st.variant is None:
            raise TypeError(
                f"run() got {len(args)} extra positional argument(s): those are the runtime arguments of "
                f"plan(variant=...), and this plan has no variant (custom jit_args kernels are not "
                f"supported)"
            )
        common.reject_unsupported(extra=tuple(unsupported.items()))
        common.check_q(q, st.total_q, st.hq, st.head_dim, st.dtype, self._device, self._use_cuda_graph,
                       " (qo_indptr[-1])")  # fmt: skip
        common.check_run_capture(self, q, "*_buf index")
        if st.fp8 is not None:  # fp8 attention: the output in plan()'s o_data_type
            return prefill_fp8.out_and_lse(q, out, lse, st.hq, st.fp8.o_dtype)
        return common.out_and_lse(q, out, lse, st.hq, None if st.head_dim_vo == st.head_dim else st.head_dim_vo)

    def _check_kv(self, k, v, what):
        dt, dev = self._state.kv_dtype, self._device
        if k.dtype != dt or v.dtype != dt or k.device != dev or v.device != dev:
            planned = " (plan()'s kv_data_type)" if dt != self._state.dtype else ""
            raise ValueError(
                f"{what} must be {dt}{planned} on {dev}, got {k.dtype} / {v.dtype} on {k.device} / {v.device}"
            )

    def _ragged_kv(self, k, v, n):
        """run()'s ragged k / v (``[tokens, kv_heads, head_dim]``, v at head_dim_vo, NHD or HND)
        checked to hold ``n`` tokens, as NHD views."""
        st = self._state
        hk, d, dv = st.hk, st.head_dim, st.head_dim_vo
        if (
            k.dim() != 3
            or v.dim() != 3
            or (k.shape if d == dv else k.shape[:2]) != (v.shape if d == dv else v.shape[:2])
        ):
            what = "equal 3-D tensors" if d == dv else "3-D tensors equal but for the head dim"
            raise ValueError(f"k/v must be {what}, got {tuple(k.shape)} / {tuple(v.shape)}")
        if self._kv_layout == "HND":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        self._check_kv(k, v, "k/v")
        common.check_last_dim_contiguous(("k", k), ("v", v))
        if k.shape[0] < n or k.shape[1:] != (hk, d) or v.shape[1:] != (hk, dv):
            dims = f"{d}" if d == dv else f"{d} (k) / {dv} (v)"
            raise ValueError(
                f"k/v ({self._kv_layout}) must hold {n} (kv_indptr[-1]) tokens of "
                f"{hk} kv heads x {dims}, got {tuple(k.shape)} / {tuple(v.shape)} as [tokens, heads, dim]"
            )
        return k, v

    def _launch(self, q, k4, v4, kv_indptr, kv_indices, out, lse, args=(), sinks=None, ov=None, sc=scales.NONE):
        """K/V are 4-D views; ``sc``: the run's ``scales.Scales``.  A cache without any token
        (so no request has kv) gets o = 0, lse = -inf without a kernel (TMA descriptors cannot
        describe an empty tensor; with sinks: lse = the sink)."""
        st = self._state
        if st.fp8 is not None:  # fp8 attention: the V^T pass, its kernel, the merge
            return prefill_fp8.launch(self, st, q, k4, v4, kv_indptr, kv_indices, out, lse, sinks, ov, sc)
        ov = ov or {}
        sm = sc.sm_scale(ov.get("sm_scale", st.sm_scale))
        sinks = common.check_sinks(sinks, st.hq, self._device)
        module, vvals = ov.get("binding", st.binding).select(args, sinks)
        if q.shape[0] == 0:
            return
        if (st.gathered[0] if st.gathered is not None else k4).numel() == 0:
            out.zero_()
            lse.fill_(-math.inf)
            if sinks is not None:
                lse.copy_((sinks.float() * (1.0 / math.log(2.0)))[None, :].expand_as(lse))
            return
        if st.pass_binding is not None:  # the KV pass: gather / dequantize the cache, and / or transform K
            k4, v4, kv_indptr, kv_indices = kv_gather.run_pass(st, self._PAGED, k4, v4, kv_indptr, kv_indices, args)
        extra = ()
        if st.kv8_pass is not None:  # the kernel dequantizes the fp8 cache into the gather region itself
            st.kv8_pass[0].zero_()
            extra, (k4, v4) = (k4, v4) + st.kv8_pass, st.gathered
            if self._PAGED:  # the pass reads the page table; the kernel, the copy's token offsets
                extra += (kv_indptr, kv_indices)
                kv_indptr, kv_indices = st.inputs.kv_tok_indptr, st.inputs.no_indices
        vw = self._views
        module(
            sc.query(q),
            k4,
            v4,
            kv_indptr,
            kv_indices,
            out,
            lse,
            vw["work_items"],
            vw["work_indptr"],
            vw["partial_o"],
            vw["partial_lse"],
            st.group,
            sm,
            ov.get("soft_cap", st.soft_cap),
            ov.get("window_left", st.window_left),
            st.num_ctas,
            *extra,
            *vvals,
        )
        if self._use_cuda_graph or st.plan.has_split:
            st.merge(vw["partial_o"], vw["partial_lse"], vw["merge_tasks"], vw["meta"], out, lse, st.group, st.num_ctas)
        sc.output(out)

    def _select_run(self, sm_scale, logits_soft_cap, window_left) -> dict:
        """A forward()'s launch: the plan's kernel with these scalars where it serves them (same
        soft-cap / window on-off state), else the kernel with those flags (``compat.run_module``:
        loaded once, outside any CUDA-graph capture)."""
        st = self._require_plan()
        cap, window = float(logits_soft_cap or 0.0), int(window_left)
        if st.soft_cap == 0.0 and st.logits_soft_cap > 0.0 and cap != st.logits_soft_cap:
            raise ValueError(
                "this plan's soft-cap is part of its traced variant (with another logits / bias hook): "
                "pass logits_soft_cap to plan()"
            )
        traced_cap = st.soft_cap == 0.0 and st.logits_soft_cap > 0.0
        flags = dict(st.spec_kw, soft_cap=st.spec_kw["soft_cap"] if traced_cap else cap > 0, window=window >= 0)
        ov = dict(sm_scale=float(sm_scale), soft_cap=cap if flags["soft_cap"] else 0.0, window_left=window)
        if flags == st.spec_kw:
            if ov["sm_scale"] != st.sm_scale and st.variant is not None:
                info = dict(st.binding.info, sm_scale=ov["sm_scale"])
                ov["binding"] = VariantBinding(st.variant, info, st.attn, st.binding._load)
            return ov
        family, arch, vkw = st.family, st.arch, _variant_kw(st.variant)
        key = (family, arch, tuple(sorted((k, str(v)) for k, v in dict(flags, **vkw).items())))
        module = compat.run_module(lambda: kernel(family, arch, **flags, **vkw), key)
        info = dict(st.binding.info, sm_scale=ov["sm_scale"])
        ov["binding"] = VariantBinding(
            st.variant, info, module, lambda v: kernel(family, arch, **flags, **_variant_kw(v))
        )
        return ov
