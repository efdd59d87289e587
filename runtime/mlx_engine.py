"""The real engine: ``runtime`` sequences and a ``DecodeBatch`` on the MLX thread.

Every method here calls MLX and must run on the GPU actor's MLX thread
(:class:`actors.mlx_thread.MlxThread`; the GPU actor guarantees it). Memory is read with the backend-neutral
``mx.get_active_memory`` / ``mx.get_peak_memory``, never ``mx.metal``.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from runtime.batch import DecodeBatch
from runtime.engine import Finished, MemoryReading, ModelInfo, PrefillResult, Started, StepToken
from runtime.errors import ModelError
from runtime.kvstate import SLIDING_SLACK, ParkedCache, Strategy, resolve_strategy
from runtime.models import LoadedModel, load_model
from runtime.prefix import MatchKind
from runtime.sampling import SamplingParams
from runtime.sequence import Sequence, StartFrom
from runtime.snapshot import LayerKind
from runtime.turn_plan import ColdStart, FromHot, FromShared, FromWarm, SamplingOptions, Tokenized, TurnPlan
from runtime.spec import KVFormat, ModelCacheSpec
from runtime.warmup import prewarm_memory

__all__ = ["MlxEngine", "active_token_bytes", "sequence_bytes"]

log = logging.getLogger("kvmem.engine")


def active_token_bytes(spec: ModelCacheSpec, strategy: Strategy) -> int:
    """Bytes of one token's KV over the full-attention layers while a sequence runs.

    Under ``at-rest`` a Q4 layer is dequantized to the model's float dtype while
    active; under ``native`` it stays packed.
    """
    total = 0
    for layer, kind in zip(spec.layers, spec.layer_kinds(), strict=True):
        if kind is LayerKind.SLIDING:
            continue
        dims = layer.k_head_dim + layer.v_head_dim
        if kind is LayerKind.Q4 and strategy == "native":
            bits, group = spec.kv_format.bits or 4, spec.kv_format.group_size
            total += layer.kv_heads * (dims * bits // 8 + (dims // group) * 2 * 2)
        else:
            total += layer.kv_heads * dims * spec.dtype_bytes
    return total


def sequence_bytes(spec: ModelCacheSpec) -> int:
    """Fixed bytes per running sequence: its sliding-window layers, full (window + slack)."""
    return sum(
        layer.kv_heads
        * (layer.k_head_dim + layer.v_head_dim)
        * spec.dtype_bytes
        * ((layer.window or 0) + SLIDING_SLACK)
        for layer in spec.layers
        if layer.kind == "sliding"
    )


class MlxEngine:
    """Sequences, the decode batch and the loaded model (see :class:`runtime.engine.Engine`).

    Args:
        models_dir: where tiny models are built.
        kv_bits: 4 or 8 (Q4/Q8 KV at rest) or None (float KV).
        kv_group_size: quantization group size.
        strategy: ``auto``, ``at-rest`` or ``native`` attention on Q4 caches.
        weights: how GGUF weights are held (:data:`runtime.gguf.WEIGHT_MODES`).
        prewarm_mb: memory to touch once when the first model loads and keep for
            activations (see :mod:`runtime.warmup`); 0 turns it off.
    """

    def __init__(
        self,
        *,
        models_dir: Path,
        kv_bits: int | None,
        kv_group_size: int,
        strategy: str,
        weights: str = "auto",
        prewarm_mb: float = 0,
    ) -> None:
        self._models_dir = models_dir
        self._weights = weights
        self._prewarm_mb = prewarm_mb
        self._kv_format = KVFormat(bits=kv_bits, group_size=kv_group_size)
        self._attention = strategy  # "auto" is resolved on the MLX thread when a model loads
        self._strategy: Strategy = "at-rest"
        self._lm: LoadedModel | None = None
        self._seqs: dict[int, Sequence] = {}
        self._ids: dict[int, int] = {}  # id(seq) -> request id
        self._batch = DecodeBatch()
        self._model_bytes = 0
        self._baseline = 0
        self._memory = MemoryReading()

    @property
    def memory(self) -> MemoryReading:
        return self._memory

    def _sample_memory(self) -> None:
        self._memory = MemoryReading(
            active=mx.get_active_memory(),
            peak=mx.get_peak_memory(),
            baseline=self._baseline,
            model=self._model_bytes,
        )

    @property
    def lm(self) -> LoadedModel:
        if self._lm is None:
            raise ModelError("no model is loaded")
        return self._lm

    # -- model ---------------------------------------------------------------

    def load(self, name: str) -> ModelInfo:
        if self._lm is not None:
            self.unload()  # a full collection: ~90 ms with everything imported, so not on a first load
        if self._prewarm_mb > 0:
            seconds = prewarm_memory(self._prewarm_mb)
            log.info("pre-touched %g MB of activation memory in %.2f s", self._prewarm_mb, seconds)
            self._prewarm_mb = 0  # the process keeps it: once is enough
        self._baseline = mx.get_active_memory()
        mx.reset_peak_memory()
        lm = load_model(name, kv_format=self._kv_format, models_dir=self._models_dir, weights=self._weights)
        self._lm = lm
        self._strategy = resolve_strategy(self._attention)
        weights = tree_flatten(lm.model.parameters(), destination={})
        assert isinstance(weights, dict)
        self._model_bytes = sum(int(v.nbytes) for v in weights.values())
        self._sample_memory()
        return ModelInfo(
            name=name,
            tag=lm.spec.tag,
            block_bytes=lm.spec.bytes_per_block(),
            active_token_bytes=active_token_bytes(lm.spec, self._strategy),
            sequence_bytes=sequence_bytes(lm.spec),
            model_bytes=self._model_bytes,
        )

    def unload(self) -> None:
        self._seqs.clear()
        self._ids.clear()
        self._batch = DecodeBatch()
        self._lm = None
        self._model_bytes = 0
        gc.collect()
        mx.clear_cache()
        self._sample_memory()

    def close(self) -> None:
        self.unload()
        mx.clear_streams()  # MLX's recommended cleanup at the end of a thread

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        return self.lm.render(messages, tools=tools)

    def count_tokens(self, text: str) -> int:
        return len(self.lm.tokenize(text)[0])

    # -- sequences -----------------------------------------------------------

    def tokenize(self, prompt: str, plan: TurnPlan) -> Tokenized:
        ids, ends = self.lm.tokenize(plan.suffix(prompt))
        return Tokenized(ids=tuple(ids), ends=tuple(ends))

    def _base(self, plan: TurnPlan) -> ParkedCache | None:
        """The plan's cache truncated to what the turn reuses (None: start cold)."""
        lm = self.lm
        match plan.source:
            case ColdStart():
                return None
            case FromHot(parked=parked) | FromShared(parked=parked):
                assert isinstance(parked, ParkedCache)
                cache = parked
            case FromWarm(snapshot=snapshot):
                if snapshot.model_tag != lm.spec.tag:
                    return None
                cache = ParkedCache.from_snapshot(snapshot, float_dtype=lm.float_dtype)
        if cache.model_tag != lm.spec.tag:
            return None
        base = cache.truncated(plan.reuse_tokens, lm.spec)
        if base is not None and isinstance(plan.source, FromShared):
            base = replace(base, meta={})  # a shared prefix starts the new agent's own history
        return base

    def start(
        self, request_id: int, prompt: str, plan: TurnPlan, tokens: Tokenized, sampling: SamplingOptions
    ) -> Started:
        if not prompt:
            raise ValueError("empty prompt")
        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop=tuple(sampling.stop),
        )
        base = self._base(plan) if plan.reuse_tokens else None
        if base is not None:
            start = StartFrom(base, plan.match, plan.reuse_chars, list(tokens.ids), list(tokens.ends))
        elif plan.reuse_tokens:
            # The plan's cache cannot be used after all (a sliding window too short to trim): start cold.
            ids, ends = self.lm.tokenize(prompt)
            start = StartFrom(ParkedCache.empty(self.lm.spec), MatchKind.DIVERGE.value, 0, ids, ends)
        else:
            start = StartFrom(ParkedCache.empty(self.lm.spec), plan.match, 0, list(tokens.ids), list(tokens.ends))
        seq = Sequence(self.lm, prompt, None, params, strategy=self._strategy, start=start)
        self._seqs[request_id] = seq
        self._ids[id(seq)] = request_id
        self._sample_memory()
        return Started(
            tokens_reused=seq.stats.tokens_reused,
            tokens_to_prefill=seq.stats.tokens_prefilled,
            match=seq.stats.match,
            token_ids=tuple(seq.token_ids),
        )

    def prefill(self, request_id: int, chunk: int | None, *, adopt: FromShared | None = None) -> PrefillResult:
        seq = self._seqs[request_id]
        if adopt is not None and not seq.prefill_started:
            assert isinstance(adopt.parked, ParkedCache)
            base = adopt.parked.truncated(adopt.keep_tokens, self.lm.spec)
            if base is not None:
                seq.adopt(replace(base, meta={}))  # a shared prefix starts the new agent's own history
        text = seq.prefill_step(chunk)
        self._sample_memory()
        return PrefillResult(
            text=text, finished=seq.finish_reason is not None, context=seq.context, remaining=seq.to_prefill
        )

    def park_prompt(self, request_id: int) -> ParkedCache | None:
        seq = self._seqs[request_id]
        # Right after prefill the caches hold exactly the prompt (the first token is not fed yet).
        parked = seq.kv.park(text=seq.prompt, token_ids=seq.token_ids, offsets=seq.offsets)
        self._sample_memory()
        return parked

    def join(self, request_id: int) -> None:
        self._batch.add(self._seqs[request_id])
        self._sample_memory()

    def step(self) -> list[StepToken]:
        results = self._batch.step_once()
        self._sample_memory()
        return [
            StepToken(request_id=self._ids[id(seq)], text=text, finished=seq.finish_reason is not None)
            for seq, text in results
        ]

    def _leave(self, request_id: int) -> Sequence:
        seq = self._seqs.pop(request_id)
        self._ids.pop(id(seq), None)
        if seq in self._batch:
            self._batch.remove(seq)
        return seq

    def finish(self, request_id: int) -> Finished:
        seq = self._leave(request_id)
        parked: ParkedCache | None
        if seq.prefill_done:
            parked = seq.park()
        elif seq.context > seq.stats.tokens_reused:
            # Cancelled mid-prefill: keep the part of the prompt whose KV exists.
            ctx = seq.context
            parked = seq.kv.park(
                text=seq.prompt[: seq.offsets[ctx - 1]],
                token_ids=seq.token_ids[:ctx],
                offsets=seq.offsets[:ctx],
            )
        else:
            parked = None
        snapshot = parked.to_snapshot() if parked is not None else None
        self._sample_memory()
        stats = seq.stats
        return Finished(
            reply=seq.reply,
            finish_reason=seq.finish_reason,
            match=stats.match,
            tokens_reused=stats.tokens_reused,
            tokens_prefilled=min(stats.tokens_prefilled, seq.context - stats.tokens_reused),
            tokens_generated=stats.tokens_generated,
            parked=parked,
            snapshot=snapshot,
            stop_sequence=seq.stop_sequence,
        )

    def discard(self, request_id: int) -> None:
        if request_id in self._seqs:
            try:
                self._leave(request_id)
            except Exception:  # noqa: BLE001 - a broken batch is dropped whole
                self._batch = DecodeBatch()
                self._ids = {i: r for i, r in self._ids.items() if r in self._seqs}
