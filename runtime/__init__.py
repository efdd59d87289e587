"""kvmem's synchronous core: models, Q4 KV caches, persistence, generation.

Importing this package loads OpenBLAS before MLX (see :mod:`runtime.blas`).
Nothing in here imports trio.
"""

from runtime import blas as _blas  # noqa: F401  (must run before any mlx import)
