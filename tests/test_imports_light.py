"""The home folder, the KV format and persistence import without MLX.

``import runtime`` loads OpenBLAS (a shared library, :mod:`runtime.blas`) so
that a later ``import mlx`` uses it; that is fine. Importing MLX itself is
not: settings, the cache directory and tools that only read caches must not
pay for it (nor need it installed).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_home_and_persist_import_without_mlx() -> None:
    _run(
        "import runtime.home, runtime.persist\n"
        "import sys\n"
        "assert 'mlx' not in sys.modules, sorted(m for m in sys.modules if m.startswith('mlx'))\n"
    )


def test_kvformat_and_atomic_writes_import_without_mlx() -> None:
    _run(
        "import runtime.kvformat, runtime.persist.files\n"
        "import sys\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'trio'))\n"
        "assert not bad, bad\n"
    )


def test_spec_reexports_the_plain_kv_format() -> None:
    import runtime.kvformat
    import runtime.spec

    assert runtime.spec.KVFormat is runtime.kvformat.KVFormat
    assert runtime.spec.LayerSpec is runtime.kvformat.LayerSpec
