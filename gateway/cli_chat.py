"""Local agents from the command line: ``kvmem chat``, ``kvmem agents``, ``kvmem forget``, ``kvmem build-model``.

``kvmem chat --agent NAME "message"`` talks to one agent whose conversation and
KV cache persist across separate runs. The chat runs on the same in-process
runtime as ``kvmem serve`` (:func:`actors.open_runtime`): one turn path, so the
command line and the server agree on replies, tiers and token accounting.
The conversation (the messages so far) is kept in the kvmem home
(``conversations/<agent>.json``); the cache belongs to the runtime's store,
which writes it to disk when the runtime closes.

With a server holding the home, every command here acts through it
(``open_runtime`` yields an :class:`actors.owner_client.OwnerClient`): a chat's
turns run in the server's runtime, on its caches, streamed back; ``agents`` lists
its hot agents too; ``forget`` reaches every copy it holds. Output and exit
codes are those of the command alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from gateway.cli_common import HOME_SETTINGS, add_setting_options, config_from_args
from gateway.progress import Progress

if TYPE_CHECKING:
    from actors.messages_agent import TurnResult
    from actors.messages_common import TurnUsage
    from actors.messages_store import AgentRecord
    from actors.owner_client import OwnerClient
    from actors.supervisor import Runtime
    from runtime.config import Config
    from runtime.home import KvmemHome

__all__ = ["register", "TurnReport", "AgentSummary", "LineReader"]


class TurnReport(msgspec.Struct, frozen=True, kw_only=True):
    """One turn's reply and accounting: the ``kvmem chat --json`` object (its ``usage``, the one record every
    API reports: :class:`actors.messages_common.TurnUsage`)."""

    agent: str
    reply: str
    model: str
    finish_reason: str
    usage: TurnUsage


class AgentSummary(msgspec.Struct, frozen=True, kw_only=True):
    """An agent known to the home folder (a ``kvmem agents --json`` row).

    An agent keeps one cache per model: ``cached_tokens`` is the cache it used
    last, ``disk_bytes`` counts all of them.
    """

    agent: str
    model: str
    turns: int
    cached_tokens: int
    disk_bytes: int


def register(sub: Any) -> None:
    """Add this module's subcommands to the ``kvmem`` parser."""
    chat = sub.add_parser("chat", help="send a message to an agent (interactive without a message)")
    chat.add_argument("message", nargs="?", help="the user message; omit for an interactive session")
    chat.add_argument("--agent", required=True, help="agent name: its memory persists across runs")
    chat.add_argument("--system", help="system prompt for a new agent")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--seed", type=int, help="the turn's own random stream: a sampled reply repeats for the same seed")
    chat.add_argument("--json", action="store_true", help="print one JSON object per turn")
    add_setting_options(chat)
    chat.set_defaults(func=_chat)

    # No abbreviations: with only the home's settings, --models would read as --models-dir.
    agents = sub.add_parser("agents", help="list agents and their cache sizes", allow_abbrev=False)
    agents.add_argument("--json", action="store_true")
    agents.add_argument("--tenant", help="a tenant's agents (kvmem serve --api-keys) instead of the keyless ones")
    add_setting_options(agents, only=HOME_SETTINGS)
    agents.set_defaults(func=_agents)

    forget = sub.add_parser("forget", help="delete an agent's conversation and cache", allow_abbrev=False)
    forget.add_argument("agent")
    forget.add_argument("--tenant", help="the agent of this tenant (kvmem serve --api-keys)")
    add_setting_options(forget, only=HOME_SETTINGS)
    forget.set_defaults(func=_forget)

    build = sub.add_parser("build-model", help="prepare a model's files (kvmem-default, a GGUF, or a tiny test model)")
    build.add_argument("name", nargs="?", default="kvmem-default")
    add_setting_options(build)
    build.set_defaults(func=_build)


# -- the runtime ----------------------------------------------------------------------


