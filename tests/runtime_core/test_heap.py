"""What a model load leaves is frozen out of Python's full collections (runtime.heap), and the collector's
runs show in the GPU actor's trace.

A full collection walks every object the process holds, under the GIL: about 40 ms with the default
model loaded on the 2-core CPU, inside whatever turn it lands in (``benches/speed/gc_pauses.py``).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import msgspec
import trio

import runtime  # noqa: F401
from actors import open_runtime
from fake_engine import FakeEngine
from runtime import heap
from runtime.plan.engine import ModelInfo


class Weighty(FakeEngine):
    """A fake whose load reports weights, as a real model's does (the fake's own reports none, and a load
    that brought no weights freezes nothing)."""

    def load(self, name: str) -> ModelInfo:
        return msgspec.structs.replace(super().load(name), model_bytes=1 << 20)


def _unfrozen() -> int:
    """Thaw everything; then the permanent generation's size with nothing frozen. That is 0, but on
    Python 3.12 each collection moves the immortal objects it meets there (PEP 683; 375 tuples of
    classes' bases, ``(<class 'object'>,)`` and the like, here and on the H200's Python 3.12, where run 5
    counted them as frozen after a runtime closed): 3.11 and 3.13 leave them in the generations."""
    gc.unfreeze()
    gc.collect()
    return heap.frozen_objects()


def _open(tmp_path: Path, engine: FakeEngine | None = None, **kw):
    kw.setdefault("handle_signals", False)
    return open_runtime(model="fake-a", home=tmp_path, engine=engine or Weighty(), fsync=False, **kw)


async def test_the_load_freezes_what_it_leaves_and_closing_thaws_it(tmp_path):
    level = _unfrozen()
    held = ["a container the collector tracks, made before the load"]
    async with _open(tmp_path) as rt:
        await rt.agent("a").send_prompt("hello", max_tokens=3)
        frozen = heap.frozen_objects()
        assert frozen > level + 1000  # the process's objects, the runtime's among them
        # Frozen objects are in no generation: a full collection walks only what turns allocated since.
        assert not any(o is held for o in gc.get_objects())
        assert len(gc.get_objects(generation=2)) < frozen
    assert heap.frozen_objects() <= level  # closed: what the model left may be collected again


async def test_an_idle_unload_thaws_and_the_next_load_freezes_again(tmp_path, autojump_clock):
    level = _unfrozen()
    engine = Weighty()
    async with _open(tmp_path, engine, model_idle_s=60) as rt:
        # Not durable: a durable reply waits for the save's disk thread, and meanwhile the autojump clock
        # runs to the idle unload (it thawed before the check, once in CI).
        await rt.agent("m").send_prompt("one", max_tokens=2, durable=False)
        assert heap.frozen_objects() > level + 1000
        await trio.sleep(61)
        assert rt.stats().registry.idle_unloads == 1
        for _ in range(500):  # the GPU actor counts the unload as it starts it
            if heap.frozen_objects() <= level:
                break
            # real time: the autojump clock's sleeps return at once while the unload's job runs on a thread
            await trio.to_thread.run_sync(time.sleep, 0.01)
        assert heap.frozen_objects() <= level
        await rt.agent("m").send_prompt("two", max_tokens=2, durable=False)
        assert engine.loads == ["fake-a", "fake-a"] and heap.frozen_objects() > level + 1000


async def test_a_load_that_brought_no_weights_freezes_nothing(tmp_path):
    level = _unfrozen()
    async with _open(tmp_path, FakeEngine()) as rt:
        await rt.agent("a").send_prompt("hello", max_tokens=3)
        assert heap.frozen_objects() <= level


async def test_a_real_models_load_freezes_its_modules(tmp_path):
    from conftest import models_dir

    level = _unfrozen()
    async with open_runtime(model="tiny-llama", home=tmp_path, models_dir=models_dir(), fsync=False,
                            handle_signals=False, prefetch_mb=0) as rt:
        await rt.agent("a").send_prompt("hello", max_tokens=3)
        assert heap.frozen_objects() > level + 1000
        assert not any(type(o).__module__ == "mlx_lm.models.llama" for o in gc.get_objects())  # the model
    assert heap.frozen_objects() <= level  # the engine's unload collected: 3.12's immortal objects again


def test_settle_collects_the_loads_cyclic_garbage_before_freezing() -> None:
    gc.unfreeze()

    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the collector frees it

    collected: list[int] = []
    gc.callbacks.append(lambda phase, info: collected.append(info["collected"]) if phase == "stop" else None)
    try:
        Node()
        heap.settle()
    finally:
        gc.callbacks.pop()
        heap.thaw()
    assert sum(collected) >= 1  # the garbage went before the freeze, not into it


async def test_the_trace_shows_each_collection_with_its_generation_and_length(tmp_path):
    async with _open(tmp_path, trace=True) as rt:
        await rt.agent("a").send_prompt("hello", max_tokens=3)
        gc.collect(1)
        gc.collect()
        events = [e for e in rt.gpu_events() if e.kind == "gc"]
    assert [e.generation for e in events[-2:]] == [1, 2]
    assert all(e.took_ms is not None and e.took_ms >= 0 and e.request_ids == () for e in events)
    gc.collect()  # the runtime closed: its callback is gone with it
    assert len([e for e in rt.gpu_events() if e.kind == "gc"]) == len(events)

