"""KVCacheManager: one reuse plan per turn, and the turns in flight: the GPU actor's.

Plain Python like :mod:`runtime.plan.block_pool` (no trio, no mlx): the policy, while the
GPU actor, its one owner, executes it. It holds

* the **turns in flight**: their token ids, what they reused, and the prompt a running
  turn parked for others to start from (a *donor*);
* for each, the other agents' hot caches it may start from, as the hot tier gave them when it
  began (:meth:`runtime.plan.hot_tier.HotTier.donors`: agents that opted in, of the same
  tenant: a tenant's agents never start from another tenant's prefix, :mod:`runtime.identity`).

and answers the question of every turn (:meth:`KVCacheManager.plan`): given this agent's
cache (its hot one, :class:`runtime.plan.hot_tier.HotTier`, else the store's copy) and this prompt,
what is reused, from where, and what is prefilled. The answer, a
:class:`runtime.plan.turn_plan.TurnPlan`, travels to the engine unchanged. A turn can still
adopt a donor's tokens that cover more of its prompt before its first prefill chunk
(:meth:`KVCacheManager.donor_for`): agents that arrive together with the same system prompt then
prefill it once, and one that comes while the first decodes has the first's prompt parked
then (:meth:`KVCacheManager.late_donor`). The samples of one request (OpenAI's ``n``: one
prompt, several replies) form a *group*: the first prefills the prompt (from the agent's own
cache) while the others wait (:meth:`KVCacheManager.held_back`), then they start from its
prompt, to its last token, whatever its length (the same prompt, the same tokens: no floor,
no tenant or opt-in to check).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from runtime.identity import may_share, tenant_of
from runtime.plan.turn_plan import COLD, FromHot, FromShared, OwnCache, ParkedView, TurnPlan
from runtime.plan.hot_tier import HotDonor
from runtime.plan.prefix import MatchKind, PrefixMatch, common_prefix_length, match_prefix
from runtime.spec import BLOCK_TOKENS

__all__ = ["KVCacheManager", "MIN_SHARED_TOKENS", "own_plan"]


def own_plan(own: OwnCache, prompt: str) -> TurnPlan | None:
    """What ``prompt`` reuses of the agent's own cache (None: nothing): kvmem's one reuse matcher.

    On characters (:func:`runtime.plan.prefix.match_prefix`), so a reply the client got back
    with its bytes replaced (U+FFFD where a token ended inside a character) still reuses the
    tokens before it. Any common prefix counts, however small a part of the cache: a compacted
    history keeps its system prompt, an edit keeps what comes before it. Real turns
    (:meth:`KVCacheManager.plan`) and standalone sequences
    (:class:`runtime.execution.sequence.Sequence`, the warm-up) both match here.
    """
    cached = own.source.parked if isinstance(own.source, FromHot) else own.source.snapshot
    if not cached.text:
        return None
    match = match_prefix(cached.text, cached.offsets, prompt)
    if match.reuse_tokens == 0:
        return None
    return TurnPlan(tier=own.tier, source=own.source, match=match.kind.value, reuse_tokens=match.reuse_tokens,
                    reuse_chars=match.reuse_chars)


@dataclass
class _InFlight:
    agent_id: str
    model_tag: str
    token_ids: tuple[int, ...]
    tokens_reused: int
    share_prefix: bool
    prefill_started: bool = False
    donor: ParkedView | None = field(default=None, repr=False)
    donated: bool = False  # its prompt was parked for others (``donor`` None: it could not be)
    group: int | None = None  # the samples of one request (``n`` > 1): the first's request id
    hot: tuple[HotDonor, ...] = field(default=(), repr=False)  # other agents' hot caches, at its checkout


_Donor = tuple[str, ParkedView]
"""A cache a turn may start from: its agent and the cache (a hot cache, or a turn in flight's prompt)."""


MIN_SHARED_TOKENS = BLOCK_TOKENS
"""The fewest tokens a turn takes from another agent's cache (beyond them, to the token).

Another agent's cache is Q4 at rest: a turn that starts from it gets a reply that may part, at a
near tie, from the one the same conversation gets alone. Below a block that is a chat template's
opening, a default system prompt or a short one, whose prefill costs at most a block's (256 tokens,
0.7 s on the default model on this 2-core CPU: ``benches/results/reuse_costs.md``), so a short
conversation replies as it does alone, whichever agents happen to be hot
(``tests/reliability/test_reliability_load.py``); a long system prompt, the case sharing is for, is taken to the
token. The agent's own cache has no floor."""


def _whole_blocks(tokens: int) -> int:
    return tokens // BLOCK_TOKENS * BLOCK_TOKENS


class KVCacheManager:
    """The turns in flight and the reuse plan of each (see the module docstring)."""

    def __init__(self) -> None:
        self._inflight: dict[int, _InFlight] = {}
        self.prefix_hits = 0  # turns that started from another agent's cache

    def plan(self, agent_id: str, model_tag: str, prompt: str, *, share_prefix: bool, own: OwnCache | None,
             hot: Sequence[HotDonor] = ()) -> TurnPlan:
        """What this turn reuses, from where, and what it prefills.

        The agent's own cache (``own``, from its checkout) to the last whole token it has in common
        with the prompt; when the agent shares prefixes and another sharing agent's hot cache (``hot``,
        from the same checkout) or turn in flight covers more of the prompt, that one, to the token.
        Else cold.
        """
        mine = own_plan(own, prompt) if own is not None else None
        if mine is not None and mine.match in (MatchKind.EXTEND.value, MatchKind.EXACT.value):
            return mine  # an append: another agent's cache would have to hold this agent's own turns to beat it
        if share_prefix:
            shared = self._shared(agent_id, model_tag, prompt, hot, beyond=mine.reuse_chars if mine else 0)
            if shared is not None:
                return shared
        return mine or COLD

    def _shared(self, agent_id: str, model_tag: str, prompt: str, hot: Sequence[HotDonor], *,
                beyond: int) -> TurnPlan | None:
        """The longest prefix of ``prompt`` another sharing agent's cache covers, to the last whole token before
        the word where they part (as the agent's own cache is matched), if it covers more than ``beyond``
        characters and at least :data:`MIN_SHARED_TOKENS` tokens."""
        best: tuple[PrefixMatch, str, ParkedView] | None = None
        for donor, parked in [*hot, *self._in_flight_donors(agent_id, model_tag)]:
            if parked.num_tokens < MIN_SHARED_TOKENS:
                continue  # it cannot give enough: not worth matching its text
            match = match_prefix(parked.text, parked.offsets, prompt)
            if match.reuse_tokens >= MIN_SHARED_TOKENS and match.reuse_chars > (best[0].reuse_chars if best else beyond):
                best = (match, donor, parked)
        if best is None:
            return None
        match, donor, parked = best
        self.prefix_hits += 1
        return TurnPlan(tier="shared", source=FromShared(parked=parked, reuse_tokens=match.reuse_tokens, donor=donor),
                        match=match.kind.value, reuse_tokens=match.reuse_tokens, reuse_chars=match.reuse_chars)

    def _in_flight_donors(self, agent_id: str, model_tag: str) -> list[_Donor]:
        """The prompts other agents' turns in flight of ``model_tag`` parked for others, within ``agent_id``'s
        tenant."""
        return [(f.agent_id, f.donor) for f in self._inflight.values()
                if f.donor is not None and f.model_tag == model_tag and may_share(agent_id, f.agent_id)]

    # -- turns in flight ----------------------------------------------------------

    def begin(self, request_id: int, *, agent_id: str, model_tag: str, token_ids: Sequence[int], tokens_reused: int,
              share_prefix: bool, group: int | None = None, hot: Sequence[HotDonor] = ()) -> None:
        """A turn's sequence was built: ``token_ids`` is its whole prompt, ``tokens_reused`` of them cached;
        ``group``: the first request id of the samples of one request it is one of (None: it is alone);
        ``hot``: the other agents' hot caches its checkout gave (its adoption may start from one)."""
        self._inflight[request_id] = _InFlight(agent_id, model_tag, tuple(token_ids), tokens_reused, share_prefix,
                                               group=group, hot=tuple(hot))

    def _siblings(self, request_id: int, turn: _InFlight) -> list[tuple[int, _InFlight]]:
        """The other samples of ``turn``'s request in flight (none for a turn alone)."""
        if turn.group is None:
            return []
        return [(other_id, other) for other_id, other in self._inflight.items()
                if other_id != request_id and other.group == turn.group]

    def held_back(self, request_id: int) -> bool:
        """Whether this sample of a request waits for its first sample's prompt: the first is in flight and has
        not parked its prompt yet (once it has, or once it is gone, the sample starts). The first sample goes
        first, from the agent's own cache; the others then start from its prompt, to its last token."""
        turn = self._inflight.get(request_id)
        if turn is None or turn.group is None or turn.group == request_id or turn.prefill_started:
            return False
        first = self._inflight.get(turn.group)
        return first is not None and not first.donated

    @staticmethod
    def _best_donor(turn: _InFlight, donors: Iterable[_Donor], *, floor: int) -> tuple[int, _Donor] | None:
        """The donor whose tokens cover the most of ``turn``'s prompt, to its last token: at least ``floor``
        tokens and more than the turn reuses; (tokens kept, donor), or None."""
        best: tuple[int, _Donor] | None = None
        for donor in donors:
            keep = min(common_prefix_length(donor[1].token_ids, turn.token_ids), len(turn.token_ids) - 1)
            if keep >= floor and keep > (best[0] if best else turn.tokens_reused):
                best = (keep, donor)
        return best

    def _sibling_donor(self, request_id: int, turn: _InFlight) -> FromShared | None:
        """The prompt another sample of ``turn``'s request parked, to its last token, if it covers more than the
        turn reuses (see the module docstring)."""
        parked = [(other.agent_id, other.donor) for _, other in self._siblings(request_id, turn)
                  if other.donor is not None]
        best = self._best_donor(turn, parked, floor=1)
        if best is None:
            return None
        keep, (donor, cache) = best
        return FromShared(parked=cache, reuse_tokens=keep, donor=donor)

    def donor_for(self, request_id: int) -> FromShared | None:
        """Before a sharing turn's first prefill chunk: a donor's tokens that cover more of its prompt than it
        reuses (None: none, or its prefill started already). A question: :meth:`start_prefill` records the answer.

        Donors are the prompts turns in flight parked for others and, for a turn that reuses nothing, the
        other sharing agents' hot caches its checkout gave (a turn that reuses something was planned
        against them already, on its text). Matched on token ids, to the token: the turn then starts from
        the donor's first tokens, which are its own tokenization's, so the result is what a prefill of
        those tokens computes.
        """
        turn = self._inflight.get(request_id)
        if turn is None or turn.prefill_started:
            return None
        if (sibling := self._sibling_donor(request_id, turn)) is not None:
            return sibling
        if not turn.share_prefix:
            return None
        in_flight = self._in_flight_donors(turn.agent_id, turn.model_tag)
        hot = list(turn.hot) if turn.tokens_reused == 0 else []
        best = self._best_donor(turn, in_flight + hot, floor=MIN_SHARED_TOKENS)
        if best is None:
            return None
        keep, (donor, parked) = best
        return FromShared(parked=parked, reuse_tokens=keep, donor=donor)

    def start_prefill(self, request_id: int, adopted: FromShared | None) -> None:
        """The turn's first prefill chunk runs now, from ``adopted`` (:meth:`donor_for`'s answer) if not None."""
        turn = self._inflight.get(request_id)
        if turn is None or turn.prefill_started:
            return
        turn.prefill_started = True
        if adopted is not None:
            turn.tokens_reused = adopted.reuse_tokens
            if adopted.donor != turn.agent_id:  # another agent's, not a sample's own request's
                self.prefix_hits += 1

    def wants_donor(self, request_id: int, starting: Collection[int] = ()) -> bool:
        """Whether a sharing turn that has not started prefill would reuse more of this prefilled turn's prompt
        (``starting``: turns whose prefill starts in the same step, counted as started)."""
        turn = self._inflight.get(request_id)
        if turn is None:
            return False

        def waiting(other_id: int, other: _InFlight) -> bool:
            return not (other.prefill_started or other_id in starting)

        if turn.group == request_id and any(waiting(*pair) for pair in self._siblings(request_id, turn)):
            return True  # the first sample of a request: the others start from its prompt
        return any(waiting(other_id, other) and self._would_reuse_more(turn, other)
                   for other_id, other in self._inflight.items() if other_id != request_id)

    def awaits_donor(self, request_id: int, prefilling: Iterable[int], starting: Collection[int] = ()) -> bool:
        """Whether a sharing turn that has not started prefill would start from more of a prompt being prefilled
        (a sharing turn of ``prefilling`` whose prefill started) than it reuses: it then waits for that prompt,
        which its turn parks once prefilled (:meth:`wants_donor`), instead of prefilling the same blocks again.
        Prompts of a few tokens' difference in length otherwise take turns at the chunks (the scheduler's
        aging credit), and agents that arrived together each prefilled the system prompt they share.
        ``starting``: turns whose prefill starts in the same step, counted as started."""
        turn = self._inflight.get(request_id)
        if turn is None or turn.prefill_started:
            return False
        if self.held_back(request_id):
            return True
        return any((other.prefill_started or other_id in starting) and self._would_reuse_more(other, turn)
                   for other_id in prefilling
                   if other_id != request_id and (other := self._inflight.get(other_id)) is not None)

    def _would_reuse_more(self, donor: _InFlight, taker: _InFlight) -> bool:
        """Whether ``taker`` would reuse more of ``donor``'s prompt than it does: both share prefixes, with one
        model and one tenant (:meth:`wants_donor` and :meth:`awaits_donor` ask it from either side)."""
        return (donor.share_prefix and taker.share_prefix and donor.model_tag == taker.model_tag
                and tenant_of(donor.agent_id) == tenant_of(taker.agent_id)
                and self._shared_blocks(donor.token_ids, taker) > taker.tokens_reused)

    def late_donor(self, request_id: int, decoding: Iterable[int]) -> int | None:
        """The turn of ``decoding`` whose prompt this sharing turn, not yet started, would start from more of
        than it reuses, where that prompt was parked for nobody (its prefill ended before this turn came:
        :meth:`wants_donor` was asked then); the one that gives it the most blocks. The GPU actor parks it
        from its batch row now (:meth:`add_donor`), and the turn adopts it instead of prefilling the same
        blocks again: agents with one system prompt whose messages came a little apart share it too."""
        turn = self._inflight.get(request_id)
        if turn is None or turn.prefill_started:
            return None
        decoding = list(decoding)
        first = self._inflight.get(turn.group) if turn.group is not None and turn.group != request_id else None
        if first is not None and turn.group in decoding and not first.donated:
            return turn.group  # a sample admitted after its request's first sample prefilled: it starts from that
        best: tuple[int, int] | None = None
        for other_id in decoding:
            other = self._inflight.get(other_id)
            if other_id == request_id or other is None or other.donated or not self._would_reuse_more(other, turn):
                continue
            blocks = self._shared_blocks(other.token_ids, turn)
            if best is None or blocks > best[0]:
                best = (blocks, other_id)
        return None if best is None else best[1]

    def add_donor(self, request_id: int, parked: ParkedView | None) -> None:
        """The prompt a running turn parked for others (see :meth:`wants_donor`; None: it could not be)."""
        turn = self._inflight.get(request_id)
        if turn is not None:
            turn.donor, turn.donated = parked, True

    def left(self, agent_id: str, model_tag: str, parked: ParkedView) -> None:
        """A sharing agent's turn ended with ``parked``, now its hot cache in the store: the sharing turns in
        flight that have not started prefill may start from it, as from the hot caches their checkout gave
        (it came after their checkout)."""
        for turn in self._inflight.values():
            if (not turn.prefill_started and turn.share_prefix and turn.model_tag == model_tag
                    and may_share(turn.agent_id, agent_id)):
                turn.hot = (*(d for d in turn.hot if d.agent_id != agent_id), HotDonor(agent_id, parked))

    def end(self, request_id: int) -> None:
        """The turn left the GPU (finished, cancelled or failed)."""
        self._inflight.pop(request_id, None)

    @staticmethod
    def _shared_blocks(donor_ids: Sequence[int], turn: _InFlight) -> int:
        """Whole blocks of ``turn``'s prompt ``donor_ids`` cover: what is worth waiting for, or parking a
        decoding row for (a few tokens in common, such as a template's opening, are not)."""
        return _whole_blocks(common_prefix_length(donor_ids, turn.token_ids))
