"""The kvmem home folder and settings: built models, caches and conversations in one place.

``$KVMEM_HOME`` when set, else ``$XDG_DATA_HOME/kvmem`` (``~/.local/share/kvmem``)::

    models/          tiny models built on first use (kvmem-default, test models)
    caches/          the block cache directory (see runtime.persist)
    conversations/   one JSON file per agent: the model and the messages so far
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.atomic import write_atomic
from runtime.kvformat import KVFormat

__all__ = ["KvmemHome", "Settings", "default_home", "write_atomic"]


def default_home() -> Path:
    if env := os.environ.get("KVMEM_HOME"):
        return Path(env).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "kvmem"


@dataclass(frozen=True)
class Settings:
    """Runtime settings, from keyword arguments or ``KVMEM_*`` environment variables.

    Attributes:
        model: model name (tiny recipe), folder, or Hugging Face id.
        kv_bits: 4 or 8 for quantized KV at rest, None for float KV.
        kv_group_size: quantization group size.
        attention: ``auto`` (``at-rest`` on CPU, ``native`` on GPU backends),
            ``at-rest`` (dequantize while active; fastest on CPU) or ``native``
            (attend on packed Q4 with MLX's quantized SDPA).
        budget_mb: memory budget for KV caches in MiB.
        weights: how GGUF weights are held (:data:`runtime.gguf.WEIGHT_MODES`).
    """

    model: str = "kvmem-default"
    kv_bits: int | None = 4
    kv_group_size: int = 64
    attention: str = "auto"
    budget_mb: int = 2048
    weights: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_format(self) -> KVFormat:
        return KVFormat(bits=self.kv_bits, group_size=self.kv_group_size)

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        env = os.environ
        values: dict[str, Any] = {}
        if "KVMEM_MODEL" in env:
            values["model"] = env["KVMEM_MODEL"]
        if "KVMEM_KV_BITS" in env:
            raw = env["KVMEM_KV_BITS"].strip().lower()
            values["kv_bits"] = None if raw in ("", "none", "float", "0") else int(raw)
        if "KVMEM_KV_GROUP_SIZE" in env:
            values["kv_group_size"] = int(env["KVMEM_KV_GROUP_SIZE"])
        if "KVMEM_ATTENTION" in env:
            values["attention"] = env["KVMEM_ATTENTION"]
        if "KVMEM_WEIGHTS" in env:
            values["weights"] = env["KVMEM_WEIGHTS"]
        if "KVMEM_BUDGET_MB" in env:
            values["budget_mb"] = int(env["KVMEM_BUDGET_MB"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values.get("attention", "auto") not in ("auto", "at-rest", "native"):
            raise ValueError(f"attention must be 'auto', 'at-rest' or 'native', got {values['attention']!r}")
        return cls(**values)


class KvmemHome:
    """Paths under the home folder, created 0700 on first use."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or default_home()).expanduser()
        for sub in ("models", "caches", "conversations"):
            (self.root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def caches_dir(self) -> Path:
        return self.root / "caches"

    def conversation_path(self, safe_name: str) -> Path:
        return self.root / "conversations" / f"{safe_name}.json"

    def load_conversation(self, safe_name: str) -> dict[str, Any]:
        path = self.conversation_path(safe_name)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {"messages": []}
        return data if isinstance(data, dict) and isinstance(data.get("messages"), list) else {"messages": []}

    def save_conversation(self, safe_name: str, data: dict[str, Any]) -> None:
        write_atomic(self.conversation_path(safe_name), json.dumps(data, ensure_ascii=False).encode())

    def delete_conversation(self, safe_name: str) -> bool:
        path = self.conversation_path(safe_name)
        existed = path.exists()
        path.unlink(missing_ok=True)
        return existed
