"""Two nodes and one Redis: TTFT of a turn on another node (remote) vs the same node (warm, hot) vs cold.

Two ``kvmem serve`` subprocesses (node A, node B) with their own cache folders and
``--store`` pointed at one ``redis-server`` on loopback (no persistence). Per
context size C (1K, 4K) one agent, raw-prompt turns through the agent API,
streamed, 16 greedy output tokens each:

1. **cold** on A (nothing anywhere);
2. **remote** on B: B has nothing, Redis has A's turn 1 (pull, then load from disk);
3. B is restarted (SIGTERM: caches flushed and published);
4. **warm** on B: its disk holds what Redis holds (no pull);
5. **hot** on B;
6. **remote'** on A: A's hot cache is turn 1, Redis has B's turns: A drops it and pulls.

Bytes moved are the nodes' own counters (``kvmem_remote_bytes_sent_total`` /
``_received_total``); Redis memory per agent is ``used_memory`` after the agent's
turns minus before.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, log, table
from benches.prompts import context_text
from benches.server import KvmemServer, StreamedTurn, run_turn

QUESTIONS = ("Summarize the notes.", "Why did it matter?", "Where did they go next?", "What did the letter say?",
             "Who wrote it?", "What happened then?")
STATES = ("cold", "remote", "warm", "hot", "remote'")


def _ask(q: str) -> str:
    return f"\n\nUser: {q}\nAssistant:"


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def main(argv: list[str] | None = None) -> None:
    import redis

    p = harness.parser(__doc__, repeats=1)
    p.add_argument("--tokens", type=int, default=16, help="output tokens per turn")
    p.add_argument("--model", default="kvmem-default")
    args = p.parse_args(argv)
    sizes = [1024] if args.quick else [1024, 4096]
    res = ResultFile("redis_tier", "Two nodes and one Redis: cross-node TTFT, bytes per turn, Redis memory",
                     args.quick, argv or [])
    folder = harness.model_dir(args.model)
    samples: dict[tuple[int, str], StreamedTurn] = {}
    moved: dict[tuple[int, str], tuple[float, float]] = {}
    memory: dict[int, float] = {}

    with tempfile.TemporaryDirectory(prefix="kvmem-bench-redis-") as tmp:
        proc, url = _redis(Path(tmp))
        client = redis.Redis.from_url(url)
        flags = ["--store", url]
        a = KvmemServer(Path(tmp) / "a", model=args.model, extra=flags)
        b = KvmemServer(Path(tmp) / "b", model=args.model, extra=flags)
        try:
            a.start()
            b.start()
            prompts: dict[int, str] = {}

            def turn(node: KvmemServer, state: str, c: int, q: int) -> None:
                agent = f"redis-{c}"
                sent, got = _metric(node.url, "kvmem_remote_bytes_sent_total"), _metric(
                    node.url, "kvmem_remote_bytes_received_total")
                t = run_turn(node.url, agent, prompts[c], max_tokens=args.tokens)
                node.wait_saved([agent])
                samples[(c, state)] = t
                moved[(c, state)] = (_metric(node.url, "kvmem_remote_bytes_received_total") - got,
                                     _metric(node.url, "kvmem_remote_bytes_sent_total") - sent)
                res.record(context=c, state=state, node="a" if node is a else "b", ttft_ms=t.ttft_ms,
                           e2e_ms=t.e2e_ms, tier=t.tier, reused=t.reused, prefilled=t.prefilled,
                           bytes_received=moved[(c, state)][0], bytes_sent=moved[(c, state)][1])
                log(f"C={c} {state}: ttft {t.ttft_ms:.0f} ms tier={t.tier} reused={t.reused} "
                    f"prefilled={t.prefilled} received={moved[(c, state)][0]:.0f} sent={moved[(c, state)][1]:.0f}")
                prompts[c] = prompts[c] + t.text + _ask(QUESTIONS[q])

            for c in sizes:
                before = float(client.info("memory")["used_memory"])
                prompts[c] = context_text(folder, c - 12, label=f"redis-{c}", offset=c) + _ask(QUESTIONS[0])
                turn(a, "cold", c, 1)
                turn(b, "remote", c, 2)
                memory[c] = float(client.info("memory")["used_memory"]) - before
            b.restart()
            for c in sizes:
                turn(b, "warm", c, 3)
                turn(b, "hot", c, 4)
                turn(a, "remote'", c, 5)
        finally:
            a.stop()
            b.stop()
            proc.terminate()
            proc.wait()

    rows = []
    for c in sizes:
        s = {state: samples[(c, state)] for state in STATES}
        rows.append([
            f"{c // 1024}K ({s['cold'].prefilled} tok)",
            *(f"{s[state].ttft_ms:.0f}" for state in STATES),
            " / ".join(f"{s[state].tier}" for state in STATES),
            " / ".join(f"{s[state].reused}+{s[state].prefilled}" for state in STATES[1:]),
            f"{moved[(c, 'cold')][1] / 2**20:.2f}",
            f"{moved[(c, 'remote')][0] / 2**20:.2f} / {moved[(c, 'remote')][1] / 2**20:.2f}",
            f"{moved[(c, 'hot')][1] / 2**20:.3f}",
            f"{moved[(c, 'remote' + chr(39))][0] / 2**20:.2f}",
            f"{memory[c] / 2**20:.2f}",
        ])
    res.setup += [
        f"two `kvmem serve --model {args.model} --store redis://127.0.0.1:PORT/0` subprocesses (own cache folders), "
        f"one `redis-server --save '' --appendonly no` on loopback, Q4 KV; {args.tokens} greedy tokens per turn; "
        "one sample per state (a machine shared with other jobs: see the load average)",
    ]
    res.body += [
        *table(["context", "cold TTFT ms", "remote TTFT ms", "warm TTFT ms", "hot TTFT ms", "remote' TTFT ms",
                "tiers", "reused+prefilled remote / warm / hot / remote'", "MiB published (cold turn)",
                "MiB pulled / published (remote turn)", "MiB published (hot turn)", "MiB pulled (remote')",
                "Redis MiB per agent (2 turns)"], rows),
        "",
        ("cold = turn 1 on node A; remote = turn 2 on node B, whose disk has nothing (pulled from Redis, then "
         "loaded from disk); warm = turn 3 on B after a restart (its disk already holds Redis's cache: no pull); "
         "hot = turn 4 on B; remote' = turn 5 on A, whose hot cache (turn 1) is older than Redis's: dropped and "
         "the missing files pulled. Bytes are the nodes' own counters; Redis memory is `used_memory` after the "
         "agent's first two turns minus before."),
    ]
    print(res.write().read_text())


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
