"""One configuration: ``runtime.config.Config`` from flags > KVMEM_* environment > TOML > defaults, validated once.

The same loader serves ``kvmem serve``, ``kvmem chat``/``agents``/``forget`` and
``kvmem scenario``; ``open_runtime(config, **overrides)`` takes its result.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import runtime  # noqa: F401  (OpenBLAS before mlx)
from actors import open_runtime
from fake_engine import FakeEngine
from gateway.cli import _parser
from gateway.cli_chat import CHAT_DEFAULTS
from gateway.cli_common import config_from_args
from runtime.config import FIELDS, Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


# -- the loader ------------------------------------------------------------------------


def test_config_defaults_bind_loopback() -> None:
    config = load_config({}, env={})
    assert config == Config()
    assert config.host == "127.0.0.1" and config.port == 8000 and config.api_key is None
    assert config.model == "kvmem-default" and config.kv_bits == 4 and config.attention == "auto"


def test_config_precedence_flags_over_env_over_toml(tmp_path: Path) -> None:
    toml = tmp_path / "kvmem.toml"
    toml.write_text('model = "from-toml"\nport = 9001\nbudget_mb = 100\nmodels = ["a", "b"]\napi_key = "t"\n')
    env = {"KVMEM_PORT": "9002", "KVMEM_BUDGET_MB": "200", "KVMEM_KV_BITS": "float", "KVMEM_CONFIG": str(toml)}
    config = load_config({"port": 9003, "model": None}, env=env)
    assert config.model == "from-toml"  # only the TOML names it (a None flag is "not given")
    assert config.port == 9003  # flag > env > TOML
    assert config.budget_mb == 200  # env > TOML
    assert config.kv_bits is None and config.models == ("a", "b") and config.api_key == "t"
    assert load_config({}, env={"KVMEM_MODELS": "x, y"}).models == ("x", "y")


def test_a_commands_own_defaults_sit_below_every_source(tmp_path: Path) -> None:
    defaults = {"prewarm_mb": 0, "budget_mb": 64}
    assert load_config({}, env={}, defaults=defaults).prewarm_mb == 0
    toml = tmp_path / "c.toml"
    toml.write_text("prewarm_mb = 256\n")
    assert load_config({}, env={}, config_file=toml, defaults=defaults).prewarm_mb == 256
    assert load_config({}, env={"KVMEM_BUDGET_MB": "128"}, defaults=defaults).budget_mb == 128
    assert load_config({"budget_mb": 32}, env={}, defaults=defaults).budget_mb == 32


def test_config_toml_serve_table_and_explicit_file_wins_over_env_file(tmp_path: Path) -> None:
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("port = 1\n")
    b.write_text("[serve]\nport = 2\n")
    assert load_config({}, env={"KVMEM_CONFIG": str(a)}, config_file=b).port == 2


@pytest.mark.parametrize(
    ("toml", "env", "needle"),
    [
        ("port = 70000\n", {}, "port"),
        ('port = "x"\n', {}, "port"),
        ("colour = 1\n", {}, "colour"),
        ("", {"KVMEM_KV_BITS": "3"}, "kv_bits"),
        ("", {"KVMEM_KV_KEY_BITS": "2"}, "kv_key_bits"),
        ('kv_bits = "float"\nkv_key_bits = 8\n', {}, "kv_key_bits needs quantized KV"),
        ("", {"KVMEM_ATTENTION": "fast"}, "attention"),
        ("", {"KVMEM_FSYNC": "maybe"}, "fsync"),
        ("", {"KVMEM_PREFILL_CHUNK": "0"}, "prefill_chunk"),
        ("hot_budget_mb = 0\n", {}, "hot_budget_mb"),
        ("model = [\n", {}, "TOML"),
    ],
)
def test_bad_settings_name_themselves(tmp_path: Path, toml: str, env: dict[str, str], needle: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=needle):
        load_config({}, env=env, config_file=path)


def test_an_unknown_flag_name_or_default_is_an_error() -> None:
    with pytest.raises(ConfigError, match="kv_bit"):
        load_config({"kv_bit": 4}, env={})
    with pytest.raises(ConfigError, match="prewarm"):
        load_config({}, env={}, defaults={"prewarm": 0})


@pytest.mark.parametrize(("raw", "bits"), [("float", None), ("none", None), ("0", None), ("", None), (0, None),
                                          ("8", 8), (8, 8), ("4", 4), ("FLOAT", None)])
def test_kv_bits_is_normalized_once_for_every_source(tmp_path: Path, raw: object, bits: int | None) -> None:
    assert load_config({"kv_bits": raw}, env={}).kv_bits == bits
    assert Config().replace(kv_bits=raw).kv_bits == bits
    if isinstance(raw, str):
        assert load_config({}, env={"KVMEM_KV_BITS": raw}).kv_bits == bits
        path = tmp_path / "c.toml"
        path.write_text(f'kv_bits = "{raw}"\n')
        assert load_config({}, env={}, config_file=path).kv_bits == bits


def test_kv_key_bits_come_from_every_source_and_unset_is_the_values_bits(tmp_path: Path) -> None:
    assert Config().kv_key_bits is None and load_config({}, env={"KVMEM_KV_KEY_BITS": "8"}).kv_key_bits == 8
    assert load_config({}, env={"KVMEM_KV_KEY_BITS": "none"}).kv_key_bits is None
    path = tmp_path / "c.toml"
    path.write_text("kv_key_bits = 8\nkv_bits = 4\n")
    assert load_config({}, env={}, config_file=path).kv_key_bits == 8
    assert load_config({"kv_key_bits": 4}, env={}, config_file=path).kv_key_bits == 4


def test_environment_booleans_optionals_and_paths() -> None:
    env = {"KVMEM_FSYNC": "off", "KVMEM_ACCEPT_ANY_MODEL": "yes", "KVMEM_MODEL_IDLE_S": "none",
           "KVMEM_PREFILL_CHUNK": "64", "KVMEM_HOME": "/srv/kvmem", "KVMEM_CACHE_DIR": "/fast"}
    config = load_config({}, env=env)
    assert config.fsync is False and config.accept_any_model is True
    assert config.model_idle_s is None and config.prefill_chunk == 64
    assert config.home_path == Path("/srv/kvmem") and config.models_path == Path("/srv/kvmem/models")
    assert config.caches_path == Path("/fast/caches")
    assert load_config({"models_dir": Path("/m")}, env={}).models_path == Path("/m")
    assert load_config({"home": Path("/h")}, env={}).caches_path == Path("/h/caches")


def test_every_setting_has_an_environment_variable() -> None:
    for name in FIELDS:
        value = {"home": "/h", "cache_dir": "/c", "models_dir": "/m", "api_key": "k", "host": "::1",
                 "model": "m", "models": "m2", "weights": "float32", "attention": "native"}.get(name)
        if value is None:
            continue
        assert getattr(load_config({}, env={"KVMEM_" + name.upper(): value}), name) in (value, (value,))


# -- Config.replace and open_runtime's overrides ----------------------------------------


def test_replace_validates_and_names_what_is_wrong() -> None:
    config = Config().replace(home=Path("/tmp/x"), models=["a"], kv_bits="float")
    assert config.home == "/tmp/x" and config.models == ("a",) and config.kv_bits is None
    with pytest.raises(TypeError, match="kv_bit"):
        Config().replace(kv_bit=4)
    with pytest.raises(ConfigError, match="attention"):
        Config().replace(attention="fast")
    with pytest.raises(ConfigError, match="max_batch"):
        Config().replace(max_batch=0)


async def test_open_runtime_takes_a_config_and_overrides_on_top(tmp_path: Path) -> None:
    base = load_config({"model": "fake-a", "home": tmp_path}, env={})
    async with open_runtime(base, engine=FakeEngine(), fsync=False, handle_signals=False, models=["fake-b"]) as rt:
        result = await rt.agent("a").send([{"role": "user", "content": "hi"}], max_tokens=3, model="fake-b")
        assert result.model == "fake-b"
    assert (tmp_path / "caches" / "agents").is_dir()
    # keyword settings alone, as before
    async with open_runtime(model="fake-a", home=tmp_path, engine=FakeEngine(), handle_signals=False) as rt:
        assert (await rt.agent("a").send([{"role": "user", "content": "hi"}], max_tokens=3)).usage.tier == "cold"


async def test_open_runtime_refuses_bad_settings_before_starting_anything(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="kv_bit"):
        async with open_runtime(model="fake-a", home=tmp_path, engine=FakeEngine(), kv_bit=4):
            pass
    with pytest.raises(ConfigError, match="budget_mb"):
        async with open_runtime(model="fake-a", home=tmp_path, engine=FakeEngine(), budget_mb=-1):
            pass
    with pytest.raises(TypeError, match="model="):
        async with open_runtime("fake-a", home=tmp_path, engine=FakeEngine()):  # type: ignore[arg-type]
            pass
    assert not (tmp_path / "caches").exists()


async def test_a_runtime_opened_without_preload_loads_the_model_at_first_use(tmp_path: Path) -> None:
    async with open_runtime(model="fake-a", home=tmp_path, engine=FakeEngine(), handle_signals=False,
                            preload=False) as rt:
        assert rt.stats().registry.loads == 0
        assert await rt.list_agents() == []
        await rt.agent("a").send([{"role": "user", "content": "hi"}], max_tokens=2)
        assert rt.stats().registry.loads == 1


# -- the command line reads it once ---------------------------------------------------


def test_chat_and_serve_flags_are_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FIELDS:
        monkeypatch.delenv("KVMEM_" + name.upper(), raising=False)
    monkeypatch.delenv("KVMEM_CONFIG", raising=False)
    toml = tmp_path / "kvmem.toml"
    toml.write_text('[serve]\nmodel = "tiny-qwen2"\nkv_group_size = 32\nbudget_mb = 99\n')
    chat = _parser().parse_args(["chat", "--agent", "a", "--config", str(toml), "--kv-bits", "float",
                                 "--home", str(tmp_path), "hi"])
    config = config_from_args(chat, **CHAT_DEFAULTS)
    assert (config.model, config.kv_bits, config.kv_group_size, config.budget_mb) == ("tiny-qwen2", None, 32, 99)
    assert config.home == str(tmp_path) and config.prewarm_mb == 0  # chat does not pre-warm unless told to
    serve = _parser().parse_args(["serve", "--config", str(toml), "--model", "tiny-llama", "--port", "0",
                                  "--hot-budget-mb", "7", "--models", "a,b"])
    config = config_from_args(serve)
    assert (config.model, config.port, config.hot_budget_mb, config.models) == ("tiny-llama", 0, 7, ("a", "b"))
    assert config.prewarm_mb == 512 and config.budget_mb == 99
    monkeypatch.setenv("KVMEM_PREWARM_MB", "128")
    assert config_from_args(chat, **CHAT_DEFAULTS).prewarm_mb == 128


def test_a_bad_setting_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "chat", "--agent", "a", "--home", str(tmp_path), "--kv-bits", "3", "hi"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvmem chat: bad setting") and "kv_bits" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_config_module_imports_neither_mlx_nor_trio() -> None:
    code = ("import sys, runtime.config; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'mlx_lm', 'trio', 'numpy', 'gateway', 'actors'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_auto_leaves_a_memory_setting_to_the_backend_profile() -> None:
    assert load_config({}, env={"KVMEM_BUDGET_MB": "auto", "KVMEM_KEEP_FLOAT_MB": "auto"}).budget_mb is None
    assert load_config({}, env={"KVMEM_KEEP_FLOAT_MB": "0"}).keep_float_mb == 0
    assert Config().hot_budget_mb is None


def test_auto_leaves_a_gpu_setting_to_the_backend_profile_and_a_word_wins() -> None:
    """``short_attention_kernel``, ``fused_projections`` and ``small_products_kernel`` are on under the GPU policy
    unless set: unset and ``auto`` are None (the profile decides), ``false`` turns each off on a GPU."""
    config = load_config({}, env={"KVMEM_SHORT_ATTENTION_KERNEL": "auto", "KVMEM_FUSED_PROJECTIONS": "",
                                  "KVMEM_SMALL_PRODUCTS_KERNEL": "auto"})
    assert config.short_attention_kernel is None and config.fused_projections is None
    assert config.small_products_kernel is None
    assert Config().short_attention_kernel is None and Config().fused_projections is None
    assert Config().small_products_kernel is None
    off = load_config({}, env={"KVMEM_SHORT_ATTENTION_KERNEL": "false", "KVMEM_FUSED_PROJECTIONS": "0",
                               "KVMEM_SMALL_PRODUCTS_KERNEL": "false"})
    assert off.short_attention_kernel is False and off.fused_projections is False
    assert off.small_products_kernel is False
