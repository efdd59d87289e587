"""Model families MLX's CUDA backend computes wrongly with ``mx.compile`` on: loading one turns it off.

H200 run 4 (MLX 0.32.4, ``benches/results/gpu_runs/2026-11-27-run4-probe.md``): tiny-gpt-oss's
MoE block came off the device 4.5 away from MLX's CPU stream when a layer's graph was evaluated
whole with compile on, and right (1.2e-05) with compile off or with each block's input evaluated
first; no router choice flipped, so it is a kernel's error, not a near tie. mlx-lm's gpt-oss
activation (``SwigluOAI``) is a shapeless ``mx.compile`` over strided halves of the gate-up
projection. The suite's two gpt-oss cache tests failed on that device by up to 12.5 in a logit.

So loading a model of such a family on CUDA turns MLX's compile off for the process
(``mx.disable_compile``; MLX checks it at each compiled call): its elementwise kernels run
unfused, slower and right, and so does every model the process loads after it. Elsewhere
(CPU, Metal) nothing changes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

__all__ = ["COMPILE_WRONG_ON_CUDA", "compile_off_for", "turn_compile_off_if_wrong"]

log = logging.getLogger("kvmem.model")

COMPILE_WRONG_ON_CUDA = frozenset({"gpt_oss"})
"""``model_type`` values whose forward MLX's CUDA backend gets wrong with compile on (see the module docstring)."""


def compile_off_for(model_type: str | None, backend: str) -> bool:
    """Whether a model of ``model_type`` needs MLX's compile off on ``backend`` (``cpu``, ``metal``, ``cuda``)."""
    return backend == "cuda" and model_type in COMPILE_WRONG_ON_CUDA


def turn_compile_off_if_wrong(name: str, config: Mapping[str, Any], backend: str) -> bool:
    """Turn MLX's compile off when the model ``config`` describes needs it on ``backend``; True when it did."""
    model_type = config.get("model_type")
    if not compile_off_for(model_type if isinstance(model_type, str) else None, backend):
        return False
    mx.disable_compile()
    log.warning("%s: MLX's compile is off for this process: its CUDA kernels compute %s models wrongly with it on "
                "(runtime.model.cuda_compile)", name, model_type)
    return True
