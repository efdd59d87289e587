"""Durability on request: what ``X-Kvmem-Durable`` / ``kvmem serve --durable`` keep under ``kill -9``, and their cost.

Without it a turn's cache is saved *write-behind*: the answer leaves first and the
store writes the cache a few milliseconds later, so a server killed in between
has answered a turn it no longer holds (the next turn re-prefills it). A durable
turn is answered only once its cache is on disk. One run measures, side by side
(``kvmem serve`` subprocesses on tiny-llama by default, fsync on):

1. **kill -9 right after the answer.** One cache directory across all trials, the
   modes interleaved (seeded shuffle). A trial: the server runs with the mode's
   flags; one turn on the mode's agent (its history, from disk) and its save seen
   on disk; then the measured turn (``POST /v1/agents/{id}/messages``, a prompt
   past 256 tokens so block files are written too) and ``SIGKILL`` the moment its
   answer has arrived (for a stream: its ``done`` event). The server restarts on
   the same directory and ``GET /v1/agents/{id}`` says how many tokens its stored
   cache holds: the turn is *kept* when that covers the turn
   (``tokens_reused + tokens_prefilled + tokens_generated - 1``, the last token
   generated is never fed back), else *lost*. The manifest read straight from the
   disk after the kill must say the same. Modes: write-behind; durable by header
   (``X-Kvmem-Durable: true``); durable by setting (``--durable``, no header);
   ``--durable`` with ``X-Kvmem-Durable: false`` (the header overrides: write-behind);
   streaming write-behind and streaming durable (header).
2. **The write-behind window**: on one server, the time from a write-behind
   answer's arrival until the turn's manifest is on disk, i.e. the time in which
   a kill loses an answered turn. It is watched on the disk itself (the manifest
   file polled every 0.25 ms from this process), not through ``GET
   /v1/agents/{id}``: the store runs that listing and the saves on one disk
   thread, so a GET sent during a save waits for it and always reads "saved".
3. **Hot-path cost**: on that server, hot turns of one agent alternate durable and
   write-behind (pairs in ABBA order, each turn growing the context alike: its
   reply and one sentence; a new agent every 25 pairs, so contexts stay 0.6K-2K
   tokens); client-side end-to-end latency of the non-streaming
   request. Every turn starts once the previous one's save is on disk, so a
   write-behind save never overlaps the next turn. Reported: medians per mode,
   the median of the per-pair differences, and the ratio.

Run: ``python -m benches durability [--quick] [--trials N] [--pairs N] [--model NAME]``;
``tests/test_reliability_durable.py`` uses :func:`kill_trials` and :func:`turn`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benches.harness import BENCH_HOME, ResultFile, log, median, pyplot, save_figure, table
from benches.load import MODEL, percentile, start_server

SEED_TEXT = ("The harbour master kept a ledger of every ship that came in, with its cargo, its crew and the "
             "weather of the day. ") * 12
GROWTH = " Next entry: the tide turned and the harbour was calm."
POLL_S = 0.00025


@dataclass(frozen=True)
class Mode:
    """How a turn asks for durability: the request header, the server's ``--durable`` setting, streaming."""

    name: str
    header: str | None  # X-Kvmem-Durable, None: absent
    server_durable: bool
    stream: bool = False

    @property
    def durable(self) -> bool:
        return self.header == "true" if self.header is not None else self.server_durable

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.name.lower()).strip("-")


WRITE_BEHIND = Mode("write-behind", None, False)
DURABLE_HEADER = Mode("durable (header)", "true", False)
DURABLE_SETTING = Mode("durable (--durable)", None, True)
OVERRIDDEN = Mode("--durable, header false", "false", True)
STREAM_WRITE_BEHIND = Mode("stream, write-behind", None, False, stream=True)
STREAM_DURABLE = Mode("stream, durable (header)", "true", False, stream=True)
MODES = (WRITE_BEHIND, DURABLE_HEADER, DURABLE_SETTING, OVERRIDDEN, STREAM_WRITE_BEHIND, STREAM_DURABLE)


@dataclass
class Agent:
    """One agent's conversation: its id and the prompt its next turn sends (the whole history)."""

    agent_id: str
    prompt: str


