"""Tensor-parallel sharding of a loaded model, and the names a rank's caches carry.

mlx-lm shards llama-family models itself (``model.shard(group)``: the query,
key, value and MLP-up projections split by output rows, the attention-output
and MLP-down projections by input columns with an ``all_sum`` after them). kvmem
only calls it, and first checks that the model splits evenly: each rank must
hold whole attention heads and whole key-value heads, or a rank's KV cache
would not be a set of heads at all.

A rank's cache holds only its heads, so its model tag says which part it is
(:func:`shard_model_id`): a part saved by rank 1 of 2 is never served as a whole
cache, nor as another rank's part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime.errors import UnsupportedModelError

__all__ = ["check_shardable", "shard_model", "shard_model_id", "rank_tag"]


def check_shardable(config: Mapping[str, Any], size: int, *, name: str) -> None:
    """Refuse a model whose attention heads, key-value heads or MLP width do not divide by ``size``.

    Raises:
        UnsupportedModelError: naming the counts that do not divide.
    """
    heads = int(config.get("num_attention_heads") or 0)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    width = int(config.get("intermediate_size") or 0)
    if not heads:
        raise UnsupportedModelError(f"model {name!r} cannot be split over {size} ranks: its config names no "
                                    "num_attention_heads")
    uneven = [f"{count} {what}" for what, count in (("attention heads", heads), ("key-value heads", kv_heads),
                                                    ("MLP units", width)) if count % size]
    if uneven:
        raise UnsupportedModelError(
            f"model {name!r} cannot be split over {size} ranks: {' and '.join(uneven)} do not divide by {size}; "
            f"pick a model whose head counts do (tiny-llama has 4 attention and 2 key-value heads)"
        )


def shard_model(model: Any, config: Mapping[str, Any], group: Any, *, name: str) -> None:
    """Keep this rank's part of ``model``'s weights (mlx-lm's ``shard``), after checking it divides evenly."""
    import mlx.core as mx

    if not callable(getattr(model, "shard", None)):
        raise UnsupportedModelError(f"model {name!r}: mlx-lm cannot shard its architecture by tensor parallelism")
    check_shardable(config, group.size(), name=name)
    model.shard(group)
    mx.eval(model.parameters())


def shard_model_id(name: str, rank: int, size: int) -> str:
    """The model id a rank's caches are tagged with: ``name+tp<rank>of<size>``."""
    return f"{name}+tp{rank}of{size}"


def rank_tag(tag: str, *, rank: int, size: int) -> str:
    """Another rank's tag for the same model: ``m+tp0of2@h/q4g64`` -> ``m+tp1of2@h/q4g64`` for rank 1.

    Raises:
        ValueError: ``tag`` is not a sharded model's tag for ``size`` ranks.
    """
    model, sep, rest = tag.partition("@")
    base, marker, _part = model.rpartition("+tp")
    if not sep or not marker or not _part.endswith(f"of{size}"):
        raise ValueError(f"{tag!r} is not the tag of a model sharded over {size} ranks")
    return f"{shard_model_id(base, rank, size)}@{rest}"
