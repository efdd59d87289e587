"""Every setting where the docs say it is: a TOML key, a ``KVMEM_`` variable and a flag, and the docs page.

Each :class:`runtime.config.Config` field gets a value other than its default
through each surface in turn (a TOML file, the environment, the command line
of ``kvmem serve`` and, for the runtime's settings, of every other command that
opens a runtime), and the value must land in the ``Config``. A new field without
a sample here fails :func:`test_every_setting_has_a_sample`.
``docs/configuration.md`` must be what ``python -m runtime.config`` writes.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import _parser
from gateway.cli_common import config_from_args
from runtime.config import (
    FIELDS,
    SERVER_FIELDS,
    Config,
    configuration_page,
    load_config,
    settings,
)

ROOT = Path(__file__).resolve().parents[2]

SAMPLES: dict[str, tuple[str, Any, Any]] = {
    # name: (the text a flag or variable carries, the TOML value, the value the Config holds)
    "model": ("tiny-qwen2", "tiny-qwen2", "tiny-qwen2"),
    "models": ("a,b", ["a", "b"], ("a", "b")),
    "weights": ("float16", "float16", "float16"),
    "model_idle_s": ("90", 90, 90.0),
    "home": ("/srv/kvmem", "/srv/kvmem", "/srv/kvmem"),
    "cache_dir": ("/fast", "/fast", "/fast"),
    "models_dir": ("/m", "/m", "/m"),
    "fsync": ("false", False, False),
    "durable": ("false", False, False),
    "store": ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    "lease_s": ("12.5", 12.5, 12.5),
    "kv_bits": ("8", 8, 8),
    "kv_group_size": ("32", 32, 32),
    "kv_key_bits": ("4", 4, 4),
    "attention": ("native", "native", "native"),
    "numpy_attention": ("false", False, False),
    "plain_attention_queries": ("64", 64, 64),
    "short_attention_kernel": ("true", True, True),
    "fused_projections": ("true", True, True),
    "small_products_kernel": ("true", True, True),
    "profile": ("gpu", "gpu", "gpu"),
    "budget_mb": ("100", 100, 100.0),
    "hot_budget_mb": ("64", 64, 64.0),
    "prefetch_mb": ("0", 0, 0.0),
    "keep_float_mb": ("16", 16, 16.0),
    "prewarm_mb": ("0", 0, 0.0),
    "max_batch": ("4", 4, 4),
    "decode_run_steps": ("8", 8, 8),
    "prefill_chunk": ("64", 64, 64),
    "idle_timeout_s": ("5", 5, 5.0),
    "host": ("0.0.0.0", "0.0.0.0", "0.0.0.0"),
    "port": ("9100", 9100, 9100),
    "api_key": ("k", "k", "k"),
    "api_keys": ("/etc/kvmem/keys.toml", "/etc/kvmem/keys.toml", "/etc/kvmem/keys.toml"),
    "accept_any_model": ("true", True, True),
    "cors_origins": ("https://a.example, https://b.example", ["https://a.example", "https://b.example"],
                     ("https://a.example", "https://b.example")),
    "max_body_bytes": ("2048", 2048, 2048),
    "body_timeout_s": ("3", 3, 3.0),
    "max_tokens_limit": ("64", 64, 64),
    "default_max_tokens": ("32", 32, 32),
    "graceful_timeout_s": ("1", 1, 1.0),
}

OTHER_COMMANDS = [
    ["chat", "--agent", "a", "hi"],
    ["agents"],
    ["forget", "a"],
    ["build-model", "tiny-llama"],
    ["scenario", "run", "some.yaml"],
    ["scenario", "resume", "some-run"],
]
"""Every command that opens a runtime besides ``kvmem serve``: the runtime's settings are its flags too."""


