"""The public ⊕ ops, FlashInfer's names and conventions: ``merge_state``, ``merge_state_in_place``,
``merge_states`` (the code and the conventions: ``cute_attn.wrappers.merge``)."""

from .wrappers.merge import GRID_CAP, merge_pair_module, merge_state, merge_state_in_place, merge_states

__all__ = ["merge_state", "merge_state_in_place", "merge_states", "merge_pair_module", "GRID_CAP"]
