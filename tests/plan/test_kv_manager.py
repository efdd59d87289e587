"""The reuse planner's one decision per turn (what is reused, from where, and what is prefilled), over the
hot tier's caches.

Pure Python (no trio, no mlx): caches here are plain objects with one token per
character, so every expected number can be counted by hand. :class:`Wired` joins the
GPU actor's hot tier and its planner as the actor does: a turn plans against what
its checkout gave (its own cache, and the other sharing agents' hot caches).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from runtime.plan.turn_plan import ColdStart, FromHot, FromShared, FromWarm, OwnCache
from runtime.plan.hot_tier import HotTier
from runtime.plan.kv_manager import KVCacheManager
from runtime.spec import BLOCK_TOKENS, CacheSnapshot, LayerKind, LayerSnapshot

TAG = "m@1"
OTHER_TAG = "m@2"


@dataclass(frozen=True)
class Parked:
    model_tag: str
    text: str

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(ord(c) for c in self.text)

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(range(1, len(self.text) + 1))

    @property
    def num_tokens(self) -> int:
        return len(self.text)

    @property
    def nbytes(self) -> int:
        return len(self.text) * 4


def _snapshot(text: str, tag: str = TAG) -> CacheSnapshot:
    ids = np.zeros((1, len(text), 1), dtype=np.float32)
    return CacheSnapshot(model_tag=tag, text=text, token_ids=[ord(c) for c in text],
                         offsets=list(range(1, len(text) + 1)),
                         layers=[LayerSnapshot(LayerKind.FLOAT, {"k": ids, "v": ids})])


class Wired:
    """The GPU actor's hot tier and its planner, joined as the actor joins them: ``plan`` and ``begin``
    take the other sharing agents' hot caches a checkout gives, and ``put`` (a turn's check-in) tells the
    planner of a sharing agent's new cache, as the GPU actor does; the rest is either's own."""

    def __init__(self, budget: int) -> None:
        self.hot = HotTier(hot_budget_bytes=budget)
        self.planner = KVCacheManager()

    def plan(self, agent_id, model_tag, prompt, *, share_prefix, own):  # type: ignore[no-untyped-def]
        donors = self.hot.donors(agent_id, model_tag) if share_prefix else ()
        return self.planner.plan(agent_id, model_tag, prompt, share_prefix=share_prefix, own=own, hot=donors)

    def begin(self, request_id, *, agent_id, model_tag, share_prefix, **kw):  # type: ignore[no-untyped-def]
        donors = self.hot.donors(agent_id, model_tag) if share_prefix else ()
        self.planner.begin(request_id, agent_id=agent_id, model_tag=model_tag, share_prefix=share_prefix,
                           hot=donors, **kw)

    def put(self, agent_id, parked, *, share_prefix, **kw):  # type: ignore[no-untyped-def]
        if share_prefix:  # the GPU actor, as it checks a sharing turn's new cache in
            self.planner.left(agent_id, parked.model_tag, parked)
        return self.hot.put(agent_id, parked, share_prefix=share_prefix, **kw)

    def adopt(self, request_id):  # type: ignore[no-untyped-def]
        """What the GPU actor does with a step's start: the planner's answer, recorded."""
        shared = self.planner.donor_for(request_id)
        self.planner.start_prefill(request_id, shared)
        return shared

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.planner if hasattr(self.planner, name) else self.hot, name)


def _manager(budget: int = 1 << 30) -> Wired:
    return Wired(budget)


def _put(m: Wired, agent: str, parked: Parked, *, share_prefix: bool = True, block_bytes: int = 1) -> list:
    hashes = [f"{parked.model_tag}:{parked.text[:end]}" for end in range(BLOCK_TOKENS, parked.num_tokens + 1,
                                                                         BLOCK_TOKENS)]
    return m.put(agent, parked, share_prefix=share_prefix, block_bytes=block_bytes, block_hashes=hashes)


def test_a_prompt_that_extends_the_hot_cache_reuses_all_of_it():
    m = _manager()
    parked = Parked(TAG, "system: be brief\nuser: hi\nassistant: hello")
    _put(m, "a", parked)
    assert m.holds("a", TAG)
    plan = m.plan("a", TAG, parked.text + "\nuser: more", share_prefix=True, own=m.checkout("a", TAG))
    assert (plan.tier, plan.match, plan.reuse_tokens, plan.reuse_chars) == ("hot", "extend", parked.num_tokens,
                                                                             len(parked.text))
    assert isinstance(plan.source, FromHot) and plan.source.parked is parked
    assert plan.suffix(parked.text + "\nuser: more") == "\nuser: more"
    assert plan.source.parked.token_ids[: plan.reuse_tokens] == parked.token_ids


def test_the_same_prompt_again_recomputes_the_last_token():
    m = _manager()
    parked = Parked(TAG, "abcdef")
    _put(m, "a", parked)
    plan = m.plan("a", TAG, "abcdef", share_prefix=False, own=m.checkout("a", TAG))
    assert (plan.match, plan.reuse_tokens, plan.suffix("abcdef")) == ("exact", 5, "f")


def test_an_agent_without_a_hot_cache_is_planned_from_its_disk_cache():
    m = _manager()
    assert not m.holds("a", TAG) and m.checkout("a", TAG) is None
    warm = _snapshot("hello there")
    own = OwnCache(source=FromWarm(snapshot=warm), tier="warm")  # what the store's Load gives
    plan = m.plan("a", TAG, "hello there, again", share_prefix=True, own=own)
    assert (plan.tier, plan.reuse_tokens) == ("warm", len("hello there"))
    assert isinstance(plan.source, FromWarm) and plan.source.snapshot is warm


def test_a_diverged_prompt_starts_cold_and_never_uses_another_models_cache():
    m = _manager()
    _put(m, "a", Parked(TAG, "one conversation entirely"))
    plan = m.plan("a", TAG, "something else", share_prefix=True, own=m.checkout("a", TAG))
    assert plan.tier == "cold" and isinstance(plan.source, ColdStart) and plan.reuse_tokens == 0
    assert m.plan("a", OTHER_TAG, "one conversation entirely, more", share_prefix=True, own=m.checkout("a", OTHER_TAG)).tier == "cold"


def test_a_partial_match_reuses_up_to_where_the_texts_differ():
    m = _manager()
    _put(m, "a", Parked(TAG, "0123456789"))
    plan = m.plan("a", TAG, "012345678X and more", share_prefix=False, own=m.checkout("a", TAG))
    assert (plan.match, plan.reuse_tokens, plan.reuse_chars) == ("partial", 9, 9)


SYSTEM = "s" * (2 * BLOCK_TOKENS + 40)


def test_another_agents_cache_gives_its_prefix_to_the_token_when_own_cache_has_nothing():
    """Not only whole 256-token blocks: every token before the word where the prompts part."""
    m = _manager()
    donor = Parked(TAG, SYSTEM + "user: donor's question")
    _put(m, "donor", donor)
    plan = m.plan("new", TAG, SYSTEM + "user: my question", share_prefix=True, own=m.checkout("new", TAG))
    assert plan.tier == "shared" and isinstance(plan.source, FromShared)
    kept = len(SYSTEM + "user:")  # " my" is the word they part in
    assert plan.source.donor == "donor" and plan.source.reuse_tokens == kept
    assert (plan.match, plan.reuse_tokens, plan.reuse_chars) == ("partial", kept, kept)
    assert m.prefix_hits == 1


def test_less_than_a_block_of_another_agents_cache_is_not_taken_and_of_its_own_is():
    """A short conversation replies as it does alone, whichever agents are hot (another agent's cache is Q4);
    its prefill costs at most a block's. The agent's own cache has no floor."""
    from runtime.plan.kv_manager import MIN_SHARED_TOKENS

    m = _manager()
    short = "s" * (MIN_SHARED_TOKENS - 10)
    _put(m, "donor", Parked(TAG, short + " donor's question"))
    assert m.plan("new", TAG, short + " my question", share_prefix=True, own=m.checkout("new", TAG)).tier == "cold"
    _put(m, "new", Parked(TAG, short + " an earlier question"))
    plan = m.plan("new", TAG, short + " my question", share_prefix=True, own=m.checkout("new", TAG))
    assert (plan.tier, plan.reuse_tokens) == ("hot", len(short))


def test_a_compacted_history_keeps_the_system_prompt_of_the_agents_own_cache():
    """An agent CLI's compaction: the system prompt, a summary, a new question. The seeds' 80% rule sent it cold."""
    m = _manager()
    history = "".join(f"user: question {i}\nassistant: answer {i}\n" for i in range(200))
    _put(m, "a", Parked(TAG, SYSTEM + history))
    prompt = SYSTEM + "user: summary of the work so far. Next question?"
    plan = m.plan("a", TAG, prompt, share_prefix=True, own=m.checkout("a", TAG))
    assert (plan.tier, plan.match) == ("hot", "partial") and isinstance(plan.source, FromHot)
    assert plan.reuse_tokens == len(SYSTEM + "user:") < 0.2 * len(SYSTEM + history)


def test_the_cache_that_covers_more_of_the_prompt_wins_own_or_another_agents():
    m = _manager()
    _put(m, "a", Parked(TAG, SYSTEM[:100] + " an old branch of the conversation"))
    _put(m, "b", Parked(TAG, SYSTEM + "user: the same question"))
    prompt = SYSTEM + "user: the same question, again"
    plan = m.plan("a", TAG, prompt, share_prefix=True, own=m.checkout("a", TAG))
    assert plan.tier == "shared" and plan.source.donor == "b" and plan.reuse_chars == len(SYSTEM + "user: the same question")
    assert m.plan("a", TAG, prompt, share_prefix=False, own=m.checkout("a", TAG)).tier == "hot"  # opted out: own
    _put(m, "a", Parked(TAG, prompt))
    plan = m.plan("a", TAG, prompt + " more", share_prefix=True, own=m.checkout("a", TAG))
    assert (plan.tier, plan.match, plan.reuse_chars) == ("hot", "extend", len(prompt))


@pytest.mark.parametrize(("requester_shares", "donor_shares"), [(False, True), (True, False)])
def test_prefix_sharing_is_opt_out_both_ways(requester_shares, donor_shares):
    m = _manager()
    _put(m, "donor", Parked(TAG, SYSTEM + "donor"), share_prefix=donor_shares)
    assert m.plan("new", TAG, SYSTEM + "mine", share_prefix=requester_shares, own=m.checkout("new", TAG)).tier == "cold"


def test_a_prompt_inside_another_agents_cache_keeps_one_token_to_prefill():
    m = _manager()
    _put(m, "donor", Parked(TAG, SYSTEM))
    plan = m.plan("new", TAG, SYSTEM[: 2 * BLOCK_TOKENS], share_prefix=True, own=m.checkout("new", TAG))
    assert plan.reuse_tokens == 2 * BLOCK_TOKENS - 1  # the last token's logits are the next token's


def test_a_turn_in_flight_donates_its_prompt_blocks_to_a_turn_that_has_not_started():
    m = _manager()
    first = [ord(c) for c in SYSTEM + "first"]
    second = [ord(c) for c in SYSTEM + "second"]
    m.begin(1, agent_id="a", model_tag=TAG, token_ids=first, tokens_reused=0, share_prefix=True)
    m.begin(2, agent_id="b", model_tag=TAG, token_ids=second, tokens_reused=0, share_prefix=True)
    assert m.adopt(1) is None  # nobody has parked anything yet; request 1 starts prefill
    assert m.wants_donor(1) and not m.wants_donor(2)  # 2 has not prefilled: it cannot donate
    m.add_donor(1, Parked(TAG, SYSTEM + "first"))
    adopted = m.adopt(2)
    assert adopted is not None and adopted.donor == "a" and adopted.reuse_tokens == len(SYSTEM)  # to the token
    assert m.adopt(2) is None  # only before the first chunk
    assert not m.wants_donor(1)  # 2 has it now
    # A new sharing turn of a third agent plans from the donor while it runs...
    plan = m.plan("c", TAG, SYSTEM + "third", share_prefix=True, own=m.checkout("c", TAG))
    assert plan.tier == "shared" and plan.source.donor == "a"
    # ... and not after it ended.
    m.end(1)
    m.end(2)
    assert m.plan("c", TAG, SYSTEM + "third", share_prefix=True, own=m.checkout("c", TAG)).tier == "cold"


def test_a_turn_not_started_waits_for_a_shared_prompt_being_prefilled_and_only_for_that():
    """Agents that arrive together with one system prompt and questions of different lengths: once one has
    started its prefill, the others wait for its prompt instead of taking chunks (the scheduler's aging credit
    would hand the next chunk to a prompt a few tokens shorter, and both would prefill the shared blocks)."""
    from runtime.identity import namespaced

    m = _manager()
    longer = [ord(c) for c in SYSTEM + "a longer question"]
    shorter = [ord(c) for c in SYSTEM + "short"]
    m.begin(1, agent_id="a", model_tag=TAG, token_ids=longer, tokens_reused=0, share_prefix=True)
    m.begin(2, agent_id="b", model_tag=TAG, token_ids=shorter, tokens_reused=0, share_prefix=True)
    assert not m.awaits_donor(2, [1, 2])  # nobody started: the scheduler picks who goes first
    assert m.adopt(1) is None  # 1 starts prefill
    assert m.awaits_donor(2, [1, 2]) and not m.awaits_donor(1, [1, 2])
    assert not m.awaits_donor(2, [2])  # 1 is no longer prefilling: nothing to wait for
    m.begin(3, agent_id="c", model_tag=TAG, token_ids=shorter, tokens_reused=0, share_prefix=False)
    m.begin(4, agent_id=namespaced("globex", "d"), model_tag=TAG, token_ids=shorter, tokens_reused=0,
            share_prefix=True)
    m.begin(5, agent_id="e", model_tag=TAG, token_ids=[7] * len(shorter), tokens_reused=0, share_prefix=True)
    assert not m.awaits_donor(3, [1, 3])  # opted out of sharing
    assert not m.awaits_donor(4, [1, 4])  # another tenant's prompt
    assert not m.awaits_donor(5, [1, 5])  # nothing in common
    m.begin(6, agent_id="f", model_tag=TAG, token_ids=longer, tokens_reused=0, share_prefix=False)
    assert m.adopt(6) is None
    assert not m.awaits_donor(2, [2, 6])  # a turn that opted out never parks its prompt for others


def test_a_decoding_turn_whose_prompt_nobody_waited_for_is_asked_for_it_late():
    """A sharing turn that came after another's prefill ended (nobody wanted it then): the decoding turn that
    gives it the most blocks is named, once; the prompt parked, the turn adopts it."""
    m = _manager()
    ids = [ord(c) for c in SYSTEM + "first"]
    m.begin(1, agent_id="a", model_tag=TAG, token_ids=ids, tokens_reused=0, share_prefix=True)
    m.begin(2, agent_id="b", model_tag=TAG, token_ids=ids[:BLOCK_TOKENS] + [7] * 20, tokens_reused=0,
            share_prefix=True)
    assert m.adopt(1) is None and m.adopt(2) is None and not m.wants_donor(1)  # both prefilled, no donor
    m.begin(3, agent_id="c", model_tag=TAG, token_ids=[ord(c) for c in SYSTEM + "third"], tokens_reused=0,
            share_prefix=True)
    assert m.late_donor(3, [2]) == 2  # one block
    assert m.late_donor(3, [1, 2]) == 1  # the whole system prompt
    assert m.late_donor(3, []) is None  # 1 is no longer decoding
    m.add_donor(1, Parked(TAG, SYSTEM + "first"))
    assert m.late_donor(3, [1]) is None  # parked once
    shared = m.adopt(3)
    assert shared is not None and shared.donor == "a" and shared.reuse_tokens == len(SYSTEM)
    assert m.late_donor(3, [2]) is None  # started
    m.add_donor(2, None)  # its prompt could not be parked (a sliding window): not asked again
    m.begin(4, agent_id="d", model_tag=TAG, token_ids=ids[:BLOCK_TOKENS] + [7] * 30, tokens_reused=0,
            share_prefix=True)
    assert m.late_donor(4, [2]) is None
    m.begin(5, agent_id="e", model_tag=TAG, token_ids=ids, tokens_reused=0, share_prefix=False)
    m.begin(6, agent_id="f", model_tag=TAG, token_ids=ids, tokens_reused=0, share_prefix=True)
    assert m.late_donor(5, [6]) is None and m.late_donor(6, [5]) is None  # either side opted out


def test_a_cold_turn_adopts_a_hot_cache_that_came_after_its_plan_and_an_own_cache_keeps_its_plan():
    """A donor whose turn ended between this turn's plan and its first chunk left its prompt in the hot
    tier: a turn that reuses nothing starts from it there, to the token; one that reuses its own cache was
    planned against the hot caches already and keeps its plan."""
    m = _manager()
    ids = [ord(c) for c in SYSTEM + "mine"]
    m.begin(1, agent_id="b", model_tag=TAG, token_ids=ids, tokens_reused=0, share_prefix=True)
    m.begin(2, agent_id="c", model_tag=TAG, token_ids=ids, tokens_reused=BLOCK_TOKENS, share_prefix=True)
    _put(m, "a", Parked(TAG, SYSTEM + "a reply"))
    _put(m, "z", Parked(TAG, SYSTEM + "mine, opted out"), share_prefix=False)
    shared = m.adopt(1)
    assert shared is not None and shared.donor == "a" and shared.reuse_tokens == len(SYSTEM)
    assert m.adopt(2) is None


def test_a_turn_that_does_not_share_neither_adopts_nor_is_wanted_as_donor():
    m = _manager()
    ids = [ord(c) for c in SYSTEM + "x"]
    m.begin(1, agent_id="a", model_tag=TAG, token_ids=ids, tokens_reused=0, share_prefix=True)
    m.begin(2, agent_id="b", model_tag=TAG, token_ids=ids, tokens_reused=0, share_prefix=False)
    assert not m.wants_donor(1)
    m.add_donor(1, Parked(TAG, SYSTEM + "x"))
    assert m.adopt(2) is None


def test_over_budget_caches_drop_the_least_recently_used_stored_ones():
    block = BLOCK_TOKENS * 4
    m = _manager(budget=2 * block)  # two blocks
    a, b, c = (Parked(TAG, ch * 100) for ch in "abc")
    assert _put(m, "a", a, block_bytes=block) == []
    assert _put(m, "b", b, block_bytes=block) == []
    # c does not fit; the store holds no copy of a or b yet: c stays over budget.
    assert _put(m, "c", c, block_bytes=block) == []
    assert m.stats().over_budget == 1
    assert not m.stored("a", Parked(TAG, "a" * 100))  # another object: a newer cache replaced it, or not this one
    assert m.stored("a", a) is False and m.stored("b", b) is False  # the store holds them, still accounted
    # c's copy goes to the store: it never fit, so it leaves RAM.
    assert m.stored("c", c) is True
    assert m.get("c", TAG) is None and m.stats().demotions == 1
    # Touch a (a plan), then a new cache demotes b, the least recently used stored one.
    m.plan("a", TAG, "a" * 100 + "!", share_prefix=False, own=m.checkout("a", TAG))
    demoted = _put(m, "d", Parked(TAG, "d" * 100), block_bytes=block)
    assert [e.agent_id for e in demoted] == ["b"]
    assert [e.agent_id for e in m.entries()] == ["a", "d"]


def test_forget_and_a_model_swap_drop_hot_caches():
    m = _manager()
    _put(m, "a", Parked(TAG, "x" * 10))
    _put(m, "a", Parked(OTHER_TAG, "y" * 10))
    _put(m, "b", Parked(TAG, "z" * 10))
    assert m.forget("a") == 2 and not m.holds("a", TAG) and not m.holds("a", OTHER_TAG)
    m.drop_model(TAG)
    assert m.entries() == [] and TAG not in m.stats().pools


def test_turns_in_flight_donate_within_their_tenant_only():
    from runtime.identity import namespaced

    m = _manager()
    a1, a2, b1 = namespaced("acme", "a1"), namespaced("acme", "a2"), namespaced("globex", "b1")
    ids = [ord(c) for c in SYSTEM + "first"]
    m.begin(1, agent_id=a1, model_tag=TAG, token_ids=ids, tokens_reused=0, share_prefix=True)
    m.begin(2, agent_id=b1, model_tag=TAG, token_ids=ids, tokens_reused=0, share_prefix=True)
    assert m.adopt(1) is None
    assert not m.wants_donor(1)  # only another tenant's turn waits: nobody of acme would reuse it
    m.begin(3, agent_id=a2, model_tag=TAG, token_ids=ids, tokens_reused=0, share_prefix=True)
    assert m.wants_donor(1)  # acme's second turn would
    m.add_donor(1, Parked(TAG, SYSTEM + "first"))
    assert m.adopt(2) is None  # globex's turn does not start from acme's prompt
    adopted = m.adopt(3)
    assert adopted is not None and adopted.donor == a1
    assert m.plan(b1, TAG, SYSTEM + "third", share_prefix=True, own=m.checkout(b1, TAG)).tier == "cold"  # nor plans from it
    assert m.plan(namespaced("acme", "a3"), TAG, SYSTEM + "third", share_prefix=True, own=m.checkout(namespaced("acme", "a3"), TAG)).tier == "shared"
