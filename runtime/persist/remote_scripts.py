"""What runs inside Redis for the shared tier: fenced manifest swaps, reference counts, forgetting.

The shared tier (:mod:`runtime.persist.remote`) keeps three kinds of key per
agent next to the files: the manifest, the fence it was published under, and
``files-<manifest>``, the newline-joined keys of every file the manifest names
(blocks and the agent's own segments and state file). One hash,
``<prefix>:refs``, counts for each file key how many current manifests name it.

**Garbage collection by reference counts, kept by the manifest swap itself.**
:data:`PUBLISH_MANIFEST` replaces a manifest and, in the same atomic script,
counts one more reference for each file the new manifest names that the old
one did not, one less for each file only the old one named, and deletes a file
whose count reaches zero (a superseded state file or segment, a block no agent
names any more). :data:`FORGET` does the same for every manifest of an agent.
So Redis holds what the current manifests name, plus files of publishes that
never reached their manifest (a node killed in between: bounded by crashes).

Why this is safe against concurrent publishes: files are sent (``SET NX``)
before their manifest, so a file may be deleted between a publisher's upload
and its manifest swap (its count was zero: another agent's manifest dropped
the same block). The invariant that makes that harmless: **a manifest goes in
only if every file it names exists at that instant**, checked inside the
script. Otherwise the script returns the missing keys and the publisher sends
them again (:meth:`runtime.persist.remote.RemoteTier.publish`). A file with a
count is never deleted; a file without one may go at any moment.

**Forgetting across nodes.** :data:`FORGET` takes the agent's next fence (the
lease counter, ``INCR``) and records it as the agent's tombstone. A manifest
published under an older fence (a node still finishing a turn, or one that
served the agent while Redis was unreachable) is refused, like one under an
older lease; a node that next takes the agent's lease sees a tombstone newer
than its last check and drops its own hot and disk copies first.

The scripts touch keys that they do not declare (the files a manifest names),
which standalone Redis allows; Redis Cluster would need the block keys in the
agent's slot or a different scheme (see the scale notes in docs/cluster.md).
"""

from __future__ import annotations

__all__ = ["PUBLISH_MANIFEST", "FORGET", "DELETE_UNREFERENCED", "RELEASE", "RENEW", "PUBLISHED", "STALE"]

PUBLISHED = 1
""":data:`PUBLISH_MANIFEST`'s answer when the manifest is in."""

STALE = 0
""":data:`PUBLISH_MANIFEST`'s answer when a newer fence published (or forgot the agent) since."""

_SPLIT = """
local function split(listed)
  local keys = {}
  if listed then for k in string.gmatch(listed, '[^\\n]+') do keys[k] = true end end
  return keys
end
local function unref(refs, key)
  if redis.call('HINCRBY', refs, key, -1) <= 0 then
    redis.call('HDEL', refs, key)
    redis.call('DEL', key)
  end
end
"""

PUBLISH_MANIFEST = _SPLIT + """
-- KEYS: manifest, its fence, its file list, the agent's tombstone, the refs hash, the agent's manifest set
-- ARGV: manifest bytes, fence, then every file key the manifest names
local fence = tonumber(ARGV[2])
local newest = math.max(tonumber(redis.call('GET', KEYS[2]) or '0'), tonumber(redis.call('GET', KEYS[4]) or '0'))
local old = split(redis.call('GET', KEYS[3]))
local new = {}
for i = 3, #ARGV do new[ARGV[i]] = true end
if fence < newest then
  -- refused: what this publisher sent that no manifest names goes again
  for k in pairs(new) do
    if redis.call('HEXISTS', KEYS[5], k) == 0 then redis.call('DEL', k) end
  end
  return 0
end
local missing = {}
for k in pairs(new) do
  if redis.call('EXISTS', k) == 0 then table.insert(missing, k) end
end
if #missing > 0 then return missing end
for k in pairs(new) do
  if not old[k] then redis.call('HINCRBY', KEYS[5], k, 1) end
end
for k in pairs(old) do
  if not new[k] then unref(KEYS[5], k) end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], table.concat(ARGV, '\\n', 3))
redis.call('SADD', KEYS[6], KEYS[1])
return 1
"""
"""Swap a manifest in under a fence, keeping the files' reference counts (see the module docstring).

Returns 1 (published), 0 (a newer fence published or forgot the agent: nothing
changed) or the list of named files that are not in Redis (nothing changed:
send them and try again).
"""

FORGET = _SPLIT + """
-- KEYS: the agent's fence counter, its tombstone, the refs hash, the agent's manifest set
-- ARGV: the prefixes of a manifest's fence key and file-list key ('fence-', 'files-' before the manifest's name)
local fence = redis.call('INCR', KEYS[1])
redis.call('SET', KEYS[2], fence)
local forgotten = 0
for _, manifest in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  local head, name = string.match(manifest, '^(.*:)([^:]+)$')
  local files = head .. ARGV[2] .. name
  for k in pairs(split(redis.call('GET', files))) do unref(KEYS[3], k) end
  forgotten = forgotten + redis.call('DEL', manifest, head .. ARGV[1] .. name, files)
end
redis.call('DEL', KEYS[4])
return {fence, forgotten}
"""
"""Forget an agent cluster-wide: tombstone at its next fence, drop its manifests and their references.

Returns ``{tombstone fence, keys deleted}``.
"""

DELETE_UNREFERENCED = """
-- KEYS: the refs hash, then file keys
local deleted = 0
for i = 2, #KEYS do
  if redis.call('HEXISTS', KEYS[1], KEYS[i]) == 0 then deleted = deleted + redis.call('DEL', KEYS[i]) end
end
return deleted
"""
"""Delete the given files that no manifest names (files of publishes that never reached their manifest)."""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
"""Delete the lease only if it is still ours."""

RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
"""Extend the lease only if it is still ours."""
