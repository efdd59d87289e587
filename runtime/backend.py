"""The backend profile: every CPU-versus-GPU decision, made once and read everywhere else.

kvmem was tuned on a 2-core CPU, where MLX's float32 matmul is the only fast
one, its quantized SDPA runs single-threaded, host memory *is* device memory
(a NumPy view of an MLX array costs nothing) and glibc's allocator decides
first-touch costs. None of that holds on a GPU (CUDA or Metal), where the
same tricks become host round trips. So the policy is one frozen value,
:class:`BackendProfile`, decided when the engine is built (:func:`decide_profile`:
pure, testable without MLX) and refined once when a model loads (whether the
native Q4 attention kernels exist for the model's own shapes and dtypes).
Code that used to ask ``mx.default_device()`` reads the profile instead.

The policy can be forced (the ``profile`` setting, ``KVMEM_PROFILE=gpu``): the
GPU policy then runs on the CPU device, so the CPU test suite covers the GPU
paths' logic; ``cpu`` on a GPU machine gives the CPU policy there.

| decision | ``cpu`` policy | ``gpu`` policy |
|--|--|--|
| attention (``auto``) | at-rest (float while active: prefill into Q4 is 3-4x slower on CPU) | at-rest too: quantizing each token as it arrives (native) loses needles float keeps (``docs/models.md``); ``native`` when asked, once its kernels run the model's shapes, else at-rest |
| GGUF weights (``auto``) | float32 (the only fast matmul on MLX's CPU backend), where that takes at most half the machine's memory; else as stored (one log line) | as stored (Q4/Q8) |
| a packed GGUF's float tensors (its norms: llama.cpp stores them float32) | float32 (MLX's CPU quantized matmul is several times slower in float16) | float16, the packed blocks' own scale dtype: activations and KV follow the norms, and MLX's CUDA quantized matmul has no float32 kernel |
| float dtype of activations and KV | the weights' (float32 for a GGUF) | the model's own (bf16 / f16 stay so; a packed GGUF float16; never float32 by accident) |
| prefill chunk | 512 / 256 / 128 as the context grows | 2048 (mlx-lm's ``prefill_step_size``) |
| decode | in lockstep (the host waits for each step); a lone row is a batch of one | one step ahead (``mx.async_eval``, as mlx-lm's ``generate_step``); a lone row on its own caches, as there |
| decode steps back to back in one job on the model's thread (``decode_run_steps`` unset) | 1: a run's thread contends with trio and OpenBLAS for the two cores and the GIL (8 agents on kvmem-default: about 10% fewer tokens/s with runs; one agent: no change) | :data:`GPU_DECODE_RUN_STEPS`: the device computes while the host would wait for trio between steps (a 1-layer model: 0.83x plain mlx-lm's tokens/s with runs, 0.66x without; ``benches/results/decode_runs.md``) |
| NumPy attention, NumPy KV copies, the shared-prefix check | on (``numpy_attention``) | off: no host round trip |
| allocator tuning and pre-warm | on | off (device memory is not the glibc heap) |
| short passes' attention (2 to ``plain_attention_queries`` query positions a row) | NumPy (above) | plain MLX operations, up to :data:`GPU_PLAIN_ATTENTION_QUERIES` (unset): on CUDA the fused kernel builds a cuDNN graph per new shape, about 65 ms each, and a growing conversation's every turn has new ones (an H200, run 3: a batch of 8's join took 263 ms a round instead of 1,071) |
| a decode step of rows of different lengths (a batch's padding) | NumPy's decode attention (from 1K keys over the batch; MLX's below) | on CUDA, kvmem's one kernel (``short_attention_kernel``, unset): causal, each row from its first key, for these steps and for the short passes (over more than :data:`runtime.kv.short_attention.SHORT_PASS_KEYS` keys in two passes, where the load's check holds them; ``runtime.kv.short_attention``; H200 run 6: a 1B's step of 8 rows launched in 3.5 ms against 6.6 through MLX's masked fallback, which other backends keep: a product, the mask, a softmax and a product a layer) |
| a llama or qwen2 layer's projections (``fused_projections`` unset) | seven products | four: queries, keys and values one product, gate and up another (``runtime.model.fused_projections``; H200 run 6: on CUDA every product of two or more rows costs the host about 37 µs of submit whatever its size, a one-row product 11; a 1B layer's four submitted in 0.17 ms at 8 rows against its seven's 0.26) |
| memory budgets (``budget_mb``, ``hot_budget_mb``, ``keep_float_mb`` left unset) | 2048 / 512 / 1024 MiB | 25% / 10% / 10% of the device's memory (CUDA's total, Metal's recommended working set); the CPU's where it is not known (the GPU policy forced on a CPU) |
| MLX's buffer cache | MLX's own: freed buffers kept up to its memory limit | also emptied once a prompt of several chunks has its first token, as mlx-lm's ``generate_step`` empties it after every chunk: a cache growing chunk by chunk frees longer and longer buffers no later request fits |
| a turn's end | the cache is quantized and copied to the host for its save at once | quantized without waiting; the save's host copy is made later, when the GPU actor has nothing to run or the store needs it, never between two decode steps; made while idle, it stops between two parts (a few MB of one array: ``runtime.kv.host_copy``) for a message; overdue while turns run, it goes a few parts a loop pass, after the prefill under way (``actors.gpu``) |
| quantized projections (CUDA only, whatever the policy) | — | MLX compiles its quantized kernels for passes of 8+ rows on the machine at first use (SmolLM2-135M's first 1,000-token forward on an H200 did not end in a minute): a small model's (at most 1 GiB made float) are all made float at load; a larger model's that MLX's fast kernel does not take too, and the kernels the rest use are compiled at load (``runtime.model.cuda_qmm``) |
| a cache read from disk, onto the device | ``mx.array`` (host memory is the device's) | ``mx.load`` of the arrays as a safetensors stream: one copy each to device memory, not managed memory paged in at about 0.6 GB/s on CUDA (``runtime.kv.upload``) |
| a Q4 cache dequantized (a turn's activation, a park's kept float) | unpacked in float32 by plain operations (MLX's kernel is about 8x slower on the CPU) | ``mx.dequantize``: one kernel an array, not nine, and no float32 intermediates |
| a cache copied to the host for its save | its own arrays read in place | a device copy read, so the cache's own buffers stay device memory (MLX moves any buffer the host reads to managed memory for good) |
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec

__all__ = ["BackendProfile", "ModelKernels", "Policy", "cuda_kernel_tolerance", "cuda_kernels_run", "decide_profile",
           "detect_device", "device_profile", "profile_setting", "physical_memory_mb", "WEIGHTS_MEMORY_SHARE",
           "CPU_CHUNKS", "GPU_CHUNK", "CPU_MEMORY_MB", "GPU_MEMORY_SHARES", "GPU_DECODE_RUN_STEPS", "DECODE_RUN_S",
           "GPU_PLAIN_ATTENTION_QUERIES"]

Policy = Literal["cpu", "gpu"]

CPU_CHUNKS: tuple[tuple[int, int], ...] = ((1024, 512), (4096, 256), (2**62, 128))
"""The CPU's prefill chunk schedule: (context below, chunk). Attention cost per token grows
with the context, so chunks shrink to bound each chunk's latency (the decode stall it causes)."""