@asynccontextmanager
async def _open_runtime(config: Config, *, preload: bool = True) -> AsyncIterator[Runtime | OwnerClient]:
    """``open_runtime(config)`` for a command that runs until its process exits (through the server
    that holds the home, if one does)."""
    from actors import open_runtime

    async with open_runtime(config, preload=preload) as rt:
        # What is imported and loaded by now lives until exit: keep it out of later garbage
        # collections (a full one walks mlx-lm's and transformers' objects: ~90 ms here,
        # and the engine runs one when it unloads the model at exit).
        gc.freeze()
        yield rt


# -- chat ---------------------------------------------------------------------------

PROGRESS_DELAY_S = 1.0
"""A model load or a prefill shorter than this shows no progress (:mod:`gateway.progress`)."""

CHAT_DEFAULTS: dict[str, Any] = {"prewarm_mb": 0, "prefetch_mb": 0}
"""``kvmem chat``'s own defaults (below flags, environment and TOML). Pre-warming 512 MiB
costs a one-shot chat process 0.4-2 s and ~500 MB of memory on a 2-core VM, more than it
saves on a chat-sized turn; set ``prewarm_mb`` to pre-warm for long resumed conversations.
A chat process serves one agent, so it reads no other agent's cache ahead (``prefetch_mb``)."""


def _chat(args: argparse.Namespace) -> int:
    import trio

    config = config_from_args(args, **CHAT_DEFAULTS)
    trio.run(_chat_session, args, config)
    return 0


async def _chat_session(args: argparse.Namespace, config: Config) -> None:
    """One runtime for the whole session: later turns of an interactive chat are served hot."""
    from runtime.home import KvmemHome

    home = KvmemHome(config.home_path)
    async with AsyncExitStack() as stack:
        loading = Progress(f"kvmem: loading {config.model}", delay_s=PROGRESS_DELAY_S)
        with nullcontext() if args.json else loading.ticking(_loaded(config.model)):
            rt = await stack.enter_async_context(_open_runtime(config))
        if args.message is not None:
            await _turn(rt, home, config, args, args.message)
            return
        stdin = LineReader(sys.stdin.fileno())
        interactive = sys.stdin.isatty()
        while True:
            if interactive:
                print(f"{args.agent}> ", end="", flush=True)
            line = await stdin.readline()
            if line is None or line.strip() in ("/exit", "/quit"):
                return
            if line.strip():
                await _turn(rt, home, config, args, line)
    # Leaving open_runtime has written every dirty cache to disk (also after Ctrl-C).


class LineReader:
    """Lines of text from a file descriptor, read without blocking the event loop.

    Reading is no MLX work, so it runs on trio's thread pool. It uses
    ``os.read`` rather than ``input()``: a read abandoned by Ctrl-C at the
    prompt must not hold ``sys.stdin``'s lock, which the interpreter takes
    again when it exits (a blocked ``input()`` there aborts the process).
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = b""
        self._eof = False

    async def readline(self) -> str | None:
        """The next line without its line ending; None at end of input."""
        import trio

        while b"\n" not in self._buffer and not self._eof:
            chunk = await trio.to_thread.run_sync(os.read, self._fd, 65536, abandon_on_cancel=True)
            self._eof = not chunk
            self._buffer += chunk
        if not self._buffer:
            return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.rstrip(b"\r").decode("utf-8", errors="replace")


async def _turn(rt: Runtime | OwnerClient, home: KvmemHome, config: Config, args: argparse.Namespace,
                message: str) -> None:
    """Send ``message`` as the agent's next user turn; save the conversation; print the reply and accounting."""
    from runtime.identity import check_agent_id, safe_agent_dirname

    agent_id = check_agent_id(args.agent)
    name = safe_agent_dirname(agent_id)  # the id as checked (NFC): one conversation per agent
    convo = home.load_conversation(name)
    messages: list[dict[str, Any]] = list(convo["messages"])
    if args.system and not messages:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": message})
    options: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                               "seed": args.seed}
    handle = rt.agent(agent_id)
    if args.json:
        result = await handle.send(messages, **options)
    else:
        import trio

        from actors.supervisor import Runtime

        # A server's prefill is the server's to show (its operator page): through it, no progress line.
        progress = PrefillProgress(rt, args.agent) if isinstance(rt, Runtime) else None
        async with handle.stream(messages, **options) as stream, trio.open_nursery() as nursery:
            if progress is not None:
                nursery.start_soon(progress.show)
            try:
                async for delta in stream:
                    if progress is not None:
                        progress.stop()  # the reply begins: the progress line goes first
                    print(delta, end="", flush=True)
            finally:
                if progress is not None:
                    progress.stop()  # also before an error's message
                nursery.cancel_scope.cancel()
        print(flush=True)
        assert stream.result is not None
        result = stream.result
    messages.append({"role": "assistant", "content": result.reply})
    home.save_conversation(name, {"agent": args.agent, "model": config.model, "messages": messages})
    _print_turn(_report(args.agent, result), as_json=args.json)


