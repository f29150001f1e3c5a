"""The one wrapper layer: FlashInfer-compatible wrappers over the kernel families, the planner
and the runtime.  The public module paths (``cute_attn.decode``, ``.prefill``, ``.cascade``,
``.sparse``, ``.merge``) re-export from here."""
