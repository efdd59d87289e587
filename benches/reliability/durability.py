"""Durable by default: what a ``kill -9`` 0-50 ms after the answer keeps, per mode, and what durability costs.

kvmem answers a turn (the non-streaming body, a stream's final ``done`` event) only
once the turn's cache is saved on disk (fsync on): a turn answered is a turn kept.
Two opt-outs make the save *write-behind* (the answer leaves first, the cache lands
on disk a few milliseconds later, so a server killed in between answered a turn it
no longer holds and the next turn re-prefills it): the operator's ``kvmem serve
--no-durable`` (``KVMEM_DURABLE=0``, TOML ``durable = false``) and a request's
``X-Kvmem-Durable: false``; ``X-Kvmem-Durable: true`` asks for durability on a
``--no-durable`` server. One run measures, side by side (``kvmem serve``
subprocesses, fsync on, ``KVMEM_DURABLE`` and ``KVMEM_CONFIG`` removed from their
environment so "default" is the built-in default):

1. **kill -9 0-50 ms after the answer.** One cache directory across all trials, the
   modes interleaved (seeded shuffle). A trial: the server runs with the mode's
   flags; one write-behind turn on the mode's agent (its history, from disk) and
   its save seen on disk; then the measured turn (``POST /v1/agents/{id}/messages``,
   contexts of 360-890 tokens on kvmem-default, 550-1230 on tiny-llama, past one
   256-token block, so block files are written too; a new agent every 10 trials of a mode) and ``SIGKILL`` at a delay drawn
   uniformly from 0 to 50 ms (seeded) after its answer has arrived (for a stream:
   its ``done`` event); the delay actually taken is recorded. The server restarts on
   the same directory and ``GET /v1/agents/{id}`` says how many tokens its stored
   cache holds: the turn is *kept* when that covers the turn (``tokens_reused +
   tokens_prefilled + tokens_generated - 1``, the last token generated is never fed
   back), else *lost*. The manifest read straight from the disk after the kill must
   say the same. Modes: ``durable (default)`` (no flag, no header);
   ``write-behind (X-Kvmem-Durable: false)``; ``write-behind (--no-durable)``;
   ``durable (--no-durable + X-Kvmem-Durable: true)``; ``stream, durable
   (default)``; ``stream, write-behind (header false)``. For write-behind modes the
   loss rate per 10 ms of kill delay shows the opt-out's window.
2. **The write-behind window**: the time from a write-behind answer's arrival (the
   write-behind turns of part 3) until the turn's manifest is on disk, i.e. the time
   in which a kill loses an answered turn. It is watched on the disk itself (the
   manifest file polled every 0.25 ms from this process), not through ``GET
   /v1/agents/{id}``: the store runs that listing and the saves on one disk thread,
   so a GET sent during a save waits for it and always reads "saved".
3. **Cost**, at about 1K and about 4K tokens of context (``--contexts``; 1K and 3K on
   tiny-llama, whose context is 4K), on one
   server with the default setting: hot turns alternate durable (the default, no
   header) and write-behind (``X-Kvmem-Durable: false``) in ABBA pairs, every turn a
   stream: client-side *first token* (request sent -> first ``delta`` event with
   text), *whole turn* (request sent -> ``done`` event) and the stream's *last delta
   -> done* (the part of a turn a durable answer's save is in). A context's agent starts
   with a prompt of about the target (calibrated on the server's tokenizer) and each
   turn adds its reply and one sentence; a new agent starts (cold, then one
   unmeasured hot turn of each kind) once the context passed the target by 25%
   (checked every two pairs, so each agent's pairs are ABBA-balanced). Every turn
   starts once the previous one's save is on disk, so a write-behind save never
   overlaps the next turn. Reported: medians per mode, the median of the per-pair
   differences (with a 95% bootstrap interval), and the ratio of the medians.

Run: ``python -m benches durability [--quick] [--trials N] [--minor-trials N] [--pairs N] [--contexts 1024,4096]
[--model NAME]`` (a run without kill trials, ``--trials 0 --minor-trials 0``, writes ``durability[_MODEL]_cost.md``;
``--report-from RESULT.md`` writes a result's sections and plot again from its raw runs);
``tests/reliability/test_reliability_durable.py`` uses :func:`kill_trials` and :func:`turn`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
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

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benches.harness import BENCH_HOME, ResultFile, log, median, pyplot, save_figure, table
from benches.reliability.load import MODEL, percentile, start_server

SENTENCE = ("The harbour master kept a ledger of every ship that came in, with its cargo, its crew and the "
            "weather of the day. ")
SEED_TEXT = SENTENCE * 12
GROWTH = " Next entry: the tide turned and the harbour was calm."
POLL_S = 0.00025
KILL_WINDOW_MS = 50.0  # kills are sent uniformly 0..this after the answer
DELAY_BINS_MS = ((0.0, 10.0), (10.0, 20.0), (20.0, 30.0), (30.0, 40.0), (40.0, 50.0), (50.0, float("inf")))
"""Kill delays are reported in these bins (the last: a kill the loaded machine sent past the 50 ms drawn)."""
GROW = 1.25  # a cost agent is replaced once its context passed the target by this factor
TRIALS_PER_AGENT = 10


@dataclass(frozen=True)
class Mode:
    """How a turn gets (or skips) durability: the request header, the server's setting, streaming."""

    name: str
    header: str | None  # X-Kvmem-Durable, None: absent
    server_durable: bool  # False: kvmem serve --no-durable
    stream: bool = False

    @property
    def durable(self) -> bool:
        return self.header == "true" if self.header is not None else self.server_durable

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.name.lower()).strip("-")