@dataclass
class Turn:
    """One finished turn as the client saw it."""

    reply: str
    usage: dict[str, Any]
    e2e_ms: float
    arrived: float  # perf_counter() when the answer (a stream's done event) was in

    @property
    def cache_tokens(self) -> int:
        """Tokens the agent's cache holds after this turn (the last generated token is never fed back)."""
        u = self.usage
        return int(u["tokens_reused"] + u["tokens_prefilled"] + u["tokens_generated"]) - 1


def agent_dir(cache_dir: Path, agent_id: str) -> Path:
    """Where ``kvmem serve --cache-dir cache_dir`` keeps ``agent_id``'s files."""
    from runtime.identity import safe_agent_dirname

    return cache_dir / "caches" / "agents" / safe_agent_dirname(agent_id)


def stored_tokens(cache_dir: Path, agent_id: str) -> int:
    """Tokens of the agent's newest cache on disk, read from its manifests (0: none); never asks the server."""
    from runtime.persist.manifests import read_listings

    try:
        listings = read_listings(agent_dir(cache_dir, agent_id))
    except OSError:
        return 0
    return max((ls.manifest.num_tokens for ls in listings if ls.manifest is not None), default=0)


def _manifest_stamp(folder: Path) -> tuple[tuple[str, int, int], ...]:
    try:
        with os.scandir(folder) as entries:
            return tuple(sorted((e.name, e.inode(), e.stat().st_mtime_ns) for e in entries
                                if e.name.startswith("manifest")))
    except FileNotFoundError:
        return ()


def wait_saved(cache_dir: Path, agent_id: str, tokens: int, *, timeout_s: float = 10.0) -> float:
    """Poll the disk until the agent's stored cache holds ``tokens``; the perf_counter() when it did."""
    folder = agent_dir(cache_dir, agent_id)
    deadline = time.perf_counter() + timeout_s
    stamp: tuple[tuple[str, int, int], ...] | None = None
    while True:
        now = _manifest_stamp(folder)
        if now != stamp:  # a manifest was replaced: read it
            seen = time.perf_counter()
            stamp = now
            if stored_tokens(cache_dir, agent_id) >= tokens:
                return seen
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{agent_id}: no cache of {tokens} tokens on disk after {timeout_s} s")
        time.sleep(POLL_S)


def turn(http: httpx.Client, agent: Agent, *, header: str | None, stream: bool = False, max_tokens: int = 16,
         on_answer: Callable[[], None] | None = None) -> Turn:
    """One turn of ``agent`` (``X-Kvmem-Durable: header`` unless None); ``on_answer`` runs the moment it is in.

    The agent's prompt then grows by the reply and :data:`GROWTH`.
    """
    headers = {"x-kvmem-durable": header} if header is not None else {}
    body = {"prompt": agent.prompt, "max_tokens": max_tokens, "share_prefix": False, "stream": stream}
    path = f"/v1/agents/{agent.agent_id}/messages"
    started = arrived = time.perf_counter()
    if not stream:
        response = http.post(path, json=body, headers=headers)
        arrived = time.perf_counter()
        if on_answer is not None:
            on_answer()
        if response.status_code != 200:
            raise RuntimeError(f"{path} -> {response.status_code}: {response.text[:300]}")
        result = response.json()
    else:
        result = None
        with http.stream("POST", path, json=body, headers=headers) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{path} -> {response.status_code}: {response.read()[:300]!r}")
            event = ""
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event in ("done", "error"):
                    arrived = time.perf_counter()
                    if on_answer is not None:
                        on_answer()
                    if event == "error":
                        raise RuntimeError(f"stream error: {line}")
                    result = json.loads(line[6:])
                    break
        if result is None:
            raise RuntimeError(f"{path}: the stream ended without a done event")
    agent.prompt += result["reply"] + GROWTH
    return Turn(reply=result["reply"], usage=result["usage"], e2e_ms=(arrived - started) * 1000, arrived=arrived)


# -- 1. kill -9 right after the answer -----------------------------------------------------------