GPU_CHUNK = 2048
"""Prefill chunk on a GPU: mlx-lm's own ``prefill_step_size``; a chunk is one kernel launch
per layer, so fewer, larger chunks keep the device busy."""

GPU_DECODE_RUN_STEPS = 256
"""Decode steps a batch runs back to back in one job on a GPU's model thread when no prefill is
waiting (:class:`runtime.plan.scheduler.Step`'s ``decode_steps``); each step's tokens still stream
as it ends, and a finished row, a message or :data:`DECODE_RUN_S` ends the run early. Between two
runs the model's thread waits for trio: on an H200 (run 5) the step after a run's end came 9-12 ms
after the run's last, against 2.4 ms (1B) and 6 ms (3B) steps, so runs of 64 (run 5's) cost a 1B's
128-token reply about 3% of its decode rate; runs this long end by time or by the reply's end."""

DECODE_RUN_S = 0.5
"""A decode run also ends once it has run this long (seconds), whatever its steps: between runs the
GPU actor makes a slice of any save copy overdue (``runtime.plan.save_queue.COPY_OVERDUE_S``), so
one waits at most this long behind a long reply; at run 5's 9-12 ms a boundary that is 2% of a run."""

GPU_PLAIN_ATTENTION_QUERIES = 64
"""Under the GPU policy, forward passes of 2 to this many query positions a row attend with plain
MLX operations (``plain_attention_queries`` unset): a hot turn's message or a batch's join costs
no new fused-kernel graph. Longer passes (prefill chunks) keep the fused kernel, whose graph per
shape is then small beside the pass, and one-token decode steps keep MLX's vector kernel."""


