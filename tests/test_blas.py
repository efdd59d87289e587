"""OpenBLAS is loaded before MLX and MLX's matmuls run through it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cpu_only
from runtime import blas

PROBE = """
import json, sys, time
import runtime
import mlx.core as mx
a = mx.random.normal((512, 576)); b = mx.random.normal((576, 1536)); mx.eval(a, b)
mx.eval(a @ b)
t = time.perf_counter()
for _ in range(10):
    mx.eval(a @ b)
dt = (time.perf_counter() - t) / 10
maps = open('/proc/self/maps').read()
print(json.dumps({'gflops': 2 * 512 * 576 * 1536 / dt / 1e9, 'openblas_mapped': 'libopenblas' in maps,
                  'loaded': runtime.blas.openblas_path()}))
"""


def _probe(env_extra: dict[str, str]) -> dict:
    import os

    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS loading is a Linux CPU concern")
@cpu_only("the probe's matmul runs on the default device: only MLX's CPU backend calls OpenBLAS")
def test_mlx_matmuls_go_through_openblas():
    if blas._find_openblas() is None:
        pytest.skip("libopenblas0-pthread is not installed")
    with_blas = _probe({})
    without = _probe({"KVMEM_NO_OPENBLAS": "1"})
    assert with_blas["openblas_mapped"] and with_blas["loaded"]
    assert not without["openblas_mapped"]
    # The bundled reference BLAS is ~30x slower; demand a clear gap, not the full ratio.
    assert with_blas["gflops"] > 4 * without["gflops"], (with_blas, without)


def test_loader_is_a_noop_off_linux(monkeypatch):
    monkeypatch.setattr(blas, "_loaded", None)
    monkeypatch.setattr(blas.sys, "platform", "darwin")
    assert blas.load_openblas() is None
