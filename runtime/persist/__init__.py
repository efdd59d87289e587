"""The warm tier: agents' KV caches in a directory, written once per token.

:class:`CacheDirectory` is the only code that touches a cache directory. Layout::

    root/
      blocks/<hh>/<hash>.safetensors          immutable 256-token block, shared by every
                                              agent whose tokens up to its end are the same
      agents/<dir>/manifest-<digest>.json     what the agent's cache for one model is made of
      agents/<dir>/seg-<sha256>.safetensors   the agent's own pieces (any token range)
      agents/<dir>/state-<sha256>.safetensors sliding layers + every layer's layout
      tenants/<tenant>/                       the same layout, once per tenant (``--api-keys``;
                                              :mod:`runtime.persist.tenants`): a tenant's agents
                                              and blocks, deduplicated within the tenant only

An agent has **one cache per model tag** (:attr:`runtime.spec.ModelCacheSpec.tag`):
``<digest>`` is a digest of the tag (:func:`manifest_name`), so a turn with
another model saves beside the first model's cache instead of over it, and
each resumes its own. A ``manifest.json`` left by kvmem before per-model
caches is still read as the cache of the model it records, until that model
saves again (:mod:`runtime.persist.manifests`). ``<dir>`` is
:func:`runtime.identity.safe_agent_dirname` of the agent id.

An agent's blocked-layer (full-attention) KV is an ordered list of **pieces**
covering tokens ``0:num_tokens`` without gaps:

* a **shared block** holds one aligned 256-token block. ``<hash>`` is a hash
  chain over (format version, model tag, previous block's hash, the block's
  token ids), so agents that share a prefix share its files. A save writes a
  block file only for a block whose 256 tokens are all new in that save (the
  first save, which holds the system prompt, is the common case); if the file
  is already there and intact it is reused, even with other bits (the same
  model can compute the same prefix slightly differently, batched or alone).
* a **segment** holds any other range: the tokens a later turn adds to an
  unfinished block, the remainder after the last whole block. It is named by
  its content hash and never rewritten; a block filled over several turns
  stays made of the segments that filled it.

A save reuses every piece of the previous manifest that lies inside the common
token-id prefix, so each token's KV is written once. The **state** file holds
the sliding-window layers (bounded by their window), rewritten whole on each
save where they changed, and a zero-token slice of every blocked layer that
records its dtype and shape. The **manifest** (JSON) holds format version,
model tag, agent id, the pieces with their sizes and checksums (the SHA-256 of
a file's header, which records the XXH3 checksum of its data), the state file's,
layer kinds and keys, meta, times, and the text, token ids and offsets
compressed (about 6 bytes per token): the only thing rewritten in full every
turn.

A save writes new blocks, segments and the state file first (temp files, then
fsync them all, rename them all, fsync their directories), then replaces the
model's manifest the same way, then removes the agent's files that no
manifest of the agent (any model) lists any more. A kill at any point leaves
the old manifest with everything it needs, or the new one. Garbage collection
keeps every block that any manifest of any agent lists. Loads verify sizes,
checksums, the hash chain, contiguity and every shape against the manifest,
and turn any problem into a :class:`~runtime.errors.CacheMiss` (logged), never
an uncaught error; a file that fails its own checksum is removed so the next
save rewrites it. Files are ``0o600``, directories ``0o700``.

Where each part lives:

==============  ==============================================================
``directory``   :class:`CacheDirectory`, the facade that delegates to the
                modules below; the folders and file names of an open cache
                directory, agent ids to safe folder names
``save``        a save: plan, write pieces, replace the manifest, tidy up
``load``        a load: check the manifest, read the state and the pieces'
                files straight into one allocation
``gc``          garbage collection and leftover temporary files
``agents``      listing stored caches, ``exists``, deleting an agent
``pieces``      which pieces a save keeps and which ranges it writes (the
                plan, pure policy); writing block, segment and state files;
                whether one on disk is intact
``manifests``   an agent folder's manifests (one per model, plus legacy),
                decoding them and checking each against itself
``format``      manifest schema and its packed text, token ids and offsets,
                file names, block hash chain, which tensors the files hold,
                file metadata
``codec``       canonical safetensors encoding with a data checksum (XXH3)
``files``       atomic file replacement (``write_atomic``), private folders,
                batches of atomic writes, safe reads
``tenants``     which cache directory an agent id names: the default one, or
                its tenant's subtree (:class:`TenantDirectories`)
``remote``      the shared tier: these files mirrored in Redis, pulled onto
                the disk (checked) before a load, published after a save;
                cluster leases (imported only when a ``store`` is set)
==============  ==============================================================
"""

from runtime.persist.agents import AgentEntry
from runtime.persist.directory import CacheDirectory
from runtime.persist.format import FORMAT_VERSION
from runtime.persist.manifests import manifest_name
from runtime.persist.save import SaveReport

__all__ = [
    "FORMAT_VERSION",
    "AgentEntry",
    "CacheDirectory",
    "SaveReport",
    "manifest_name",
]
