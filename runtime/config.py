"""kvmem's one configuration: :class:`Config`, read once at the edge and handed down.

Every setting has one name, used as the TOML key, as the environment variable
(``KVMEM_`` + the name in upper case) and, with dashes, as the command-line
flag (every setting is a flag of ``kvmem serve``; all but the HTTP server's
:data:`SERVER_FIELDS` are flags of the other commands that open a runtime too).
:func:`settings` lists them as every surface spells them, with their defaults and
meanings from :class:`Config`'s docstring, and ``python -m runtime.config`` writes
``docs/configuration.md`` from that. :func:`load_config` merges the sources, highest first::

    flags  >  KVMEM_* environment  >  TOML file  >  defaults

    # kvmem.toml  (kvmem serve --config kvmem.toml, or KVMEM_CONFIG=kvmem.toml)
    model = "kvmem-default"
    models = ["tiny-llama"]          # KVMEM_MODELS=tiny-llama,tiny-qwen2
    kv_bits = 4                      # 4, 8 or "float"
    port = 8000
    budget_mb = 2048
    api_key = "secret"               # one key, one namespace; or, for tenants:
    # api_keys = "/etc/kvmem/keys.toml"  (gateway.tenants: key -> tenant, limits)
    store = "redis://127.0.0.1:6379/0"   # the shared tier: several nodes serve any agent

Keys may sit at the top level or under ``[serve]``. Values are validated with
msgspec (types and ranges); a bad value or an unknown name is a
:class:`ConfigError` that names the setting. ``kvmem serve``, ``kvmem chat``,
``kvmem agents``, ``kvmem forget`` and ``kvmem scenario`` load a ``Config``
once; ``actors.open_runtime(config, **overrides)`` and the HTTP gateway take it
as it is. Python callers override single fields with :meth:`Config.replace`
(validated the same way).

This module imports msgspec and the standard library only (no mlx, no trio),
so every layer can use it.
"""

from __future__ import annotations

import os
import re
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "FIELDS",
    "SERVER_FIELDS",
    "Config",
    "ConfigError",
    "Setting",
    "configuration_page",
    "default_home",
    "load_config",
    "settings",
]

ENV_PREFIX = "KVMEM_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
"""The environment variable naming a TOML file (``--config`` wins over it)."""

Attention = Literal["auto", "at-rest", "native"]
Weights = Literal["auto", "float32", "float16", "bfloat16", "quantized"]


class ConfigError(ValueError):
    """A setting has a bad value or an unknown name, or the TOML file cannot be read."""


