"""The real engine: ``runtime`` sequences and a ``DecodeBatch`` on the MLX thread.

Every method here calls MLX and must run on :class:`actors.mlx_thread.MlxThread`
(the GPU actor guarantees it). Memory is read with the backend-neutral
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

from actors.engine import Finished, MemoryReading, PrefillResult, Started, StepToken
from actors.messages_gpu import (
    CacheSource,
    ColdStart,
    FromHot,
    FromShared,
    FromWarm,
    ModelInfo,
    SamplingOptions,
)
from runtime.batch import DecodeBatch
from runtime.errors import ModelError
from runtime.kvstate import SLIDING_SLACK, ParkedCache, Strategy, resolve_strategy
from runtime.models import LoadedModel, load_model
from runtime.prefix import common_prefix_length, match_prefix
from runtime.sampling import SamplingParams
from runtime.sequence import Sequence
from runtime.snapshot import BLOCK_TOKENS, LayerKind
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
    """Sequences, the decode batch and the loaded model (see :class:`actors.engine.Engine`).

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
        self._sharing: set[int] = set()  # requests whose prompt prefix may be shared (both ways)
        self._donors: dict[int, ParkedCache] = {}  # request id -> its parked prompt, while it runs
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
        self.unload()
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
        self._sharing.clear()
        self._donors.clear()
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

    def _cached_text(self, source: CacheSource) -> tuple[str, tuple[int, ...] | list[int], str | None]:
        match source:
            case ColdStart():
                return "", (), None
            case FromHot(parked=parked):
                return parked.text, parked.offsets, parked.model_tag
            case FromWarm(snapshot=snap):
                return snap.text, snap.offsets, snap.model_tag
            case FromShared(parked=parked, keep_tokens=keep):
                offsets = parked.offsets[:keep]
                return parked.text[: offsets[-1] if offsets else 0], offsets, parked.model_tag
        raise TypeError(f"unknown cache source {source!r}")

    def measure(self, prompt: str, source: CacheSource) -> int:
        lm = self.lm
        text, offsets, tag = self._cached_text(source)
        reuse_tokens = reuse_chars = 0
        if text and tag == lm.spec.tag:
            match = match_prefix(text, offsets, prompt)
            reuse_tokens, reuse_chars = match.reuse_tokens, match.reuse_chars
        return reuse_tokens + len(lm.tokenize(prompt[reuse_chars:])[0])

    def _base(self, source: CacheSource) -> ParkedCache | None:
        lm = self.lm
        match source:
            case ColdStart():
                return None
            case FromHot(parked=parked):
                assert isinstance(parked, ParkedCache)
                return parked
            case FromWarm(snapshot=snap):
                return ParkedCache.from_snapshot(snap, float_dtype=lm.float_dtype)
            case FromShared(parked=parked, keep_tokens=keep):
                assert isinstance(parked, ParkedCache)
                base = parked.truncated(keep, lm.spec)
                # A shared prefix starts the new agent's own history: no donor meta.
                return None if base is None else replace(base, meta={})
        raise TypeError(f"unknown cache source {source!r}")

    def start(
        self, request_id: int, prompt: str, source: CacheSource, sampling: SamplingOptions, *, share: bool = False
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
        seq = Sequence(self.lm, prompt, self._base(source), params, strategy=self._strategy)
        self._seqs[request_id] = seq
        self._ids[id(seq)] = request_id
        if share:
            self._sharing.add(request_id)
        self._sample_memory()
        return Started(
            tokens_reused=seq.stats.tokens_reused,
            tokens_to_prefill=seq.stats.tokens_prefilled,
            match=seq.stats.match,
        )

    def prefill(self, request_id: int, chunk: int | None) -> PrefillResult:
        seq = self._seqs[request_id]
        if request_id in self._sharing and not seq.prefill_started:
            self._adopt_prefix(request_id, seq)
        text = seq.prefill_step(chunk)
        if text is not None and request_id in self._sharing and self._wanted_as_donor(seq):
            # Right after prefill the caches hold exactly the prompt (the first token is not fed yet).
            donor = seq.kv.park(text=seq.prompt, token_ids=seq.token_ids, offsets=seq.offsets)
            if donor is not None:
                self._donors[request_id] = donor
        self._sample_memory()
        return PrefillResult(
            text=text, finished=seq.finish_reason is not None, context=seq.context, remaining=seq.to_prefill
        )

    # -- prefix sharing between sequences in flight ----------------------------
    #
    # The cache store shares a prefix only from an agent's *parked* cache, so
    # agents that arrive together (a shared system prompt, all cold) would each
    # prefill it. Here the first of them to finish prefill parks its prompt while
    # it decodes, and the others, before their first chunk, restart from its
    # whole blocks. The scheduler finishes equal-length prefills in arrival order,
    # so the others have not started yet when the first is done.

    def _shared_blocks(self, donor_ids: tuple[int, ...] | list[int], seq: Sequence) -> int:
        """Tokens of whole blocks ``seq``'s prompt has in common with ``donor_ids``."""
        common = common_prefix_length(list(donor_ids), seq.token_ids)
        return (common // BLOCK_TOKENS) * BLOCK_TOKENS

    def _wanted_as_donor(self, donor: Sequence) -> bool:
        """Whether a sharing sequence that has not started prefill would reuse more of ``donor``."""
        return any(
            rid in self._sharing
            and not other.prefill_started
            and self._shared_blocks(donor.token_ids, other) > other.stats.tokens_reused
            for rid, other in self._seqs.items()
            if other is not donor
        )

    def _adopt_prefix(self, request_id: int, seq: Sequence) -> None:
        """Restart ``seq`` from the longest whole-block prefix a running donor parked."""
        best: tuple[int, ParkedCache] | None = None
        for donor_id, parked in self._donors.items():
            keep = self._shared_blocks(parked.token_ids, seq) if donor_id != request_id else 0
            keep = min(keep, (len(seq.token_ids) - 1) // BLOCK_TOKENS * BLOCK_TOKENS)  # one token left to prefill
            if keep > seq.stats.tokens_reused and (best is None or keep > best[0]):
                best = (keep, parked)
        if best is None:
            return
        base = best[1].truncated(best[0], self.lm.spec)
        if base is not None:
            # A shared prefix starts the new agent's own history: no donor meta.
            seq.adopt(replace(base, meta={}))

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
        self._sharing.discard(request_id)
        self._donors.pop(request_id, None)
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