@dataclass
class KillTrial:
    """One kill: what the turn needed on disk, and what the restarted server found."""

    mode: str
    durable: bool
    agent_id: str
    e2e_ms: float
    cache_tokens: int  # the turn's cache (prompt + generated - 1)
    previous_tokens: int  # the agent's stored cache before the turn
    kill_after_ms: float  # answer arrived -> SIGKILL sent
    on_disk_after_kill: int = -1  # the manifest read from the disk after the kill
    served_after_restart: int = -1  # GET /v1/agents/{id} cached_tokens on the restarted server

    @property
    def lost(self) -> bool:
        return self.served_after_restart < self.cache_tokens


@dataclass
class KillOutcome:
    trials: list[KillTrial] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)  # disk and server told different stories
    wall_s: float = 0.0

    def of(self, mode: Mode) -> list[KillTrial]:
        return [t for t in self.trials if t.mode == mode.name]


def _server(cache_dir: Path, mode: Mode, *, model: str, home: str | None) -> tuple[subprocess.Popen[str], str]:
    # start_server names tiny-llama; a later --model wins (argparse keeps the last)
    extra = ["--model", model, "--prewarm-mb", "0", *(["--durable"] if mode.server_durable else [])]
    proc, url, _lines = start_server(cache_dir, budget_mb=512, hot_budget_mb=64, extra=extra, home=home)
    return proc, url


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


def kill_trials(schedule: list[Mode], *, cache_dir: Path, model: str = MODEL, home: str | None = None,
                max_tokens: int = 16) -> KillOutcome:
    """Run one kill trial per entry of ``schedule``, in order (see the module docstring, 1)."""
    out = KillOutcome()
    agents = {m.name: Agent(f"kill-{m.slug}", f"Ledger of {m.name}. " + SEED_TEXT) for m in schedule}
    began = time.monotonic()
    proc, url = _server(cache_dir, schedule[0], model=model, home=home)
    try:
        pending: KillTrial | None = None
        for i, mode in enumerate(schedule):
            agent = agents[mode.name]
            with httpx.Client(base_url=url, timeout=httpx.Timeout(120, connect=5)) as http:
                if pending is not None:  # what the last kill left, as this server sees it
                    info = http.get(f"/v1/agents/{pending.agent_id}")
                    pending.served_after_restart = info.json()["cached_tokens"] if info.status_code == 200 else 0
                    if (pending.served_after_restart >= pending.cache_tokens) != (
                            pending.on_disk_after_kill >= pending.cache_tokens):
                        out.disagreements.append(f"{pending}")
                    pending = None
                warm = turn(http, agent, header="false", max_tokens=max_tokens)  # history, hot, saved
                wait_saved(cache_dir, agent.agent_id, warm.cache_tokens)
                killed: list[float] = []

                def kill_now() -> None:
                    proc.send_signal(signal.SIGKILL)
                    killed.append(time.perf_counter())

                measured = turn(http, agent, header=mode.header, stream=mode.stream, max_tokens=max_tokens,
                                on_answer=kill_now)
            proc.wait(30)
            pending = KillTrial(mode=mode.name, durable=mode.durable, agent_id=agent.agent_id,
                                e2e_ms=measured.e2e_ms, cache_tokens=measured.cache_tokens,
                                previous_tokens=warm.cache_tokens,
                                kill_after_ms=(killed[0] - measured.arrived) * 1000,
                                on_disk_after_kill=stored_tokens(cache_dir, agent.agent_id))
            out.trials.append(pending)
            log(f"kill {i + 1}/{len(schedule)} {mode.name}: "
                f"{'kept' if pending.on_disk_after_kill >= pending.cache_tokens else 'LOST'} on disk")
            proc, url = _server(cache_dir, schedule[min(i + 1, len(schedule) - 1)], model=model, home=home)
        if pending is not None:
            with httpx.Client(base_url=url, timeout=httpx.Timeout(60, connect=5)) as http:
                info = http.get(f"/v1/agents/{pending.agent_id}")
                pending.served_after_restart = info.json()["cached_tokens"] if info.status_code == 200 else 0
            if (pending.served_after_restart >= pending.cache_tokens) != (
                    pending.on_disk_after_kill >= pending.cache_tokens):
                out.disagreements.append(f"{pending}")
    finally:
        _kill(proc)
    out.wall_s = time.monotonic() - began
    return out