def default_home() -> Path:
    """``$KVMEM_HOME`` when set, else ``$XDG_DATA_HOME/kvmem`` (``~/.local/share/kvmem``)."""
    if env := os.environ.get(ENV_PREFIX + "HOME"):
        return Path(env).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "kvmem"


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every kvmem setting: the runtime's and the HTTP server's.

    Build one with :func:`load_config` (flags, environment, TOML) or
    ``Config().replace(...)``; both validate. Constructing ``Config(...)``
    directly does not check types (msgspec's rule): :func:`actors.open_runtime`
    validates what it is given.

    Attributes:
        model: the default model: ``kvmem-default``, a ``.gguf`` file, a model
            folder, a Hugging Face id or a tiny test model's name.
        models: other models requests may name (the runtime swaps to them).
        weights: how GGUF weights are held: ``auto`` (float32 on CPU, as stored on
            GPU backends), ``float32``, ``float16``, ``bfloat16`` or ``quantized``. Packed
            (``quantized``), a GGUF's float tensors, and so its activations and KV, are float32
            under the CPU policy and float16 (the blocks' scale dtype) under the GPU one.
        model_idle_s: unload the model after this long without requests (None: never).
        home: the kvmem home (built models, caches, conversations); None:
            ``$KVMEM_HOME`` or ``~/.local/share/kvmem`` (:func:`default_home`).
        cache_dir: a folder for the KV caches (``<cache_dir>/caches``) instead of the home.
        models_dir: where models are built (default ``<home>/models``).
        fsync: fsync cache files (turn off only for throwaway caches).
        durable: answer a turn (the non-streaming response, a stream's final event) only
            once its cache is saved, so a turn answered is a turn kept even if the process
            is killed right after (the default); off: the save is write-behind, 15-30 ms after
            the answer (a request turns it on or off for itself with ``X-Kvmem-Durable``).
        store: the shared tier, ``redis://[:PASSWORD@]HOST:PORT/DB`` (``rediss://`` for
            TLS): the local cache directory stays the fast tier, Redis holds every
            node's caches so any node serves any agent (:mod:`runtime.persist.remote`).
            None: this node's disk only.
        lease_s: with a ``store``, how long an agent's cluster lease lasts unless
            given back (a node that dies holds its agents this long).
        kv_bits: 4 or 8 (quantized KV at rest) or None (float KV; ``"float"`` in
            the environment, TOML and flags).
        kv_group_size: quantization group size.
        kv_key_bits: the keys' bits when they differ from the values' (``kv_bits``): 8 keeps
            keys in Q8 and values at ``kv_bits``, as llama.cpp's ``--cache-type-k q8_0
            --cache-type-v q4_0`` (a query's attention over thousands of keys is what quantization
            noise flips; a value's error is averaged by the weights). Unset (``auto``): the backend
            profile's, 8 under the GPU policy with at-rest attention (H200 run 6: Q4 at rest lost 2 of
            float's 75 needle hits; on the real default model keys in Q8 cut Q4's KL to float 5.5x, at
            1.44x the bytes), ``kv_bits`` elsewhere. Attends at rest (native attention takes one bits
            for both).
        attention: ``auto`` (at-rest on every device: native loses needles float keeps,
            docs/models.md), ``at-rest`` (Q4 at rest, float while a sequence runs; fastest
            on CPU) or ``native`` (attend on packed Q4 with MLX's quantized SDPA).
        profile: which backend policy applies (:mod:`runtime.backend`): ``auto`` (the
            device's), or ``cpu`` / ``gpu`` forced (the GPU policy on a CPU runs its paths'
            logic; the CPU policy on a GPU its host paths).
        numpy_attention: on the CPU backend, float attention of llama and qwen2
            models runs in NumPy (:mod:`runtime.cpu.attention`: 4-6x faster
            than MLX's there); off: MLX's own attention everywhere.
        plain_attention_queries: under the GPU policy, forward passes of 2 to this many new
            tokens a row (a hot turn's message, a batch's join) attend with plain MLX operations
            instead of the fused kernel, which on CUDA builds a cuDNN graph for every new shape
            (about 65 ms each on an H200); 0: never; unset (``auto``): 64 under the GPU policy
            (a batch of 8's join: 1,071 ms to 263 ms on the H200), unused under the CPU's.
        short_attention_kernel: on CUDA, the decode steps of a batch of rows of different lengths and
            the short passes (a hot turn's message, a batch's join: up to ``plain_attention_queries``
            queries a row) attend through kvmem's one kernel (causal, each row from its own first key,
            :mod:`runtime.kv.short_attention`; a short pass over more than 2,048 keys in two passes, where the
            model's load held them to MLX's attention, else plain operations) instead of MLX's masked
            fallback and plain operations, several graph nodes a layer each; unset (``auto``): on under the
            GPU policy (H200 run 6: a 1B's step of 8 rows launched in 3.5 ms instead of 6.6); ignored on
            other backends.
        fused_projections: each llama or qwen2 layer's query, key and value projections run as one
            product, and its MLP's gate and up projections as another (:mod:`runtime.model.fused_projections`):
            seven products a layer become four, the same values; on CUDA each product of more than one
            row costs the host a cuBLASLt algorithm lookup (H200 run 6: about 37 µs of submit a product);
            unset (``auto``): on under the GPU policy, off under the CPU's (no change measured there).
        small_products_kernel: on CUDA, a float layer's products of 2 to 16 rows (a batch's decode step, a
            hot turn's message) run in kvmem's one kernel (:mod:`runtime.model.small_products`) instead of
            cuBLASLt, which costs the host about 37 µs a call against a one-row product's 11 (H200 run 6);
            unset (``auto``): on under the GPU policy, once the load's check holds it to MLX's product
            (else MLX's, with one log line); ignored on other backends.
        budget_mb: KV memory for running sequences (admission, batch size), MiB; unset
            (``auto``): 2048 on a CPU, 25% of a GPU's memory (the backend profile's, :mod:`runtime.backend`).
        hot_budget_mb: memory for idle caches kept in memory (the hot tier), MiB; unset
            (``auto``): 512 on a CPU, 10% of a GPU's memory.
        keep_float_mb: memory for the float KV of recently finished turns (``at-rest``),
            so an agent's next hot turn skips dequantizing its Q4 cache, MiB (0: off); unset
            (``auto``): 1024 on a CPU, 10% of a GPU's memory.
        prefetch_mb: at start, the most recently saved caches are read from disk while the
            model loads, up to this many MiB, so their agents' first turns wait for no disk
            (0: off; not with a shared ``store``).
        prewarm_mb: memory touched once at the first model load and kept, so the
            first turn after a start is as fast as later ones (Linux; 0: off).
        max_batch: most sequences decoding at once.
        decode_run_steps: decode steps the batch may run back to back in one job on the model's
            thread when no prefill is waiting (each step's tokens still stream at once; a finished
            row, a new turn or a client that left ends the run after its step); 1: a job, and a
            round trip through trio, per step; unset (``auto``): 1 on a CPU, 64 on a GPU (the
            backend profile's, :mod:`runtime.backend`).
        prefill_chunk: tokens per prefill chunk (None: adaptive, 512/256/128 by context).
        idle_timeout_s: an agent's actor stops after this long without requests.
        host: the address ``kvmem serve`` binds: loopback by default (this machine only);
            ``0.0.0.0`` for every interface (set an ``api_key`` then).
        port: the port ``kvmem serve`` listens on; 0 picks a free one.
        api_key: when set, every HTTP route but ``/healthz`` requires it
            (``x-api-key: K`` or ``Authorization: Bearer K``).
        api_keys: a TOML file of keys, each naming a tenant, with the tenants' limits
            (:mod:`gateway.tenants`): each tenant has its own agents, cache subtree
            and prefix sharing. Not together with ``api_key`` (one key file or one
            key), nor with ``store`` (yet).
        accept_any_model: serve requests naming an unknown model with the default
            model instead of answering 404 (for clients with a hard-coded model name).
        cors_origins: the origins a web page may call the API from (``https://app.example``,
            comma-separated; ``*``: any): browsers' CORS preflight is answered, before any API key
            is asked for, and responses carry ``Access-Control-Allow-Origin``. Unset: none (a page
            on another origin cannot call kvmem; the operator page is served from kvmem itself).
        max_body_bytes: request bodies above this get 413.
        body_timeout_s: a request body still arriving this long after its headers gets
            408 and the connection is closed (slow-upload clients cannot hold it open).
        max_tokens_limit: requests asking for more new tokens get 400.
        default_max_tokens: new tokens when an OpenAI or agents API request names no limit (fewer where
            the model's context leaves less room).
        graceful_timeout_s: on shutdown, how long running requests may finish.
    """

    # -- models
    model: str = "kvmem-default"
    models: tuple[str, ...] = ()
    weights: Weights = "auto"
    model_idle_s: Annotated[float, Meta(gt=0)] | None = None
    # -- where things live
    home: str | None = None
    cache_dir: str | None = None
    models_dir: str | None = None
    fsync: bool = True
    durable: bool = True
    store: Annotated[str, Meta(pattern=r"^(redis|rediss|unix)://")] | None = None
    lease_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    # -- KV format
    kv_bits: Literal[4, 8] | None = 4
    kv_group_size: Literal[32, 64, 128] = 64
    kv_key_bits: Literal[4, 8] | None = None
    attention: Attention = "auto"
    numpy_attention: bool = True
    plain_attention_queries: Annotated[int, Meta(ge=0, le=4096)] | None = None
    short_attention_kernel: bool | None = None
    fused_projections: bool | None = None
    small_products_kernel: bool | None = None
    profile: Literal["auto", "cpu", "gpu"] = "auto"
    # -- memory and scheduling
    budget_mb: Annotated[float, Meta(gt=0)] | None = None
    hot_budget_mb: Annotated[float, Meta(gt=0)] | None = None
    prefetch_mb: Annotated[float, Meta(ge=0)] = 256
    keep_float_mb: Annotated[float, Meta(ge=0)] | None = None
    prewarm_mb: Annotated[float, Meta(ge=0)] = 512
    max_batch: Annotated[int, Meta(ge=1, le=1024)] = 32
    decode_run_steps: Annotated[int, Meta(ge=1, le=1024)] | None = None
    prefill_chunk: Annotated[int, Meta(ge=1)] | None = None
    idle_timeout_s: Annotated[float, Meta(gt=0)] = 300.0
    # -- HTTP server
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    api_key: str | None = None
    api_keys: str | None = None
    accept_any_model: bool = False
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 4 * 2**20
    body_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    max_tokens_limit: Annotated[int, Meta(ge=1)] = 4096
    default_max_tokens: Annotated[int, Meta(ge=1)] = 512
    graceful_timeout_s: Annotated[float, Meta(ge=0)] = 10.0

    @property
    def home_path(self) -> Path:
        """The home folder: ``home``, else :func:`default_home`."""
        return Path(self.home).expanduser() if self.home else default_home()

    @property
    def models_path(self) -> Path:
        """Where models are built: ``models_dir``, else ``<home>/models``."""
        return Path(self.models_dir).expanduser() if self.models_dir else self.home_path / "models"

    @property
    def caches_path(self) -> Path:
        """The cache directory: ``<cache_dir>/caches``, else ``<home>/caches``."""
        return (Path(self.cache_dir).expanduser() if self.cache_dir else self.home_path) / "caches"

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied, all fields validated.

        Values are normalized as from the environment (``kv_bits="float"`` or 0
        is None, a path becomes its string, ``models="a,b"`` a tuple).

        Raises:
            TypeError: a name that is not a setting (the message names it).
            ConfigError: a bad value (the message names the setting).
        """
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise TypeError(f"unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                            f"known: {', '.join(FIELDS)}")
        return _validated({**msgspec.structs.asdict(self), **changes})


FIELDS: tuple[str, ...] = Config.__struct_fields__
SERVER_FIELDS: frozenset[str] = frozenset({
    "host", "port", "api_key", "api_keys", "accept_any_model", "cors_origins", "max_body_bytes", "body_timeout_s",
    "max_tokens_limit", "default_max_tokens", "graceful_timeout_s",
})
"""The HTTP server's settings: flags of ``kvmem serve`` only (the others are flags of every command)."""
_BOOLS = frozenset({"fsync", "durable", "accept_any_model", "numpy_attention", "short_attention_kernel",
                    "fused_projections", "small_products_kernel"})
_NONE_WORDS = ("", "none", "null")
_NONE_ALLOWED = frozenset({"model_idle_s", "prefill_chunk", "api_key", "api_keys", "store"})
_AUTO_IS_NONE = frozenset({"budget_mb", "hot_budget_mb", "keep_float_mb", "short_attention_kernel",
                           "fused_projections", "small_products_kernel", "kv_key_bits"})
"""Settings whose default the backend profile decides: ``auto`` (or nothing) leaves it to the profile."""


def _normalize(key: str, value: Any) -> Any:
    """One normalization for every source: environment-style strings, paths, ``kv_bits`` spellings."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if key == "kv_bits":
        if isinstance(value, str):
            raw = value.strip().lower()
            return None if raw in (*_NONE_WORDS, "float", "0") else raw
        return None if value == 0 else value
    if not isinstance(value, str):
        return value
    if key in ("models", "cors_origins"):
        return [m.strip() for m in value.split(",") if m.strip()]
    if key in _AUTO_IS_NONE and value.strip().lower() in (*_NONE_WORDS, "auto"):
        return None
    if key in _BOOLS:
        raw = value.strip().lower()
        if raw in ("1", "true", "yes", "on"):
            return True
        if raw in ("0", "false", "no", "off"):
            return False
        return value  # validation names it
    if key in _NONE_ALLOWED and value.strip().lower() in _NONE_WORDS:
        return None
    return value


def _validated(values: Mapping[str, Any]) -> Config:
    normalized = {k: _normalize(k, v) for k, v in values.items()}
    try:
        config = msgspec.convert(normalized, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"bad setting: {exc}") from exc
    if config.api_keys is not None and config.api_key is not None:
        # Which wins would be a guess: one key for everyone, or a tenant per key. Say so instead.
        raise ConfigError("api_key and api_keys are both set: give one key (one namespace) or a key file "
                          "(a tenant per key), not both")
    if config.api_keys is not None and config.store is not None:
        raise ConfigError("api_keys (tenants) and store (the shared tier) are not supported together yet")
    if config.kv_key_bits is not None and config.kv_bits is None:
        raise ConfigError("kv_key_bits needs quantized KV (kv_bits 4 or 8): with kv_bits float the keys are float too")
    return config


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    table = data["serve"] if isinstance(data.get("serve"), dict) else data
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown settings {unknown}; known: {sorted(FIELDS)}")
    return dict(table)


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    return {key: env[ENV_PREFIX + key.upper()] for key in FIELDS if ENV_PREFIX + key.upper() in env}


def load_config(
    flags: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> Config:
    """Merge the sources (flags > environment > TOML > defaults) into a validated :class:`Config`.

    Args:
        flags: values by setting name; None means "not given".
        env: the environment (default ``os.environ``); ``KVMEM_CONFIG`` names a TOML file.
        config_file: a TOML file (wins over ``KVMEM_CONFIG``); keys at the top level or under ``[serve]``.
        defaults: a command's own defaults, below every source but above :class:`Config`'s
            (``kvmem chat`` does not pre-warm memory unless told to).

    Raises:
        ConfigError: a bad value or an unknown name (the message names the setting), or an unreadable file.
    """
    env = os.environ if env is None else env
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown = sorted((set(given) | set(defaults or {})) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown settings {unknown}; known: {sorted(FIELDS)}")
    merged: dict[str, Any] = dict(defaults or {})
    path = config_file or env.get(CONFIG_ENV)
    if path:
        merged.update(_from_toml(Path(path).expanduser()))
    merged.update(_from_env(env))
    merged.update(given)
    return _validated(merged)


# -- every surface of every setting (flags, docs) ------------------------------------


class Setting(msgspec.Struct, frozen=True, kw_only=True):
    """One setting as each surface spells it: a row of ``docs/configuration.md`` and one generated flag.

    ``default`` is written as in TOML (``""``: unset); ``meaning`` is the setting's entry in
    :class:`Config`'s docstring (reST markup as written there); ``choices`` are the values a
    string setting takes (empty: any); ``boolean`` settings are ``--name`` / ``--no-name`` flags.
    """

    name: str
    env: str
    flag: str
    default: str
    meaning: str
    choices: tuple[str, ...] = ()
    boolean: bool = False
    server_only: bool = False


def settings() -> tuple[Setting, ...]:
    """Every :class:`Config` field, in declaration order, as :class:`Setting` rows.

    Raises:
        AssertionError: a field has no entry in :class:`Config`'s docstring (a test runs this).
    """
    docs = _field_docs()
    hints = typing.get_type_hints(Config)
    defaults = Config()
    rows = []
    for name in FIELDS:
        assert name in docs, f"Config.{name} has no entry under Attributes: in Config's docstring"
        literal = typing.get_origin(hints[name]) is Literal
        choices = tuple(str(a) for a in typing.get_args(hints[name])) if literal else ()
        rows.append(Setting(name=name, env=ENV_PREFIX + name.upper(), flag="--" + name.replace("_", "-"),
                            default=_toml_literal(getattr(defaults, name)),
                            meaning=docs[name], choices=choices, boolean=name in _BOOLS,
                            server_only=name in SERVER_FIELDS))
    return tuple(rows)


def _field_docs() -> dict[str, str]:
    """``Attributes:`` of :class:`Config`'s docstring by setting name (``host, port:`` names two)."""
    text = (Config.__doc__ or "").split("Attributes:", 1)[1]
    docs: dict[str, str] = {}
    for entry in re.split(r"\n {8}(?=[a-z_]+(?:, [a-z_]+)*:)", text):
        names, _, meaning = entry.partition(":")
        for name in names.split(","):
            docs[name.strip()] = " ".join(meaning.split())
    return docs


def _toml_literal(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    return str(value)


def _markdown(rest: str) -> str:
    """reST inline markup as Markdown (``x`` and :mod:`x` become `x`), safe inside a table cell."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", rest).replace("``", "`")
    return text.replace("|", "\\|")


_PAGE_HEAD = """\
# Configuration

<!-- Generated by `python -m runtime.config > docs/configuration.md` from runtime/config.py
     (Config's fields and docstring); tests/runtime_core/test_config_surfaces.py checks it is current. -->

Every kvmem setting has one name, used as the key in a TOML file, as an environment variable
(`KVMEM_` and the name in upper case) and as a command-line flag (dashes for underscores).
When a setting is given more than once, the highest source wins:

    flags  >  KVMEM_* environment  >  TOML file  >  defaults

The TOML file is `--config FILE` or `KVMEM_CONFIG=FILE`; its keys sit at the top level or
under `[serve]`. A bad value or an unknown name stops the command with one line naming it.

Spellings: a boolean is `--name` / `--no-name` as a flag, and `true`/`false`, `1`/`0`,
`yes`/`no` or `on`/`off` in the environment; `none` (or nothing) unsets an optional setting
in the environment; `kv_bits` takes `float` for float KV everywhere; `models` is a list in
TOML and comma-separated in the environment and on the command line.
"""


def configuration_page() -> str:
    """``docs/configuration.md``: every setting's TOML key, variable, flag, default and meaning."""
    rows = settings()
    parts = [_PAGE_HEAD]
    for title, note, server in (
        ("The runtime", ("Flags of every command that opens a runtime: `kvmem serve`, `chat`, `build-model`, "
                         "`scenario run` and `scenario resume`; `agents` and `forget`, which only read or change a "
                         "home's agents, take `home`, `cache_dir`, `models_dir`, `model`, `fsync` and `store` (the "
                         "others still apply from the environment and TOML)."), False),
        ("The HTTP server", "Flags of `kvmem serve` only.", True),
    ):
        parts.append(f"\n## {title}\n\n{note}\n\n"
                     "| setting (TOML key) | environment | flag | default | meaning |\n"
                     "|---|---|---|---|---|\n")
        for s in (r for r in rows if r.server_only == server):
            flag = f"`--[no-]{s.flag[2:]}`" if s.boolean else f"`{s.flag}`"
            default = f"`{s.default}`" if s.default else "unset"
            parts.append(f"| `{s.name}` | `{s.env}` | {flag} | {default} | {_markdown(s.meaning)} |\n")
    return "".join(parts)


if __name__ == "__main__":
    print(configuration_page(), end="")
