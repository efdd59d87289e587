"""Python's cyclic garbage collector, kept off the turns' path.

A full (generation 2) collection walks every container object the process holds, under the
GIL, and most of them are what a model load leaves for the rest of its life: mlx-lm's modules,
the tokenizer and its chat template, every module imported on the way. Measured on the 2-core
CPU with the default model loaded (about 94,000 tracked objects): a full collection took about
40 ms; one landed inside a hot turn, whose first token came after 47 ms instead of 5 ms, and the
model's thread builds no graph while it runs (the GIL), so every decoding agent stalls with it.
``benches/speed/gc_pauses.py`` measures it turn by turn.

:func:`settle` collects once after a model load and moves what survives to the permanent
generation (``gc.freeze``), which no later collection walks: collections then see only what the
turns allocated since. :func:`thaw` moves it back before the model goes, so that whatever of the
load ends in reference cycles can be collected again (a runtime closed in a process that goes on:
tests, embedding code). Both are process-wide, as the collector is: a second runtime in the same
process settles again at its own load.
"""

from __future__ import annotations

import gc

__all__ = ["settle", "thaw", "frozen_objects"]


def settle() -> None:
    """After a model load: collect the load's garbage, then freeze every object that survives."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Before a model goes (unload, shutdown): let collections walk the frozen objects again."""
    gc.unfreeze()


def frozen_objects() -> int:
    """How many objects are frozen now (``gc.get_freeze_count``). On Python 3.12 that count also holds the
    immortal objects (PEP 683) each collection moves to the permanent generation, about 375 with nothing
    frozen; 3.11 and 3.13 leave them in the generations."""
    return gc.get_freeze_count()
