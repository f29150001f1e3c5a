"""Testing utilities: reference attention (fp32/fp64 torch) that kernels are checked against."""

from .reference import (
    LOG2E,
    merge_state_reference,
    merge_states_reference,
    paged_kv_to_ragged,
    paged_reference,
    ragged_reference,
    single_reference,
)

__all__ = [
    "LOG2E",
    "merge_state_reference",
    "merge_states_reference",
    "paged_kv_to_ragged",
    "paged_reference",
    "ragged_reference",
    "single_reference",
]