GPU_KV_KEY_BITS = 8
"""The keys' bits of the GPU policy's at-rest KV (values at ``kv_bits``): :attr:`BackendProfile.kv_key_bits`."""

CPU_MEMORY_MB: dict[str, float] = {"budget_mb": 2048.0, "hot_budget_mb": 512.0, "keep_float_mb": 1024.0}
"""The memory settings' defaults on a CPU (sized for a small machine), and wherever the device's memory is unknown."""

GPU_MEMORY_SHARES: dict[str, float] = {"budget_mb": 0.25, "hot_budget_mb": 0.10, "keep_float_mb": 0.10}
"""On a GPU, each memory setting's default as a share of the device's memory: 45% in all, beside the
model's weights. The CPU's 1 GiB float pool, for one, cannot hold a 3B model's 16K-token cache as
float (1.9 GB): restored ahead after a restart, it was dequantized at the turn instead (H200 run 2)."""


class ModelKernels(msgspec.Struct, frozen=True, kw_only=True):
    """Which of kvmem's own CUDA kernels a model's load kept: each is used only where its check at load held it to
    MLX's results and the model's layers take it (:func:`runtime.model.loaded.load_model`)."""

    short_attention: bool = False
    long_keys: bool = False
    small_products: bool = False


class BackendProfile(msgspec.Struct, frozen=True, kw_only=True):
    """Which device kvmem runs on and every policy that follows from it (see the module docstring).

    Attributes:
        device: MLX's default device type (``cpu`` or ``gpu``).
        backend: ``cpu``, ``metal`` or ``cuda`` (what the device is).
        policy: which policy applies (``cpu`` or ``gpu``): the device's, unless forced.
        forced: whether ``policy`` was forced by the ``profile`` setting.
        attention: ``at-rest`` or ``native``.
        attention_note: why, when it is not what was asked (a missing kernel, named).
        weights: how GGUF weights are held when ``auto`` is asked (``float32``, ``quantized``, ...).
        packed_floats: the dtype a GGUF's float tensors (norms, biases) take when its weights stay
            packed (``quantized``), and so the dtype of activations and KV: ``float32`` or ``float16``.
        budget_mb, hot_budget_mb, keep_float_mb: the memory settings of the same names, in MiB: as set,
            else the policy's defaults (:data:`CPU_MEMORY_MB`, :data:`GPU_MEMORY_SHARES`).
        float_dtype: the dtype of activations and float KV, read from the loaded model (empty before a load).
        prefill_chunks: the chunk schedule, (context below, chunk) pairs.
        numpy_attention: llama/qwen2 attention runs through NumPy (``runtime.cpu.attention``).
        numpy_kv_copy: KV rows are copied into batch buffers through NumPy views.
        shared_prefix_check: a decode batch looks for a prompt every row holds alike (host compare).
        run_ahead: a decode step is launched before the previous one's tokens are read
            (:class:`runtime.execution.decode_batch.DecodeBatch`).
        decode_run_steps: decode steps the batch may run back to back in one job on the model's
            thread when no prefill is waiting (the setting; unset: 1 on the CPU policy,
            :data:`GPU_DECODE_RUN_STEPS` on the GPU's).
        alone_on_own_caches: a row decoding alone runs on its own ``KVCache`` layers, as
            mlx-lm does, instead of a batch of one (whose mask and per-row offsets cost a GPU
            every layer of every step; on the CPU the batch path measured as fast or faster).
        plain_attention_queries: under the GPU policy, forward passes of 2 to this many query
            positions a row attend with plain MLX operations, not the fused kernel
            (:func:`runtime.cpu.attention.plain_attention`); 0: never (the CPU policy's NumPy
            attention covers such passes there); the setting, else :data:`GPU_PLAIN_ATTENTION_QUERIES`.
        short_attention_kernel: on CUDA, a decode step of rows of different lengths and a pass of 2
            to ``plain_attention_queries`` queries attend through kvmem's one kernel
            (:mod:`runtime.kv.short_attention`: causal, each row from its own first key; a pass over more
            than :data:`runtime.kv.short_attention.SHORT_PASS_KEYS` keys in its two passes, where the load's
            check holds them) instead of MLX's masked fallback and plain operations; the setting, unset on
            under the GPU policy, and only where the backend is CUDA. A model's load leaves it on only where
            the kernel passed its check there (:meth:`with_model`).
        long_keys_kernel: the short attention kernel's two passes over long keys are in use: set by a model's
            load whose check held them to MLX's attention (:meth:`with_model`), never by a policy.
        copy_after_turn: a finished turn's park is launched, not waited for, and its host copy for
            the save is made after the turn (:meth:`runtime.plan.engine.Engine.snapshot`), off the
            decode loop. On the CPU the copy is a memcpy of memory the host already holds: made at once.
        upload_by_copy: a cache read from disk reaches the device through ``mx.load``, one copy an
            array (:mod:`runtime.kv.upload`): on CUDA ``mx.array`` of host data is managed memory the
            device pages in at about 0.6 GB/s (an H200's warm 16K turn, read at the turn: 294 ms).
        fused_dequantize: a Q4 cache is dequantized by MLX's one kernel (``mx.dequantize``) instead of
            unpacked in float32 by nine plain operations an array, which the CPU runs about 8x faster
            (:func:`runtime.kv.q4_packing.dequantize_kv`; the engine puts it in the model's cache spec).
        download_by_copy: the host reads a device copy of a cache for its save, never the cache's
            own arrays: on CUDA MLX moves any buffer the host reads to managed memory for good
            (``Buffer::raw_ptr``), so a parked cache read in place would page-fault back onto the
            device at its next use (``runtime.kv.host_copy.host_readable``).
        float_slow_projections: on CUDA, a small model's quantized projections are made float at load, a
            larger one's that MLX's fast prefill kernel does not take too, and the kernels its packed ones
            use are compiled at load (:mod:`runtime.model.cuda_qmm`: MLX compiles them on the machine at
            first use, and SmolLM2-135M's first 1,000-token forward on an H200 did not end in a minute).
        fused_projections: each llama or qwen2 layer's query, key and value projections are one product and
            its MLP's gate and up projections another (:mod:`runtime.model.fused_projections`): seven products a
            layer become four, and on CUDA each product of more than one row costs the host a cuBLASLt algorithm
            lookup and a captured graph; the setting, unset on under the GPU policy.
        small_products_kernel: on CUDA, a float layer's products of 2 to 16 rows (a batch's decode step, a hot
            turn's message) go through kvmem's one kernel (:mod:`runtime.model.small_products`), not cuBLASLt,
            whose host cost a call is about 3x a one-row product's; the setting, unset on under the GPU
            policy, and only where the backend is CUDA (the load holds the kernel to MLX's product first,
            :func:`runtime.model.small_products.check`, and keeps MLX's if it fails).
        clear_cache_after_prefill: MLX's buffer cache is emptied once a prompt of several prefill chunks has
            its first token, at the engine's next step or finish (``Sequence.chunked_prefill_done``, after the
            token went out): mlx-lm's ``generate_step`` empties it after every chunk; MLX keeps freed buffers up
            to 95% of a CUDA device, and a cache growing chunk by chunk frees ever longer buffers no later
            request fits (a 3B model's 32K prompt: about 27 GB). Bounding the cache instead would free
            host-created buffers with ``cudaFree``, a device-wide wait, mid-prefill.
        kv_key_bits: the keys' own bits in a quantized KV format (:class:`runtime.spec.KVFormat`): the setting, else
            8 under the GPU policy with at-rest attention and quantized KV (keys Q8, values at ``kv_bits``) and none
            elsewhere (the keys take ``kv_bits``; float KV has no bits). Why: at-rest Q4 lost 2 of float's 75 needle hits on an H200 (run 6) where the
            CPU lost none, and on the real default model keys in Q8 cut Q4's KL to float 5.5x, at 1.44x its bytes
            (``benches/results/fidelity_real.md``); a GPU has the memory. Native attention takes one bits for both.
        tune_allocator: glibc keeps freed memory and one arena (``runtime.allocator``).
        prewarm_mb: memory touched at the first model load (0: none).
        openblas: the OpenBLAS library loaded at import (None: MLX's own BLAS).
    """

    device: str
    backend: str
    policy: Policy
    forced: bool = False
    attention: Literal["at-rest", "native"]
    attention_note: str | None = None
    weights: str
    weights_fit_mb: float | None = None
    packed_floats: str = "float32"
    budget_mb: float = CPU_MEMORY_MB["budget_mb"]
    hot_budget_mb: float = CPU_MEMORY_MB["hot_budget_mb"]
    keep_float_mb: float = CPU_MEMORY_MB["keep_float_mb"]
    float_dtype: str = ""
    prefill_chunks: tuple[tuple[int, int], ...]
    numpy_attention: bool
    numpy_kv_copy: bool
    shared_prefix_check: bool
    run_ahead: bool = False
    decode_run_steps: int = 1
    alone_on_own_caches: bool = False
    plain_attention_queries: int = 0
    short_attention_kernel: bool = False
    long_keys_kernel: bool = False
    copy_after_turn: bool = False
    upload_by_copy: bool = False
    download_by_copy: bool = False
    fused_dequantize: bool = False
    float_slow_projections: bool = False
    fused_projections: bool = False
    small_products_kernel: bool = False
    clear_cache_after_prefill: bool = False
    kv_key_bits: int | None = None
    tune_allocator: bool
    prewarm_mb: float
    openblas: str | None = None

    def chunk_for(self, context: int) -> int:
        """The prefill chunk for a sequence already holding ``context`` tokens."""
        for below, chunk in self.prefill_chunks:
            if context < below:
                return chunk
        return self.prefill_chunks[-1][1]

    def with_model(self, *, attention: Literal["at-rest", "native"], note: str | None, float_dtype: str,
                   kernels: ModelKernels | None = None, weights: str | None = None) -> BackendProfile:
        """This profile as a model load settled it: the attention its kernels allow, its float dtype, which of
        kvmem's own kernels it kept (``kernels``; a load drops one whose check fails, or that its model's layers do
        not take) and how its weights are held (``weights``: ``quantized`` where float32 would not fit), so that
        the line, the log and ``/healthz`` say what runs, not what was asked."""
        kept: dict[str, Any] = {} if kernels is None else {
            "short_attention_kernel": self.short_attention_kernel and kernels.short_attention,
            "long_keys_kernel": self.short_attention_kernel and kernels.short_attention and kernels.long_keys,
            "small_products_kernel": self.small_products_kernel and kernels.small_products}
        if weights is not None:
            kept["weights"] = weights
        return msgspec.structs.replace(self, attention=attention, attention_note=note, float_dtype=float_dtype, **kept)

    def line(self) -> str:
        """One line for the log: ``backend cuda (gpu policy); attention native; weights quantized; ...``."""
        chunks = "/".join(str(c) for _, c in self.prefill_chunks)
        plain = f"; plain attention up to {self.plain_attention_queries} queries" if self.plain_attention_queries else ""
        plain += "; short attention kernel" if self.short_attention_kernel else ""
        plain += " (two passes over long keys)" if self.long_keys_kernel else ""
        fused = "; projections fused" if self.fused_projections else ""
        fused += "; small products in kvmem's kernel" if self.small_products_kernel else ""
        host = [name for name, on in (("numpy-attention", self.numpy_attention), ("numpy-kv-copy", self.numpy_kv_copy),
                                      ("shared-prefix-check", self.shared_prefix_check),
                                      ("allocator", self.tune_allocator)) if on]
        parts = [
            f"backend {self.backend} ({self.policy} policy{', forced' if self.forced else ''})",
            f"attention {self.attention}" + (f" ({self.attention_note})" if self.attention_note else "") + plain,
            f"weights {self.weights}{fused}",
            f"float {self.float_dtype or '?'}",
            f"prefill chunk {chunks}",
            f"decode {'one step ahead' if self.run_ahead else 'in lockstep'}"
            + (f", runs of {self.decode_run_steps}" if self.decode_run_steps > 1 else ""),
            f"save copy {'after the turn' if self.copy_after_turn else 'at the turn end'}"
            + (", from a device copy" if self.download_by_copy else ""),
            f"disk to device {'by mx.load' if self.upload_by_copy else 'in place'}",
            f"dequantize {'fused' if self.fused_dequantize else 'unpacked'}"
            + (f"; kv keys in {self.kv_key_bits} bits" if self.kv_key_bits else "")
            + ("; MLX's cache emptied after a long prompt" if self.clear_cache_after_prefill else ""),
            f"host paths {', '.join(host) if host else 'none'}",
            f"memory KV {self.budget_mb:.0f} / hot {self.hot_budget_mb:.0f} / float {self.keep_float_mb:.0f} MB",
            f"prewarm {self.prewarm_mb:g} MB",
            f"openblas {'yes' if self.openblas else 'no'}",
        ]
        return "; ".join(parts)


