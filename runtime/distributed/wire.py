"""What rank 0 tells the other ranks, and what they answer: msgspec structs, framed msgpack over TCP.

Engine calls travel as :data:`Command` values. Caches live on every rank, each
rank holding its own heads, so a message never carries one: it names it by a
**handle**, a number rank 0 gives each parked cache and snapshot, under which
every follower keeps its own part (see :class:`runtime.distributed.leader.Handles`).
A turn's plan travels as a :class:`WirePlan`, its cache source as a handle.

Frames: a 4-byte big-endian length, then the msgpack body. Decoders are built
once (STYLE.md item 10).
"""

from __future__ import annotations

import socket
import struct

import msgspec

from runtime.plan.sampling import SamplingOptions
from runtime.plan.turn_plan import Tier, Tokenized

__all__ = [
    "ColdWire", "HotWire", "WarmWire", "SharedWire", "WireSource", "WirePlan",
    "Hello", "LoadModel", "UnloadModel", "CloseEngine", "Start", "Prefill", "ParkPrompt", "Join", "StepDecode",
    "Finish", "Discard", "Release", "LoadPart", "SavePart", "DeletePart", "CollectGarbage", "Shutdown",
    "Command", "PartLoaded", "PartDone", "Reply",
    "send_frame", "recv_command", "recv_reply", "recv_hello", "ConnectionLost",
]

_HEADER = struct.Struct(">I")
MAX_FRAME = 256 * 2**20
"""Largest frame accepted (a prompt's text and token ids; caches never travel)."""


class ConnectionLost(ConnectionError):
    """The other end closed the connection (or sent a frame too large to be ours)."""


# -- a turn's plan, with its cache named by handle ------------------------------


class ColdWire(msgspec.Struct, frozen=True, tag="cold"):
    """Nothing cached."""


class HotWire(msgspec.Struct, frozen=True, tag="hot"):
    """A parked cache every rank holds under ``handle``."""

    handle: int


class WarmWire(msgspec.Struct, frozen=True, tag="warm"):
    """A snapshot every rank read from its own disk under ``handle``."""

    handle: int


class SharedWire(msgspec.Struct, frozen=True, tag="shared"):
    """The first ``reuse_tokens`` tokens of another agent's parked cache (``handle``)."""

    handle: int
    reuse_tokens: int
    donor: str


WireSource = ColdWire | HotWire | WarmWire | SharedWire


class WirePlan(msgspec.Struct, frozen=True, kw_only=True):
    """A :class:`runtime.plan.turn_plan.TurnPlan` with its source named by handle."""

    tier: Tier
    source: WireSource
    match: str
    reuse_tokens: int
    reuse_chars: int


# -- commands: rank 0 -> every other rank ---------------------------------------


class Hello(msgspec.Struct, frozen=True, tag=True):
    """A follower's first frame: which rank it is, and of how many."""

    rank: int
    size: int


class LoadModel(msgspec.Struct, frozen=True, tag=True):
    """Load ``name`` (this rank's part) and seed MLX's generator with ``seed`` on the thread that samples."""

    name: str
    seed: int


class UnloadModel(msgspec.Struct, frozen=True, tag=True):
    pass


class CloseEngine(msgspec.Struct, frozen=True, tag=True):
    pass


class Start(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    request_id: int
    prompt: str
    plan: WirePlan
    tokens: Tokenized
    sampling: SamplingOptions


class Prefill(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    request_id: int
    chunk: int | None
    adopt: SharedWire | None = None


class ParkPrompt(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Park the prompt's KV under ``handle``."""

    request_id: int
    handle: int


class Join(msgspec.Struct, frozen=True, tag=True):
    request_id: int


class StepDecode(msgspec.Struct, frozen=True, tag=True):
    pass


class Finish(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Finish the sequence; keep its parked cache and snapshot under ``handle``."""

    request_id: int
    handle: int


class Discard(msgspec.Struct, frozen=True, tag=True):
    request_id: int


class Release(msgspec.Struct, frozen=True, tag=True):
    """Rank 0 dropped these caches: drop your parts."""

    handles: tuple[int, ...]


class LoadPart(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Read your part of ``agent_id``'s cache of the model rank 0 tags ``model_tag``; keep it under ``handle``.

    Answered with :class:`PartLoaded`."""

    agent_id: str
    model_tag: str
    handle: int


class SavePart(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Save your part of the snapshot under ``handle`` as ``agent_id``'s cache. Answered with :class:`PartDone`."""

    agent_id: str
    handle: int


class DeletePart(msgspec.Struct, frozen=True, tag=True):
    """Forget ``agent_id``'s caches. Answered with :class:`PartDone`."""

    agent_id: str


class CollectGarbage(msgspec.Struct, frozen=True, tag=True):
    pass


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    """Rank 0 is done (its caches are flushed): exit."""


Command = (
    LoadModel | UnloadModel | CloseEngine | Start | Prefill | ParkPrompt | Join | StepDecode | Finish | Discard
    | Release | LoadPart | SavePart | DeletePart | CollectGarbage | Shutdown
)


# -- replies: a follower -> rank 0 (only for cache directory work) ---------------


class PartLoaded(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The part was read (``fingerprint`` of its tokens and text) or not (``error`` says why)."""

    fingerprint: str | None = None
    error: str | None = None


class PartDone(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A save or delete finished (``error``: it failed, and why; ``missing``: the rank holds no part to save)."""

    error: str | None = None
    missing: bool = False


Reply = PartLoaded | PartDone

_encoder = msgspec.msgpack.Encoder()
_commands: msgspec.msgpack.Decoder[Command] = msgspec.msgpack.Decoder(Command)
_replies: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)
_hello = msgspec.msgpack.Decoder(Hello)


def send_frame(sock: socket.socket, message: msgspec.Struct) -> None:
    """Write one framed message."""
    body = _encoder.encode(message)
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = sock.recv(min(left, 2**20))
        if not chunk:
            raise ConnectionLost("the other rank closed the connection")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _recv_body(sock: socket.socket) -> bytes:
    (length,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if length > MAX_FRAME:
        raise ConnectionLost(f"a frame of {length} bytes: not a kvmem rank")
    return _recv_exactly(sock, length)


def recv_command(sock: socket.socket) -> Command:
    """Read one command (a follower)."""
    return _commands.decode(_recv_body(sock))


def recv_reply(sock: socket.socket) -> Reply:
    """Read one reply (rank 0)."""
    return _replies.decode(_recv_body(sock))


def recv_hello(sock: socket.socket) -> Hello:
    """Read a follower's :class:`Hello` (rank 0, at the handshake)."""
    return _hello.decode(_recv_body(sock))
