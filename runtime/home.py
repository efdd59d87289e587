"""The kvmem home folder: built models, caches and conversations in one place.

``$KVMEM_HOME`` when set, else ``$XDG_DATA_HOME/kvmem`` (``~/.local/share/kvmem``)::

    models/          tiny models built on first use (kvmem-default, test models)
    caches/          the block cache directory (see runtime.persist)
    conversations/   one JSON file per agent: the model and the messages so far
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.config import default_home
from runtime.persist.files import write_atomic

__all__ = ["KvmemHome", "default_home"]


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