def decide_profile(
    *,
    device: str,
    backend: str,
    profile: str = "auto",
    attention: str = "auto",
    weights: str = "auto",
    numpy_attention: bool = True,
    plain_attention_queries: int | None = None,
    short_attention_kernel: bool | None = None,
    fused_projections: bool | None = None,
    small_products_kernel: bool | None = None,
    kv_key_bits: int | None = None,
    kv_bits: int | None = 4,
    prewarm_mb: float = 0.0,
    prefill_chunk: int | None = None,
    decode_run_steps: int | None = None,
    budget_mb: float | None = None,
    hot_budget_mb: float | None = None,
    keep_float_mb: float | None = None,
    device_memory_mb: float | None = None,
    openblas: str | None = None,
) -> BackendProfile:
    """The profile for ``device`` and the settings (attention not yet checked against a model).

    Args:
        device: MLX's default device type (``cpu``/``gpu``).
        backend: ``cpu``, ``metal`` or ``cuda``.
        profile: ``auto`` (the device's policy), ``cpu`` or ``gpu`` (forced).
        attention, weights, numpy_attention, plain_attention_queries, short_attention_kernel, fused_projections,
            small_products_kernel, kv_key_bits, kv_bits, prewarm_mb,
            prefill_chunk, decode_run_steps: the settings of the same names;
            an explicit value wins over the policy's default (None: the policy's).
        budget_mb, hot_budget_mb, keep_float_mb: the memory settings; None: the policy's default.
        device_memory_mb: the device's memory (None: unknown), which the GPU policy's defaults share out.
        openblas: the OpenBLAS library loaded, if any (reported).

    Raises:
        ValueError: an unknown ``profile`` or ``attention``.
    """
    if profile not in ("auto", "cpu", "gpu"):
        raise ValueError(f"profile must be 'auto', 'cpu' or 'gpu', got {profile!r}")
    if attention not in ("auto", "at-rest", "native"):
        raise ValueError(f"attention must be 'auto', 'at-rest' or 'native', got {attention!r}")
    policy: Policy = ("cpu" if device == "cpu" else "gpu") if profile == "auto" else profile  # type: ignore[assignment]
    cpu = policy == "cpu"
    chunks = ((2**62, prefill_chunk),) if prefill_chunk else CPU_CHUNKS if cpu else ((2**62, GPU_CHUNK),)
    numpy_paths = cpu and numpy_attention
    asked = {"budget_mb": budget_mb, "hot_budget_mb": hot_budget_mb, "keep_float_mb": keep_float_mb}
    memory = {
        name: value if value is not None
        else CPU_MEMORY_MB[name] if cpu or not device_memory_mb
        else round(GPU_MEMORY_SHARES[name] * device_memory_mb)
        for name, value in asked.items()
    }
    return BackendProfile(
        device=device,
        backend=backend,
        policy=policy,
        forced=profile != "auto",
        # Fidelity decides, on every device: native Q4 quantizes each token as it arrives and lost
        # needles float keeps (11 of 20 at 8K where float found 15); at-rest attends in float.
        attention="at-rest" if attention == "auto" else attention,  # type: ignore[arg-type]
        weights=("float32" if cpu else "quantized") if weights == "auto" else weights,
        # float32 only where it fits: a GGUF whose float32 weights would pass this keeps its packed ones
        weights_fit_mb=_weights_fit_mb() if cpu and weights == "auto" else None,
        packed_floats="float32" if cpu else "float16",
        **memory,
        prefill_chunks=chunks,
        numpy_attention=numpy_paths,
        numpy_kv_copy=cpu,
        shared_prefix_check=numpy_paths,  # its only reader is the NumPy decode attention
        run_ahead=not cpu,
        decode_run_steps=decode_run_steps or (1 if cpu else GPU_DECODE_RUN_STEPS),
        alone_on_own_caches=not cpu,
        plain_attention_queries=0 if cpu else GPU_PLAIN_ATTENTION_QUERIES if plain_attention_queries is None
        else plain_attention_queries,
        short_attention_kernel=(not cpu if short_attention_kernel is None else short_attention_kernel)
        and backend == "cuda",
        copy_after_turn=not cpu,
        upload_by_copy=not cpu,
        download_by_copy=not cpu,
        fused_dequantize=not cpu,
        float_slow_projections=backend == "cuda",
        fused_projections=not cpu if fused_projections is None else fused_projections,
        small_products_kernel=(not cpu if small_products_kernel is None else small_products_kernel)
        and backend == "cuda",
        clear_cache_after_prefill=not cpu,
        kv_key_bits=kv_key_bits if kv_key_bits is not None
        else None if cpu or attention == "native" or kv_bits is None else GPU_KV_KEY_BITS,
        tune_allocator=cpu,
        prewarm_mb=prewarm_mb if cpu else 0.0,
        openblas=openblas,
    )


