"""The package version (its own module: the kernel cache keys hash the modules a kernel is built
from, and the package __init__ imports the wrappers and the planner)."""

__version__ = "0.1.0"
