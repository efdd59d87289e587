"""One backend profile, decided once (issue 33, items 1 and 2's check), tested on the CPU.

The policy table is pure code (:func:`runtime.backend.decide_profile`); the GPU policy is then
forced on the CPU device (``profile="gpu"``), so the paths a GPU takes run here: at-rest
attention by default (fidelity decides it on every device), native Q4 only after its load check,
2048-token chunks, and none of the CPU's host paths.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import models_dir, skip_without_native_attention

from runtime.backend import (
    CPU_CHUNKS,
    GPU_CHUNK,
    GPU_DECODE_RUN_STEPS,
    GPU_KV_KEY_BITS,
    GPU_PLAIN_ATTENTION_QUERIES,
    ModelKernels,
    decide_profile,
    detect_device,
    device_profile,
    profile_setting,
)
from runtime.execution.sequence import prefill_chunk_size

# -- the policy, as a value ----------------------------------------------------------


def test_the_cpu_device_gets_the_cpu_policy() -> None:
    p = decide_profile(device="cpu", backend="cpu", prewarm_mb=512)
    assert (p.policy, p.forced, p.attention, p.weights, p.packed_floats) == ("cpu", False, "at-rest", "float32", "float32")
    assert p.numpy_attention and p.numpy_kv_copy and p.shared_prefix_check and p.tune_allocator
    assert p.prewarm_mb == 512 and p.prefill_chunks == CPU_CHUNKS
    assert p.decode_run_steps == 1 and not p.run_ahead
    assert p.plain_attention_queries == 0  # NumPy attention covers short passes there


def test_a_gpu_gets_the_gpu_policy_with_no_host_paths() -> None:
    p = decide_profile(device="gpu", backend="cuda", prewarm_mb=512)
    assert (p.policy, p.attention, p.weights, p.packed_floats) == ("gpu", "at-rest", "quantized", "float16")
    assert not (p.numpy_attention or p.numpy_kv_copy or p.shared_prefix_check or p.tune_allocator)
    assert p.prewarm_mb == 0 and p.chunk_for(0) == p.chunk_for(100_000) == GPU_CHUNK
    assert p.decode_run_steps == GPU_DECODE_RUN_STEPS > 1 and p.run_ahead
    assert p.plain_attention_queries == GPU_PLAIN_ATTENTION_QUERIES > 1
    assert p.kv_key_bits == GPU_KV_KEY_BITS == 8  # keys in Q8 at rest (needles Q4 lost on an H200)


def test_keys_take_their_own_bits_under_the_gpu_policys_at_rest_attention_only_unless_set() -> None:
    """The GPU policy keeps keys in Q8 (values at ``kv_bits``) where it attends at rest; native attention takes one
    bits for keys and values, and the CPU policy (Q4 at rest lost no needle float found there) keeps ``kv_bits``."""
    assert decide_profile(device="cpu", backend="cpu").kv_key_bits is None
    assert decide_profile(device="gpu", backend="cuda", attention="native").kv_key_bits is None
    assert decide_profile(device="gpu", backend="metal").kv_key_bits == 8
    assert decide_profile(device="gpu", backend="cuda", kv_key_bits=4).kv_key_bits == 4
    assert decide_profile(device="cpu", backend="cpu", kv_key_bits=8).kv_key_bits == 8
    assert decide_profile(device="gpu", backend="cuda", kv_bits=None).kv_key_bits is None  # float KV has no bits
    assert "kv keys in 8 bits" in decide_profile(device="gpu", backend="cuda").line()
    assert "kv keys" not in decide_profile(device="cpu", backend="cpu").line()
    engine = _engine(profile="gpu")
    assert engine._kv_format.label == "k8v4g64" and _engine(profile="cpu")._kv_format.label == "q4g64"
    assert _engine(profile="gpu", kv_bits=None)._kv_format.label == "float"  # float KV has no key bits
    assert _engine(profile="gpu", kv_bits=8)._kv_format.label == "q8g64"  # keys at 8 bits are Q8's own
    assert _engine(profile="gpu", attention="native")._kv_format.label == "q4g64"  # native: one bits for both


def test_the_policy_can_be_forced_either_way_and_explicit_settings_win() -> None:
    forced = decide_profile(device="cpu", backend="cpu", profile="gpu")
    assert (forced.policy, forced.forced, forced.attention, forced.numpy_kv_copy) == ("gpu", True, "at-rest", False)
    assert decide_profile(device="gpu", backend="metal", profile="cpu").numpy_attention
    explicit = decide_profile(device="gpu", backend="cuda", attention="at-rest", weights="bfloat16",
                              prefill_chunk=1024)
    assert (explicit.attention, explicit.weights, explicit.chunk_for(50_000)) == ("at-rest", "bfloat16", 1024)
    assert decide_profile(device="gpu", backend="cuda", decode_run_steps=1).decode_run_steps == 1
    assert decide_profile(device="cpu", backend="cpu", decode_run_steps=8).decode_run_steps == 8
    assert decide_profile(device="gpu", backend="cuda", plain_attention_queries=0).plain_attention_queries == 0
    assert decide_profile(device="gpu", backend="cuda", plain_attention_queries=16).plain_attention_queries == 16
    assert decide_profile(device="cpu", backend="cpu", plain_attention_queries=16).plain_attention_queries == 0
    gpu = decide_profile(device="gpu", backend="cuda")
    assert profile_setting("decode_run_steps", None, gpu) == GPU_DECODE_RUN_STEPS
    assert profile_setting("decode_run_steps", 4, gpu) == 4
    assert profile_setting("decode_run_steps", None, None) == 1  # an engine without a profile: the CPU's
    assert not decide_profile(device="cpu", backend="cpu", numpy_attention=False).shared_prefix_check
    with pytest.raises(ValueError, match="profile"):
        decide_profile(device="cpu", backend="cpu", profile="tpu")


def test_the_cpu_schedule_is_the_one_sequences_use_alone() -> None:
    cpu = decide_profile(device="cpu", backend="cpu")
    for context in (0, 1023, 1024, 4095, 4096, 10**6):
        assert cpu.chunk_for(context) == prefill_chunk_size(context)
    assert [cpu.chunk_for(c) for c in (0, 1024, 4096)] == [512, 256, 128]


def test_the_profile_line_names_every_decision() -> None:
    line = decide_profile(device="cpu", backend="cpu", profile="gpu").line()
    for part in ("backend cpu (gpu policy, forced)", "attention at-rest", "weights quantized", "prefill chunk 2048",
                 f"decode one step ahead, runs of {GPU_DECODE_RUN_STEPS}", "host paths none",
                 "save copy after the turn, from a device copy", "disk to device by mx.load", "dequantize fused"):
        assert part in line
    cpu = decide_profile(device="cpu", backend="cpu").line()
    for part in ("save copy at the turn end;", "disk to device in place", "dequantize unpacked"):
        assert part in cpu


def test_a_load_leaves_on_only_the_kernels_it_kept_and_the_line_says_so() -> None:
    """A kernel whose check at load failed, or that the model's layers do not take, is off in the profile the log
    and ``/healthz`` show; one the setting turned off stays off whatever the load kept."""
    asked = decide_profile(device="gpu", backend="cuda")
    assert asked.short_attention_kernel and asked.small_products_kernel and not asked.long_keys_kernel

    def loaded(profile: Any, **kept: bool) -> Any:
        return profile.with_model(attention="at-rest", note=None, float_dtype="bfloat16", kernels=ModelKernels(**kept))

    every = loaded(asked, short_attention=True, long_keys=True, small_products=True)
    assert every.short_attention_kernel and every.long_keys_kernel and every.small_products_kernel
    assert "short attention kernel (two passes over long keys)" in every.line()
    assert "small products in kvmem's kernel" in every.line()
    one_pass = loaded(asked, short_attention=True, small_products=True)
    assert "short attention kernel;" in one_pass.line() and "two passes" not in one_pass.line()
    none = loaded(asked)
    assert not (none.short_attention_kernel or none.long_keys_kernel or none.small_products_kernel)
    assert "short attention kernel" not in none.line() and "small products" not in none.line()
    assert not loaded(asked, long_keys=True).long_keys_kernel  # two passes only with the one
    off = decide_profile(device="gpu", backend="cuda", short_attention_kernel=False, small_products_kernel=False)
    assert not loaded(off, short_attention=True, long_keys=True, small_products=True).long_keys_kernel
    # a profile settled without word of the kernels keeps what it asked
    assert asked.with_model(attention="at-rest", note=None, float_dtype="bfloat16").small_products_kernel


# -- the GPU policy, forced on the CPU device ----------------------------------------


def _engine(**settings: Any) -> Any:
    from runtime.execution.mlx_engine import MlxEngine

    return MlxEngine(models_dir=models_dir(), kv_group_size=64, **{"kv_bits": 4, "attention": "auto", **settings})


def test_the_engines_profile_after_a_load_names_the_kernels_the_load_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    import msgspec

    from runtime.execution import mlx_engine

    real = mlx_engine.load_model

    def checked(*args: Any, **kwargs: Any) -> Any:  # as a CUDA load whose two-pass and products checks failed
        lm = real(*args, **kwargs)
        lm.short_attention_kernel, lm.long_keys_kernel, lm.small_products_kernel = True, False, False
        return lm

    monkeypatch.setattr(mlx_engine, "load_model", checked)
    engine = _engine(profile="gpu")
    engine._profile = msgspec.structs.replace(engine.profile, short_attention_kernel=True, small_products_kernel=True)
    try:
        engine.load("tiny-llama")
        assert engine.profile.short_attention_kernel and not engine.profile.long_keys_kernel
        assert not engine.profile.small_products_kernel  # asked, not kept
        assert "short attention kernel;" in engine.profile.line() and "small products" not in engine.profile.line()
    finally:
        engine.unload()


def test_the_gpu_policy_on_the_cpu_runs_native_attention_when_asked_without_host_paths() -> None:
    from runtime.cpu import kv_copy

    default = _engine(profile="gpu")
    try:
        assert default.load("tiny-llama").profile.attention == "at-rest"  # auto: fidelity decides
    finally:
        default.unload()
    skip_without_native_attention()
    engine = _engine(profile="gpu", attention="native")
    try:
        info = engine.load("tiny-llama")
        assert info.profile is not None and info.profile == engine.profile
        assert (info.profile.attention, info.profile.attention_note) == ("native", None)  # its kernels ran
        assert info.profile.float_dtype == "float32"
        assert not engine.lm.numpy_attention  # NumPy attention not installed
        assert not kv_copy._host_views and not engine._batch.shared_prefix_check
    finally:
        engine.unload()
        kv_copy.use_host_views(None)
    cpu = _engine(profile="cpu")  # the CPU policy (forced, so this holds on a GPU machine too)
    try:
        profile = cpu.load("tiny-llama").profile
        assert profile is not None and profile.attention == "at-rest" and cpu.lm.numpy_attention
        assert kv_copy._host_views and cpu._batch.shared_prefix_check
    finally:
        cpu.unload()


async def test_a_backend_without_the_native_kernels_starts_at_rest_with_one_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from actors import open_runtime
    from runtime.kv import q4_cache

    missing = ("[quantized_matmul] No implementation for problem shape: 281x281x64x32, transpose: true, "
               "activation: float32, bits: 4, group size: 64, mode: \"affine\"")

    def no_kernel(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(missing)

    monkeypatch.setattr(q4_cache.QuantizedKVCache, "update_and_fetch", no_kernel)
    with caplog.at_level(logging.WARNING, logger="kvmem.kvstate"):
        async with open_runtime(home=tmp_path, models_dir=models_dir(), model="tiny-llama", prewarm_mb=0,
                                profile="gpu", attention="native") as rt:
            profile = rt.stats().registry.profile
            result = await rt.agent("a").send([{"role": "user", "content": "Hello there"}], max_tokens=4)
    assert profile is not None and (profile.policy, profile.attention) == ("gpu", "at-rest")
    assert profile.attention_note is not None and "quantized_matmul" in profile.attention_note
    assert len([r for r in caplog.records if "quantized_matmul" in r.getMessage()]) == 1  # said once, named
    assert result.usage.tokens_generated > 0  # it serves, at rest, instead of failing to start
    from runtime.cpu import kv_copy

    kv_copy.use_host_views(None)


async def test_healthz_shows_the_profile(tmp_path: Path) -> None:
    from actors import open_runtime
    from gateway.app import create_app
    from runtime.config import Config

    config = Config(home=str(tmp_path), models_dir=str(models_dir()), model="tiny-llama", prewarm_mb=0,
                    profile="gpu")
    async with open_runtime(config) as rt:
        app = create_app(rt, config)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvmem") as http:
            body = (await http.get("/healthz")).json()
    profile = body["profile"]
    assert (profile["policy"], profile["forced"], profile["attention"], profile["backend"]) == \
        ("gpu", True, "at-rest", detect_device()[1])
    assert profile["prefill_chunks"] == [[2**62, GPU_CHUNK]] and profile["numpy_attention"] is False
    from runtime.cpu import kv_copy

    kv_copy.use_host_views(None)


def test_a_bfloat16_model_keeps_bfloat16_activations_and_kv_under_the_gpu_policy(tmp_path: Path) -> None:
    """Never float32 by accident, and never float16 either: the float KV a Q4 cache is
    dequantized into, the float kept after a turn and a restored cache are the model's dtype."""
    import mlx.core as mx
    from gguf_writer import write_gguf
    from mlx.utils import tree_flatten

    from runtime.cpu import kv_copy

    from runtime.model import tiny_models
    from runtime.plan.sampling import SamplingOptions
    from runtime.plan.turn_plan import ColdStart, TurnPlan
    from runtime.kv.kvstate import ActiveKV, ParkedCache

    gguf = write_gguf(tiny_models.ensure_tiny_model("tiny-llama", models_dir()), tmp_path / "tiny.gguf")
    # keys in Q4 like the values, so the restored cache can attend natively too (one bits for both)
    engine = _engine(profile="gpu", weights="bfloat16", kv_key_bits=4)
    try:
        info = engine.load(str(gguf))
        assert info.profile is not None and info.profile.float_dtype == "bfloat16"
        prompt = "Tell me about the sea. " * 20
        plan = TurnPlan(tier="cold", source=ColdStart(), match="empty", reuse_tokens=0, reuse_chars=0)
        engine.start(1, prompt, plan, engine.tokenize(prompt, plan), SamplingOptions(max_tokens=3))
        while not (result := engine.prefill(1, None)).remaining == 0:
            pass
        if not result.finished:
            engine.join(1)
            while not any(t.finished for t in engine.step()):
                pass
        finished = engine.finish(1)
        parked = finished.parked
        assert isinstance(parked, ParkedCache) and finished.snapshot is None  # the GPU policy copies later
        snapshot = engine.snapshot(parked)
        layer = engine.lm.spec.layers[0]
        token_k = mx.zeros((1, layer.kv_heads, 1, layer.k_head_dim), dtype=mx.bfloat16)
        token_v = mx.zeros((1, layer.kv_heads, 1, layer.v_head_dim), dtype=mx.bfloat16)
        for attention in ("at-rest", "native"):
            for cache in ActiveKV(ParkedCache.from_snapshot(snapshot, float_dtype=engine.lm.float_dtype),
                                  engine.lm.spec, attention).caches:
                # What attention sees of the restored cache plus one new token: the model's dtype only
                # (native Q4 keeps float16 scales on disk; attention gets them as bfloat16).
                seen = [a for _, a in tree_flatten(cache.update_and_fetch(token_k, token_v))
                        if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating)]
                assert seen and all(a.dtype == mx.bfloat16 for a in seen), (attention, [a.dtype for a in seen])
    finally:
        engine.unload()
        kv_copy.use_host_views(None)


