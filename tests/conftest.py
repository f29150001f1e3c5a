"""Test markers: ``gpu`` tests skip without a CUDA device, ``compile`` tests without the CuTe DSL."""

import os
import subprocess
import sys

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


# What the compile tests build: ``ci`` (every kernel geometry of ``default``, its modes pairwise:
# cute_attn.presets.covering) unless set to ``default`` for the whole shipped set.
COMPILE_TEST_PRESET = os.environ.get("CUTE_ATTN_COMPILE_TEST_PRESET", "ci")


@pytest.fixture(scope="session")
def aot_cache(tmp_path_factory):
    """COMPILE_TEST_PRESET compiled for both arches by the CLI, once per session: (dir, CLI output)."""
    out = tmp_path_factory.mktemp("aot")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cute_attn",
            "compile",
            "--arch",
            "sm_90a",
            "--arch",
            "sm_100a",
            "--preset",
            COMPILE_TEST_PRESET,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=3600,  # ci: ~240 specs, ~12 min on 2 cores; default: 933 specs, most of an hour
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout
