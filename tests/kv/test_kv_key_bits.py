"""Keys at their own bits (``kv_key_bits``): a runtime saves, restores and serves them as a format of its own.

The numbers are held elsewhere: tests/kv/test_cache_correctness.py holds keys in Q8 with values in Q4 closer
to the cold float run than Q4 on every tiny architecture, and a warm cache read from disk bitwise its hot
self; tests/model/test_spec.py holds the format's label and bytes. Here, through the actors: the keys are stored
at 8 bits and the values at 4, a restart reuses them, and a runtime of another format never reads them.
"""

from __future__ import annotations

from pathlib import Path

import trio  # noqa: F401  (pytest-trio runs the async tests)

from actors import open_runtime
from conftest import models_dir
from runtime.config import Config
from runtime.persist import CacheDirectory

MODEL = "tiny-llama"
ASK = [{"role": "user", "content": "Tell me about the harbour, its ships and the lighthouse keeper. " * 6}]
MORE = [{"role": "user", "content": "And what did the keeper write in his book?"}]


def _open(home: Path, **fmt: int | None):
    return open_runtime(home=home, models_dir=models_dir(), model=MODEL, prewarm_mb=0, fsync=False, **fmt)


async def test_keys_in_q8_are_saved_restored_and_kept_apart_from_q4(tmp_path: Path) -> None:
    async with _open(tmp_path, kv_key_bits=8) as rt:
        first = await rt.agent("a").send(ASK, max_tokens=6)
        assert first.usage.tier == "cold"
        await rt.flush()
    chat = [*ASK, {"role": "assistant", "content": first.reply}, *MORE]
    async with _open(tmp_path, kv_key_bits=8) as rt:  # a restart: the cache comes back from disk
        warm = await rt.agent("a").send(chat, max_tokens=6)
    assert warm.usage.tier == "warm" and warm.usage.tokens_reused > 0, warm.usage
    # on disk: the keys packed at 8 bits (64 dimensions in 16 words), the values at 4 (in 8)
    saved = CacheDirectory(Config(home=str(tmp_path)).caches_path)
    (tag,) = {entry.model_tag for entry in saved.list_agents() if entry.agent_id == "a"}
    assert tag.endswith("/k8v4g64"), tag
    layer = next(layer for layer in saved.load("a", model_tag=tag).layers if "k_w" in layer.arrays)
    assert layer.arrays["k_w"].shape[-1] == 16 and layer.arrays["v_w"].shape[-1] == 8
    async with _open(tmp_path, kv_key_bits=4) as rt:  # the same home, keys in Q4: the Q8 keys' cache is not its
        other = await rt.agent("a").send(chat, max_tokens=6)
    assert other.usage.tier == "cold" and other.usage.tokens_reused == 0, other.usage


def test_native_attention_with_keys_at_their_own_bits_attends_at_rest_and_says_why() -> None:
    """MLX's quantized attention takes one bits for keys and values: asked for ``native``, such a format gets
    at-rest and a note in the profile (the line ``kvmem serve`` logs and ``/healthz`` shows), never a failed load."""
    from runtime.execution.mlx_engine import MlxEngine

    engine = MlxEngine(models_dir=models_dir(), kv_bits=4, kv_group_size=64, kv_key_bits=8, attention="native")
    engine.load(MODEL)
    try:
        assert engine.profile.attention == "at-rest"
        assert "k8v4g64" in engine.profile.line(), engine.profile.line()
    finally:
        engine.unload()
