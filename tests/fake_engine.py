"""A deterministic engine without MLX, for fast actor tests and demos.

One character is one token (its id is ``ord``). The reply to a prompt is a
fixed function of the prompt text: ``max_tokens`` letters chosen from a hash of
the prompt, so batching, ordering or caching can never change it, and tests can
compute the expected reply with :func:`fake_reply`. Caches are
:class:`FakeParked` objects; their snapshots are real
:class:`runtime.spec.CacheSnapshot` objects (one float layer holding the
token ids), so the cache store persists them with the real ``CacheDirectory``.

Model names starting with ``fake`` load instantly; anything else fails like an
unknown model. ``step_delay_s`` / ``chunk_delay_s`` make steps take real time,
for cancellation and interleaving tests. ``context_length`` is the fake model's context
(None: unlimited, only the KV budget applies).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.plan.engine import (
    Finished,
    MemoryReading,
    ModelInfo,
    PrefillResult,
    SequenceStarted,
    StepTiming,
    StepToken,
    TurnStats,
)
from runtime.plan.sampling import SamplingOptions
from runtime.plan.tools import ToolChoice
from runtime.plan.turn_plan import FromShared, Tokenized, TurnPlan
from runtime.errors import ModelError
from runtime.spec import BLOCK_TOKENS, CacheSnapshot, LayerKind, LayerSnapshot

__all__ = ["FakeEngine", "FakeParked", "fake_reply", "fake_render", "FAKE_TOKEN_BYTES"]

FAKE_TOKEN_BYTES = 16
"""Pretend KV bytes per token (active and at rest)."""

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def fake_render(messages: list[dict[str, Any]]) -> str:
    """The fake chat template: ``role: content`` lines, then ``assistant:``."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def fake_reply(prompt: str, max_tokens: int) -> str:
    """The reply the fake engine gives to ``prompt`` (greedy or not)."""
    seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little")
    return "".join(_LETTERS[(seed + 7 * i) % 26] for i in range(max_tokens))


@dataclass(frozen=True)
class FakeParked:
    """A fake parked cache: text, one token per character."""

    model_tag: str
    text: str
    token_ids: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.num_tokens * FAKE_TOKEN_BYTES

    def to_snapshot(self) -> CacheSnapshot:
        ids = np.asarray(self.token_ids, dtype=np.float32).reshape(1, -1, 1)
        return CacheSnapshot(
            model_tag=self.model_tag,
            text=self.text,
            token_ids=list(self.token_ids),
            offsets=list(self.offsets),
            layers=[LayerSnapshot(LayerKind.FLOAT, {"k": ids, "v": ids.copy()})],
        )


def _parked(tag: str, text: str) -> FakeParked:
    return FakeParked(tag, text, tuple(ord(c) for c in text), tuple(range(1, len(text) + 1)))


@dataclass
class _FakeSeq:
    prompt: str
    reused: int
    max_tokens: int
    target: str
    match: str = "empty"
    prefilled: int = 0
    generated: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_at: float = 0.0  # the engine's clock, as the real one keeps it
    last_token_at: float = 0.0

    @property
    def context(self) -> int:
        return self.reused + self.prefilled