@pytest.mark.parametrize(("profile", "float_dtype"), [("gpu", "float16"), ("cpu", "float32")])
def test_a_packed_gguf_computes_in_float16_under_the_gpu_policy(tmp_path: Path, profile: str, float_dtype: str) -> None:
    """llama.cpp stores a GGUF's norms in float32, and activations follow the norms: a packed
    GGUF computed in float32 on a GPU (twice the activation and KV memory, and no CUDA kernel
    for a float32 quantized matmul). The GPU policy gives its float tensors the blocks' float16;
    the CPU policy, where MLX's quantized matmul is several times slower in float16, keeps float32."""
    from gguf_writer import write_gguf, write_quantized_gguf

    from runtime.cpu import kv_copy
    from runtime.model import tiny_models

    floats = write_gguf(tiny_models.ensure_tiny_model("tiny-llama", models_dir()), tmp_path / "tiny.gguf")
    write_quantized_gguf(floats, tmp_path / "q4.gguf", "Q4_0")
    engine = _engine(profile=profile, weights="quantized")
    try:
        info = engine.load(str(tmp_path / "q4.gguf"))
        assert info.profile is not None and (info.profile.weights, info.profile.float_dtype) == ("quantized", float_dtype)
        assert f"float {float_dtype}" in info.profile.line()
        assert engine.lm.spec.float_dtype == float_dtype  # the KV a turn writes
    finally:
        engine.unload()
        kv_copy.use_host_views(None)


