"""benches.thread_cpu: which threads ran during a window (the GPU bench's question for a slow decode step)."""

from __future__ import annotations

import threading
import time

import pytest

from benches.thread_cpu import ThreadClock, available

pytestmark = pytest.mark.skipif(not available(), reason="/proc's per-thread times are Linux's")


def _spin(cpu_seconds: float) -> None:
    """Run until this thread has used ``cpu_seconds`` of CPU (however busy the machine is)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def test_a_busy_thread_is_named_with_its_share_of_the_window_and_an_idle_one_is_not() -> None:
    done, spun = threading.Event(), threading.Event()

    def busy() -> None:
        _spin(0.2)
        spun.set()
        done.wait()  # alive when the clock stops: a thread gone by then has no /proc entry to read

    sleeper = threading.Thread(target=done.wait, name="sleeper")
    spinner = threading.Thread(target=busy, name="spinner")
    sleeper.start()
    clock = ThreadClock()
    clock.start()
    spinner.start()
    spun.wait()
    window = clock.stop()
    done.set()
    spinner.join()
    sleeper.join()
    # CPU time, not wall time: the spinner ran 0.2 s of it however long a busy machine made it wait
    assert 0.19 <= window.threads["spinner"] <= window.wall_s + 0.01
    (name, share), = window.top(1)  # its share of the wall time (the window's length is the machine's doing)
    assert name == "spinner" and share == pytest.approx(window.threads["spinner"] / window.wall_s)
    assert window.threads.get("sleeper", 0.0) < 0.005 and window.process_cpu_s >= window.threads["spinner"]
    assert window.machine_busy_s >= 0 and window.steal_s >= 0


def test_a_threads_first_touches_of_new_memory_are_counted_as_its_faults() -> None:
    """A thread that writes 64 MiB of fresh memory (mapped page by page at the first touch) against one that
    only sleeps. Reference: the pages written, 4 KiB each (huge pages would make fewer: at least a few)."""
    import mmap

    done, touched = threading.Event(), threading.Event()

    def toucher() -> None:
        memory = mmap.mmap(-1, 64 << 20)  # anonymous: no page mapped before it is touched
        for offset in range(0, len(memory), 4096):
            memory[offset] = 1
        touched.set()
        done.wait()
        memory.close()

    sleeper = threading.Thread(target=done.wait, name="sleeper")
    sleeper.start()
    clock = ThreadClock()
    clock.start()
    worker = threading.Thread(target=toucher, name="toucher")
    worker.start()
    touched.wait()
    window = clock.stop()
    done.set()
    worker.join()
    sleeper.join()
    assert window.faults["toucher"] >= 32  # 16,384 pages of 4 KiB; a few 2 MiB huge pages at the very least
    assert window.faults.get("sleeper", 0) < 10


def test_threads_waiting_for_a_core_and_sharing_one_are_told() -> None:
    """Three spinning threads on one CPU: each waited for it about two thirds of the window, and all three last
    ran on one physical core. Reference: the window's own wall time and the affinity the test sets."""
    import hashlib
    import os

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("thread affinity is Linux's")
    cpu = min(os.sched_getaffinity(0))
    stop, ready = threading.Event(), threading.Barrier(4)

    data = bytes(1 << 20)

    def spin() -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only (Linux: 0 is the calling thread)
        ready.wait()
        while not stop.is_set():
            hashlib.sha256(data).digest()  # runs without the GIL: the three want the CPU, not the GIL

    spinners = [threading.Thread(target=spin, name=f"spinner-{i}") for i in range(3)]
    for t in spinners:
        t.start()
    ready.wait()
    clock = ThreadClock()
    clock.start()
    time.sleep(0.6)
    window = clock.stop()
    stop.set()
    for t in spinners:
        t.join()
    names = [f"spinner-{i}" for i in range(3)]
    assert all(window.waits[name] > 0.2 * window.wall_s for name in names), window.waits
    assert sum(window.threads[name] for name in names) <= 1.1 * window.wall_s  # one CPU's worth between them
    assert set(names) <= set(window.sharing_a_core(4)) and len({window.cores[name] for name in names}) == 1


def test_one_cpu_a_core_keeps_the_lowest_hyperthread_of_each_core(tmp_path) -> None:
    from benches.thread_cpu import one_cpu_a_core

    # two packages: cpus 0 and 4 one core, 1 and 5 another; 2 alone on package 1; 3's topology unknown
    for cpu, package, core in ((0, 0, 0), (4, 0, 0), (1, 0, 1), (5, 0, 1), (2, 1, 0)):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert one_cpu_a_core({0, 1, 2, 3, 4, 5}, root=tmp_path) == {0, 1, 2, 3}
    assert one_cpu_a_core({4, 5}, root=tmp_path) == {4, 5}  # only the allowed ones


def test_keep_threads_to_sets_every_threads_cpus_and_new_threads_inherit_them() -> None:
    import os

    from benches.thread_cpu import keep_threads_to, one_cpu_a_core

    before = os.sched_getaffinity(0)
    seen: list[set[int]] = []
    try:
        keep = {min(before)}
        assert keep_threads_to(keep) >= 1
        assert os.sched_getaffinity(0) == keep
        thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join()
        assert seen == [keep]
        assert one_cpu_a_core() <= before
    finally:
        keep_threads_to(before)
    assert os.sched_getaffinity(0) == before
