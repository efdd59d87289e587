"""Which of this process's threads ran during a window, and what the machine's hypervisor took (Linux ``/proc``).

Why: on the H200 (run 6) kvmem's cold 1B decode steps cost the model's thread 3.5 ms of CPU time each
while plain mlx-lm's, in the same process and the same seconds, took 2.3 ms, and the same kvmem steps took
2.1 ms later in that run: the thread's own CPU time was inflated, not spent waiting. Other threads busy
at the same moment (a library's workers spinning, the runtime's own) share the cores and their caches;
on a virtual machine the hypervisor can take a core's time while a thread is counted as running. A
:class:`ThreadClock` read before and after a turn says which threads used the CPU during it, how much of
the machine was busy, and how much time the hypervisor stole (``/proc/stat``'s ``steal``).

Each thread's CPU time comes from ``/proc/self/task/<tid>/schedstat`` (nanoseconds on the CPU), else
``stat``'s ticks; a thread is named by Python's ``threading`` where it is a Python thread, else by its
``comm`` (MLX's, CUDA's and OpenBLAS's workers). ``schedstat`` also gives the time a thread was ready to
run but waited for a core, and ``stat`` its minor page faults (memory the kernel maps at the first touch,
in the thread's own CPU time: a heap given back to the system and grown again) and the CPU it last ran
on, whose physical core (``/sys/devices/system/cpu``) says whether two busy threads last shared one:
hyperthreads of one core each run slower, with their CPU time counted in full.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ThreadClock", "Window", "available", "keep_threads_to", "one_cpu_a_core"]

_TASKS = Path("/proc/self/task")
_CPUS = Path("/sys/devices/system/cpu")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def available() -> bool:
    """Whether this system has ``/proc``'s per-thread times (Linux)."""
    return _TASKS.is_dir()


def _thread_times(tid: str) -> tuple[float, float, int] | None:
    """Thread ``tid``'s CPU time and its wait for a core, in seconds (wait 0 where unknown), and its minor page
    faults so far, or None when it is gone."""
    fields = _stat_fields(tid)
    if fields is None:
        return None
    faults = int(fields[7])  # stat's 10th field: minflt
    try:
        ran, waited = (int(v) / 1e9 for v in (_TASKS / tid / "schedstat").read_text().split()[:2])
        return ran, waited, faults
    except (OSError, ValueError):
        return (int(fields[11]) + int(fields[12])) * _TICK_S, 0.0, faults  # utime, stime