def schedule_of(counts: dict[Mode, int], seed: int) -> list[Mode]:
    """``counts[m]`` trials of each mode, shuffled (seeded) so the machine's load drifts over all alike."""
    modes = [m for m, n in counts.items() for _ in range(n)]
    random.Random(seed).shuffle(modes)
    return modes


# -- 2 and 3. the write-behind window and the hot path ---------------------------------------------


@dataclass
class HotTurn:
    pair: int
    durable: bool
    e2e_ms: float
    ttft_ms: float
    cache_tokens: int
    on_disk_at_answer: bool  # the manifest already held the turn when the answer was in
    window_ms: float  # answer in -> manifest on disk (0 when it was there already)


def hot_turns(url: str, *, cache_dir: Path, pairs: int, max_tokens: int = 16, pairs_per_agent: int = 25,
              prefix: str = "hot-path") -> list[HotTurn]:
    """``pairs`` pairs of hot turns, durable and write-behind in ABBA order (module docstring, 2-3).

    One agent takes ``pairs_per_agent`` pairs, then the next starts (so contexts stay 0.6K-2K tokens).
    """
    out: list[HotTurn] = []
    with httpx.Client(base_url=url, timeout=httpx.Timeout(120, connect=5)) as http:
        for first in range(0, pairs, pairs_per_agent):
            agent = Agent(f"{prefix}-{first // pairs_per_agent}", "Ledger of the hot path. " + SEED_TEXT)
            for _ in range(2):  # cold, then a hot turn of each kind, unmeasured
                done = turn(http, agent, header="false", max_tokens=max_tokens)
                wait_saved(cache_dir, agent.agent_id, done.cache_tokens)
            done = turn(http, agent, header="true", max_tokens=max_tokens)
            for pair in range(first, min(pairs, first + pairs_per_agent)):
                for durable in ((False, True) if pair % 2 == 0 else (True, False)):
                    done = turn(http, agent, header="true" if durable else "false", max_tokens=max_tokens)
                    at_answer = stored_tokens(cache_dir, agent.agent_id) >= done.cache_tokens
                    saved = done.arrived if at_answer else wait_saved(cache_dir, agent.agent_id, done.cache_tokens)
                    out.append(HotTurn(pair=pair, durable=durable, e2e_ms=done.e2e_ms,
                                       ttft_ms=float(done.usage.get("ttft_ms") or 0.0),
                                       cache_tokens=done.cache_tokens, on_disk_at_answer=at_answer,
                                       window_ms=max(0.0, (saved - done.arrived) * 1000)))
    return out


# -- the program -----------------------------------------------------------------------------------


def _kill_rows(outcome: KillOutcome) -> list[list[Any]]:
    rows = []
    for mode in MODES:
        trials = outcome.of(mode)
        if not trials:
            continue
        lost = sum(t.lost for t in trials)
        rows.append([mode.name, "yes" if mode.durable else "no", len(trials), len(trials) - lost, lost,
                     f"{median(t.kill_after_ms for t in trials):.2f}", f"{median(t.e2e_ms for t in trials):.0f}"])
    return rows


