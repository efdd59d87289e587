"""Local agents from the command line: ``kvmem chat``, ``kvmem agents``, ``kvmem forget``, ``kvmem build-model``.

``kvmem chat --agent NAME "message"`` talks to one agent whose conversation and
KV cache persist across separate runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gateway.cli_common import add_model_options

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add this module's subcommands to the ``kvmem`` parser."""
    chat = sub.add_parser("chat", help="send a message to an agent (interactive without a message)")
    chat.add_argument("message", nargs="?", help="the user message; omit for an interactive session")
    chat.add_argument("--agent", required=True, help="agent name: its memory persists across runs")
    chat.add_argument("--system", help="system prompt for a new agent")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--json", action="store_true", help="print one JSON object per turn")
    add_model_options(chat)
    chat.set_defaults(func=_chat)

    agents = sub.add_parser("agents", help="list agents and their cache sizes")
    agents.add_argument("--json", action="store_true")
    add_model_options(agents)
    agents.set_defaults(func=_agents)

    forget = sub.add_parser("forget", help="delete an agent's conversation and cache")
    forget.add_argument("agent")
    add_model_options(forget)
    forget.set_defaults(func=_forget)

    build = sub.add_parser("build-model", help="prepare a model's files (kvmem-default, a GGUF, or a tiny test model)")
    build.add_argument("name", nargs="?", default="kvmem-default")
    add_model_options(build)
    build.set_defaults(func=_build)


def _session(args: argparse.Namespace) -> Any:
    from runtime.chat import ChatSession
    from runtime.home import KvmemHome, Settings

    kv_bits: Any = None
    if args.kv_bits is not None:
        kv_bits = 0 if args.kv_bits.lower() in ("float", "none", "0") else int(args.kv_bits)
    settings = Settings.from_env(model=args.model, attention=args.attention, weights=args.weights)
    if kv_bits is not None:
        settings = Settings(**{**settings.__dict__, "kv_bits": kv_bits or None})
    return ChatSession(KvmemHome(args.home), settings)


def _print_turn(report: Any, *, as_json: bool, streamed: bool) -> None:
    if as_json:
        print(json.dumps(report.to_json(), ensure_ascii=False), flush=True)
        return
    if not streamed:
        print(report.reply)
    print(
        f"[{report.agent}] tier={report.tier} match={report.match} reused={report.tokens_reused} "
        f"prefilled={report.tokens_prefilled} generated={report.tokens_generated} "
        f"ttft={report.ttft_ms:.1f}ms",
        file=sys.stderr,
        flush=True,
    )


def _chat(args: argparse.Namespace) -> int:
    from runtime.sampling import SamplingParams

    session = _session(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)

    def one(message: str) -> None:
        stream = None if args.json else (lambda t: print(t, end="", flush=True))
        report = session.turn(args.agent, message, system=args.system, params=params, on_text=stream)
        if stream:
            print(flush=True)
        _print_turn(report, as_json=args.json, streamed=stream is not None)

    if args.message is not None:
        one(args.message)
        return 0
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input(f"{args.agent}> " if interactive else "")
        except EOFError:
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip():
            one(line)


def _agents(args: argparse.Namespace) -> int:
    rows = _session(args).agents()
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))
        return 0
    if not rows:
        print("no agents yet")
        return 0
    print(f"{'agent':24} {'turns':>5} {'tokens':>7} {'disk':>10}  model")
    for r in rows:
        print(f"{r.agent:24} {r.turns:5d} {r.cached_tokens:7d} {r.disk_bytes:10,d}  {r.model}")
    return 0


def _forget(args: argparse.Namespace) -> int:
    if _session(args).forget(args.agent):
        print(f"forgot {args.agent}")
        return 0
    print(f"no agent named {args.agent!r}", file=sys.stderr)
    return 1


def _build(args: argparse.Namespace) -> int:
    from runtime.errors import ModelError
    from runtime.home import KvmemHome
    from runtime.models import prepare_model_files

    try:
        print(prepare_model_files(args.name, KvmemHome(args.home).models_dir))
    except ModelError as exc:
        print(f"kvmem: {exc}", file=sys.stderr)
        return 1
    return 0
