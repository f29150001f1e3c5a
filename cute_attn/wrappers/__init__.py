"""The one wrapper layer: FlashInfer-compatible wrappers over the kernel families, the planner
and the runtime.  The public module paths (``cute_attn.decode``, ``.prefill``, ``.cascade``,
``.sparse``, ``.merge``) re-export from here.

``common``: what every wrapper checks and holds (workspace, dtypes, index arrays, out / lse /
sinks, CUDA-graph guards, ``reject_unsupported``); ``options``: FlashInfer's options ->
variants; ``masks``: custom masks; ``plans``: the frozen per-plan state; ``decode``,
``prefill_base`` + ``prefill``, ``single``, ``cascade``, ``sparse``, ``merge``: the wrappers
and ops."""