def test_a_gguf_too_large_for_float32_on_this_machine_keeps_its_packed_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 58, item 6: under the CPU policy ``weights=auto`` makes a GGUF float32, which for a 7B Q4 file
    would take ~28 GB of this machine's 24. A model whose float32 weights pass the share of memory left for
    them (:data:`runtime.backend.WEIGHTS_MEMORY_SHARE`) keeps the file's packed weights, says so in one
    line, and runs; one that fits is still made float32. The machine's memory is set small for the test."""
    import mlx.core as mx
    from gguf_writer import write_gguf, write_quantized_gguf
    from mlx.utils import tree_flatten

    import runtime.backend

    from runtime.cpu import kv_copy
    from runtime.model import tiny_models

    floats = write_gguf(tiny_models.ensure_tiny_model("tiny-llama", models_dir()), tmp_path / "tiny.gguf")
    write_quantized_gguf(floats, tmp_path / "q4.gguf", "Q4_0")
    unpacked_mb = floats.stat().st_size / 2**20  # the float32 file: about what its weights take unpacked
    for memory_mb, kept in ((unpacked_mb / 2 / runtime.backend.WEIGHTS_MEMORY_SHARE, "quantized"),
                            (unpacked_mb * 4 / runtime.backend.WEIGHTS_MEMORY_SHARE, "float32")):
        monkeypatch.setattr(runtime.backend, "physical_memory_mb", lambda mb=memory_mb: mb)
        caplog.clear()
        engine = _engine(profile="cpu", weights="auto")
        try:
            assert engine.profile.weights == "float32" and engine.profile.weights_fit_mb is not None
            with caplog.at_level(logging.WARNING, logger="kvmem.gguf"):
                info = engine.load(str(tmp_path / "q4.gguf"))
            assert info.profile is not None and info.profile.weights == kept, info.profile
            assert f"weights {kept}" in info.profile.line()
            warned = [r for r in caplog.records if "kept packed" in r.getMessage()]
            assert len(warned) == (kept == "quantized"), caplog.text
            packed = any(str(a.dtype) == "mlx.core.uint32" for _, a in tree_flatten(engine.lm.model.parameters()))
            assert packed == (kept == "quantized")
            logits = engine.lm.model(mx.array([[1, 2, 3, 4]]))  # it runs
            assert logits.shape[-1] > 0 and bool(mx.all(mx.isfinite(logits)))
        finally:
            engine.unload()
            kv_copy.use_host_views(None)
    explicit = _engine(profile="cpu", weights="float32")  # asked for by name: no bound
    assert explicit.profile.weights_fit_mb is None


