"""A bystander's first token while other clients send prompts far too large for the context (issue 58, item 1).

One ``kvmem serve`` on kvmem-default (8,192-token context). The *bystander* sends short streamed turns
(``POST /v1/chat/completions``, a new agent each, a ~60-token question, ``max_tokens`` 4) one after
another and times its first streamed content delta. In alternating blocks it does so alone, then while two
*attackers* loop: each streams a ~3.5 MB prompt (well under the 4 MiB body limit) and hangs up as soon
as it has the status line, or after ``--hang-up-s`` if none comes. Reported: the bystander's first
token alone and attacked (medians), their ratio (issue 58's goal: at most 1.5x), and what the attackers got
(status codes, time to their answer).

Why it holds: kvmem refuses a prompt whose length alone shows it cannot fit the context before it is
tokenized (``actors.gpu._refuse_from_length``: each token covers at most the vocabulary's longest entry,
162 bytes here, so 3.5 MB is at least ~21,600 tokens); a body over 256 KB is measured and decoded on a
worker thread (``gateway.context.decode_body``); a prompt past 64K characters is tokenized by its own
worker (``actors.gpu.LONG_TEXT_CHARS``), and an idle loop never waits for it; a queued text job whose
client left is dropped unrun.

Run: ``python -m benches huge_prompts [--quick] [--blocks N] [--per-block N]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from benches import harness
from benches.harness import ResultFile, log, median, table
from benches.server import KvmemServer

MODEL = "kvmem-default"
ATTACK_BYTES = 3_500_000
QUESTION = ("You are a helpful assistant for a small library. A reader asks: which three books would you "
            "suggest for someone who liked a long novel about the sea, and why? Answer briefly.")


def _attack_body(salt: int) -> bytes:
    words = f"storm {salt} harbour lantern keel tide rope gull "
    text = (words * (ATTACK_BYTES // len(words) + 1))[:ATTACK_BYTES]
    return json.dumps({"model": MODEL, "max_tokens": 16, "stream": True,
                       "messages": [{"role": "user", "content": text}]}).encode()


async def _bystander_turn(client: httpx.AsyncClient, url: str, n: int) -> float:
    """One short streamed turn of a new agent; ms to its first content delta."""
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": f"[{n}] {QUESTION}"}]}
    t0 = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"X-Agent-ID": f"bystander-{n}"}, timeout=300) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data:") and '"content"' in line:
                chunk = json.loads(line[5:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    return (time.perf_counter() - t0) * 1e3
    return (time.perf_counter() - t0) * 1e3


async def _attacker(url: str, name: str, hang_up_s: float, outcomes: list[dict[str, Any]]) -> None:
    """Loop: send a huge prompt, hang up at the status line (or after ``hang_up_s``)."""
    body = _attack_body(len(outcomes))
    async with httpx.AsyncClient(timeout=None) as client:
        i = 0
        while True:
            i += 1
            t0 = time.perf_counter()
            status: int | None = None
            with trio.move_on_after(hang_up_s):
                async with client.stream("POST", f"{url}/v1/chat/completions", content=body,
                                         headers={"content-type": "application/json",
                                                  "X-Agent-ID": f"{name}-{i}"}) as resp:
                    status = resp.status_code  # and hang up: the stream is closed unread
            outcomes.append({"attacker": name, "status": status, "ms": (time.perf_counter() - t0) * 1e3})
            await trio.sleep(0)


async def _measure(url: str, *, blocks: int, per_block: int, hang_up_s: float,
                   res: ResultFile) -> tuple[list[float], list[float], list[dict[str, Any]]]:
    alone: list[float] = []
    attacked: list[float] = []
    outcomes: list[dict[str, Any]] = []
    n = 0
    async with httpx.AsyncClient() as client:
        await _bystander_turn(client, url, -1)  # the first turn after a load compiles and faults in
        for block in range(blocks):
            for mode in ("alone", "attacked") if block % 2 == 0 else ("attacked", "alone"):
                async with trio.open_nursery() as nursery:
                    if mode == "attacked":
                        for name in ("attacker-a", "attacker-b"):
                            nursery.start_soon(_attacker, url, name, hang_up_s, outcomes)
                        await trio.sleep(1.0)  # the attack under way
                    for _ in range(per_block):
                        n += 1
                        ms = await _bystander_turn(client, url, n)
                        (alone if mode == "alone" else attacked).append(ms)
                        res.record(block=block, mode=mode, bystander_ttft_ms=ms)
                        log(f"block {block} {mode}: bystander first token {ms:.0f} ms")
                    nursery.cancel_scope.cancel()
                await trio.sleep(0.5)  # whatever the attack left queued drains before the next block
    return alone, attacked, outcomes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 blocks of 3 turns a mode")
    p.add_argument("--blocks", type=int, help="alternating alone/attacked blocks (default 6; quick 2)")
    p.add_argument("--per-block", type=int, help="bystander turns per block and mode (default 5; quick 3)")
    p.add_argument("--hang-up-s", type=float, default=2.0,
                   help="an attacker hangs up at its status line or after this long")
    args = p.parse_args(argv)
    blocks = args.blocks or (2 if args.quick else 6)
    per_block = args.per_block or (3 if args.quick else 5)
    res = ResultFile("huge_prompts", "A bystander's first token while others send 3.5 MB prompts", args.quick,
                     argv or [])
    res.setup.append(f"`kvmem serve --model {MODEL}` (a fresh cache directory); bystander: streamed OpenAI turns "
                     f"of a new agent each, ~60 prompt tokens, `max_tokens` 4, greedy; attackers: 2 clients "
                     f"looping {ATTACK_BYTES / 1e6:.1f} MB prompts (streamed, hanging up at the status line or after "
                     f"{args.hang_up_s:g} s); {blocks} blocks x {per_block} bystander turns a mode, the order "
                     "alternating")
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-huge-") as tmp, KvmemServer(Path(tmp) / "kv") as server:
        alone, attacked, outcomes = trio.run(lambda: _measure(server.url, blocks=blocks, per_block=per_block,
                                                              hang_up_s=args.hang_up_s, res=res))
    for o in outcomes:
        res.record(**o)
    ratio = median(attacked) / median(alone)
    statuses: dict[str, int] = {}
    for o in outcomes:
        statuses[str(o["status"])] = statuses.get(str(o["status"]), 0) + 1
    answered = [o["ms"] for o in outcomes if o["status"] is not None]
    res.body += [
        "## The bystander's first token",
        "",
        *table(["mode", "turns", "median ms", "min ms", "max ms"],
               [["alone", len(alone), f"{median(alone):.0f}", f"{min(alone):.0f}", f"{max(alone):.0f}"],
                ["two clients sending 3.5 MB prompts", len(attacked), f"{median(attacked):.0f}",
                 f"{min(attacked):.0f}", f"{max(attacked):.0f}"]]),
        "",
        f"**Attacked / alone: {ratio:.2f}x** (issue 58's goal: at most 1.5x; "
        f"{'met' if ratio <= 1.5 else 'NOT met'}).",
        "",
        "## What the attackers got",
        "",
        *table(["status", "requests"], sorted(statuses.items())),
        "",
        f"{len(outcomes)} huge requests in all; answered ones got their status a median "
        f"{median(answered) if answered else float('nan'):.0f} ms after they began sending (upload, JSON decode "
        "on a worker thread, the template, and the length bound's refusal).",
    ]
    path = res.write()
    log(f"wrote {path}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
