"""The compile targets: every arch cute_attn builds for, and how a device's compute capability
maps onto one.  Which kernel serves which arch is the backend table's business
(``families.backends``)."""

from __future__ import annotations

HOPPER = "sm_90a"
BLACKWELL = "sm_100a"
ARCHS = (HOPPER, BLACKWELL)

# compute capability (major, minor) -> arch; the "a" targets run only on exactly that major
ARCH_BY_CAPABILITY = {(9, 0): HOPPER, (10, 0): BLACKWELL}


def check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; cute_attn compiles for {', '.join(ARCHS)}")
    return arch
