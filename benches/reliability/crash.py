"""Crash safety: ``kill -9`` a ``kvmem serve`` process at random moments while it writes caches.

One cache directory lives across all trials. Each trial:

1. starts ``kvmem serve`` (tiny-llama, small budgets, fsync on) on 127.0.0.1;
2. checks what the previous kill left: no ``*.tmp`` file survives startup; every agent the
   directory lists loads and verifies (``CacheDirectory.load``, every checksum) or is a miss;
   every *durable* turn is still there — the stored manifest's ``updated_at`` is the one recorded
   or newer and it loads (a lost durable turn counts as data lost, which must be zero);
3. drives ``--agents`` agents through turns over HTTP (prompts past 256 tokens, so both shared
   block files and agent files are written). A turn is *durable* when its response arrived AND a
   following ``GET /v1/agents/{id}`` shows it saved (``on_disk``, not ``dirty``): its manifest's
   ``updated_at`` is recorded;
4. once ``--min-durable`` turns of this trial are durable (default 1, so every trial has
   something to lose), sends SIGKILL after a further random delay (uniform in
   ``--min-delay``..``--max-delay`` seconds), landing mid-turn, mid-save or between them; with
   ``--save-window-s W`` the kill lands uniform(0, W) seconds after a response arrived, which is
   when its write-behind save runs (aimed at the writes themselves).

Run: ``python -m benches.reliability.crash`` (50 trials) or ``--trials N``; ``tests/reliability/test_reliability_crash.py``
runs a few trials through :func:`run_trials`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benches.reliability.load import start_server

SEED_TEXT = ("The harbour master kept a ledger of every ship that came in, with its cargo, its crew and the "
             "weather of the day. ") * 12


@dataclass
class CrashTrials:
    trials: int = 0
    kills: int = 0
    turns_completed: int = 0
    turns_durable: int = 0
    temp_files_after_kill: int = 0
    temp_files_after_startup: int = 0
    agents_checked: int = 0
    agents_verified: int = 0
    agents_missed: int = 0
    durable_checked: int = 0
    durable_lost: list[str] = field(default_factory=list)
    load_failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def _temp_files(root: Path) -> int:
    return sum(1 for p in root.rglob("*.tmp"))


def _verify(cache_root: Path, durable: dict[str, float], out: CrashTrials) -> None:
    """Load every stored agent fully (all checksums); check every durable turn survived."""
    from runtime.errors import CacheMiss
    from runtime.persist import CacheDirectory

    directory = CacheDirectory(cache_root, fsync=False)
    entries = {e.agent_id: e for e in directory.list_agents()}
    for agent_id, entry in entries.items():
        out.agents_checked += 1
        try:
            directory.load(agent_id, model_tag=entry.model_tag)
            out.agents_verified += 1
        except CacheMiss as exc:
            out.agents_missed += 1
            if agent_id in durable:
                out.load_failures.append(f"{agent_id}: {exc}")
    for agent_id, updated_at in durable.items():
        out.durable_checked += 1
        stored = entries.get(agent_id)
        if stored is None or stored.updated_at < updated_at:
            out.durable_lost.append(f"{agent_id}: recorded {updated_at}, found {stored and stored.updated_at}")


def _drive(url: str, agent_id: str, state: dict[str, str], durable: dict[str, float], out: CrashTrials,
           stop: threading.Event, lock: threading.Lock, max_tokens: int, responded: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=httpx.Timeout(30, connect=5)) as http:
        while not stop.is_set():
            prompt = state[agent_id]
            try:
                response = http.post(f"/v1/agents/{agent_id}/messages",
                                     json={"prompt": prompt, "max_tokens": max_tokens, "share_prefix": False})
                if response.status_code != 200:
                    return
                reply = response.json()["reply"]
                responded.set()  # its save starts now (write-behind)
                with lock:
                    out.turns_completed += 1
                state[agent_id] = prompt + reply + f" Entry {len(prompt) % 97}: calm seas."
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and not stop.is_set():
                    info = http.get(f"/v1/agents/{agent_id}").json()
                    if info["on_disk"] and not info["dirty"] and info["updated_at"] is not None:
                        with lock:
                            durable[agent_id] = info["updated_at"]
                            out.turns_durable += 1
                        break
                    time.sleep(0.01)
            except (httpx.TransportError, ValueError, KeyError):
                return  # the server was killed


def run_trials(trials: int, *, cache_dir: Path, agents: int = 3, max_tokens: int = 24, min_delay: float = 0.3,
               max_delay: float = 3.0, seed: int = 0, time_limit_s: float = 600, min_durable: int = 1,
               save_window_s: float = 0.0) -> CrashTrials:
    """Run the kill/restart trials (see the module docstring); the outcome counts everything."""
    rng = random.Random(seed)
    out = CrashTrials()
    durable: dict[str, float] = {}
    state = {f"ship-{i}": f"Ledger {i}. " + SEED_TEXT for i in range(agents)}
    cache_root = cache_dir / "caches"
    began = time.monotonic()
    for trial in range(trials + 1):  # the last start only verifies
        if time.monotonic() - began > time_limit_s:
            break
        out.temp_files_after_kill += _temp_files(cache_dir) if cache_dir.exists() else 0
        proc, url, _lines = start_server(cache_dir, budget_mb=64, hot_budget_mb=8)
        try:
            out.temp_files_after_startup += _temp_files(cache_dir)
            _verify(cache_root, durable, out)
            if trial == trials:
                break
            out.trials += 1
            stop, lock, responded = threading.Event(), threading.Lock(), threading.Event()
            threads = [threading.Thread(target=_drive, args=(url, a, state, durable, out, stop, lock, max_tokens,
                                                             responded), daemon=True) for a in state]
            durable_before = out.turns_durable
            for t in threads:
                t.start()
            wait_until = time.monotonic() + 30
            while out.turns_durable < durable_before + min_durable and time.monotonic() < wait_until:
                time.sleep(0.01)
            if save_window_s:  # aim at the write-behind save that follows a response
                responded.clear()
                responded.wait(10)
                time.sleep(rng.uniform(0, save_window_s))
            else:
                time.sleep(rng.uniform(min_delay, max_delay))
            with lock:  # no durable record is half-made while the kill lands
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                stop.set()
            out.kills += 1
            for t in threads:
                t.join(10)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
    out.wall_s = time.monotonic() - began
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-delay", type=float, default=0.0)
    p.add_argument("--max-delay", type=float, default=1.5)
    p.add_argument("--min-durable", type=int, default=1)
    p.add_argument("--save-window-s", type=float, default=0.0,
                   help="instead of a random delay, kill uniform(0, this) seconds after a response arrives")
    p.add_argument("--time-limit-s", type=float, default=900)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvmem-crash-") as tmp:
        out = run_trials(args.trials, cache_dir=Path(tmp) / "cache", agents=args.agents, seed=args.seed,
                         min_delay=args.min_delay, max_delay=args.max_delay, time_limit_s=args.time_limit_s,
                         min_durable=args.min_durable, save_window_s=args.save_window_s)
    report = {k: (len(v) if isinstance(v, list) else v) for k, v in vars(out).items()}
    for line in out.durable_lost + out.load_failures:
        print(line, file=sys.stderr)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    ok = not out.durable_lost and not out.load_failures and out.temp_files_after_startup == 0
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("KVMEM_HOME", "/tmp/kvmem-test-home")
    sys.exit(main())
