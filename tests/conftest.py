"""Test markers: ``gpu`` tests skip without a CUDA device, ``compile`` tests without the CuTe DSL."""
import os

import pytest


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _has_dsl() -> bool:
    from cute_attn.runtime.cache import installed_dsl_version

    return installed_dsl_version() is not None


def pytest_collection_modifyitems(config, items):
    gpu, dsl = _has_gpu(), _has_dsl()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (sm_90 or sm_100); none is visible")
    skip_dsl = pytest.mark.skip(reason="needs nvidia-cutlass-dsl to compile kernels")
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        if "compile" in item.keywords and not dsl:
            item.add_marker(skip_dsl)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """A fresh, empty module cache for the test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("CUTE_ATTN_CACHE_DIR", str(root))
    return root
