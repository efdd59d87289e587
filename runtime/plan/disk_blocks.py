"""Starting a turn from whole blocks on disk: when to look, and the plan that starts from them.

Pure (no trio, no mlx), like :mod:`runtime.plan.kv_manager`. The manager plans a turn against
what is in RAM (the agent's own cache, read from disk when it had no hot one, and other
agents' hot caches and turns in flight). After a restart, or once the hot tier dropped them,
a prompt may begin with tokens that no cache in RAM holds but that the tenant's
``blocks/`` does: another agent's system prompt, the agent's own earlier branch. Blocks
are named by the hash chain of their token ids, so they are found from the turn's own
tokens (:mod:`runtime.persist.prefix_blocks`), once the prompt is tokenized:

1. :func:`blocks_to_look_up`: whether the turn should ask (it shares prefixes, the model's
   layers all live in blocks, its plan does not already reuse its whole cache, and the prompt
   has more whole blocks than the plan reuses), and the token ids to ask for;
2. the GPU actor asks the cache store (``ReadBlocks``), which reads the longest run of them;
3. :func:`start_from_blocks`: the plan and tokens of a turn that starts from those blocks,
   when they cover more of the prompt than its plan did.

The blocks hold exactly what a prefill of those token ids computed, at those positions, so
the turn computes what a cold prefill of its prompt would.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.plan.turn_plan import FromHot, FromShared, FromWarm, Tokenized, TurnPlan
from runtime.plan.prefix import MatchKind
from runtime.spec import BLOCK_TOKENS, CacheSnapshot, LayerKind, LayerSnapshot

__all__ = ["blocks_to_look_up", "start_from_blocks", "whole_prompt"]


def whole_prompt(plan: TurnPlan, tokens: Tokenized) -> tuple[list[int], list[int]]:
    """The turn's whole prompt as token ids and end offsets: the plan's reused tokens, then its suffix's."""
    ids, ends = [], []
    match plan.source:
        case FromHot(parked=cached) | FromShared(parked=cached) | FromWarm(snapshot=cached):
            ids, ends = list(cached.token_ids[: plan.reuse_tokens]), list(cached.offsets[: plan.reuse_tokens])
    return ids + list(tokens.ids), ends + [plan.reuse_chars + end for end in tokens.ends]


def blocks_to_look_up(plan: TurnPlan, tokens: Tokenized, *, share_prefix: bool,
                      layer_kinds: Sequence[LayerKind]) -> tuple[int, ...] | None:
    """The token ids whose whole blocks a turn should look for on disk, or None: nothing to gain.

    None when the agent opted out of sharing, a layer slides (its window is in no block), the plan
    extends or repeats a cache already (the disk holds no more of it than RAM), or the prompt's whole
    blocks could give less than a block more than the plan reuses: the read starts at the first block
    (a run is found by its hash chain from there), so a compacted history that keeps 3,009 tokens of a
    3,100-token prompt would read twelve blocks to save 63 tokens of prefill. The last token is never
    asked for: its logits are the next token's, so it is prefilled.
    """
    if not share_prefix or not layer_kinds or LayerKind.SLIDING in layer_kinds:
        return None
    if plan.match in (MatchKind.EXTEND.value, MatchKind.EXACT.value):
        return None
    total = plan.reuse_tokens + len(tokens.ids)
    if (total - 1) // BLOCK_TOKENS * BLOCK_TOKENS - plan.reuse_tokens < BLOCK_TOKENS:
        return None
    ids, _ = whole_prompt(plan, tokens)
    return tuple(ids[: total - 1])


def start_from_blocks(plan: TurnPlan, tokens: Tokenized, prompt: str, *, model_tag: str, reused: int,
                      layers: Sequence[LayerSnapshot]) -> tuple[TurnPlan, Tokenized] | None:
    """The plan and suffix tokens of a turn that starts from its prompt's first ``reused`` tokens read
    from disk (``layers``), or None when that is no more than ``plan`` reuses.

    Also None when the blocks end inside a character (the token after them shares its end offset):
    a cache's text must end on a character.
    """
    if reused <= plan.reuse_tokens:
        return None
    ids, ends = whole_prompt(plan, tokens)
    if ends[reused - 1] == ends[reused]:
        return None
    chars = ends[reused - 1]
    snapshot = CacheSnapshot(model_tag=model_tag, text=prompt[:chars], token_ids=ids[:reused],
                             offsets=ends[:reused], layers=list(layers))
    start = TurnPlan(tier="warm", source=FromWarm(snapshot=snapshot), match=MatchKind.EXTEND.value,
                     reuse_tokens=reused, reuse_chars=chars)
    return start, Tokenized(ids=tuple(ids[reused:]), ends=tuple(end - chars for end in ends[reused:]))
