"""OpenBLAS is loaded before MLX and MLX's matmuls run through it.

The evidence is in the bits, not the clock: MLX's product equals OpenBLAS's own ``cblas_sgemm`` on the same
inputs, called directly, bit for bit, and the bundled reference BLAS (``KVMEM_NO_OPENBLAS=1``), which sums in
another order, does not. How much faster that makes MLX's CPU matmuls is ``benches/speed/blas.py``'s to measure.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cpu_only
from runtime import blas

PROBE = """
import ctypes, json, sys
import numpy as np
import runtime
import mlx.core as mx
M, K, N = 512, 576, 1536
rng = np.random.default_rng(0)
a, b = rng.standard_normal((M, K), dtype=np.float32), rng.standard_normal((K, N), dtype=np.float32)
got = np.array(mx.array(a) @ mx.array(b))
maps = open('/proc/self/maps').read()  # what MLX ran with, before the probe maps OpenBLAS itself
openblas = ctypes.CDLL(sys.argv[1])  # OpenBLAS's own product: row-major, neither transposed
c = np.zeros((M, N), dtype=np.float32)
F = ctypes.POINTER(ctypes.c_float)
openblas.cblas_sgemm(101, 111, 111, M, N, K, ctypes.c_float(1.0), a.ctypes.data_as(F), K, b.ctypes.data_as(F), N,
                     ctypes.c_float(0.0), c.ctypes.data_as(F), N)
print(json.dumps({'bits_differ': int((got != c).sum()), 'close': bool(np.allclose(got, c, rtol=1e-4, atol=1e-3)),
                  'openblas_mapped': 'libopenblas' in maps, 'loaded': runtime.blas.openblas_path()}))
"""


def _probe(env_extra: dict[str, str], openblas: str) -> dict:
    import os

    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", PROBE, openblas], capture_output=True, text=True, env=env,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS loading is a Linux CPU concern")
@cpu_only("the probe's matmul runs on the default device: only MLX's CPU backend calls OpenBLAS")
def test_mlx_matmuls_go_through_openblas():
    openblas = blas._find_openblas()
    if openblas is None:
        pytest.skip("libopenblas0-pthread is not installed")
    with_blas = _probe({}, openblas)
    without = _probe({"KVMEM_NO_OPENBLAS": "1"}, openblas)
    assert with_blas["loaded"] and with_blas["openblas_mapped"]
    assert with_blas["bits_differ"] == 0, with_blas  # MLX's product is OpenBLAS's, every bit of it
    # The control: the reference BLAS gives the same product within float error, in other bits (the probe maps
    # OpenBLAS itself for the comparison after MLX's product: MLX's symbols were bound by then).
    assert not without["loaded"] and not without["openblas_mapped"]
    assert without["close"] and without["bits_differ"] > 0, without


def test_loader_is_a_noop_off_linux(monkeypatch):
    monkeypatch.setattr(blas, "_loaded", None)
    monkeypatch.setattr(blas.sys, "platform", "darwin")
    assert blas.load_openblas() is None
