"""The real engine on the MLX thread: ``runtime`` sequences, and the decode batch they step in together.

Every method here calls MLX and must run on the GPU actor's MLX thread (the GPU actor guarantees it);
memory is read with the backend-neutral ``mx.get_active_memory`` / ``mx.get_peak_memory``.
:class:`MlxEngine` does what :class:`runtime.plan.engine.Engine` asks: load a model, render a prompt,
tokenize a turn's new text once, build its sequence from the plan's cache, prefill, step, park.
Sequences that finished prefill decode together in a :class:`runtime.execution.decode_batch.DecodeBatch`.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from runtime.plan.engine import (
    Finished,
    MemoryReading,
    ModelInfo,
    PrefillResult,
    SequenceStarted,
    StepTiming,
    StepToken,
)
from runtime.plan.sampling import SamplingOptions
from runtime.plan.tools import ToolChoice, ToolUse
from runtime.plan.turn_plan import FromShared, ParkedView, Tokenized, TurnPlan
from runtime.backend import BackendProfile, device_profile
from runtime.errors import ModelError
from runtime.execution.batch_prefill import choose_group, prefill_together
from runtime.execution.decode_batch import DecodeBatch
from runtime.kv.float_resident import ResidentPool, room_for
from runtime.cpu.kv_copy import use_host_views
from runtime.kv.host_copy import HostCopy
from runtime.kv.kvstate import SLIDING_SLACK, ParkedCache, AttentionMode, settle_attention, with_kept_float
from runtime.model.loaded import LoadedModel, load_model
from runtime.execution.sequence import SequenceSampling, Sequence, start_from
from runtime.spec import CacheSnapshot, KVFormat, LayerKind, ModelCacheSpec
from runtime.reply.tool_calls import ReplyRules, reply_rules
from runtime.execution.warmup import prewarm_memory, warm_up

__all__ = ["MlxEngine", "active_token_bytes", "sequence_bytes"]

log = logging.getLogger("kvmem.engine")


def active_token_bytes(spec: ModelCacheSpec, attention: AttentionMode) -> int:
    """Bytes of one token's KV over the full-attention layers while a sequence runs.

    Under ``at-rest`` a Q4 layer is dequantized to the model's float dtype while
    active; under ``native`` it stays packed.
    """
    total = 0
    for layer, kind in zip(spec.layers, spec.layer_kinds(), strict=True):
        if kind is LayerKind.SLIDING:
            continue
        dims = layer.k_head_dim + layer.v_head_dim
        if kind is LayerKind.Q4 and attention == "native":
            total += spec.kv_format.quantized_bytes(layer.kv_heads, layer.k_head_dim, layer.v_head_dim)
        else:
            total += layer.kv_heads * dims * spec.dtype_bytes
    return total


def kept_float_bytes(spec: ModelCacheSpec, tokens: int) -> int:
    """The float buffers :func:`runtime.kv.kvstate.with_kept_float` makes for a cache of ``tokens``:
    the model's float dtype over its full-attention layers, with the room a turn writes into."""
    return active_token_bytes(spec, "at-rest") * room_for(tokens)


def sequence_bytes(spec: ModelCacheSpec) -> int:
    """Fixed bytes per running sequence: its sliding-window layers, full (window + slack)."""
    return sum(layer.kv_heads * (layer.k_head_dim + layer.v_head_dim) * spec.dtype_bytes
               * ((layer.window or 0) + SLIDING_SLACK) for layer in spec.layers if layer.kind == "sliding")


# -- the engine ----------------------------------------------------------------