def test_unset_memory_settings_are_shares_of_a_gpus_memory_and_fixed_on_a_cpu() -> None:
    """The CPU's budgets (2 GiB of running KV, a 1 GiB float pool) starve a GPU: a 3B model's 16K
    cache is 1.9 GB as float, so the float pool could not keep a restored agent's cache."""
    from runtime.backend import CPU_MEMORY_MB

    gpu = decide_profile(device="gpu", backend="cuda", device_memory_mb=80_000)
    assert (gpu.budget_mb, gpu.hot_budget_mb, gpu.keep_float_mb) == (20_000, 8_000, 8_000)
    assert "memory KV 20000 / hot 8000 / float 8000 MB" in gpu.line()
    cpu = decide_profile(device="cpu", backend="cpu", device_memory_mb=80_000)
    assert (cpu.budget_mb, cpu.hot_budget_mb, cpu.keep_float_mb) == (2048, 512, 1024) == tuple(CPU_MEMORY_MB.values())
    forced = decide_profile(device="cpu", backend="cpu", profile="gpu")  # no device memory to share out
    assert (forced.budget_mb, forced.keep_float_mb) == (2048, 1024)
    explicit = decide_profile(device="gpu", backend="cuda", device_memory_mb=80_000, budget_mb=300, keep_float_mb=0)
    assert (explicit.budget_mb, explicit.hot_budget_mb, explicit.keep_float_mb) == (300, 8_000, 0)
    assert profile_setting("budget_mb", None, gpu) == 20_000 and profile_setting("budget_mb", 64, gpu) == 64
    assert profile_setting("hot_budget_mb", None, None) == 512  # an engine without a profile: the CPU's