@pytest.fixture(autouse=True)
def _no_settings_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite runs with ``KVMEM_HOME`` set: the flag tests read the environment, so clear it."""
    for name in (*FIELDS, "config"):
        monkeypatch.delenv("KVMEM_" + name.upper(), raising=False)


@functools.cache
def _kvmem() -> argparse.ArgumentParser:
    return _parser()


def _flag_args(name: str) -> list[str]:
    """The command-line words that set ``name`` to its sample: ``--port 9100``, ``--no-fsync``."""
    raw, _toml, value = SAMPLES[name]
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, raw]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)  # strings, numbers and lists of strings are written alike in TOML


def test_every_setting_has_a_sample() -> None:
    assert sorted(SAMPLES) == sorted(FIELDS)
    defaults = Config()
    for name, (_raw, _toml, value) in SAMPLES.items():
        assert getattr(defaults, name) != value, f"{name}'s sample is its default: it would land unseen"


@pytest.mark.parametrize("name", FIELDS)
def test_a_setting_lands_from_its_toml_key(tmp_path: Path, name: str) -> None:
    path = tmp_path / "kvmem.toml"
    path.write_text(f"{name} = {_toml_value(SAMPLES[name][1])}\n")
    assert getattr(load_config({}, env={}, config_file=path), name) == SAMPLES[name][2]


@pytest.mark.parametrize("name", FIELDS)
def test_a_setting_lands_from_its_environment_variable(name: str) -> None:
    env = {"KVMEM_" + name.upper(): SAMPLES[name][0]}
    assert getattr(load_config({}, env=env), name) == SAMPLES[name][2]


@pytest.mark.parametrize("name", FIELDS)
def test_a_setting_lands_from_its_flag_of_kvmem_serve(name: str) -> None:
    args = _kvmem().parse_args(["serve", *_flag_args(name)])
    assert getattr(config_from_args(args), name) == SAMPLES[name][2]


@pytest.mark.parametrize("command", OTHER_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_the_runtimes_settings_are_flags_of_every_command_that_opens_a_runtime(
        command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli_common import HOME_SETTINGS

    home_only = command[0] in ("agents", "forget")  # they read a home's agents: no engine or GPU settings
    for name in FIELDS:
        if name in SERVER_FIELDS or (home_only and name not in HOME_SETTINGS):
            with pytest.raises(SystemExit):  # the HTTP server's settings are kvmem serve's alone
                _kvmem().parse_args([*command, *_flag_args(name)])
            assert "unrecognized arguments" in capsys.readouterr().err
            continue
        args = _kvmem().parse_args([*command, *_flag_args(name)])
        assert getattr(config_from_args(args), name) == SAMPLES[name][2], (command, name)


def test_a_flag_given_as_none_leaves_the_lower_sources_in_charge(tmp_path: Path) -> None:
    path = tmp_path / "kvmem.toml"
    path.write_text("fsync = false\nport = 9200\n")
    args = _kvmem().parse_args(["serve", "--config", str(path)])
    config = config_from_args(args)
    assert config.fsync is False and config.port == 9200  # no flag: the TOML's values, not the flags' Nones


def test_every_flags_help_is_its_settings_meaning() -> None:
    from gateway.cli_common import add_setting_options

    parser = argparse.ArgumentParser(prog="kvmem serve")
    add_setting_options(parser, server=True)
    text = " ".join(parser.format_help().split())
    assert "--kv-group-size {32,64,128} quantization group size. (default: 64)" in text
    assert "--fsync, --no-fsync fsync cache files" in text
    assert "--accept-any-model, --no-accept-any-model serve requests naming an unknown model" in text


def test_the_configuration_page_is_generated_from_the_config_fields() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == configuration_page(), "docs/configuration.md is stale: python -m runtime.config > it"
    for row in settings():
        assert f"| `{row.name}` | `{row.env}` |" in page


def test_the_page_generator_runs_as_a_module() -> None:
    out = subprocess.run([sys.executable, "-m", "runtime.config"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == configuration_page()
