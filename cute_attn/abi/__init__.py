"""The contract between host and kernels, defined once: argument descriptors (``args``), the
dtype vocabulary (``dtypes``), the compile targets (``archs``) and the records the planner
writes and the kernels read (``records``).  Imports nothing else of cute_attn, so every other
layer can depend on it."""