DURABLE_DEFAULT = Mode("durable (default)", None, True)
WB_HEADER = Mode("write-behind (X-Kvmem-Durable: false)", "false", True)
WB_SETTING = Mode("write-behind (--no-durable)", None, False)
DURABLE_OPT_IN = Mode("durable (--no-durable + X-Kvmem-Durable: true)", "true", False)
STREAM_DURABLE = Mode("stream, durable (default)", None, True, stream=True)
STREAM_WB = Mode("stream, write-behind (header false)", "false", True, stream=True)
MODES = (DURABLE_DEFAULT, WB_HEADER, WB_SETTING, DURABLE_OPT_IN, STREAM_DURABLE, STREAM_WB)
MAIN_MODES = (DURABLE_DEFAULT, WB_HEADER, WB_SETTING, STREAM_DURABLE)
MINOR_MODES = (DURABLE_OPT_IN, STREAM_WB)


@dataclass
class Agent:
    """One agent's conversation: its id and the prompt its next turn sends (the whole history)."""

    agent_id: str
    prompt: str


@dataclass
class AnsweredTurn:
    """One finished turn as the client saw it."""

    reply: str
    usage: dict[str, Any]
    e2e_ms: float  # request sent -> the answer (body read, or a stream's done event)
    arrived: float  # perf_counter() when the answer was in
    first_token_ms: float | None = None  # a stream: request sent -> its first delta with text
    end_gap_ms: float | None = None  # a stream: its last delta -> its done event

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
         on_answer: Callable[[float], None] | None = None) -> AnsweredTurn:
    """One turn of ``agent`` (``X-Kvmem-Durable: header`` unless None).

    ``on_answer(arrived)`` runs the moment the answer is in (``arrived``: its perf_counter()).
    The agent's prompt then grows by the reply and :data:`GROWTH`.
    """
    headers = {"x-kvmem-durable": header} if header is not None else {}
    body = {"prompt": agent.prompt, "max_tokens": max_tokens, "share_prefix": False, "stream": stream}
    path = f"/v1/agents/{agent.agent_id}/messages"
    first: float | None = None
    last: float | None = None
    started = arrived = time.perf_counter()
    if not stream:
        response = http.post(path, json=body, headers=headers)
        arrived = time.perf_counter()
        if on_answer is not None:
            on_answer(arrived)
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
                elif line.startswith("data: ") and event == "delta":
                    last = time.perf_counter()
                    if first is None and json.loads(line[6:]).get("text"):
                        first = last
                elif line.startswith("data: ") and event in ("done", "error"):
                    arrived = time.perf_counter()
                    if on_answer is not None:
                        on_answer(arrived)
                    if event == "error":
                        raise RuntimeError(f"stream error: {line}")
                    result = json.loads(line[6:])
                    break
        if result is None:
            raise RuntimeError(f"{path}: the stream ended without a done event")
    agent.prompt += result["reply"] + GROWTH
    return AnsweredTurn(reply=result["reply"], usage=result["usage"], e2e_ms=(arrived - started) * 1000, arrived=arrived,
                first_token_ms=None if first is None else (first - started) * 1000,
                end_gap_ms=None if last is None or not stream else (arrived - last) * 1000)


# -- 1. kill -9 0-50 ms after the answer -----------------------------------------------------------


@dataclass
class KillTrial:
    """One kill: what the turn needed on disk, and what the restarted server found."""

    mode: str
    durable: bool
    agent_id: str
    e2e_ms: float
    cache_tokens: int  # the turn's cache (prompt + generated - 1)
    previous_tokens: int  # the agent's stored cache before the turn
    delay_ms: float  # the drawn delay: answer arrived -> SIGKILL
    kill_after_ms: float  # the delay taken: answer arrived -> SIGKILL sent
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


