"""Pre-warmed memory (runtime.execution.warmup): later MLX buffers reuse the touched pages instead of fresh ones."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import cpu_only

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator tuning is Linux-only")

_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import runtime  # OpenBLAS before MLX
    import mlx.core as mx
    from runtime.execution.warmup import prewarm_memory

    def resident_bytes():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    if sys.argv[1] == "prewarm":
        assert prewarm_memory(192) > 0
    before = resident_bytes()
    buffers = [mx.ones((2**20,), dtype=mx.float32) for _ in range(32)]  # 32 x 4 MiB, like an activation
    mx.eval(buffers)
    print(resident_bytes() - before)
    """
)


def _resident_growth(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1])


@cpu_only("measures host RSS growth from mx.ones: on a GPU the buffers are device memory, and the GPU policy "
          "never pre-warms (prewarm_mb 0)")
def test_activation_buffers_reuse_prewarmed_pages_instead_of_faulting_in_new_ones():
    fresh = _resident_growth("fresh")
    prewarmed = _resident_growth("prewarm")
    assert fresh >= 100 * 2**20, f"without pre-warming, 128 MiB of buffers grew resident memory by only {fresh} B"
    assert prewarmed <= 16 * 2**20, f"after pre-warming 192 MiB, 128 MiB of buffers still grew it by {prewarmed} B"


def test_prewarm_of_nothing_does_nothing():
    from runtime.execution.warmup import prewarm_memory

    assert prewarm_memory(0) == 0.0