def detect_device() -> tuple[str, str]:
    """MLX's default device type (``cpu``/``gpu``) and what it is (``cpu``, ``metal``, ``cuda``).

    The one place kvmem asks MLX which device it runs on (imported here, when asked,
    so this module stays importable where MLX must not be loaded).
    """
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu", "cpu"
    if mx.metal.is_available():
        return "gpu", "metal"
    cuda = getattr(mx, "cuda", None)
    return "gpu", "cuda" if cuda is not None and cuda.is_available() else "gpu"


def cuda_kernels_run() -> bool:
    """Whether this process runs MLX's CUDA backend and can build custom CUDA kernels there (``mx.fast.cuda_kernel``:
    kvmem's attention and small products kernels, built at their first call)."""
    import mlx.core as mx

    return detect_device()[1] == "cuda" and hasattr(mx.fast, "cuda_kernel")


def cuda_kernel_tolerance(dtype: Any) -> float:
    """How far a kvmem CUDA kernel's result in ``dtype`` may be from MLX's at a model's load (its ``check``): the
    output's own rounding, relative to values near 1."""
    import mlx.core as mx

    return {mx.float32: 1e-4, mx.bfloat16: 2e-2, mx.float16: 2e-3}.get(dtype, 1e-4)


def detect_device_memory_mb() -> float | None:
    """The device's memory in MiB: CUDA's total, Metal's recommended working set; None on a CPU (or not reported)."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return None
    info = mx.device_info()
    size = info.get("max_recommended_working_set_size") or info.get("total_memory")
    return float(size) / 2**20 if isinstance(size, int | float) and size > 0 else None


WEIGHTS_MEMORY_SHARE = 0.5
"""Under the CPU policy, GGUF weights are made float32 only when that takes at most this share of the
machine's memory (the rest for the KV budgets, activations, the OS and other processes); a larger model
keeps the file's packed weights, which MLX's CPU backend multiplies about 3x slower but which load at all:
a 7B Q4 GGUF is ~4 GB packed and ~28 GB float32."""


def physical_memory_mb() -> float | None:
    """This machine's memory in MiB (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (OSError, ValueError, AttributeError):
        return None


def _weights_fit_mb() -> float | None:
    total = physical_memory_mb()
    return None if total is None else total * WEIGHTS_MEMORY_SHARE


def device_profile(**settings: object) -> BackendProfile:
    """:func:`decide_profile` for this process's device, with the OpenBLAS it loaded (``settings``: its arguments)."""
    from runtime.blas import openblas_path

    device, backend = detect_device()
    return decide_profile(device=device, backend=backend, openblas=openblas_path(),  # type: ignore[arg-type]
                          device_memory_mb=detect_device_memory_mb(), **settings)


_WITHOUT_PROFILE: dict[str, float] = {**CPU_MEMORY_MB, "decode_run_steps": 1}
"""The CPU policy's values of the settings the profile defaults, for an engine that has no profile."""


def profile_setting(setting: str, value: float | None, profile: BackendProfile | None) -> float:
    """A setting the backend profile defaults (the memory budgets in MiB, ``decode_run_steps``):
    ``value`` where set, else ``profile``'s, else the CPU policy's (an engine without a profile)."""
    if value is not None:
        return value
    return float(getattr(profile, setting)) if profile is not None else _WITHOUT_PROFILE[setting]
