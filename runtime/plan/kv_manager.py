"""KVCacheManager: every agent's parked cache in RAM, and one reuse plan per turn.

Plain Python like :mod:`runtime.plan.block_pool` (no trio, no mlx): the policy, while
the actors execute it. It owns

* the **hot tier**: the latest parked cache of every (agent, model), least
  recently used first, charged to a :class:`runtime.plan.block_pool.BlockPool` per model.
  Full 256-token blocks are charged by content (their hash-chain ids), so agents
  whose caches begin with the same tokens pay for those blocks once. When a cache
  does not fit, least recently used caches that are already on disk are dropped
  (demoted to the warm tier); one that still does not fit stays until its save
  completes, and is then dropped;
* the **shared-prefix index**: which hot caches and which turns in flight other
  agents may start from (agents that opted in, of the same tenant: a tenant's
  agents never start from another tenant's prefix, :mod:`runtime.identity`);
* the **turns in flight**: their token ids, what they reused, and the prompt a
  running turn parked for others to start from (a *donor*).

and answers the question of every turn (:meth:`KVCacheManager.plan`): given this
agent's cache (:meth:`KVCacheManager.checkout`) and this prompt, what is reused, from where, and what is prefilled.
The answer, a :class:`runtime.plan.contract.TurnPlan`, travels to the engine unchanged.
A turn can still adopt a donor's tokens that cover more of its prompt before its first
prefill chunk (:meth:`KVCacheManager.adopt`): agents that arrive together with the
same system prompt then prefill it once, and one that comes while the first decodes
has the first's prompt parked then (:meth:`KVCacheManager.late_donor`). The samples of one
request (OpenAI's ``n``: one prompt, several replies) form a *group*: the first prefills the
prompt (from the agent's own cache) while the others wait (:meth:`KVCacheManager.held_back`), then
they start from its prompt, to its last token, whatever its length (the same prompt, the same
tokens: no floor, no tenant or opt-in to check).

The cache store actor and the GPU actor share one manager. Both run on the same
trio thread and every method here is synchronous, so each call is atomic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from runtime.plan.block_pool import BlockPool, PoolStats
from runtime.plan.contract import COLD, FromHot, FromShared, FromWarm, ParkedView, OwnCache, Tier, TurnPlan
from runtime.errors import BudgetExceededError
from runtime.plan.prefix import MatchKind, PrefixMatch, common_prefix_length, match_prefix
from runtime.spec import BLOCK_TOKENS, CacheSnapshot
from runtime.identity import AgentKey, pool_key, tenant_of

__all__ = ["KVCacheManager", "HotEntry", "HotTierStats", "MIN_SHARED_TOKENS", "own_plan"]


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
class HotEntry:
    """One agent's parked cache for one model, in RAM.

    ``on_disk``: the warm tier holds this very cache (it may be dropped from RAM).
    ``accounted``: it is charged to its model's block pool (False: over budget,
    dropped once saved).
    """

    agent_id: str
    model_tag: str
    parked: ParkedView
    share_prefix: bool
    on_disk: bool = False
    accounted: bool = False

    @property
    def key(self) -> AgentKey:
        return AgentKey(self.agent_id, self.model_tag)


@dataclass(frozen=True)
class HotTierStats:
    """The hot tier right now (``pools``: block accounting per model tag, shared blocks once)."""

    hot_agents: int
    hot_bytes: int
    over_budget: int
    prefix_hits: int
    demotions: int
    pools: dict[str, PoolStats]


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


_Donor = tuple[str, ParkedView, HotEntry | None]
"""A cache a turn may start from: its agent, the cache, and its hot-tier entry (None: a turn in flight's prompt)."""


MIN_SHARED_TOKENS = BLOCK_TOKENS
"""The fewest tokens a turn takes from another agent's cache (beyond them, to the token).

Another agent's cache is Q4 at rest: a turn that starts from it gets a reply that may part, at a
near tie, from the one the same conversation gets alone. Below a block that is a chat template's
opening, a default system prompt or a short one, whose prefill costs at most a block's (256 tokens,
0.7 s on the default model on this 2-core CPU: ``benches/results/reuse_costs.md``), so a short
conversation replies as it does alone, whichever agents happen to be hot
(``tests/test_reliability_load.py``); a long system prompt, the case sharing is for, is taken to the
token. The agent's own cache has no floor."""


def _whole_blocks(tokens: int) -> int:
    return tokens // BLOCK_TOKENS * BLOCK_TOKENS


class KVCacheManager:
    """The hot tier, the shared-prefix index and the turns in flight (see the module docstring).

    Args:
        hot_budget_bytes: RAM for parked caches, per model.
    """

    def __init__(self, *, hot_budget_bytes: int) -> None:
        self._budget = hot_budget_bytes
        self._entries: dict[AgentKey, HotEntry] = {}  # least recently used first
        self._pools: dict[str, BlockPool] = {}
        self._inflight: dict[int, _InFlight] = {}
        self._prefix_hits = 0
        self._demotions = 0

    # -- the plan ---------------------------------------------------------------

    def needs_disk(self, agent_id: str, model_tag: str) -> bool:
        """Whether the agent's disk cache must be read before its turn (it has no hot cache)."""
        return AgentKey(agent_id, model_tag) not in self._entries

    def checkout(
        self, agent_id: str, model_tag: str, *, warm: CacheSnapshot | None = None, warm_tier: Tier = "warm",
        prepared: ParkedView | None = None,
    ) -> OwnCache | None:
        """The agent's own cache a turn starts from: its hot cache (now the most recently used), else ``warm``.

        ``warm`` is its cache read from disk, when :meth:`needs_disk` said so (``warm_tier``
        names where the disk got it: ``remote`` when it was just pulled from the shared tier;
        ``prepared``: the same cache already restored at start). The turn holds the
        returned cache, so dropping it from the hot tier meanwhile loses nothing.
        """
        entry = self._entries.get(AgentKey(agent_id, model_tag))
        if entry is not None:
            self._touch(entry)
            return OwnCache(source=FromHot(parked=entry.parked), tier="hot")
        if warm is not None and warm.model_tag == model_tag:
            return OwnCache(source=FromWarm(snapshot=warm, prepared=prepared), tier=warm_tier)
        return None

    def plan(self, agent_id: str, model_tag: str, prompt: str, *, share_prefix: bool, own: OwnCache | None) -> TurnPlan:
        """What this turn reuses, from where, and what it prefills.

        The agent's own cache (``own``, from :meth:`checkout`) to the last whole token it has
        in common with the prompt; when the agent shares prefixes and another sharing agent's
        hot cache or turn in flight covers more of the prompt, that one, to the token. Else cold.
        """
        mine = own_plan(own, prompt) if own is not None else None
        if mine is not None and mine.match in (MatchKind.EXTEND.value, MatchKind.EXACT.value):
            return mine  # an append: another agent's cache would have to hold this agent's own turns to beat it
        if share_prefix:
            shared = self._shared(agent_id, model_tag, prompt, beyond=mine.reuse_chars if mine else 0)
            if shared is not None:
                return shared
        return mine or COLD

    def _shared(self, agent_id: str, model_tag: str, prompt: str, *, beyond: int) -> TurnPlan | None:
        """The longest prefix of ``prompt`` another sharing agent's cache covers, to the last whole token before
        the word where they part (as the agent's own cache is matched), if it covers more than ``beyond``
        characters and at least :data:`MIN_SHARED_TOKENS` tokens."""
        hot, in_flight = self._donors(agent_id, model_tag)
        best: tuple[PrefixMatch, str, ParkedView, HotEntry | None] | None = None
        for donor, parked, entry in hot + in_flight:
            if parked.num_tokens < MIN_SHARED_TOKENS:
                continue  # it cannot give enough: not worth matching its text
            match = match_prefix(parked.text, parked.offsets, prompt)
            if match.reuse_tokens >= MIN_SHARED_TOKENS and match.reuse_chars > (best[0].reuse_chars if best else beyond):
                best = (match, donor, parked, entry)
        if best is None:
            return None
        match, donor, parked, entry = best
        self._prefix_hits += 1
        if entry is not None:
            self._touch(entry)
        return TurnPlan(tier="shared", source=FromShared(parked=parked, reuse_tokens=match.reuse_tokens, donor=donor),
                        match=match.kind.value, reuse_tokens=match.reuse_tokens, reuse_chars=match.reuse_chars)

    def _donors(self, agent_id: str, model_tag: str) -> tuple[list[_Donor], list[_Donor]]:
        """What ``agent_id`` may start from for ``model_tag``, within its tenant: other sharing agents' hot caches,
        and the prompts other agents' turns in flight parked for others; each (agent, cache, its hot entry)."""
        tenant = tenant_of(agent_id)

        def shares(other: str, tag: str) -> bool:
            return other != agent_id and tag == model_tag and tenant_of(other) == tenant

        hot: list[_Donor] = [(e.agent_id, e.parked, e) for e in self._entries.values()
                             if e.share_prefix and shares(e.agent_id, e.model_tag)]
        in_flight: list[_Donor] = [(f.agent_id, f.donor, None) for f in self._inflight.values()
                                   if f.donor is not None and shares(f.agent_id, f.model_tag)]
        return hot, in_flight

    # -- turns in flight ----------------------------------------------------------

    def begin(self, request_id: int, *, agent_id: str, model_tag: str, token_ids: Sequence[int], tokens_reused: int,
              share_prefix: bool, group: int | None = None) -> None:
        """A turn's sequence was built: ``token_ids`` is its whole prompt, ``tokens_reused`` of them cached;
        ``group``: the first request id of the samples of one request it is one of (None: it is alone)."""
        self._inflight[request_id] = _InFlight(agent_id, model_tag, tuple(token_ids), tokens_reused, share_prefix,
                                               group=group)

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
        parked = [(other.agent_id, other.donor, None) for _, other in self._siblings(request_id, turn)
                  if other.donor is not None]
        best = self._best_donor(turn, parked, floor=1)
        if best is None:
            return None
        keep, (donor, cache, _) = best
        turn.tokens_reused = keep
        return FromShared(parked=cache, reuse_tokens=keep, donor=donor)

    def adopt(self, request_id: int) -> FromShared | None:
        """Before a sharing turn's first prefill chunk: a donor's tokens that cover more of its prompt than it reuses.

        Donors are the prompts turns in flight parked for others and, for a turn that reuses nothing, other
        sharing agents' hot caches (a donor whose turn ended since this turn was planned left its cache
        there; a turn that reuses something was planned against the hot caches already, on its text).
        Matched on token ids, to the token: the turn then starts from the donor's first tokens, which are
        its own tokenization's, so the result is what a prefill of those tokens computes. Marks the turn's
        prefill as started.
        """
        turn = self._inflight.get(request_id)
        if turn is None or turn.prefill_started:
            return None
        turn.prefill_started = True
        if (sibling := self._sibling_donor(request_id, turn)) is not None:
            return sibling
        if not turn.share_prefix:
            return None
        hot, in_flight = self._donors(turn.agent_id, turn.model_tag)
        best = self._best_donor(turn, in_flight + (hot if turn.tokens_reused == 0 else []), floor=MIN_SHARED_TOKENS)
        if best is None:
            return None
        keep, (donor, parked, entry) = best
        if entry is not None:
            self._touch(entry)
        turn.tokens_reused = keep
        self._prefix_hits += 1
        return FromShared(parked=parked, reuse_tokens=keep, donor=donor)

    def wants_donor(self, request_id: int) -> bool:
        """Whether a sharing turn that has not started prefill would reuse more of this prefilled turn's prompt."""
        turn = self._inflight.get(request_id)
        if turn is None:
            return False
        if turn.group == request_id and any(not other.prefill_started for _, other in self._siblings(request_id, turn)):
            return True  # the first sample of a request: the others start from its prompt
        return any(not other.prefill_started and self._would_reuse_more(turn, other)
                   for other_id, other in self._inflight.items() if other_id != request_id)

    def awaits_donor(self, request_id: int, prefilling: Iterable[int]) -> bool:
        """Whether a sharing turn that has not started prefill would start from more of a prompt being prefilled
        (a sharing turn of ``prefilling`` whose prefill started) than it reuses: it then waits for that prompt,
        which its turn parks once prefilled (:meth:`wants_donor`), instead of prefilling the same blocks again.
        Prompts of a few tokens' difference in length otherwise take turns at the chunks (the scheduler's
        aging credit), and agents that arrived together each prefilled the system prompt they share."""
        turn = self._inflight.get(request_id)
        if turn is None or turn.prefill_started:
            return False
        if self.held_back(request_id):
            return True
        return any(other.prefill_started and self._would_reuse_more(other, turn)
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

    def end(self, request_id: int) -> None:
        """The turn left the GPU (finished, cancelled or failed)."""
        self._inflight.pop(request_id, None)

    @staticmethod
    def _shared_blocks(donor_ids: Sequence[int], turn: _InFlight) -> int:
        """Whole blocks of ``turn``'s prompt ``donor_ids`` cover: what is worth waiting for, or parking a
        decoding row for (a few tokens in common, such as a template's opening, are not)."""
        return _whole_blocks(common_prefix_length(donor_ids, turn.token_ids))

    # -- the hot tier -------------------------------------------------------------

    def get(self, agent_id: str, model_tag: str) -> HotEntry | None:
        """The agent's hot cache for that model (without touching the LRU order)."""
        return self._entries.get(AgentKey(agent_id, model_tag))

    def entries(self) -> list[HotEntry]:
        """Every hot cache, least recently used first."""
        return list(self._entries.values())

    def put(self, agent_id: str, parked: ParkedView, *, share_prefix: bool, block_bytes: int,
            block_hashes: Sequence[str]) -> list[HotEntry]:
        """Make ``parked`` the agent's hot cache for its model (not yet on disk).

        ``block_hashes`` are its full blocks' hash-chain ids. Returns the caches
        dropped from RAM to make room (all already on disk).
        """
        key = AgentKey(agent_id, parked.model_tag)
        entry = self._entries.get(key)
        if entry is None:
            entry = HotEntry(agent_id, parked.model_tag, parked, share_prefix)
        else:
            self._unaccount(entry)
            entry.parked, entry.share_prefix, entry.on_disk = parked, share_prefix, False
        self._touch(entry)
        return self._account(entry, block_bytes, block_hashes)

    def saved(self, agent_id: str, parked: ParkedView) -> bool:
        """``parked`` is on disk now. Returns True when it was dropped from RAM (it never fit the budget)."""
        entry = self._entries.get((agent_id, parked.model_tag))
        if entry is None or entry.parked is not parked:
            return False  # replaced or forgotten meanwhile
        entry.on_disk = True
        if not entry.accounted:
            self._demote(entry)
            return True
        return False

    def forget(self, agent_id: str) -> int:
        """Drop every hot cache of the agent; returns how many there were."""
        entries = [e for e in self._entries.values() if e.agent_id == agent_id]
        for entry in entries:
            self._drop(entry)
        return len(entries)

    def drop(self, agent_id: str, model_tag: str) -> bool:
        """Drop the agent's hot cache for that model (another node has served the agent since); whether it had one."""
        entry = self._entries.get(AgentKey(agent_id, model_tag))
        if entry is not None:
            self._drop(entry)
        return entry is not None

    def drop_model(self, model_tag: str) -> None:
        """Drop every hot cache of a model and its pool (the model was unloaded)."""
        for entry in [e for e in self._entries.values() if e.model_tag == model_tag]:
            self._drop(entry)
        self._pools.pop(model_tag, None)

    def stats(self) -> HotTierStats:
        entries = self._entries.values()
        return HotTierStats(
            hot_agents=len(self._entries),
            hot_bytes=sum(e.parked.nbytes for e in entries),
            over_budget=sum(not e.accounted for e in entries),
            prefix_hits=self._prefix_hits,
            demotions=self._demotions,
            pools={tag: pool.stats() for tag, pool in self._pools.items()},
        )

    def _touch(self, entry: HotEntry) -> None:
        self._entries.pop(entry.key, None)
        self._entries[entry.key] = entry

    def _pool(self, tag: str, block_bytes: int) -> BlockPool:
        pool = self._pools.get(tag)
        if pool is None:
            pool = self._pools[tag] = BlockPool(budget_bytes=self._budget, bytes_per_block=max(1, block_bytes))
        return pool

    def _account(self, entry: HotEntry, block_bytes: int, block_hashes: Sequence[str]) -> list[HotEntry]:
        """Charge ``entry`` to its model's pool, dropping clean least recently used caches to make room."""
        pool = self._pool(entry.model_tag, block_bytes)
        demoted: list[HotEntry] = []
        while True:
            try:
                # Named within the tenant: the pool's dedup must not tell one tenant what another holds.
                pool.share(entry.agent_id, [pool_key(entry.agent_id, h) for h in block_hashes])
                pool.reserve(entry.agent_id, entry.parked.num_tokens)
                entry.accounted = True
                return demoted
            except BudgetExceededError:
                pool.release(entry.agent_id)
            victim = next((e for e in self._entries.values()
                           if e is not entry and e.on_disk and e.model_tag == entry.model_tag), None)
            if victim is None:
                entry.accounted = False  # dropped as soon as its save completes
                return demoted
            self._demote(victim)
            demoted.append(victim)

    def _unaccount(self, entry: HotEntry) -> None:
        pool = self._pools.get(entry.model_tag)
        if pool is not None:
            pool.release(entry.agent_id)
        entry.accounted = False

    def _drop(self, entry: HotEntry) -> None:
        self._unaccount(entry)
        self._entries.pop(entry.key, None)

    def _demote(self, entry: HotEntry) -> None:
        self._demotions += 1
        self._drop(entry)
