"""Cache I/O: save and load time vs cache size, next to the machine's sequential I/O floor.

For each size (1K-16K tokens; 1K-4K with ``--quick``) a synthetic Q4 snapshot of
kvmem-default's KV geometry (30 layers x 3 KV heads x head_dim 64, group 64:
6,480 bytes per token) is saved with ``runtime.persist.CacheDirectory``
(fsync on: blocks, tail, manifest, directory) and loaded back after every file
of the agent has been dropped from the page cache
(``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)``), i.e. a load from disk,
not from RAM, with validation (checksums) included.

Side by side, for the same number of bytes in one file: the **floor** —
sequential write + fsync, and a sequential read after dropping the file from
the page cache. ``save / floor`` and ``load / floor`` are the fractions
kvmem adds over the raw device (1.0 = as fast as a plain file).
Every agent gets fresh random KV, so no block is shared with an earlier save.

The process's allocator is set up as a kvmem server's is after its first model
load (``runtime.allocator.keep_freed_memory``: freed buffers stay in the process, so
a load fills memory that earlier loads used instead of faulting in fresh pages);
``--allocator default`` measures with glibc's defaults instead.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, log, median, table
from benches.snapshots import bytes_per_token, snapshot
from runtime.persist import CacheDirectory
from runtime.allocator import keep_freed_memory

CHUNK = 4 * 2**20


def drop_from_page_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def floor_write(path: Path, nbytes: int) -> float:
    data = os.urandom(min(nbytes, CHUNK))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, data[: min(left, len(data))])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def floor_read(path: Path) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        while os.read(fd, CHUNK):
            pass
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, quick_repeats=3)
    p.add_argument("--allocator", choices=("server", "default"), default="server",
                   help="keep freed memory as kvmem serve does (server), or glibc's defaults")
    args = p.parse_args(argv)
    kept = args.allocator == "server" and keep_freed_memory()
    reps = harness.repeats(args, full=5, quick=3)
    sizes = [1024, 2048, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384]
    res = ResultFile("cache_io", "Cache I/O: save / load vs cache size, against the sequential I/O floor",
                     args.quick, argv or [], variant="" if args.allocator == "server" else "_default_allocator")
    res.setup.append("allocator: " + ("freed memory kept, as in `kvmem serve` (runtime.allocator.keep_freed_memory)"
                                      if kept else "glibc defaults (freed large buffers go back to the kernel)"))
    rows, curve = [], []
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-io-", dir=os.environ.get("KVMEM_BENCH_IO_DIR")) as tmp:
        root = Path(tmp)
        fs = os.statvfs(root)
        res.setup.append(f"folder: {root} (block size {fs.f_bsize}); {reps} repeats per size, median")
        store = CacheDirectory(root / "caches", fsync=True)
        for n in sizes:
            saves, loads, wfl, rfl, sizes_b, hot_loads, load_cpu = [], [], [], [], [], [], []
            for r in range(reps):
                snap = snapshot(n, salt=n * 100 + r)
                agent = f"io-{n}-{r}"
                t0 = time.perf_counter()
                report = store.save(agent, snap)
                save_s = time.perf_counter() - t0
                agent_bytes = report.bytes_written
                drop_from_page_cache(root / "caches")
                t0, c0 = time.perf_counter(), time.process_time()
                loaded = store.load(agent, model_tag=snap.model_tag)
                load_s = time.perf_counter() - t0
                cpu_s = time.process_time() - c0  # all threads, user + system
                assert loaded.num_tokens == n
                t0 = time.perf_counter()
                store.load(agent, model_tag=snap.model_tag)
                hot_load_s = time.perf_counter() - t0  # files now in the page cache: the CPU part of a load
                floor = root / "floor.bin"
                w = floor_write(floor, agent_bytes)
                rd = floor_read(floor)
                floor.unlink()
                saves.append(save_s)
                loads.append(load_s)
                hot_loads.append(hot_load_s)
                load_cpu.append(cpu_s)
                wfl.append(w)
                rfl.append(rd)
                sizes_b.append(agent_bytes)
                res.record(tokens=n, repeat=r, bytes=agent_bytes, save_ms=save_s * 1e3, load_ms=load_s * 1e3,
                           floor_write_ms=w * 1e3, floor_read_ms=rd * 1e3, load_cpu_ms=cpu_s * 1e3,
                           hot_load_ms=hot_load_s * 1e3, blocks=report.blocks_written,
                           kv_bytes=snap.nbytes)
                log(f"{n} tokens: save {save_s * 1e3:.1f} ms, load {load_s * 1e3:.1f} ms, "
                    f"floor write {w * 1e3:.1f} / read {rd * 1e3:.1f} ms ({agent_bytes / 2**20:.1f} MiB)")
                store.delete(agent)
            mb = median(sizes_b) / 2**20
            s, ld, w, rd, hl, lc = (median(x) * 1e3 for x in (saves, loads, wfl, rfl, hot_loads, load_cpu))
            rows.append([n, f"{mb:.1f}", f"{s:.1f}", f"{w:.1f}", f"{s / w:.2f}", f"{ld:.1f}", f"{rd:.1f}",
                         f"{ld / rd:.2f}", f"{lc:.1f}", f"{hl:.1f}", f"{mb / (ld / 1e3):.0f}",
                         f"{mb / (rd / 1e3):.0f}"])
            curve.append((n, s, w, ld, rd))
    res.setup.append(f"snapshot: Q4 group 64, {bytes_per_token('q4')} KV bytes per token (+ manifest, text, ids)")
    worst = max(c[3] / c[4] for c in curve)
    res.body += [
        *table(["tokens", "MiB on disk", "save ms", "floor write+fsync ms", "save / floor", "load ms",
                "floor read ms", "load / floor", "load CPU ms", "load, page-cached ms", "load MiB/s",
                "floor read MiB/s"], rows),
        "",
        (f"Goal: load within 2x of the file-read floor — worst load / floor here {worst:.2f} "
        f"({'met' if worst <= 2 else 'missed'}). Loads are from a dropped page cache (disk), "
        "including manifest parsing and checksum validation; the floor is one plain file of the same size. "
         "*load CPU* is the process time of the cold load, user and system (the kernel's reading and "
         "read-ahead included, as well as kvmem's checksums and parsing): on this shared 2-core machine the "
         "load is CPU-bound, and other processes' load adds to its wall time. *load, page-cached* repeats "
         "the load with the files in RAM."),
    ]
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [c[0] for c in curve]
    for idx, label, style in ((1, "kvmem save (fsync)", "o-"), (2, "floor write+fsync", "o--"),
                              (3, "kvmem load (cold page cache)", "s-"), (4, "floor read (cold)", "s--")):
        ax.plot(xs, [c[idx] for c in curve], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached tokens (Q4, kvmem-default geometry)")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    ax.set_title("cache save / load vs sequential I/O floor")
    harness.save_figure(res, fig)
    print(res.write(plot=True).read_text())


if __name__ == "__main__":
    main()