def _server(cache_dir: Path, mode: Mode, *, model: str, home: str | None, budget_mb: float = 512,
            hot_budget_mb: float = 64) -> tuple[subprocess.Popen[str], str]:
    # start_server names tiny-llama; a later --model wins (argparse keeps the last). Durable: no flag at all.
    extra = ["--model", model, "--prewarm-mb", "0", *([] if mode.server_durable else ["--no-durable"])]
    proc, url, _lines = start_server(cache_dir, budget_mb=budget_mb, hot_budget_mb=hot_budget_mb, extra=extra,
                                     home=home)
    return proc, url


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


def _sleep_until(deadline: float) -> None:
    """Sleep to ``deadline`` (perf_counter), spinning the last 1.5 ms so the delay is taken to ~0.01 ms."""
    left = deadline - time.perf_counter()
    if left > 0.0015:
        time.sleep(left - 0.0015)
    while time.perf_counter() < deadline:
        pass


def kill_trials(schedule: list[Mode], *, cache_dir: Path, model: str = MODEL, home: str | None = None,
                max_tokens: int = 16, delays_ms: list[float] | None = None) -> KillOutcome:
    """Run one kill trial per entry of ``schedule``, in order (see the module docstring, 1).

    ``delays_ms[i]``: how long after trial i's answer the SIGKILL is sent (None: at once).
    """
    delays = list(delays_ms) if delays_ms is not None else [0.0] * len(schedule)
    assert len(delays) == len(schedule)
    out = KillOutcome()
    agents: dict[tuple[str, int], Agent] = {}
    done_per_mode: dict[str, int] = {}
    began = time.monotonic()
    proc, url = _server(cache_dir, schedule[0], model=model, home=home)

    def settle(http: httpx.Client, pending: KillTrial) -> None:  # what the last kill left, as this server sees it
        info = http.get(f"/v1/agents/{pending.agent_id}")
        pending.served_after_restart = info.json()["cached_tokens"] if info.status_code == 200 else 0
        if (pending.served_after_restart >= pending.cache_tokens) != (
                pending.on_disk_after_kill >= pending.cache_tokens):
            out.disagreements.append(f"{pending}")

    try:
        pending: KillTrial | None = None
        for i, (mode, delay) in enumerate(zip(schedule, delays, strict=True)):
            n = done_per_mode.get(mode.name, 0)
            done_per_mode[mode.name] = n + 1
            key = (mode.slug, n // TRIALS_PER_AGENT)
            if key not in agents:
                agents[key] = Agent(f"kill-{key[0]}-{key[1]}", f"Ledger {key[1]} of {mode.name}. " + SEED_TEXT)
            agent = agents[key]
            with httpx.Client(base_url=url, timeout=httpx.Timeout(120, connect=5)) as http:
                if pending is not None:
                    settle(http, pending)
                    pending = None
                warm = turn(http, agent, header="false", max_tokens=max_tokens)  # history, hot, saved
                wait_saved(cache_dir, agent.agent_id, warm.cache_tokens)
                killed: list[float] = []

                def kill_later(arrived: float, delay_ms: float = delay) -> None:
                    _sleep_until(arrived + delay_ms / 1000)
                    proc.send_signal(signal.SIGKILL)
                    killed.append(time.perf_counter())

                measured = turn(http, agent, header=mode.header, stream=mode.stream, max_tokens=max_tokens,
                                on_answer=kill_later)
            proc.wait(30)
            pending = KillTrial(mode=mode.name, durable=mode.durable, agent_id=agent.agent_id,
                                e2e_ms=measured.e2e_ms, cache_tokens=measured.cache_tokens,
                                previous_tokens=warm.cache_tokens, delay_ms=delay,
                                kill_after_ms=(killed[0] - measured.arrived) * 1000,
                                on_disk_after_kill=stored_tokens(cache_dir, agent.agent_id))
            out.trials.append(pending)
            log(f"kill {i + 1}/{len(schedule)} {mode.name} at +{pending.kill_after_ms:.1f} ms: "
                f"{'kept' if pending.on_disk_after_kill >= pending.cache_tokens else 'LOST'} on disk")
            proc, url = _server(cache_dir, schedule[min(i + 1, len(schedule) - 1)], model=model, home=home)
        if pending is not None:
            with httpx.Client(base_url=url, timeout=httpx.Timeout(60, connect=5)) as http:
                settle(http, pending)
    finally:
        _kill(proc)
    out.wall_s = time.monotonic() - began
    return out


def schedule_of(counts: dict[Mode, int], seed: int) -> list[Mode]:
    """``counts[m]`` trials of each mode, shuffled (seeded) so the machine's load drifts over all alike."""
    modes = [m for m, n in counts.items() for _ in range(n)]
    random.Random(seed).shuffle(modes)
    return modes


def delays_of(n: int, seed: int) -> list[float]:
    """``n`` kill delays, uniform in 0..:data:`KILL_WINDOW_MS` ms (seeded)."""
    rng = random.Random(seed + 1)
    return [rng.uniform(0.0, KILL_WINDOW_MS) for _ in range(n)]


# -- 2 and 3. the write-behind window and the cost at 1K / 4K --------------------------------------


@dataclass
class CostTurn:
    target: int  # the context the agent was sized for (tokens)
    pair: int
    agent_id: str
    durable: bool
    first_token_ms: float
    e2e_ms: float
    server_ttft_ms: float
    tier: str
    cache_tokens: int  # the turn's context: its cache after the turn
    on_disk_at_answer: bool  # the manifest already held the turn when the answer was in
    window_ms: float  # answer in -> manifest on disk (0 when it was there already)
    end_gap_ms: float = float("nan")  # the stream's last delta -> its done event


def calibrate(http: httpx.Client, *, cache_dir: Path, max_tokens: int) -> tuple[float, float]:
    """Tokens of a prompt of n :data:`SENTENCE`: ``(overhead, per_sentence)``, from two cold turns."""
    measured = []
    for n in (12, 36):
        agent = Agent(f"calibrate-{n}", SENTENCE * n)
        done = turn(http, agent, header="false", max_tokens=max_tokens)
        wait_saved(cache_dir, agent.agent_id, done.cache_tokens)
        measured.append(done.usage["tokens_reused"] + done.usage["tokens_prefilled"])
    per = (measured[1] - measured[0]) / 24
    return measured[0] - 12 * per, per


def cost_turns(url: str, *, cache_dir: Path, targets: list[int], pairs: int, max_tokens: int = 16,
               prefix: str = "cost") -> list[CostTurn]:
    """``pairs`` ABBA pairs of streamed hot turns per target context, durable (default) and write-behind."""
    out: list[CostTurn] = []
    with httpx.Client(base_url=url, timeout=httpx.Timeout(300, connect=5)) as http:
        overhead, per = calibrate(http, cache_dir=cache_dir, max_tokens=max_tokens)
        log(f"calibrated: a prompt of n sentences is {overhead:.0f} + {per:.2f} n tokens")
        for target in targets:
            agent: Agent | None = None
            context = 0
            count = 0
            for pair in range(pairs):
                if pair % 2 == 0 and (agent is None or context > GROW * target):
                    sentences = max(1, round((target - overhead - 12) / per))
                    agent = Agent(f"{prefix}-{target}-{count}", f"Ledger {count} of {target}. " + SENTENCE * sentences)
                    count += 1
                    done = turn(http, agent, header="false", max_tokens=max_tokens)  # cold
                    wait_saved(cache_dir, agent.agent_id, done.cache_tokens)
                    log(f"{agent.agent_id}: cold turn, {done.cache_tokens} tokens, {done.e2e_ms:.0f} ms")
                    for header in ("false", None):  # one hot turn of each kind, unmeasured
                        done = turn(http, agent, header=header, stream=True, max_tokens=max_tokens)
                        wait_saved(cache_dir, agent.agent_id, done.cache_tokens)
                assert agent is not None
                for durable in ((False, True) if pair % 2 == 0 else (True, False)):
                    done = turn(http, agent, header=None if durable else "false", stream=True, max_tokens=max_tokens)
                    at_answer = stored_tokens(cache_dir, agent.agent_id) >= done.cache_tokens
                    saved = done.arrived if at_answer else wait_saved(cache_dir, agent.agent_id, done.cache_tokens)
                    context = done.cache_tokens
                    out.append(CostTurn(
                        target=target, pair=pair, agent_id=agent.agent_id, durable=durable,
                        first_token_ms=float(done.first_token_ms if done.first_token_ms is not None else "nan"),
                        e2e_ms=done.e2e_ms, server_ttft_ms=float(done.usage.get("ttft_ms") or 0.0),
                        tier=str(done.usage.get("tier")), cache_tokens=done.cache_tokens,
                        on_disk_at_answer=at_answer, window_ms=max(0.0, (saved - done.arrived) * 1000),
                        end_gap_ms=float(done.end_gap_ms if done.end_gap_ms is not None else "nan")))
                log(f"{target}: pair {pair + 1}/{pairs}, {context} tokens")
    return out


# -- the program -----------------------------------------------------------------------------------


def median_interval(values: list[float], *, seed: int = 0, rounds: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (resampled with replacement, seeded)."""
    if not values:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    medians = sorted(median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def pair_differences(turns: list[CostTurn], metric: str) -> list[float]:
    """Durable minus write-behind ``metric`` of each pair (ms): the machine's load drifts out."""
    by_pair: dict[tuple[int, int], dict[bool, float]] = {}
    for t in turns:
        by_pair.setdefault((t.target, t.pair), {})[t.durable] = getattr(t, metric)
    return [p[True] - p[False] for p in by_pair.values() if len(p) == 2]


def _bin_label(low: float, high: float) -> str:
    return f"{low:g}-{high:g} ms" if high != float("inf") else f"{low:g}+ ms (sent late)"


def _binned(trials: list[KillTrial]) -> list[list[KillTrial]]:
    """``trials`` by :data:`DELAY_BINS_MS` of the delay actually taken."""
    return [[t for t in trials if low <= t.kill_after_ms < high] for low, high in DELAY_BINS_MS]


def _kill_rows(outcome: KillOutcome) -> list[list[Any]]:
    rows = []
    for mode in MODES:
        trials = outcome.of(mode)
        if not trials:
            continue
        lost = sum(t.lost for t in trials)
        delays = [t.kill_after_ms for t in trials]
        rows.append([mode.name, "yes" if mode.durable else "no", len(trials), len(trials) - lost, f"**{lost}**",
                     f"{min(delays):.1f}-{max(delays):.1f}", f"{median(t.e2e_ms for t in trials):.0f}"])
    return rows


def _window_rows(outcome: KillOutcome) -> list[list[Any]]:
    """Lost / trials per kill-delay bin, for each mode and the write-behind modes together."""
    rows = []
    groups = [(m.name, outcome.of(m)) for m in MODES if outcome.of(m)]
    groups.append(("all write-behind modes", [t for t in outcome.trials if not t.durable]))
    groups.append(("all durable modes", [t for t in outcome.trials if t.durable]))
    for name, trials in groups:
        rows.append([name, *(f"{sum(t.lost for t in inside)}/{len(inside)}" if inside else "-"
                             for inside in _binned(trials))])
    return rows


def _plot(res: ResultFile, cost: list[CostTurn], outcome: KillOutcome, targets: list[int]) -> None:
    plt = pyplot()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.6))
    modes = [m for m in MODES if outcome.of(m)]
    for y, mode in enumerate(modes):
        trials = outcome.of(mode)
        kept = [t.kill_after_ms for t in trials if not t.lost]
        lost = [t.kill_after_ms for t in trials if t.lost]
        left.scatter(kept, [y] * len(kept), marker="o", s=14, color="tab:green", alpha=0.7,
                     label="kept" if y == 0 else None)
        left.scatter(lost, [y] * len(lost), marker="x", s=18, color="tab:red", label="lost" if y == 0 else None)
    left.set_yticks(range(len(modes)), [f"{m.name} ({sum(t.lost for t in outcome.of(m))}/{len(outcome.of(m))})"
                                        for m in modes], fontsize=7)
    left.set_xlabel("SIGKILL sent, ms after the answer arrived")
    left.set_title("kill -9 trials: lost / trials per mode" if modes else "no kill trials in this run")
    if modes:
        left.legend(fontsize=8, loc="lower right")

    windows = sorted(t.window_ms for t in cost if not t.durable)
    if windows:
        xs = [x / 2 for x in range(0, int(KILL_WINDOW_MS * 2) + 1)]
        middle.plot(xs, [sum(w > x for w in windows) / len(windows) for x in xs], color="tab:blue",
                    label=f"write-behind save not yet on disk (hot turns, n={len(windows)})")
    wb = [t for t in outcome.trials if not t.durable]
    du = [t for t in outcome.trials if t.durable]
    for trials, color, label in ((wb, "tab:red", "write-behind kills: lost share"),
                                 (du, "tab:green", "durable kills: lost share")):
        xs, ys = [], []
        for (low, high), inside in zip(DELAY_BINS_MS, _binned(trials), strict=True):
            if inside:
                xs.append((low + high) / 2 if high != float("inf") else median(t.kill_after_ms for t in inside))
                ys.append(sum(t.lost for t in inside) / len(inside))
        if xs:
            middle.plot(xs, ys, "o--", color=color, label=label)
    middle.set_xlabel("ms after the answer arrived")
    middle.set_ylabel("share")
    middle.set_ylim(-0.03, 1.03)
    middle.set_title("the write-behind window (a kill inside it loses the turn)")
    middle.legend(fontsize=7)

    labels, data = [], []
    for target in targets:
        here = [t for t in cost if t.target == target]
        gap = not all(math.isnan(t.end_gap_ms) for t in here)
        for metric, name in (("first_token_ms", "first token"), ("e2e_ms", "whole turn"),
                             *([("end_gap_ms", "last delta\n-> done")] if gap else [])):
            diffs = pair_differences(here, metric)
            if diffs:
                labels.append(f"~{target / 1024:g}K\n{name}\n{median(diffs):+.1f} ms")
                data.append(diffs)
    if data:
        right.boxplot(data, showfliers=True)
        right.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
    right.axhline(0, color="grey", ls=":")
    right.set_ylabel("durable - write-behind, same pair (ms)")
    right.set_title("cost of durability per ABBA pair (streamed)")
    save_figure(res, fig)