class PrefillProgress:
    """A long prefill's progress on stderr until the reply begins (not with ``--json``).

    On a terminal, ``[alice] prefill [######------] 1,024/4,096 tokens  180 tokens/s  ETA 17 s``
    redrawn in place; piped, a plain line every few seconds (:mod:`gateway.progress`). Only a
    prefill that lasts :data:`PROGRESS_DELAY_S` shows anything. It reads the runtime's running
    turns (:meth:`actors.supervisor.Runtime.running_turns`: tokens prefilled of the total).
    :meth:`stop` erases the line at once (no checkpoint in between), so the reply never lands behind it.
    """

    EVERY_S = 0.25

    def __init__(self, rt: Runtime, agent: str, *, delay_s: float = PROGRESS_DELAY_S, **options: Any) -> None:
        self._rt = rt
        self._agent = agent
        self._progress = Progress(f"[{agent}] prefill", unit="tokens", delay_s=delay_s, **options)

    async def show(self) -> None:
        """Follow the agent's turn until :meth:`stop` (or cancellation)."""
        import trio

        while True:
            await trio.sleep(self.EVERY_S)
            turn = next((t for t in self._rt.running_turns() if t.agent_id == self._agent), None)
            if turn is not None and turn.phase == "prefill":
                self._progress.update(turn.tokens_prefilled, total=turn.tokens_to_prefill)

    def stop(self) -> None:
        """Erase the line; show nothing more."""
        self._progress.close()


def _loaded(model: str) -> Callable[[Progress], str]:
    return lambda p: f"kvmem: loaded {model} in {p.elapsed_s:.1f} s"


def _report(agent: str, result: TurnResult) -> TurnReport:
    return TurnReport(agent=agent, reply=result.reply, model=result.model, finish_reason=result.finish_reason,
                      usage=result.usage)


def _print_turn(report: TurnReport, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(msgspec.to_builtins(report), ensure_ascii=False), flush=True)
        return
    u = report.usage
    print(
        f"[{report.agent}] tier={u.tier} match={u.match} reused={u.tokens_reused} "
        f"prefilled={u.tokens_prefilled} generated={u.tokens_generated} "
        f"ttft={u.ttft_ms:.1f}ms",
        file=sys.stderr,
        flush=True,
    )


# -- agents and forget ----------------------------------------------------------------


def _agents(args: argparse.Namespace) -> int:
    import trio

    rows = trio.run(_list_agents, config_from_args(args), _tenant_arg(args))
    if args.json:
        print(json.dumps(msgspec.to_builtins(rows)))
        return 0
    if not rows:
        print("no agents yet")
        return 0
    width = max(24, *(len(r.agent) for r in rows))  # a conversation's id is conv- and 64 hex digits
    print(f"{'agent':{width}} {'turns':>5} {'tokens':>7} {'disk':>10}  model")
    for r in rows:
        print(f"{r.agent:{width}} {r.turns:5d} {r.cached_tokens:7d} {r.disk_bytes:10,d}  {r.model}")
    return 0


def _tenant_arg(args: argparse.Namespace) -> str | None:
    """``--tenant``, checked (a bad name is a ConfigError: one line, no traceback)."""
    from runtime.config import ConfigError
    from runtime.identity import check_tenant_name

    try:
        return None if args.tenant is None else check_tenant_name(args.tenant)
    except ValueError as exc:
        raise ConfigError(f"--tenant: {exc}") from None


