"""``kvmem serve`` configuration: command-line flags > ``KVMEM_*`` environment > TOML file > defaults.

Every setting has one name, used as the TOML key, as the environment variable
(``KVMEM_`` + the name in upper case) and, with dashes, as the flag::

    # kvmem.toml  (kvmem serve --config kvmem.toml, or KVMEM_CONFIG=kvmem.toml)
    model = "kvmem-default"
    models = ["tiny-llama"]          # KVMEM_MODELS=tiny-llama,tiny-qwen2
    host = "127.0.0.1"
    port = 8000
    budget_mb = 2048
    api_key = "secret"

Values are validated with msgspec (types and ranges); a bad value names its key.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

__all__ = ["ServeConfig", "ConfigError", "load_config", "ENV_PREFIX"]

ENV_PREFIX = "KVMEM_"


class ConfigError(ValueError):
    """A setting has a bad value, or the TOML file cannot be read."""


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of ``kvmem serve`` (see the module docstring for where they come from).

    Attributes:
        model: the default model (tiny model name, folder or Hugging Face id).
        models: other models requests may name (the runtime swaps to them).
        accept_any_model: serve requests naming an unknown model with the default
            model instead of answering 404 (for clients with a hard-coded model name).
        host, port: where to listen; loopback by default, port 0 picks a free port.
        home: the kvmem home (models, caches); default ``$KVMEM_HOME`` or ``~/.local/share/kvmem``.
        cache_dir: a folder for the KV caches (``<cache_dir>/caches``) instead of the home;
            models are still built under the home.
        kv_bits: 4 or 8 (quantized KV at rest) or None (``float``).
        kv_group_size: quantization group size.
        attention: ``auto``, ``at-rest`` or ``native`` (see the README); None: the runtime's default.
        weights: how GGUF weights are held: ``auto`` (float32 on CPU, as stored on GPU
            backends), ``float32``, ``float16``, ``bfloat16`` or ``quantized``.
        budget_mb: KV memory for running sequences (admission, batch size).
        hot_budget_mb: memory for idle caches kept in RAM (the hot tier).
        prewarm_mb: memory touched once at start and kept for activations, so the
            first turn after a restart is as fast as later ones (Linux; 0: off).
        max_batch: most sequences decoding at once.
        idle_timeout_s: an agent's actor stops after this long without requests.
        api_key: when set, every route but ``/healthz`` requires it
            (``x-api-key: K`` or ``Authorization: Bearer K``).
        max_body_bytes: request bodies above this get 413.
        max_tokens_limit: requests asking for more new tokens get 400.
        default_max_tokens: new tokens when an OpenAI request names no limit.
        graceful_timeout_s: on shutdown, how long running requests may finish.
    """

    model: str = "kvmem-default"
    models: tuple[str, ...] = ()
    accept_any_model: bool = False
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    home: str | None = None
    cache_dir: str | None = None
    kv_bits: Literal[4, 8] | None = 4
    kv_group_size: Literal[32, 64, 128] = 64
    attention: Literal["auto", "at-rest", "native"] | None = None
    weights: Literal["auto", "float32", "float16", "bfloat16", "quantized"] = "auto"
    budget_mb: Annotated[float, Meta(gt=0)] = 2048
    hot_budget_mb: Annotated[float, Meta(gt=0)] = 512
    prewarm_mb: Annotated[float, Meta(ge=0)] = 512
    max_batch: Annotated[int, Meta(ge=1, le=1024)] = 32
    idle_timeout_s: Annotated[float, Meta(gt=0)] = 300.0
    api_key: str | None = None
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 4 * 2**20
    max_tokens_limit: Annotated[int, Meta(ge=1)] = 4096
    default_max_tokens: Annotated[int, Meta(ge=1)] = 512
    graceful_timeout_s: Annotated[float, Meta(ge=0)] = 10.0

    @property
    def home_path(self) -> Path | None:
        return Path(self.home).expanduser() if self.home else None


FIELDS: tuple[str, ...] = ServeConfig.__struct_fields__


def _normalize(key: str, value: Any) -> Any:
    """Turn environment-style strings into what the struct expects."""
    if key == "models" and isinstance(value, str):
        return [m.strip() for m in value.split(",") if m.strip()]
    if key == "kv_bits" and isinstance(value, str):
        raw = value.strip().lower()
        return None if raw in ("", "none", "float", "0") else raw
    if key == "kv_bits" and value == 0:
        return None
    if key == "accept_any_model" and isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return value


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    table = data.get("serve", data) if isinstance(data.get("serve"), dict) else data
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown settings {unknown}; known: {sorted(FIELDS)}")
    return dict(table)


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    return {key: env[ENV_PREFIX + key.upper()] for key in FIELDS if ENV_PREFIX + key.upper() in env}


def load_config(
    cli: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> ServeConfig:
    """Merge the sources (flags > environment > TOML > defaults) into a validated :class:`ServeConfig`.

    Args:
        cli: flag values by setting name; None values mean "not given".
        env: the environment (default ``os.environ``); ``KVMEM_CONFIG`` names a TOML file.
        config_file: a TOML file (wins over ``KVMEM_CONFIG``); keys at the top level or under ``[serve]``.

    Raises:
        ConfigError: a bad value (the message names the setting) or an unreadable file.
    """
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        merged.update(_from_toml(Path(path).expanduser()))
    merged.update(_from_env(env))
    merged.update({k: v for k, v in (cli or {}).items() if v is not None})
    values = {k: _normalize(k, v) for k, v in merged.items()}
    try:
        return msgspec.convert(values, ServeConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"bad setting: {exc}") from exc