def _stat_fields(tid: str) -> list[str] | None:
    """``/proc/self/task/<tid>/stat`` after "pid (comm) ": the state is field 0."""
    try:
        stat = (_TASKS / tid / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def _last_core(tid: str) -> str | None:
    """The physical core (package and core id) thread ``tid`` last ran on, or None where unknown."""
    fields = _stat_fields(tid)
    if fields is None or len(fields) < 37:
        return None
    return _core_of(int(fields[36]))  # stat's 39th field: the processor


def _core_of(cpu: int, root: Path = _CPUS) -> str | None:
    """Logical CPU ``cpu``'s physical core, as ``package/core``, or None where the system does not say."""
    topology = root / f"cpu{cpu}" / "topology"
    try:
        return f"{(topology / 'physical_package_id').read_text().strip()}/{(topology / 'core_id').read_text().strip()}"
    except OSError:
        return None


def one_cpu_a_core(allowed: set[int] | None = None, root: Path = _CPUS) -> set[int]:
    """The lowest logical CPU of each physical core among ``allowed`` (this process's, by default): a process kept
    to them runs no two of its threads on hyperthreads of one core. A CPU whose core is unknown stands alone."""
    chosen: dict[str, int] = {}
    for cpu in sorted(os.sched_getaffinity(0) if allowed is None else allowed):
        chosen.setdefault(_core_of(cpu, root) or f"cpu{cpu}", cpu)
    return set(chosen.values())


def keep_threads_to(cpus: set[int]) -> int:
    """Keep every thread of this process, and those they start later, to ``cpus``; returns how many threads."""
    kept = 0
    for tid in os.listdir(_TASKS):
        try:
            os.sched_setaffinity(int(tid), cpus)
            kept += 1
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
    return kept


def _comm(tid: str) -> str:
    try:
        return (_TASKS / tid / "comm").read_text().strip()
    except OSError:
        return "?"


def _machine_ticks() -> tuple[int, int]:
    """All CPUs' (busy, steal) ticks since boot (``/proc/stat``'s first line), or zeros."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0, 0
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


@dataclass
class Window:
    """What a :class:`ThreadClock` measured between its start and its stop."""

    wall_s: float
    threads: dict[str, float] = field(default_factory=dict)  # name -> CPU seconds in the window
    machine_busy_s: float = 0.0  # every CPU's busy time (this process's and the rest)
    steal_s: float = 0.0  # time the hypervisor ran something else while a CPU of this machine wanted to run
    waits: dict[str, float] = field(default_factory=dict)  # name -> seconds ready to run, waiting for a core
    faults: dict[str, int] = field(default_factory=dict)  # name -> minor page faults in the window
    cores: dict[str, str] = field(default_factory=dict)  # name (one thread) -> the physical core it last ran on

    @property
    def process_cpu_s(self) -> float:
        return sum(self.threads.values())

    def top(self, n: int = 4) -> list[tuple[str, float]]:
        """The ``n`` threads that ran most, with their share of the window's wall time."""
        ranked = sorted(self.threads.items(), key=lambda kv: -kv[1])[:n]
        return [(name, cpu / self.wall_s if self.wall_s else 0.0) for name, cpu in ranked]

    def sharing_a_core(self, n: int = 4) -> list[str]:
        """Of the ``n`` threads that ran most, those that last ran on one physical core with another of them."""
        by_core: dict[str, list[str]] = {}
        for name, _ in self.top(n):
            if (core := self.cores.get(name)) is not None:
                by_core.setdefault(core, []).append(name)
        return [name for names in by_core.values() if len(names) > 1 for name in names]


class ThreadClock:
    """Per-thread CPU time of this process, and the machine's busy and stolen time, from :meth:`start` to
    :meth:`stop`."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self._cpu: dict[str, tuple[float, float, int]] = {}
        self._machine = (0, 0)

    def start(self) -> None:
        self._machine = _machine_ticks()
        self._cpu = self._read()
        self._t0 = time.perf_counter()

    def stop(self) -> Window:
        wall = time.perf_counter() - self._t0
        now = self._read()
        busy, steal = _machine_ticks()
        names = {str(t.native_id): t.name for t in threading.enumerate() if t.native_id is not None}
        used: dict[str, list[tuple[str, float, float, int]]] = {}  # name -> its threads' (tid, CPU, wait, faults)
        for tid, (cpu, wait, faults) in now.items():
            cpu0, wait0, faults0 = self._cpu.get(tid, (0.0, 0.0, 0))
            if (ran := cpu - cpu0) > 0:
                used.setdefault(names.get(tid) or _comm(tid), []).append((tid, ran, wait - wait0, faults - faults0))
        # a library's workers share a name (their process's, unless they set one): summed, and counted
        named = {(name if len(runs) == 1 else f"{name} ({len(runs)} threads)"): runs for name, runs in used.items()}
        cores = {name: core for name, runs in named.items() if len(runs) == 1
                 and (core := _last_core(runs[0][0])) is not None}
        return Window(wall_s=wall, threads={name: sum(r[1] for r in runs) for name, runs in named.items()},
                      machine_busy_s=(busy - self._machine[0]) * _TICK_S,
                      steal_s=(steal - self._machine[1]) * _TICK_S,
                      waits={name: sum(r[2] for r in runs) for name, runs in named.items()},
                      faults={name: sum(r[3] for r in runs) for name, runs in named.items()}, cores=cores)

    @staticmethod
    def _read() -> dict[str, tuple[float, float, int]]:
        if not available():
            return {}
        out = {}
        for task in _TASKS.iterdir():
            times = _thread_times(task.name)
            if times is not None:
                out[task.name] = times
        return out