async def _list_agents(config: Config, tenant: str | None = None) -> list[AgentSummary]:
    from runtime.home import KvmemHome
    from runtime.identity import local_id

    # Listing needs no model; a server holding the home lists its hot agents too.
    async with _open_runtime(config, preload=False) as rt:
        records = await rt.list_agents(tenant=tenant)
    if tenant is not None:  # a tenant's agents have no `kvmem chat` conversations in the home
        return summarize_agents(None, [msgspec.structs.replace(r, agent_id=local_id(r.agent_id)) for r in records])
    return summarize_agents(KvmemHome(config.home_path), records)


def summarize_agents(home: KvmemHome | None, records: list[AgentRecord]) -> list[AgentSummary]:
    """Agents with a conversation in ``home`` or a cache among ``records`` (the store's, one per agent and model)."""
    latest: dict[str, AgentRecord] = {}
    disk_bytes: dict[str, int] = {}
    for r in records:  # an agent's first record is the cache it used last
        latest.setdefault(r.agent_id, r)
        disk_bytes[r.agent_id] = disk_bytes.get(r.agent_id, 0) + r.disk_bytes
    out = []
    # A tenant's agents (home None) have no `kvmem chat` conversations.
    for path in sorted(home.root.joinpath("conversations").glob("*.json")) if home else ():
        assert home is not None
        convo = home.load_conversation(path.stem)
        agent = str(convo.get("agent", path.stem))
        record = latest.pop(agent, None)
        turns = sum(1 for m in convo["messages"] if m.get("role") == "user")
        out.append(AgentSummary(agent=agent, model=str(convo.get("model", "")), turns=turns,
                                cached_tokens=record.num_tokens if record else 0,
                                disk_bytes=disk_bytes.get(agent, 0)))
    for agent, record in latest.items():
        out.append(AgentSummary(agent=agent, model=record.model_tag, turns=0, cached_tokens=record.num_tokens,
                                disk_bytes=disk_bytes[agent]))
    return out


def _forget(args: argparse.Namespace) -> int:
    import trio

    if trio.run(_forget_agent, config_from_args(args), args.agent, _tenant_arg(args)):
        print(f"forgot {args.agent}")
        return 0
    print(f"no agent named {args.agent!r}", file=sys.stderr)
    return 1


async def _forget_agent(config: Config, agent: str, tenant: str | None = None) -> bool:
    """Delete the agent's caches (every model's) and conversation; True if anything existed."""
    from runtime.home import KvmemHome
    from runtime.identity import check_agent_id, namespaced, safe_agent_dirname

    agent = check_agent_id(agent)  # NFC, as every door names it
    name = safe_agent_dirname(agent)
    agent_id = namespaced(tenant, agent)
    # Forgetting needs no model. A server (or another runtime) holding the home forgets the agent
    # itself: only it can drop its hot, unsaved and prefetched copies; this process deletes no cache.
    async with _open_runtime(config, preload=False) as rt:
        had_cache = await rt.agent(agent_id).forget()  # its caches, and blocks no other agent references
    return had_cache if tenant else KvmemHome(config.home_path).delete_conversation(name) or had_cache


# -- build-model ----------------------------------------------------------------------


def _build(args: argparse.Namespace) -> int:
    """Build or prepare the model's files, with progress on stderr; print its folder on stdout."""
    from runtime.model import tiny_models
    from runtime.errors import ModelError
    from runtime.model.loaded import prepare_model_files

    config = config_from_args(args)
    name = args.name
    try:
        if name in tiny_models.RECIPES and not Path(name).exists():
            # A tiny model is generated tensor by tensor: a bar (prepare_model_files then finds it built).
            building = Progress(f"kvmem: building {name}", unit="tensors")
            with building:
                tiny_models.ensure_tiny_model(name, config.models_path,
                                              progress=lambda done, total: building.update(done, total=total))
                building.close(f"kvmem: built {name} in {building.elapsed_s:.1f} s")
            folder = prepare_model_files(name, config.models_path)
        else:  # a GGUF's config and tokenizer folder (once), or a folder as it is: a spinner
            with Progress(f"kvmem: preparing {name}").ticking(lambda p: f"kvmem: prepared {name} in "
                                                                        f"{p.elapsed_s:.1f} s"):
                folder = prepare_model_files(name, config.models_path)
    except ModelError as exc:
        print(f"kvmem: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0
