"""What a wrapper's ``run()`` launches for the variant its ``plan()`` chose.

Shared by the decode and prefill wrappers: the plan's kernel module with the variant's runtime
values (computed once in ``plan()`` when they do not depend on ``run()``'s arguments), or, when
``run()`` passes ``sinks``, the same variant + :class:`AttentionSink` (its module loaded on the
first such run).  Nothing here imports the DSL.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from .base import Variant, runtime_values
from .builtins import AttentionSink


class VariantBinding:
    def __init__(self, variant: Optional[Variant], info: dict, module, load: Callable):
        """``info``: what :meth:`Variant.fill` may read (heads, head dim, sm_scale, device, batch);
        ``module``: the plan's kernel; ``load(variant) -> module`` for the sink variant."""
        self.variant, self.info, self.module, self._load = variant, info, module, load
        self.values = None  # runtime values when run() gets no extra arguments
        if variant is not None:
            try:
                self.values = runtime_values(variant, info)
            except ValueError:
                pass  # some come from run(*args)
        self._sink = None

    def select(self, args: Sequence = (), sinks=None):
        """(module, runtime values) for one ``run()``; ``sinks`` already validated, fp32."""
        if sinks is not None:
            if self._sink is None:
                sv = AttentionSink() if self.variant is None else self.variant + AttentionSink()
                self._sink = (sv, self._load(sv))
            sv, module = self._sink
            return module, runtime_values(sv, self.info, tuple(args) + (sinks,))
        if args or (self.values is None and self.variant is not None):
            return self.module, runtime_values(self.variant, self.info, args)
        return self.module, self.values or []
