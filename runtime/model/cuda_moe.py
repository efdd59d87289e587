"""Other roads for a mixture-of-experts model's expert products on CUDA, to find run 5's wrong one (``KVMEM_CUDA_MOE``).

H200 run 5: three tiny-gpt-oss cache tests (float32, MLX's compile off) were off by O(10) in a logit
on CUDA, and right on the CPU. Run 4's layer-by-layer probe put the error in the MoE block when a
layer's graph was evaluated whole, not when the block's input was evaluated first. mlx-lm's
``SwitchGLU`` sorts a pass's tokens by expert once it routes 64 or more (token, expert) pairs, and
MLX 0.32's CUDA backend multiplies sorted pairs with a CUTLASS grouped GEMM whose groups a kernel
counts on the device; fewer pairs go one gather-and-multiply a pair.

``KVMEM_CUDA_MOE`` sends every ``SwitchGLU`` of a model loaded on CUDA down another road, so a lent GPU
runs those tests each way (``benches/gpu_session.sh``) beside the probe's expert products alone
(``benches/gpu/gpu_probe.py``, ``gather``):

* ``unsorted``: the products one gather a pair, never sorted;
* ``inputs-evaluated``: the block's input and routes evaluated before its products (a graph boundary).

Unset (the default) nothing changes, and on other backends it is ignored. The road that makes the tests
pass is then measured for speed and made the CUDA default for the families that need it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

__all__ = ["MOE_ROAD_ENV", "MOE_ROADS", "take_moe_road"]

MOE_ROAD_ENV = "KVMEM_CUDA_MOE"


class _Unsorted(SwitchGLU):
    """``SwitchGLU`` whose pairs are never sorted by expert, however many."""

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        x = mx.expand_dims(x, (-2, -3))
        indices = mx.stop_gradient(indices)
        up, gate = self.up_proj(x, indices), self.gate_proj(x, indices)
        return self.down_proj(self.activation(up, gate), indices).squeeze(-2)


class _InputsEvaluated(SwitchGLU):
    """``SwitchGLU`` whose input and routes are evaluated before its products."""

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        mx.eval(x, indices)
        return super().__call__(x, indices)


MOE_ROADS: dict[str, type[SwitchGLU]] = {"unsorted": _Unsorted, "inputs-evaluated": _InputsEvaluated}
"""``KVMEM_CUDA_MOE``'s values and the ``SwitchGLU`` each makes of a model's own."""


def take_moe_road(model: nn.Module, road: str) -> int:
    """Send every ``SwitchGLU`` of ``model`` down ``road`` (one of :data:`MOE_ROADS`); returns how many.

    The layers keep their parameters where they are: only their class changes, to a subclass of mlx-lm's
    whose ``__call__`` takes the road.

    Raises:
        ValueError: ``road`` is none of :data:`MOE_ROADS`.
    """
    if road not in MOE_ROADS:
        raise ValueError(f"{MOE_ROAD_ENV}={road!r}: expected one of {', '.join(MOE_ROADS)}")
    blocks: list[Any] = [m for _, m in model.named_modules() if type(m) is SwitchGLU]
    for block in blocks:
        block.__class__ = MOE_ROADS[road]
    return len(blocks)