def median_interval(values: list[float], *, seed: int = 0, rounds: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (resampled with replacement, seeded)."""
    if not values:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    medians = sorted(median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def pair_differences(hot: list[HotTurn]) -> list[float]:
    """Durable minus write-behind E2E of each pair (ms): the machine's load drifts out."""
    by_pair: dict[int, dict[bool, float]] = {}
    for t in hot:
        by_pair.setdefault(t.pair, {})[t.durable] = t.e2e_ms
    return [p[True] - p[False] for p in by_pair.values() if len(p) == 2]


def _plot(res: ResultFile, hot: list[HotTurn], outcome: KillOutcome) -> None:
    plt = pyplot()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    pairs = sorted({t.pair for t in hot})
    for durable, color, label in ((False, "tab:blue", "write-behind"), (True, "tab:red", "durable")):
        ys = [next(t.e2e_ms for t in hot if t.pair == p and t.durable == durable) for p in pairs]
        left.plot(pairs, ys, "o-", color=color, ms=3, lw=1, label=f"{label} (median {median(ys):.0f} ms)")
    left.set_xlabel("pair (a new agent every 25; context grows within)")
    left.set_ylabel("end-to-end latency, non-streaming (ms)")
    left.set_title("hot turns, durable and write-behind alternating")
    left.legend(fontsize=8)
    diffs = pair_differences(hot)
    low, high = median_interval(diffs)
    middle.hist(diffs, bins=25, color="tab:purple", alpha=0.8)
    middle.axvline(median(diffs), color="black",
                   label=f"median {median(diffs):+.1f} ms (95% CI {low:+.1f}..{high:+.1f})")
    middle.axvline(0, color="grey", ls=":")
    middle.set_xlabel("durable - write-behind, same pair (ms)")
    middle.set_ylabel("pairs")
    middle.set_title("hot-path cost per pair")
    middle.legend(fontsize=8)
    windows = [t.window_ms for t in hot if not t.durable]
    right.hist(windows, bins=20, color="tab:blue", alpha=0.8, label="write-behind: answer -> on disk")
    kills = [t.kill_after_ms for t in outcome.trials]
    if kills:
        right.axvline(median(kills), color="black", ls="--", label=f"kill sent {median(kills):.2f} ms after answer")
    right.set_xlabel("ms after the answer arrived")
    right.set_ylabel("turns")
    right.set_title("write-behind window (a kill inside it loses the turn)")
    right.legend(fontsize=8)
    save_figure(res, fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short run (fewer trials and pairs)")
    p.add_argument("--trials", type=int, help="kill trials per main mode (write-behind, durable by header); "
                   "the other modes get a third of it (default 20; 4 with --quick)")
    p.add_argument("--pairs", type=int, help="durable / write-behind pairs of hot turns, 25 per agent "
                   "(default 100; 10 with --quick)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default=MODEL, help=f"a model kvmem serve knows (default {MODEL}; kvmem-default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    trials = args.trials if args.trials is not None else (4 if args.quick else 20)
    pairs = args.pairs if args.pairs is not None else (10 if args.quick else 100)
    minor = max(1, trials // 3) if trials else 0
    counts = {WRITE_BEHIND: trials, DURABLE_HEADER: trials, DURABLE_SETTING: minor, OVERRIDDEN: minor,
              STREAM_WRITE_BEHIND: minor, STREAM_DURABLE: minor}
    home = str(BENCH_HOME)
    res = ResultFile("durability", "Durability on request: kill -9 after the answer, the write-behind window, "
                     "hot-path cost", args.quick, argv or [], model=args.model,
                     variant="" if args.model == MODEL else f"_{args.model}")
    res.setup += [
        f"`kvmem serve --model {args.model} --budget-mb 512 --hot-budget-mb 64 --prewarm-mb 0` "
        "(fsync on, the default), a fresh cache directory; `POST /v1/agents/{id}/messages` with `prompt` "
        f"(a first prompt of {len(SEED_TEXT)} characters: about 490 tiny-llama tokens, 310 kvmem-default tokens, past "
        f"one 256-token block, so block files are written too), `max_tokens` {args.max_tokens}, greedy",
        "durable turns: `X-Kvmem-Durable: true`, or the server's `--durable` with no header",
    ]
    with tempfile.TemporaryDirectory(prefix="kvmem-durability-") as tmp:
        outcome = KillOutcome()
        if trials:
            schedule = schedule_of(counts, args.seed)
            log(f"{len(schedule)} kill trials")
            outcome = kill_trials(schedule, cache_dir=Path(tmp) / "kill", model=args.model, home=home,
                                  max_tokens=args.max_tokens)
        log(f"{pairs} pairs of hot turns")
        proc, url = _server(Path(tmp) / "hot", WRITE_BEHIND, model=args.model, home=home)
        try:
            hot = hot_turns(url, cache_dir=Path(tmp) / "hot", pairs=pairs, max_tokens=args.max_tokens)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)

    for t in outcome.trials:
        res.record(kind="kill", **asdict(t), lost=t.lost)
    for h in hot:
        res.record(kind="hot", **asdict(h))
    wb = [t for t in hot if not t.durable]
    du = [t for t in hot if t.durable]
    windows = [t.window_ms for t in wb]
    diffs = pair_differences(hot)
    low, high = median_interval(diffs)
    wb_med, du_med = median(t.e2e_ms for t in wb), median(t.e2e_ms for t in du)
    durable_lost = sum(t.lost for t in outcome.trials if t.durable)
    wb_trials = [t for t in outcome.trials if not t.durable]

    body = []
    if outcome.trials:
        body += [
            "## 1. kill -9 the moment the answer arrives",
            "",
            f"{len(outcome.trials)} trials on one cache directory, modes interleaved; after each kill the server "
            "restarts on the directory and `GET /v1/agents/{id}` must show a cache covering the turn "
            "(prompt + generated - 1 tokens). Kill sent a median "
            f"{median(t.kill_after_ms for t in outcome.trials):.2f} ms after the answer was in "
            f"(wall {outcome.wall_s:.0f} s).",
            "",
            *table(["mode", "durable", "trials", "kept", "lost", "kill after answer, median ms",
                    "E2E median ms"], _kill_rows(outcome)),
            "",
            f"**Durable turns lost: {durable_lost} of {sum(t.durable for t in outcome.trials)}.** "
            f"Write-behind turns lost: {sum(t.lost for t in wb_trials)} of {len(wb_trials)}. "
            f"Disk and restarted server disagreed on {len(outcome.disagreements)} trials.",
            "",
        ]
    body += [
        "## 2. The write-behind window",
        "",
        f"{len(wb)} write-behind hot turns (part 3): from the answer's arrival until the turn's manifest is on "
        "disk, watched on the disk (every 0.25 ms). A `kill -9` inside this window loses the answered turn; "
        f"{sum(t.on_disk_at_answer for t in wb)} of {len(wb)} were on disk when the answer arrived. "
        f"Durable turns on disk at the answer: {sum(t.on_disk_at_answer for t in du)} of {len(du)}.",
        "",
        *table(["", "median ms", "p90 ms", "max ms", "min ms"],
               [["answer -> on disk (write-behind)", f"{median(windows):.1f}", f"{percentile(windows, 0.9):.1f}",
                 f"{max(windows):.1f}", f"{min(windows):.1f}"]]),
        "",
        "## 3. Hot-path cost",
        "",
        f"{pairs} pairs of hot turns (ABBA order), {min(pairs, 25)} pairs per agent, then a new agent "
        f"(contexts {min((t.cache_tokens for t in hot), default=0)}-{max((t.cache_tokens for t in hot), default=0)}"
        " tokens); client-side E2E of the non-streaming request.",
        "",
        *table(["mode", "turns", "E2E median ms", "E2E p90 ms", "server TTFT median ms"],
               [["write-behind", len(wb), f"{wb_med:.1f}", f"{percentile([t.e2e_ms for t in wb], 0.9):.1f}",
                 f"{median(t.ttft_ms for t in wb):.1f}"],
                ["durable", len(du), f"{du_med:.1f}", f"{percentile([t.e2e_ms for t in du], 0.9):.1f}",
                 f"{median(t.ttft_ms for t in du):.1f}"]]),
        "",
        f"Durable minus write-behind, per pair (the machine's load drifts out): median **{median(diffs):+.1f} ms** "
        f"(95% bootstrap interval {low:+.1f} to {high:+.1f} ms), **{median(diffs) / wb_med:+.1%}** of a "
        f"write-behind turn's median E2E; difference of the medians {du_med - wb_med:+.1f} ms "
        f"(ratio {du_med / wb_med:.2f}x). What a durable turn adds is its save, which a write-behind turn does "
        f"after its answer (that save ends a median {median(windows):.1f} ms after the answer, having started "
        "a little before it).",
        "",
    ]
    res.body = body
    if args.model != MODEL:  # its geometry from the folder the server prepared, not a float32 copy (model_dir)
        prepared = sorted((BENCH_HOME / "models" / "gguf").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
        res.model = str(prepared[-1].parent) if prepared else None
    _plot(res, hot, outcome)
    path = res.write(plot=True)
    print(path)
    print("\n".join(body))
    return 0 if durable_lost == 0 and not outcome.disagreements else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
