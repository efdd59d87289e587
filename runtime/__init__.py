"""kvmem's synchronous core: models, Q4 KV caches, persistence, generation.

Importing this package loads OpenBLAS before MLX (see :mod:`runtime.blas`) and sets the
MLX environment kvmem needs on CUDA (:mod:`runtime.mlx_env`).
Nothing in here imports trio.
"""

import os as _os

# mlx-lm's tokenizers come from transformers, which tells every process without
# PyTorch that its models are unavailable; kvmem never uses them.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from runtime import mlx_env as _mlx_env  # noqa: E402  (before MLX reads its environment)

_mlx_env.apply_mlx_defaults()

from runtime import blas as _blas  # noqa: E402,F401  (must run before any mlx import)
