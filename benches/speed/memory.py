"""Memory: KV bytes per token (Q4 / Q8 / float16 / float32), N hot agents, agents in a 2 GB budget.

1. **Bytes per token** from ``ModelCacheSpec.bytes_per_token()`` of the loaded
   kvmem-default model in each KV format, next to the bytes per token of a 4K
   cache saved by ``CacheDirectory`` (file sizes on disk: blocks + tail +
   manifest with text, ids and offsets).
2. **N agents hot**: N 4K-token caches (synthetic KV, default geometry) held as
   ``ParkedCache`` in MLX memory, as the hot tier holds them; MLX active memory
   over the baseline and the peak while loading them (``mx.get_active_memory``,
   ``mx.get_peak_memory``).
3. **Agents at 4K in 2 GB**: floor(2 GiB / bytes of one 4K cache), from the spec
   and from the measured memory per agent.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, log, table
from benches.snapshots import snapshot
from runtime.persist import CacheDirectory

MODES = ("q4", "q8", "float16", "float32")
BUDGET = 2 * 2**30
CONTEXT = 4096


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> None:
    import mlx.core as mx

    from runtime.spec import KVFormat
    from runtime.kv.kvstate import ParkedCache
    from runtime.model.loaded import load_model

    args = harness.parser(__doc__, quick_repeats=1).parse_args(argv)
    counts = (1, 2, 4) if args.quick else (1, 2, 4, 8)
    res = ResultFile("memory", "Memory: KV bytes per token, N hot agents, agents at 4K in a 2 GB budget",
                     args.quick, argv or [])
    spec_bpt: dict[str, int] = {}
    for bits in (4, 8, None):
        lm = load_model("kvmem-default", kv_format=KVFormat(bits=bits), models_dir=harness.BENCH_HOME / "models")
        if bits is None:
            spec_bpt["float32"] = lm.spec.bytes_per_token()
            spec_bpt["float16"] = dataclasses.replace(lm.spec, dtype_bytes=2).bytes_per_token()
        else:
            spec_bpt[f"q{bits}"] = lm.spec.bytes_per_token()
        del lm
    mx.clear_cache()

    disk_bpt: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-mem-") as tmp:
        for mode in MODES:
            store = CacheDirectory(Path(tmp) / mode, fsync=False)
            store.save("a", snapshot(CONTEXT, mode=mode, tag=f"bench@synthetic/{mode}"))
            disk_bpt[mode] = _dir_bytes(Path(tmp) / mode) / CONTEXT

    hot: dict[tuple[str, int], tuple[float, float]] = {}
    for mode in MODES:
        dtype = mx.float16 if mode == "float16" else mx.float32
        for n in counts:
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            snaps = [snapshot(CONTEXT, mode=mode, salt=i) for i in range(n)]
            parked = [ParkedCache.from_snapshot(s, float_dtype=dtype) for s in snaps]
            mx.eval([a for p in parked for layer in p.layers for a in layer.arrays.values()])
            del snaps
            active = mx.get_active_memory() - base
            peak = mx.get_peak_memory() - base
            hot[(mode, n)] = (active, peak)
            res.record(mode=mode, agents=n, context=CONTEXT, active_bytes=active, peak_bytes=peak,
                       nbytes=sum(p.nbytes for p in parked))
            log(f"{mode} x{n}: active {active / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB")
            del parked
            mx.clear_cache()

    fp16 = spec_bpt["float16"]
    rows = []
    for mode in MODES:
        per_agent_measured = hot[(mode, 1)][0]
        rows.append([mode, spec_bpt[mode], f"{spec_bpt[mode] / fp16:.3f}", f"{disk_bpt[mode]:.0f}",
                     f"{spec_bpt[mode] * CONTEXT / 2**20:.1f}", BUDGET // (spec_bpt[mode] * CONTEXT),
                     int(BUDGET // per_agent_measured)])
    hot_rows = [[mode] + [f"{hot[(mode, n)][0] / 2**20:.0f} / {hot[(mode, n)][1] / 2**20:.0f}" for n in counts]
                for mode in MODES]
    q4_ratio = spec_bpt["q4"] / fp16
    res.setup.append(f"hot agents: {CONTEXT}-token caches; float32 is this model's dtype (the at-rest "
                     "attention runs an active sequence in float32 on CPU)")
    res.body += [
        "## Bytes per token and agents at 4K in a 2 GiB budget",
        "",
        *table(["KV format", "bytes/token (spec)", "x float16", "bytes/token on disk (4K cache)",
                "MiB per 4K agent", "agents in 2 GiB (spec)", "agents in 2 GiB (measured MLX memory)"], rows),
        "",
        (f"Q4 / float16 = {q4_ratio:.3f} (design goal ≤ 0.29 for head_dim ≥ 64: "
        f"{'met' if q4_ratio <= 0.29 else 'missed'}). On-disk bytes include the manifest (text, token ids, "
        "offsets, checksums)."),
        "",
        f"## N agents hot at {CONTEXT} tokens: MLX active / peak MiB over the baseline",
        "",
        *table(["KV format", *[f"{n} agent{'s' if n > 1 else ''}" for n in counts]], hot_rows),
        "",
    ]
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in MODES:
        ax.plot(counts, [hot[(mode, n)][0] / 2**20 for n in counts], "o-", label=mode)
    ax.axhline(BUDGET / 2**20, color="grey", linestyle="--", label="2 GiB budget")
    ax.set_xlabel(f"agents hot ({CONTEXT}-token caches)")
    ax.set_ylabel("MLX active memory, MiB")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("hot-tier memory by KV format (kvmem-default geometry)")
    harness.save_figure(res, fig)
    print(res.write(plot=True).read_text())


if __name__ == "__main__":
    main()