class MlxEngine:
    """Sequences, the decode batch and the loaded model (see :class:`runtime.plan.engine.Engine`).

    Args:
        models_dir: where tiny models are built.
        kv_bits, kv_group_size: 4 or 8 (Q4/Q8 KV at rest) or None (float KV); the quantization group.
        kv_key_bits: the keys' bits where they differ from ``kv_bits`` (:class:`runtime.spec.KVFormat`; None: the
            backend profile's, :attr:`runtime.backend.BackendProfile.kv_key_bits`).
        attention, weights: ``auto``, ``at-rest`` or ``native`` attention on Q4 caches; how GGUF
            weights are held (:data:`runtime.model.gguf.WEIGHT_MODES`).
        prewarm_mb: memory to touch once when the first model loads and keep for activations,
            and a throwaway turn at each load (:mod:`runtime.execution.warmup`); 0 turns both off.
        numpy_attention: attend through :mod:`runtime.cpu.attention` where it applies.
        plain_attention_queries: the setting of that name (GPU policy: short passes' attention
            from plain MLX operations; 0: never; None: the profile's).
        short_attention_kernel: the setting of that name (CUDA: short passes' and a padded batch's attention in
            kvmem's one kernel, :mod:`runtime.kv.short_attention`).
        fused_projections: the setting of that name (a llama or qwen2 layer's query, key and value projections one
            product, its gate and up another: :mod:`runtime.model.fused_projections`).
        small_products_kernel: the setting of that name (CUDA: products of 2 to 16 rows in kvmem's kernel,
            :mod:`runtime.model.small_products`).
        keep_float_mb: float KV kept after turns for the next hot turn (:mod:`runtime.kv.float_resident`; 0: off;
            None: the backend profile's default).
        budget_mb, hot_budget_mb: the runtime's KV and hot-tier budgets (None: the profile's defaults),
            which the actors size themselves from; here only so the profile line reports them as run.
        group: an ``mx.distributed`` group: load this rank's tensor-parallel part of each model.
        profile: ``auto`` (the device's backend policy) or ``cpu`` / ``gpu`` forced
            (:mod:`runtime.backend`); every CPU-versus-GPU decision reads :attr:`profile`.
        prefill_chunk: a fixed prefill chunk (None: the profile's schedule).
        decode_run_steps: the setting of that name (None: the profile's), which the GPU actor runs by.
    """

    def __init__(
        self,
        *,
        models_dir: Path,
        kv_bits: int | None,
        kv_group_size: int,
        attention: str,
        kv_key_bits: int | None = None,
        weights: str = "auto",
        prewarm_mb: float = 0,
        numpy_attention: bool = True,
        plain_attention_queries: int | None = None,
        short_attention_kernel: bool | None = None,
        fused_projections: bool | None = None,
        small_products_kernel: bool | None = None,
        keep_float_mb: float | None = 0,
        budget_mb: float | None = None,
        hot_budget_mb: float | None = None,
        group: Any = None,
        profile: str = "auto",
        prefill_chunk: int | None = None,
        decode_run_steps: int | None = None,
    ) -> None:
        # Every CPU-versus-GPU decision, once (runtime.backend); a model load settles the attention.
        self._profile = device_profile(profile=profile, attention=attention, weights=weights,
                                       numpy_attention=numpy_attention, prewarm_mb=prewarm_mb,
                                       plain_attention_queries=plain_attention_queries,
                                       short_attention_kernel=short_attention_kernel,
                                       fused_projections=fused_projections,
                                       small_products_kernel=small_products_kernel,
                                       kv_key_bits=kv_key_bits, kv_bits=kv_bits,
                                       prefill_chunk=prefill_chunk, decode_run_steps=decode_run_steps,
                                       keep_float_mb=keep_float_mb,
                                       budget_mb=budget_mb, hot_budget_mb=hot_budget_mb)
        use_host_views(self._profile.numpy_kv_copy)
        self._residents = ResidentPool(int(self._profile.keep_float_mb * 2**20))
        self._group = group
        self._models_dir = models_dir
        self._prewarm_mb = self._profile.prewarm_mb  # touched at the first load only
        self._warm_up = self._profile.prewarm_mb > 0  # a throwaway turn at each model load (runtime.execution.warmup.warm_up)
        # The keys' bits as the profile decided them (the setting, else the policy's)
        self._kv_format = KVFormat(bits=kv_bits, group_size=kv_group_size, key_bits=self._profile.kv_key_bits)
        self._attention: AttentionMode = "at-rest"
        self._lm: LoadedModel | None = None
        self._seqs: dict[int, Sequence] = {}
        self._ids: dict[int, int] = {}  # id(seq) -> request id
        self._batch = self._new_batch()
        self._model_bytes = self._baseline = 0
        self._memory = MemoryReading()

    @classmethod
    def from_config(cls, config: Any, group: Any = None) -> MlxEngine:
        """The engine a :class:`runtime.config.Config` describes (``group``: this rank's, under ``--distributed``)."""
        return cls(models_dir=config.models_path, kv_bits=config.kv_bits, kv_group_size=config.kv_group_size,
                   kv_key_bits=config.kv_key_bits, attention=config.attention, weights=config.weights,
                   prewarm_mb=config.prewarm_mb,
                   numpy_attention=config.numpy_attention, keep_float_mb=config.keep_float_mb, group=group,
                   budget_mb=config.budget_mb, hot_budget_mb=config.hot_budget_mb,
                   plain_attention_queries=config.plain_attention_queries,
                   short_attention_kernel=config.short_attention_kernel,
                   fused_projections=config.fused_projections,
                   small_products_kernel=config.small_products_kernel,
                   profile=config.profile, prefill_chunk=config.prefill_chunk,
                   decode_run_steps=config.decode_run_steps)

    @property
    def profile(self) -> BackendProfile:
        """The backend profile: decided at construction, its attention settled by the last load."""
        return self._profile

    def _new_batch(self) -> DecodeBatch:
        return DecodeBatch(shared_prefix_check=self._profile.shared_prefix_check, run_ahead=self._profile.run_ahead,
                           alone_on_own_caches=self._profile.alone_on_own_caches)

    @property
    def memory(self) -> MemoryReading:
        return self._memory

    def _sample_memory(self) -> None:
        self._memory = MemoryReading(active=mx.get_active_memory(), peak=mx.get_peak_memory(),
                                     baseline=self._baseline, model=self._model_bytes)

    @property
    def lm(self) -> LoadedModel:
        if self._lm is None:
            raise ModelError("no model is loaded")
        return self._lm

    # -- model ---------------------------------------------------------------

    def load(self, name: str) -> ModelInfo:
        if self._lm is not None:
            self.unload()  # a full collection (~90 ms), so not on a first load
        if self._prewarm_mb > 0:
            seconds = prewarm_memory(self._prewarm_mb)
            log.info("pre-touched %g MB of activation memory in %.2f s", self._prewarm_mb, seconds)
            self._prewarm_mb = 0  # the process keeps it: once is enough
        self._baseline = mx.get_active_memory()
        mx.reset_peak_memory()
        lm = load_model(
            name,
            kv_format=self._kv_format,
            models_dir=self._models_dir,
            weights=self._profile.weights,
            packed_floats=self._profile.packed_floats,
            numpy_attention=self._profile.numpy_attention,
            plain_attention_queries=self._profile.plain_attention_queries,
            short_attention_kernel=self._profile.short_attention_kernel,
            float_slow_projections=self._profile.float_slow_projections,
            fused_projections=self._profile.fused_projections,
            small_products_kernel=self._profile.small_products_kernel,
            group=self._group,
            weights_fit_mb=self._profile.weights_fit_mb,
        )
        lm.upload_by_copy = self._profile.upload_by_copy
        lm.spec = replace(lm.spec, fused_dequantize=self._profile.fused_dequantize)
        self._lm = lm
        self._attention, note = settle_attention(lm, self._profile.attention)
        self._profile = self._profile.with_model(attention=self._attention, note=note,
                                                 float_dtype=str(lm.float_dtype).removeprefix("mlx.core."),
                                                 kernels=lm.kernels,
                                                 weights="quantized" if lm.weights_mode == "quantized" else None)
        log.info("%s: %s", name, self._profile.line())
        if self._warm_up:
            log.info("warmed %s up in %.2f s", name, warm_up(lm, self._attention))
            if lm.tool_format != "template":  # agent clients send tools on every request: not on the first one's clock
                lm.grammar_vocabulary  # noqa: B018 - a cached property, built here (~0.5 s)
        weights = tree_flatten(lm.model.parameters(), destination={})
        assert isinstance(weights, dict)
        self._model_bytes = sum(int(v.nbytes) for v in weights.values())
        self._sample_memory()
        context = lm.context_length
        if context is None:
            log.warning("model %s: no context length in its config; prompts are limited by the KV budget only",
                        name)
        return ModelInfo(name=name, tag=lm.spec.tag, block_bytes=lm.spec.bytes_per_block(),
                         active_token_bytes=active_token_bytes(lm.spec, self._attention),
                         sequence_bytes=sequence_bytes(lm.spec), model_bytes=self._model_bytes,
                         context_length=context, profile=self._profile,
                         layer_kinds=tuple(lm.spec.layer_kinds()), max_token_bytes=_longest_token_bytes(lm))

    def unload(self) -> None:
        self._seqs.clear()
        self._ids.clear()
        self._batch = self._new_batch()
        self._lm = None
        self._model_bytes = 0
        gc.collect()
        mx.clear_cache()
        self._sample_memory()

    def close(self) -> None:
        self.unload()
        mx.clear_streams()  # MLX's recommended cleanup at the end of a thread

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
    ) -> str:
        # A template's own tool format may leave the definitions out or refuse the choice; kvmem's
        # generic format always renders them (its grammar, built at the turn's start, does the rest).
        if tools and tool_choice is not None and self.lm.supports_tools:
            rules = reply_rules(self.lm, ToolUse(tools=tuple(tools), choice=tool_choice))  # raises if it cannot
            tools = tools if rules.render_tools else None
        return self.lm.render(messages, tools=tools)

    def count_tokens(self, text: str) -> int:
        return len(self.lm.tokenize(text)[0])

    # -- sequences -----------------------------------------------------------

    def tokenize(self, prompt: str, plan: TurnPlan) -> Tokenized:
        ids, ends = self.lm.tokenize(plan.suffix(prompt))
        return Tokenized(ids=tuple(ids), ends=tuple(ends))

    def start(
        self, request_id: int, prompt: str, plan: TurnPlan, tokens: Tokenized, sampling: SamplingOptions
    ) -> SequenceStarted:
        if not prompt:
            raise ValueError("empty prompt")
        rules = self._rules(sampling)  # once per turn: a named call's opening renders the template
        params = self.sampling_params(sampling, rules)
        splitter = rules.splitter(sampling.tool_use) if rules is not None else None
        start = start_from(self.lm, prompt, plan, tokens)
        seq = Sequence(self.lm, prompt, None, params, attention=self._attention, start=start, tool_calls=splitter)
        seq.sync_chunks = not self._profile.run_ahead
        self._seqs[request_id] = seq
        self._ids[id(seq)] = request_id
        self._sample_memory()
        # A copy: the sequence goes on counting in its own stats, on this thread, while this crosses to the actor.
        return SequenceStarted(stats=replace(seq.stats), token_ids=tuple(seq.token_ids))

    def sampling_params(self, sampling: SamplingOptions, rules: ReplyRules | None = None) -> SequenceSampling:
        """How a turn's sequence samples: its options, plus what its ``tool_choice`` and ``response_format``
        enforce (``rules``: the turn's :func:`~runtime.reply.tool_calls.reply_rules`, worked out here if not given)."""
        unknown = [token for token, _ in sampling.logit_bias if token >= self.lm.vocab_limit]
        if unknown:
            raise ValueError(f"logit_bias: token {unknown[0]} is not in the model's vocabulary "
                             f"(ids 0 to {self.lm.vocab_limit - 1})")
        # A top-k of the whole vocabulary or more keeps every token: no filter (mlx-lm's refuses it).
        top_k = sampling.top_k if sampling.top_k < self.lm.vocab_limit else 0
        params = SequenceSampling.of(sampling, top_k=top_k)
        rules = rules or self._rules(sampling)
        if rules is None:
            return params
        banned = {token: float("-inf") for token in rules.banned}  # the reply rules' bans win over a client's bias
        return replace(params, forced=tuple(self.lm.tokenize(rules.forced)[0]) if rules.forced else (),
                       logit_bias={**params.logit_bias, **banned}, grammar=rules.grammar)

    def _rules(self, sampling: SamplingOptions) -> ReplyRules | None:
        """The turn's reply rules; None when it has no tools and no ``response_format`` (nothing to enforce)."""
        if sampling.tool_use is None and sampling.response_format is None:
            return None
        return reply_rules(self.lm, sampling.tool_use, sampling.response_format)

    def prefill(self, request_id: int, chunk: int | None, *, adopt: FromShared | None = None) -> PrefillResult:
        seq = self._seqs[request_id]
        if adopt is not None and not seq.prefill_started:
            assert isinstance(adopt.parked, ParkedCache)
            base = adopt.parked.truncated(adopt.reuse_tokens, self.lm.spec)
            if base is not None:
                seq.adopt(replace(base, meta={}, resident=None))  # a shared prefix starts the new agent's own history
        text = seq.prefill_step(chunk or self._profile.chunk_for(seq.context))
        self._sample_memory()
        return PrefillResult(text=text, finished=seq.finish_reason is not None, context=seq.context,
                             remaining=seq.to_prefill, tool_calls=seq.take_tool_calls(), timing=seq.last_chunk_timing,
                             logprobs=seq.take_logprobs())

    def prefill_together(self, request_ids: list[int]) -> dict[int, PrefillResult]:
        group = choose_group({r: self._seqs[r] for r in request_ids})
        if not group:
            return {}
        ids = list(group)
        rows = [self._seqs[r] for r in ids]
        texts, caches = prefill_together(rows, [group[r] for r in ids])
        # A row its first token finished leaves the batch at finish(), as any member does.
        self._batch.add_group(rows, caches)
        self._sample_memory()
        return {
            r: PrefillResult(text=text, finished=seq.finish_reason is not None, context=seq.context, remaining=0,
                             tool_calls=seq.take_tool_calls(), timing=seq.last_chunk_timing,
                             logprobs=seq.take_logprobs())
            for r, seq, text in zip(ids, rows, texts, strict=True)
        }

    def prepare(self, snapshot: CacheSnapshot) -> ParkedCache | None:
        lm = self.lm
        if snapshot.model_tag != lm.spec.tag:
            return None
        parked = ParkedCache.from_snapshot(snapshot, float_dtype=lm.float_dtype, by_copy=lm.upload_by_copy)
        # On the device now, ahead of the turn: left lazy, the upload (on CUDA a host-to-device copy of the
        # whole cache: about 8 ms for a 1B's 16K tokens at 20 GB/s) would run inside the turn's first chunk.
        mx.eval([a for layer in parked.layers for a in layer.arrays.values()])
        if self._attention != "at-rest" or not self._residents.fits(kept_float_bytes(lm.spec, parked.num_tokens)):
            return parked
        kept = with_kept_float(parked, lm.spec)
        return kept if kept.resident is not None and self._residents.add(kept.resident) else parked

    def park_prompt(self, request_id: int) -> ParkedCache | None:
        seq = self._seqs[request_id]
        # Right after prefill its caches hold exactly the prompt; once it joined the batch, its row holds the
        # prompt and the tokens generated since, and parking keeps the prompt's (the first len(token_ids)).
        caches = self._batch.row_caches(seq) if seq in self._batch else None
        parked = seq.kv.park(text=seq.prompt, token_ids=seq.token_ids, offsets=seq.offsets, caches=caches)
        self._sample_memory()
        return parked

    def join(self, request_id: int) -> None:
        self._batch.add(self._seqs[request_id])
        self._sample_memory()

    def _empty_cache_if_owed(self) -> None:
        """Under the profile's ``clear_cache_after_prefill``, empty MLX's buffer cache once for every prompt of
        several chunks that finished its prefill since the last call (``Sequence.chunked_prefill_done``):
        called after the first token went out, not inside its time."""
        owed = [seq for seq in self._seqs.values() if seq.chunked_prefill_done]
        for seq in owed:
            seq.chunked_prefill_done = False
        if owed and self._profile.clear_cache_after_prefill:
            mx.clear_cache()

    def step(self) -> list[StepToken]:
        self._empty_cache_if_owed()
        results = self._batch.step_once()
        self._sample_memory()
        return [
            StepToken(request_id=self._ids[id(seq)], text=text, finished=seq.finish_reason is not None,
                      tool_calls=seq.take_tool_calls(), logprobs=seq.take_logprobs())
            for seq, text in results
        ]

    @property
    def last_step_timing(self) -> StepTiming | None:
        return self._batch.last_timing

    def _leave(self, request_id: int) -> Sequence:
        seq = self._seqs.pop(request_id)
        self._ids.pop(id(seq), None)
        if seq in self._batch:
            self._batch.remove(seq)
        return seq

    def finish(self, request_id: int) -> Finished:
        self._empty_cache_if_owed()  # a turn that ended at its first token
        seq = self._leave(request_id)
        # The GPU policy launches the park and leaves the host copy for later (Engine.snapshot):
        # the decode loop waits for neither.
        later = self.profile.copy_after_turn
        parked: ParkedCache | None
        if seq.prefill_done:
            parked = seq.park(keep_float=self._residents.max_bytes > 0, wait=not later)
            if parked is not None and parked.resident is not None:
                self._residents.add(parked.resident)
        elif seq.context > seq.stats.tokens_reused:
            # Cancelled mid-prefill: keep the part of the prompt whose KV exists.
            ctx = seq.context
            parked = seq.kv.park(
                text=seq.prompt[: seq.offsets[ctx - 1]],
                token_ids=seq.token_ids[:ctx],
                offsets=seq.offsets[:ctx],
                wait=not later,
            )
        else:
            parked = None
        snapshot = parked.to_snapshot() if parked is not None and not later else None
        self._sample_memory()
        if seq.finish_reason is None:
            seq.stop_clock()  # cancelled
        stats = seq.stats
        return Finished(
            reply=seq.reply,
            finish_reason=seq.finish_reason,
            # A turn cancelled mid-prefill prefilled only part of what it started to.
            stats=replace(stats, tokens_prefilled=min(stats.tokens_prefilled, seq.context - stats.tokens_reused)),
            parked=parked,
            snapshot=snapshot,
            stop_sequence=seq.stop_sequence,
            content=seq.content,
            tool_calls=tuple(seq.tool_calls),
            logprobs=seq.logprobs,
        )

    def snapshot(self, parked: ParkedView, *, stop: Callable[[], bool] | None = None,
                 done: list[Any] | None = None) -> CacheSnapshot | None:
        assert isinstance(parked, ParkedCache)
        done = [] if done is None else done
        if not done:  # the copy's progress (runtime.kv.host_copy), which the caller keeps between calls
            done.append(HostCopy(parked, by_copy=self._profile.download_by_copy))
        copy: HostCopy = done[0]
        if stop is None:  # nothing waits on it: what is left, in one evaluation
            copy.make_rest()
        else:
            # A part at a time: on a GPU a host copy is slow (about 0.6 GB/s on an H200), so a new turn
            # waits for one part (a few MB of one array), not a layer or the whole cache.
            made = 0
            while not copy.complete:
                if made and stop():
                    return None
                copy.make_next()
                made += 1
        if parked.resident is not None:  # the Q4 it was parked as is evaluated now: its floats' last writes too
            parked.resident.settle()
        return copy.snapshot()

    def discard(self, request_id: int) -> None:
        if request_id in self._seqs:
            try:
                self._leave(request_id)
            except Exception:  # noqa: BLE001 - a broken batch is dropped whole
                self._batch = self._new_batch()
                self._ids = {i: r for i, r in self._ids.items() if r in self._seqs}


def _longest_token_bytes(lm: LoadedModel) -> int | None:
    """The UTF-8 length of the vocabulary's longest entry, as its tokenizer spells it: an upper bound on the
    bytes of text one token covers (a byte-level BPE writes a byte as one character of up to 2 bytes, a
    SentencePiece space as 3, a byte fallback token as 6: each spelling is at least the bytes it stands for)."""
    hf = getattr(lm.tokenizer, "_tokenizer", lm.tokenizer)
    try:
        vocab = hf.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: no bound
        return None
    return max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=None)
