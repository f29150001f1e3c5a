"""Which compile target a CUDA device needs."""

from __future__ import annotations

import functools

from ..abi.archs import ARCH_BY_CAPABILITY


@functools.cache
def arch_of_index(index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    arch = ARCH_BY_CAPABILITY.get((major, minor))
    if arch is None:
        name = torch.cuda.get_device_name(index)
        raise RuntimeError(
            f"cute_attn runs on Hopper (sm_90) and Blackwell (sm_100) GPUs; cuda:{index} ({name}) is sm_{major}{minor}"
        )
    return arch


def device_arch(device) -> str:
    """``sm_90a`` for compute capability 9.0, ``sm_100a`` for 10.0; anything else is an error."""
    import torch

    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"cute_attn kernels run on CUDA tensors, got a tensor on {device}")
    return arch_of_index(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def sm_count_of_index(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """Multiprocessors of a CUDA device (a launch parameter of the persistent kernels)."""
    import torch

    return sm_count_of_index(device.index if device.index is not None else torch.cuda.current_device())
