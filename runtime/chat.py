"""Synchronous, single-process agents: what ``kvmem chat`` runs on.

A :class:`ChatSession` loads the model once, keeps each agent's conversation and
parked cache, and persists both after every turn, so a later process (another
``kvmem chat`` invocation) resumes the agent from disk instead of re-prefilling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from runtime.errors import CacheMiss
from runtime.generate import generate
from runtime.home import KvmemHome, Settings
from runtime.kvstate import ParkedCache
from runtime.models import LoadedModel, load_model
from runtime.persist import AgentEntry, CacheDirectory, safe_agent_dirname
from runtime.sampling import SamplingParams

__all__ = ["ChatSession", "TurnReport", "AgentSummary"]

log = logging.getLogger("kvmem.chat")


@dataclass(frozen=True)
class TurnReport:
    """One turn's reply and accounting (the ``kvmem chat --json`` object)."""

    agent: str
    reply: str
    tokens_reused: int
    tokens_prefilled: int
    tokens_generated: int
    tier: str
    ttft_ms: float
    model: str
    match: str
    finish_reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class AgentSummary:
    """An agent known to this home folder.

    An agent keeps one cache per model: ``cached_tokens`` is its latest
    cache's, ``disk_bytes`` counts all of them.
    """

    agent: str
    model: str
    turns: int
    cached_tokens: int
    disk_bytes: int


@dataclass(frozen=True)
class _CacheSummary:
    """An agent's caches on disk: the latest saved, and the bytes of all of them."""

    latest: AgentEntry
    disk_bytes: int


class ChatSession:
    """Agents with persistent conversations and caches in one process.

    Args:
        home: the kvmem home folder.
        settings: model, KV format, attention strategy.
    """

    def __init__(self, home: KvmemHome, settings: Settings) -> None:
        self.home = home
        self.settings = settings
        self.store = CacheDirectory(home.caches_dir)
        self._lm: LoadedModel | None = None
        self._hot: dict[str, ParkedCache] = {}

    @property
    def lm(self) -> LoadedModel:
        if self._lm is None:
            self._lm = load_model(
                self.settings.model,
                kv_format=self.settings.kv_format,
                models_dir=self.home.models_dir,
                weights=self.settings.weights,
            )
        return self._lm

    def _cache_for(self, agent: str) -> tuple[ParkedCache | None, str]:
        if agent in self._hot:
            return self._hot[agent], "hot"
        try:
            snapshot = self.store.load(agent, model_tag=self.lm.spec.tag)
        except CacheMiss as miss:
            if self.store.exists(agent, model_tag=self.lm.spec.tag):
                log.warning("cache of agent %r not usable (%s): serving cold", agent, miss)
            return None, "cold"
        return ParkedCache.from_snapshot(snapshot, float_dtype=self.lm.float_dtype), "warm"

    def turn(
        self,
        agent: str,
        message: str,
        *,
        system: str | None = None,
        params: SamplingParams | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> TurnReport:
        """Send one user message as ``agent``; persist the conversation and cache."""
        name = safe_agent_dirname(agent)
        convo = self.home.load_conversation(name)
        messages: list[dict[str, Any]] = list(convo["messages"])
        if system and not messages:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": message})
        lm = self.lm  # load the model before timing the turn
        started = time.perf_counter()
        cache, tier = self._cache_for(agent)
        load_ms = (time.perf_counter() - started) * 1000
        prompt = lm.render(messages)
        result = generate(
            lm, prompt, cache, params or SamplingParams(), strategy=self.settings.attention, on_text=on_text
        )
        # TTFT as the user sees it: cache lookup (a disk load for warm agents) + prefill.
        ttft_ms = result.stats.ttft_s * 1000 + load_ms
        messages.append({"role": "assistant", "content": result.reply})
        self.home.save_conversation(name, {"agent": agent, "model": self.settings.model, "messages": messages})
        if result.cache is not None:
            self._hot[agent] = result.cache
            self.store.save(agent, result.cache.to_snapshot())
        if result.stats.tokens_reused == 0:
            tier = "cold"
        return TurnReport(
            agent=agent,
            reply=result.reply,
            tokens_reused=result.stats.tokens_reused,
            tokens_prefilled=result.stats.tokens_prefilled,
            tokens_generated=result.stats.tokens_generated,
            tier=tier,
            ttft_ms=round(ttft_ms, 2),
            model=self.settings.model,
            match=result.stats.match,
            finish_reason=result.finish_reason,
        )

    def agents(self) -> list[AgentSummary]:
        """Agents with a conversation or a cache in this home folder."""
        entries: dict[str, _CacheSummary] = {}
        for e in self.store.list_agents():  # one per agent and model
            seen = entries.get(e.agent_id)
            latest = e if seen is None or e.updated_at > seen.latest.updated_at else seen.latest
            entries[e.agent_id] = _CacheSummary(latest, e.disk_bytes + (seen.disk_bytes if seen else 0))
        out = []
        for path in sorted(self.home.root.joinpath("conversations").glob("*.json")):
            convo = self.home.load_conversation(path.stem)
            agent = str(convo.get("agent", path.stem))
            entry = entries.pop(agent, None)
            turns = sum(1 for m in convo["messages"] if m.get("role") == "user")
            out.append(
                AgentSummary(
                    agent,
                    str(convo.get("model", "")),
                    turns,
                    entry.latest.num_tokens if entry else 0,
                    entry.disk_bytes if entry else 0,
                )
            )
        for agent, entry in entries.items():
            out.append(AgentSummary(agent, entry.latest.model_tag, 0, entry.latest.num_tokens, entry.disk_bytes))
        return out

    def forget(self, agent: str) -> bool:
        """Delete an agent's conversation and caches (every model's); True if anything existed."""
        name = safe_agent_dirname(agent)
        had_cache = self.store.exists(agent)
        self.store.delete(agent)
        self._hot.pop(agent, None)
        self.store.collect_garbage()
        return self.home.delete_conversation(name) or had_cache
