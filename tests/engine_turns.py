"""An ``MlxEngine`` on a tiny model and turns run straight through it, for tests of what a turn leaves behind."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np
from conftest import models_dir

from runtime.plan.engine import Finished
from runtime.plan.sampling import SamplingOptions
from runtime.plan.turn_plan import ColdStart, TurnPlan

COLD = TurnPlan(tier="cold", source=ColdStart(), match="empty", reuse_tokens=0, reuse_chars=0)
PROMPT = "User: Tell me about the harbour and its boats.\nAssistant:"


@contextmanager
def tiny_engine(profile: str, *, attention: str = "at-rest", model: str = "tiny-llama", **settings: Any) -> Iterator[Any]:
    """A loaded ``MlxEngine`` under ``profile`` (``gpu`` / ``cpu`` forced), unloaded after."""
    from runtime.execution.mlx_engine import MlxEngine

    engine = MlxEngine(models_dir=models_dir(), kv_bits=4, kv_group_size=64, attention=attention, profile=profile,
                       **settings)
    engine.load(model)
    try:
        yield engine
    finally:
        engine.unload()


def run_turn(engine: Any, request_id: int = 1, prompt: str = PROMPT, plan: TurnPlan = COLD,
             max_tokens: int = 4) -> Finished:
    """One turn through ``engine`` as the GPU actor runs it: start, prefill, decode alone, finish."""
    engine.start(request_id, prompt, plan, engine.tokenize(prompt, plan), SamplingOptions(max_tokens=max_tokens))
    while (result := engine.prefill(request_id, None)).remaining:
        pass
    if not result.finished:
        engine.join(request_id)
        while not any(t.finished for t in engine.step()):
            pass
    return engine.finish(request_id)


def host_arrays(parked: Any) -> list[dict[str, np.ndarray]]:
    """Each layer of ``parked`` read straight into numpy (batch axis dropped, bfloat16 as float32): the
    reference a host copy made any other way must equal."""
    return [{name: np.array(a[0].astype(mx.float32) if a.dtype == mx.bfloat16 else a[0])
             for name, a in layer.arrays.items()} for layer in parked.layers]