def test_the_engines_profile_reports_the_memory_settings_it_was_given() -> None:
    from runtime.config import Config
    from runtime.execution.mlx_engine import MlxEngine

    engine = MlxEngine.from_config(Config(home=str(models_dir().parent), budget_mb=300, keep_float_mb=0))
    hot = device_profile().hot_budget_mb  # left unset: this device's default (512 on a CPU, sized on a GPU)
    assert (engine.profile.budget_mb, engine.profile.hot_budget_mb, engine.profile.keep_float_mb) == (300, hot, 0)
    assert f"memory KV 300 / hot {hot:.0f} / float 0 MB" in engine.profile.line()


async def test_a_runtime_sizes_its_unset_budgets_from_the_engines_profile(tmp_path: Path) -> None:
    from fake_engine import FakeEngine

    from actors import open_runtime

    engine = FakeEngine()
    engine.profile = decide_profile(device="gpu", backend="cuda", device_memory_mb=8_000)  # type: ignore[misc]
    async with open_runtime(model="fake-a", home=tmp_path, engine=engine, fsync=False, handle_signals=False) as rt:
        await rt.agent("a").send([{"role": "user", "content": "hello"}], max_tokens=2)
        assert rt.stats().gpu.pool.budget_bytes == 2_000 * 2**20
    async with open_runtime(model="fake-a", home=tmp_path, engine=engine, fsync=False, handle_signals=False,
                            budget_mb=64) as rt:
        await rt.agent("a").send([{"role": "user", "content": "hello again"}], max_tokens=2)
        assert rt.stats().gpu.pool.budget_bytes == 64 * 2**20
