"""How long ``kvmem serve --distributed`` takes to stop, both ranks, after a signal to ``mlx.launch`` or to a rank.

Two ranks of tiny-llama on loopback (``mlx.launch -n 2 --backend ring``, as ``tests/runtime_core/test_distributed.py``
starts them), idle and serving; then one signal, and the time until ``mlx.launch`` and both ranks are
gone (polled every 50 ms from ``/proc``). Issue 58, item 5, asks for 10 s at most. The paths:

* SIGTERM to ``mlx.launch``: it exits without passing the signal on; each rank sees its parent gone
  (:func:`runtime.distributed.launch.stop_when_orphaned`) and stops as on SIGTERM.
* SIGINT to the process group (Ctrl-C in the terminal): rank 0 shuts down, flushes, tells rank 1.
* SIGTERM or SIGINT to rank 0: the same.
* SIGTERM or SIGINT to rank 1: it gives rank 0 ``FOLLOWER_GRACE_S`` (6 s) and exits; ``mlx.launch`` then
  stops rank 0.

Not a path kvmem can serve: SIGINT to ``mlx.launch`` alone (not its group) leaves it waiting for its ranks,
which see nothing; ``kill -INT`` the group, or SIGTERM ``mlx.launch``.

Run: ``python -m benches distributed_stop [--repeats N]`` (Linux: it reads ``/proc``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benches import harness
from benches.harness import ROOT, ResultFile, log, median, table
from benches.gpu.ranks import alive, free_port_pair, kill_all, ranks_of

MODEL = "tiny-llama"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
CASES = [
    ("SIGTERM to mlx.launch", "launcher", signal.SIGTERM),
    ("SIGINT to the process group (Ctrl-C)", "group", signal.SIGINT),
    ("SIGTERM to rank 0", "rank 0", signal.SIGTERM),
    ("SIGINT to rank 0", "rank 0", signal.SIGINT),
    ("SIGTERM to rank 1", "rank 1", signal.SIGTERM),
    ("SIGINT to rank 1", "rank 1", signal.SIGINT),
]
GIVE_UP_S = 60.0


def _stop_once(home: Path, target: str, signum: int) -> float:
    """Start two ranks, send the signal, and return the seconds until every process is gone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVMEM_", "MLX_"))}
    env.update(KVMEM_HOME=str(home), KVMEM_MODELS_DIR=str(harness.BENCH_HOME / "models"), KVMEM_PREWARM_MB="0",
               PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    command = [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(free_port_pair()), "--python",
               sys.executable, "-m", "gateway.cli", "serve", "--distributed", "--model", MODEL, "--port", "0"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    serving = threading.Event()

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "serving " in line:
                serving.set()
        serving.set()

    threading.Thread(target=drain, daemon=True).start()
    ranks: list[int] = []
    try:
        if not serving.wait(180):
            raise RuntimeError("the two ranks did not start")
        ranks = ranks_of(proc.pid)
        if len(ranks) != 2:
            raise RuntimeError(f"expected two ranks, found {ranks}")
        t0 = time.perf_counter()
        if target == "launcher":
            os.kill(proc.pid, signum)
        elif target == "group":
            os.killpg(proc.pid, signum)
        else:
            os.kill(ranks[0] if target == "rank 0" else ranks[1], signum)
        while any(alive(p) for p in (proc.pid, *ranks)):
            if time.perf_counter() - t0 > GIVE_UP_S:
                return float("inf")
            time.sleep(0.05)
        return time.perf_counter() - t0
    finally:
        kill_all(proc, ranks)


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, repeats=3, quick_repeats=1)
    args = p.parse_args(argv)
    reps = harness.repeats(args, full=3, quick=1)
    res = ResultFile("distributed_stop", "Stopping both ranks of kvmem serve --distributed", args.quick, argv or [],
                     model=MODEL)
    res.setup.append(f"`mlx.launch -n 2 --backend ring ... kvmem serve --distributed --model {MODEL}` on loopback, "
                     f"idle; {reps} repeat(s) a path, each two fresh ranks; seconds from the signal until mlx.launch "
                     "and both ranks are gone")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-stop-") as tmp:
        for name, target, signum in CASES:
            times = []
            for r in range(reps):
                took = _stop_once(Path(tmp) / f"{target}-{signum}-{r}", target, signum)
                times.append(took)
                res.record(path=name, repeat=r, seconds=took)
                log(f"{name}: all gone after {took:.1f} s")
            worst = max(times)
            rows.append([name, f"{median(times):.1f}", f"{worst:.1f}", "yes" if worst <= 10 else "**no**"])
    res.body += ["## Seconds until mlx.launch and both ranks are gone", "",
                 *table(["signal", "median s", "worst s", "within 10 s"], rows), "",
                 "SIGINT to `mlx.launch` alone (not its process group) is not measured: `mlx.launch` then waits for "
                 "its ranks and passes nothing on, so they cannot tell; Ctrl-C in a terminal reaches the group."]
    log(f"wrote {res.write()}")


if __name__ == "__main__":
    main(sys.argv[1:])
