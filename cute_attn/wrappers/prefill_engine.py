"""The prefill wrappers' FlashInfer surface beyond plan() / run(), as vLLM's and SGLang's
FlashInfer backends use it (``build/dev/engine_calls.md``; FlashInfer 0.7.2): the private
attributes they read and ``forward`` / ``forward_return_lse`` with their run-time options taking
effect.  A mixin of ``BatchPrefillBase``'s two wrappers."""

from __future__ import annotations

import functools
import inspect

import torch

from . import common, guards


def recorded_plan(plan):
    """Keep each plan() call's arguments (``_plan_call``): a forward(causal=...) that differs
    from the plan re-plans with it, as FlashInfer's forward() switches its mask mode."""

    @functools.wraps(plan)
    def wrapper(self, *args, **kwargs):
        out = plan(self, *args, **kwargs)
        self._plan_call = (args, kwargs)
        return out

    return wrapper


class PrefillEngineAPI:
    """FlashInfer's prefill-wrapper attributes and ``forward`` (see the module doc)."""

    _plan_call = None

    @property
    def _causal(self) -> bool:
        return False if self._state is None else self._state.causal

    @property
    def _window_left(self) -> int:
        return -1 if self._state is None else self._state.window_left

    @property
    def _logits_soft_cap(self) -> float:
        return 0.0 if self._state is None else self._state.logits_soft_cap

    @property
    def _pos_encoding_mode(self) -> str:
        return "NONE" if self._state is None else self._state.options["pos_encoding_mode"]

    @property
    def _backend(self) -> str:
        return "fa3"  # FlashInfer's name for a Hopper prefill; cute_attn has its own kernel

    @property
    def _float_workspace_buffer(self) -> torch.Tensor:
        return self._workspace

    @property
    def _int_workspace_buffer(self) -> torch.Tensor:
        """FlashInfer's int workspace: unused (the plan's records live in a buffer of the wrapper's own)."""
        return torch.empty(0, dtype=torch.uint8, device=self._device)

    @property
    def _pin_memory_int_workspace_buffer(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    @property
    def _fixed_batch_size(self) -> int:
        return self._qo_indptr_buf.numel() - 1 if self._use_cuda_graph else 0

    @property
    def _qo_indptr_last(self):
        return None if self._state is None else self._state.total_q

    def _forward(self, q, kv, causal, pos_encoding_mode, q_scale, k_scale, v_scale, window_left, logits_soft_cap,
                 sm_scale, rope_scale, rope_theta, return_lse):  # fmt: skip
        """forward()'s semantics: this call's causal (a re-plan with it where it differs from the
        plan's, outside a capture), sm_scale (None: 1/sqrt(head_dim)), logits_soft_cap and
        window_left (``_select_run``) take effect; ``kv``: run()'s KV arguments."""
        st = self._require_plan()
        o = st.options
        if pos_encoding_mode != o["pos_encoding_mode"] or (
            pos_encoding_mode == "ROPE_LLAMA" and (rope_scale, rope_theta) != (o["rope_scale"], o["rope_theta"])
        ):
            raise ValueError("forward(pos_encoding_mode / rope_scale / rope_theta) must be the plan()'s")
        common.check_plan_scalars(window_left, logits_soft_cap, None, "")
        if o["custom_mask"] is None and bool(causal) != st.causal:
            if torch.cuda.is_current_stream_capturing() or self._plan_call is None:
                raise ValueError(
                    f"forward(causal={bool(causal)}) differs from plan(causal={st.causal}) and cannot re-plan "
                    "during a CUDA-graph capture; pass causal to plan()"
                )
            args, kwargs = self._plan_call
            bound = inspect.signature(self.plan).bind(*args, **kwargs)
            bound.arguments["causal"] = bool(causal)
            self.plan(*bound.args, **bound.kwargs)
            st = self._state
        sm = guards.launch_sm_scale(sm_scale, st.head_dim)
        ov = self._select_run(sm, logits_soft_cap, window_left)
        return self._run_kv(q, kv, ov, q_scale, k_scale, v_scale, return_lse)