class FakeEngine:
    """See the module docstring. Implements :class:`runtime.plan.engine.Engine`."""

    profile = None  # no backend profile: nothing here runs on a device

    def __init__(self, *, step_delay_s: float = 0.0, chunk_delay_s: float = 0.0, default_chunk: int = 64,
                 context_length: int | None = None, copy_after_turn: bool = False, copy_layers: int = 1,
                 copy_layer_delay_s: float = 0.0) -> None:
        self.step_delay_s = step_delay_s
        self.copy_layers, self.copy_layer_delay_s = copy_layers, copy_layer_delay_s  # a copy's parts, as layers
        self.copied_layers = 0  # parts copied in all (a copy resumed, not restarted, adds each part once)
        self.copy_after_turn = copy_after_turn  # as the GPU policy: finish leaves the save's copy for later
        self.snapshots: list[str] = []  # the texts of the copies snapshot() made
        self.context_length = context_length
        self.chunk_delay_s = chunk_delay_s
        self.default_chunk = default_chunk
        self._tag: str | None = None
        self._seqs: dict[int, _FakeSeq] = {}
        self._batch: list[int] = []
        self.loads: list[str] = []
        self.groups: list[list[int]] = []  # turns prefilled together
        self._memory = MemoryReading()

    @property
    def memory(self) -> MemoryReading:
        return self._memory  # replaced whole on the engine's thread, read on trio's

    def _sample_memory(self) -> None:
        used = sum(s.context + len(s.generated) for s in self._seqs.values()) * FAKE_TOKEN_BYTES
        self._memory = MemoryReading(active=used, peak=max(used, self._memory.peak))

    @property
    def tag(self) -> str:
        if self._tag is None:
            raise ModelError("no model is loaded")
        return self._tag

    def load(self, name: str) -> ModelInfo:
        self.unload()
        if not name.startswith("fake"):
            raise ModelError(f"could not load model {name!r}: the fake engine knows only 'fake*' models")
        self._tag = f"{name}@0000/fake"
        self.loads.append(name)
        return ModelInfo(
            name=name,
            tag=self._tag,
            block_bytes=BLOCK_TOKENS * FAKE_TOKEN_BYTES,
            active_token_bytes=FAKE_TOKEN_BYTES,
            sequence_bytes=0,
            model_bytes=0,
            context_length=self.context_length,
            layer_kinds=(LayerKind.FLOAT,),  # its snapshots' one layer
            max_token_bytes=4,  # a token a character
        )

    def unload(self) -> None:
        self._tag = None
        self._seqs.clear()
        self._batch.clear()

    def close(self) -> None:
        self.unload()

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               tool_choice: ToolChoice | None = None) -> str:
        self.tag  # noqa: B018 - raises when no model is loaded
        return fake_render(messages)

    def count_tokens(self, text: str) -> int:
        return len(text)  # one token per character, as in the fake caches

    def tokenize(self, prompt: str, plan: TurnPlan) -> Tokenized:
        self.tag  # noqa: B018
        suffix = plan.suffix(prompt)
        return Tokenized(ids=tuple(ord(c) for c in suffix), ends=tuple(range(1, len(suffix) + 1)))

    def start(
        self, request_id: int, prompt: str, plan: TurnPlan, tokens: Tokenized, sampling: SamplingOptions
    ) -> SequenceStarted:
        if not prompt:
            raise ValueError("empty prompt")
        reused = plan.reuse_tokens
        self._seqs[request_id] = _FakeSeq(prompt, reused, sampling.max_tokens, fake_reply(prompt, sampling.max_tokens),
                                          plan.match)
        return SequenceStarted(stats=TurnStats(match=plan.match, tokens_reused=reused, tokens_prefilled=len(tokens.ids)),
                               token_ids=tuple(ord(c) for c in prompt))

    def prepare(self, snapshot: Any) -> None:
        return None  # the fake keeps nothing ahead: a prefetched cache is planned from its snapshot

    def park_prompt(self, request_id: int) -> FakeParked:
        return _parked(self.tag, self._seqs[request_id].prompt)

    def prefill_together(self, request_ids: list[int]) -> dict[int, PrefillResult]:
        """Like the real engine: two or more turns whose prefill has not started, in one go."""
        group = [r for r in request_ids if not self._seqs[r].prefilled and self._seqs[r].context < len(self._seqs[r].prompt)]
        if len(group) < 2:
            return {}
        if self.chunk_delay_s:
            time.sleep(self.chunk_delay_s)  # one pass for the group
        out = {}
        for r in group:
            seq = self._seqs[r]
            seq.prefilled = len(seq.prompt) - seq.reused
            out[r] = PrefillResult(text=self._emit(seq), finished=seq.finish_reason is not None, context=seq.context)
            if seq.finish_reason is None:
                self._batch.append(r)
        self.groups.append(group)
        self._sample_memory()
        return out

    def prefill(self, request_id: int, chunk: int | None, *, adopt: FromShared | None = None) -> PrefillResult:
        seq = self._seqs[request_id]
        if adopt is not None and not seq.prefilled:
            seq.reused, seq.match = adopt.reuse_tokens, "extend"
        if self.chunk_delay_s:
            time.sleep(self.chunk_delay_s)
        todo = len(seq.prompt) - seq.context
        seq.prefilled += min(todo, chunk or self.default_chunk)
        self._sample_memory()
        if seq.context < len(seq.prompt):
            return PrefillResult(text=None, finished=False, context=seq.context, remaining=len(seq.prompt) - seq.context)
        return PrefillResult(text=self._emit(seq), finished=seq.finish_reason is not None, context=seq.context)

    def _emit(self, seq: _FakeSeq) -> str:
        letter = seq.target[len(seq.generated)]
        seq.generated.append(letter)
        seq.last_token_at = time.perf_counter()
        seq.first_token_at = seq.first_token_at or seq.last_token_at
        if len(seq.generated) >= seq.max_tokens:
            seq.finish_reason = "length"
        return letter

    def join(self, request_id: int) -> None:
        self._batch.append(request_id)

    @property
    def last_step_timing(self) -> StepTiming | None:
        """A step's delay is its wait for the "device"; nothing else takes time here."""
        return StepTiming(launch_ms=0.0, wait_ms=self.step_delay_s * 1e3, host_ms=0.0) if self._batch else None

    def step(self) -> list[StepToken]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        out = []
        for rid in self._batch:
            seq = self._seqs[rid]
            text = "" if seq.finish_reason else self._emit(seq)
            out.append(StepToken(request_id=rid, text=text, finished=seq.finish_reason is not None))
        self._sample_memory()
        return out

    def finish(self, request_id: int) -> Finished:
        seq = self._seqs.pop(request_id)
        if request_id in self._batch:
            self._batch.remove(request_id)
        reply = "".join(seq.generated)
        if seq.generated:
            text = seq.prompt + reply[:-1]  # the last sampled token never went through the model
        else:
            text = seq.prompt[: seq.context]
        parked = _parked(self.tag, text) if len(text) > seq.reused else None
        return Finished(
            reply=reply,
            finish_reason=seq.finish_reason,
            stats=TurnStats(match=seq.match, tokens_reused=seq.reused, tokens_prefilled=seq.prefilled,
                            tokens_generated=len(seq.generated), decode_s=seq.last_token_at - seq.first_token_at),
            parked=parked,
            snapshot=parked.to_snapshot() if parked is not None and not self.copy_after_turn else None,
        )

    def snapshot(self, parked: Any, *, stop: Any = None, done: list[Any] | None = None) -> CacheSnapshot | None:
        """The copy in ``copy_layers`` parts of ``copy_layer_delay_s`` each, resumable as the contract says."""
        done = [] if done is None else done
        made = 0
        while len(done) < self.copy_layers:
            if made and stop is not None and stop():
                return None
            time.sleep(self.copy_layer_delay_s)
            done.append(len(done))
            self.copied_layers += 1
            made += 1
        self.snapshots.append(parked.text)
        return parked.to_snapshot()

    def discard(self, request_id: int) -> None:
        self._seqs.pop(request_id, None)
        if request_id in self._batch:
            self._batch.remove(request_id)
