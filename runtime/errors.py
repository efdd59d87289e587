"""kvmem's exception tree.

::

    KvmemError
    ├── ModelError
    │   └── UnsupportedModelError      architecture or cache kind kvmem cannot cache
    ├── CacheMiss                      a cache that cannot be used: absent, corrupt,
    │   ├── CorruptCacheError          truncated, checksum mismatch, lies in metadata
    │   ├── ForeignModelError          made by another model (tag mismatch)
    │   └── FormatVersionError         written by an incompatible format version
    ├── BudgetExceededError            the memory budget cannot hold a request
    ├── ContextLengthExceededError     a prompt plus max_tokens beyond the model's context (also a ValueError)
    ├── DirectoryInUseError            another live process owns the cache directory (runtime.persist.owner)
    ├── DistributedError               ranks of a --distributed server that cannot start or reach each other
    └── InvalidAgentIdError            an agent id that cannot name a cache
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.persist.owner import OwnerInfo


class KvmemError(Exception):
    """Base class of every error kvmem raises on purpose."""


class ModelError(KvmemError):
    """A model could not be loaded or used."""


class UnsupportedModelError(ModelError):
    """The model has a cache kind or geometry kvmem cannot cache."""


class CacheMiss(KvmemError):
    """A stored cache cannot be used; the caller serves the request cold."""


class CorruptCacheError(CacheMiss):
    """A cache file is truncated, fails its checksum, or contradicts its manifest."""


class ForeignModelError(CacheMiss):
    """A cache was made by a different model (or cache format) than the one asked for."""


class FormatVersionError(CacheMiss):
    """A cache was written by an incompatible version of the on-disk format."""


class BudgetExceededError(KvmemError):
    """A request needs more cache memory than the whole budget."""


class ContextLengthExceededError(KvmemError, ValueError):
    """A prompt plus its ``max_tokens`` is longer than the model's context.

    Raised before any prefill: positions past the context the model was trained
    on give meaningless output, and such a prompt would hold the model for minutes.
    The message names both numbers (it is the text of the 400 a client gets).
    """


class DirectoryInUseError(KvmemError):
    """Another live process owns the cache directory (:class:`runtime.persist.owner.OwnerLock`).

    Attributes:
        root: the cache directory.
        holder: what the holder wrote about itself (None: it has not written it yet).
    """

    def __init__(self, root: Path, holder: OwnerInfo | None) -> None:
        self.root = root
        self.holder = holder
        who = holder.describe() if holder is not None else "another process"
        super().__init__(f"the cache directory {root} is in use by {who}; stop it or use another --home")


class DistributedError(KvmemError):
    """The ranks of a distributed server cannot start or reach each other."""


class InvalidAgentIdError(KvmemError, ValueError):
    """An agent id that is empty, too long, or cannot be mapped to a safe file name."""