def _contexts(targets: list[int]) -> str:
    return " and ".join(f"{t / 1024:g}K" for t in targets)


def _title(targets: list[int], *, kills: bool) -> str:
    return ("Durable by default: " + ("kill -9 0-50 ms after the answer, " if kills else "")
            + f"the write-behind window, the cost at {_contexts(targets)} tokens")


def disagreements(outcome: KillOutcome) -> list[KillTrial]:
    """Trials whose disk (read after the kill) and restarted server told different stories."""
    return [t for t in outcome.trials
            if (t.served_after_restart >= t.cache_tokens) != (t.on_disk_after_kill >= t.cache_tokens)]


def report_body(outcome: KillOutcome, cost: list[CostTurn], *, targets: list[int], pairs: int) -> list[str]:
    """The result's sections (module docstring, 1-3) from the trials and the cost turns."""
    wb = [t for t in cost if not t.durable]
    du = [t for t in cost if t.durable]
    windows = [t.window_ms for t in wb]
    durable_trials = [t for t in outcome.trials if t.durable]
    durable_lost = sum(t.lost for t in durable_trials)
    wb_trials = [t for t in outcome.trials if not t.durable]
    default_trials = outcome.of(DURABLE_DEFAULT) + outcome.of(STREAM_DURABLE)

    body = []
    if outcome.trials:
        kills = [t.kill_after_ms for t in outcome.trials]
        body += [
            "## 1. kill -9 0-50 ms after the answer",
            "",
            f"{len(outcome.trials)} trials on one cache directory, modes interleaved (seeded shuffle); in each the "
            "SIGKILL is sent at a delay drawn uniformly from 0 to 50 ms after the answer (the body, or a stream's "
            f"`done` event) arrived: taken {min(kills):.1f}-{max(kills):.1f} ms, median {median(kills):.1f} ms. "
            "After each kill the server restarts on the directory and `GET /v1/agents/{id}` must show a cache "
            f"covering the turn (prompt + generated - 1 tokens). Wall {outcome.wall_s:.0f} s.",
            "",
            *table(["mode", "durable", "trials", "kept", "lost", "kill after answer, ms", "E2E median ms"],
                   _kill_rows(outcome)),
            "",
            f"**Durable turns lost: {durable_lost} of {len(durable_trials)}** (by default, no flag and no header: "
            f"{sum(t.lost for t in default_trials)} of {len(default_trials)}). Write-behind turns lost: "
            f"{sum(t.lost for t in wb_trials)} of {len(wb_trials)}. Disk and restarted server disagreed on "
            f"{len(disagreements(outcome))} trials.",
            "",
            "Lost / trials by the delay of the kill (the opt-out's window, as kills see it):",
            "",
            *table(["mode", *(_bin_label(low, high) for low, high in DELAY_BINS_MS)], _window_rows(outcome)),
            "",
        ]
    wb_not_at_answer = [t.window_ms for t in wb if not t.on_disk_at_answer]
    body += [
        "## 2. The write-behind window",
        "",
        f"{len(wb)} write-behind hot turns of part 3 (`X-Kvmem-Durable: false`, streamed, contexts "
        f"{min((t.cache_tokens for t in wb), default=0)}-{max((t.cache_tokens for t in wb), default=0)} tokens): "
        "from the `done` event's arrival until the turn's manifest is on disk, watched on the disk (every 0.25 ms). "
        f"A `kill -9` inside this window loses the answered turn; {sum(t.on_disk_at_answer for t in wb)} of "
        f"{len(wb)} were on disk when the answer arrived. Durable (default) turns on disk at the answer: "
        f"{sum(t.on_disk_at_answer for t in du)} of {len(du)}.",
        "",
        *table(["answer -> on disk (write-behind)", "turns", "median ms", "p90 ms", "max ms", "min ms"],
               [[f"~{target / 1024:g}K", len(w), f"{median(w):.1f}", f"{percentile(w, 0.9):.1f}",
                 f"{max(w):.1f}", f"{min(w):.1f}"]
                for target in targets if (w := [t.window_ms for t in wb if t.target == target])]
               + [["all", len(windows), f"{median(windows):.1f}", f"{percentile(windows, 0.9):.1f}",
                   f"{max(windows, default=float('nan')):.1f}", f"{min(windows, default=float('nan')):.1f}"]]),
        "",
    ]
    if len(wb_not_at_answer) < len(wb):
        body += [f"({len(wb) - len(wb_not_at_answer)} write-behind turns were already on disk at the answer: "
                 "window 0.)", ""]
    body += [
        f"## 3. The cost at {_contexts(targets)} tokens",
        "",
        f"{pairs} ABBA pairs per context on one default server: durable (the default, no header) and write-behind "
        "(`X-Kvmem-Durable: false`) alternating on the same agent, every turn streamed; *first token*: the request "
        "sent -> the first `delta` event with text; *whole turn*: the request sent -> the `done` event. Each turn "
        "adds its reply and a sentence; a new agent (cold, then one unmeasured hot turn of each kind) once the "
        f"context passed the target by {GROW - 1:.0%}. Every turn starts once the previous one's save is on disk."
        + (" *last delta -> done*: from the stream's last `delta` event to its `done` event, the part of the turn "
           "a durable answer's save is in, without the decode's noise."
           if not all(math.isnan(t.end_gap_ms) for t in cost) else ""),
        "",
    ]
    rows = []
    for target in targets:
        here = [t for t in cost if t.target == target]
        if not here:
            continue
        ctx = [t.cache_tokens for t in here]
        gap = not all(math.isnan(t.end_gap_ms) for t in here)  # results before it was recorded have none
        for metric, name in (("first_token_ms", "first token"), ("e2e_ms", "whole turn"),
                             *([("end_gap_ms", "last delta -> done")] if gap else [])):
            w = [getattr(t, metric) for t in here if not t.durable]
            d = [getattr(t, metric) for t in here if t.durable]
            diffs = pair_differences(here, metric)
            low, high = median_interval(diffs)
            rows.append([f"~{target / 1024:g}K ({min(ctx)}-{max(ctx)})", name, len(diffs), f"{median(w):.1f}",
                         f"{median(d):.1f}", f"**{median(diffs):+.1f}**", f"{low:+.1f} to {high:+.1f}",
                         f"{median(d) / median(w):.3f}x"])
        tiers = sorted({t.tier for t in here})
        if tiers != ["hot"]:
            body += [f"(~{target / 1024:g}K: measured turns' tiers {tiers}.)", ""]
    body += [
        *table(["context (tokens)", "", "pairs", "write-behind median ms", "durable median ms",
                "durable - write-behind, per pair, median ms", "95% bootstrap interval ms",
                "ratio of medians"], rows),
        "",
        "What a durable turn adds is the wait for its save (the write-behind turn makes the same save after its "
        f"answer: part 2's window, median {median(windows):.1f} ms). In both modes the first token is sent before "
        "the turn's save begins, and the previous turn's save had ended before the request was sent.",
        "",
    ]
    return body


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short run (fewer trials and pairs)")
    p.add_argument("--trials", type=int, help="kill trials per main mode: durable (default), write-behind by "
                   "header and by --no-durable, stream durable (default) (default 40; 4 with --quick)")
    p.add_argument("--minor-trials", type=int, help="kill trials for --no-durable + header true and stream "
                   "write-behind (default: --trials)")
    p.add_argument("--pairs", type=int, help="ABBA pairs (durable default / X-Kvmem-Durable: false) of streamed "
                   "hot turns per context (default 24; 4 with --quick)")
    p.add_argument("--contexts", help="the contexts of the cost pairs, tokens (default 1024,4096; 1024,3072 on "
                   f"{MODEL}, whose context is 4096)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default=MODEL, help=f"a model kvmem serve knows (default {MODEL}; kvmem-default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-from", type=Path, metavar="RESULT_MD",
                   help="measure nothing: write this result's sections and plot again from its raw runs")
    args = p.parse_args(argv)
    if args.report_from is not None:
        return report_from(args.report_from)
    trials = args.trials if args.trials is not None else (4 if args.quick else 40)
    minor = args.minor_trials if args.minor_trials is not None else trials
    pairs = args.pairs if args.pairs is not None else (4 if args.quick else 24)
    contexts = args.contexts or ("1024,3072" if args.model == MODEL else "1024,4096")
    targets = [int(x) for x in contexts.split(",") if x.strip()]
    counts = {**{m: trials for m in MAIN_MODES}, **{m: minor for m in MINOR_MODES}}
    for name in ("KVMEM_DURABLE", "KVMEM_CONFIG"):  # "default" is the built-in default
        if os.environ.pop(name, None) is not None:
            log(f"{name} removed from the servers' environment")
    home = str(BENCH_HOME)
    res = ResultFile("durability", _title(targets, kills=bool(trials or minor)), args.quick, argv or [], model=args.model,
                     variant=("" if args.model == MODEL else f"_{args.model}") + ("" if trials or minor else "_cost"))
    res.setup += [
        f"`kvmem serve --model {args.model} --prewarm-mb 0` (fsync on and durable: the defaults; `--no-durable` "
        "where a mode says so), `--budget-mb 512 --hot-budget-mb 64` for the kill trials, `--budget-mb 1024 "
        "--hot-budget-mb 256` for the cost turns; fresh cache directories; `POST /v1/agents/{id}/messages` with "
        f"`prompt` (the whole history), `max_tokens` {args.max_tokens}, greedy, `share_prefix` false",
        "durable turns: no header on a default server, or `X-Kvmem-Durable: true` on a `--no-durable` one; "
        "write-behind turns: `X-Kvmem-Durable: false`, or no header on a `--no-durable` server",
    ]
    with tempfile.TemporaryDirectory(prefix="kvmem-durability-") as tmp:
        outcome = KillOutcome()
        if trials or minor:
            schedule = schedule_of({m: n for m, n in counts.items() if n}, args.seed)
            log(f"{len(schedule)} kill trials")
            outcome = kill_trials(schedule, cache_dir=Path(tmp) / "kill", model=args.model, home=home,
                                  max_tokens=args.max_tokens, delays_ms=delays_of(len(schedule), args.seed))
        log(f"{pairs} pairs of hot turns at each of {targets} tokens")
        proc, url = _server(Path(tmp) / "cost", DURABLE_DEFAULT, model=args.model, home=home, budget_mb=1024,
                            hot_budget_mb=256)
        try:
            cost = cost_turns(url, cache_dir=Path(tmp) / "cost", targets=targets, pairs=pairs,
                              max_tokens=args.max_tokens)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)

    for t in outcome.trials:
        res.record(kind="kill", **asdict(t), lost=t.lost)
    res.record(kind="kill_wall", wall_s=outcome.wall_s)
    for c in cost:
        res.record(kind="cost", **asdict(c))
    res.body = report_body(outcome, cost, targets=targets, pairs=pairs)
    if args.model != MODEL:  # its geometry from the folder the server prepared, not a float32 copy (model_dir)
        prepared = sorted((BENCH_HOME / "models" / "gguf").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
        res.model = str(prepared[-1].parent) if prepared else None
    _plot(res, cost, outcome, targets)
    path = res.write(plot=True)
    print(path)
    print("\n".join(res.body))
    return 0 if not any(t.lost for t in outcome.trials if t.durable) and not disagreements(outcome) else 1


def report_from(md: Path) -> int:
    """Write ``md``'s sections and plot again from its raw runs (after a change to the report), header kept."""
    lines = md.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("## "))
    raw = [json.loads(line) for line in lines[lines.index("```json") + 1:] if line.startswith("{")]
    kill_fields = {f for f in KillTrial.__dataclass_fields__}
    cost_fields = {f for f in CostTurn.__dataclass_fields__}
    outcome = KillOutcome(trials=[KillTrial(**{k: v for k, v in r.items() if k in kill_fields})
                                  for r in raw if r["kind"] == "kill"])
    walls = [r["wall_s"] for r in raw if r["kind"] == "kill_wall"]
    found = re.search(r"Wall (\d+) s\.", md.read_text())  # results written before the kill_wall record
    outcome.wall_s = walls[0] if walls else float(found.group(1)) if found else float("nan")
    cost = [CostTurn(**{k: v for k, v in r.items() if k in cost_fields}) for r in raw if r["kind"] == "cost"]
    targets = list(dict.fromkeys(c.target for c in cost))
    pairs = max((c.pair for c in cost), default=-1) + 1
    res = ResultFile(md.stem, "", False, [], model=None)
    res.body = report_body(outcome, cost, targets=targets, pairs=pairs)
    _plot(res, cost, outcome, targets)
    title = f"# {_title(targets, kills=bool(outcome.trials))}"
    md.write_text("\n".join([title, *lines[1:first], *res.body, "", f"![{md.stem}]({md.stem}.png)", "", "## Raw runs", "",
                             "```json", *(json.dumps(r, sort_keys=True) for r in raw), "```", ""]))
    print(md)
    print("\n".join(res.body))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
