"""MLX's CPU matmuls with Debian's OpenBLAS loaded (``runtime.blas``) against the wheel's bundled reference BLAS.

``runtime.blas`` loads ``libopenblas`` before MLX so that MLX's ``cblas_*`` symbols resolve to it; with
``KVMEM_NO_OPENBLAS=1`` MLX keeps the reference BLAS its Linux wheel bundles. ``tests/runtime_core/test_blas.py`` holds that
MLX's products are OpenBLAS's, bit for bit; how much faster that makes them is a machine's figure, measured
here (the test used to demand a gap of more than 4x in GFLOP/s, which a loaded machine could fail).

Each BLAS runs in a fresh process of its own, one after the other, on the products kvmem's default model
(SmolLM2-135M: hidden 576, MLP 1536) makes on the CPU: a 512-token prefill chunk through an MLP projection, and
a decode step of 8 rows. Each product is evaluated ``--products`` times a repeat; the best repeat's GFLOP/s is
reported (a busy machine only slows a repeat down), the median beside it. Here (2-core CPU)::

    .venv/bin/python -m benches blas
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import runtime  # noqa: F401  (OpenBLAS before mlx: the result file's header names this process's BLAS)
from benches import harness
from benches.harness import ResultFile, log, median, table

SHAPES = {  # name: (rows, inner, columns)
    "prefill chunk 512 x 576 @ 576 x 1536": (512, 576, 1536),
    "decode step 8 x 576 @ 576 x 1536": (8, 576, 1536),
}

_PROBE = """
import json, sys, time
import runtime
import mlx.core as mx
shapes, repeats, products = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
out = {"loaded": runtime.blas.openblas_path(), "gflops": {}}
for name, (m, k, n) in shapes.items():
    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    mx.eval(a, b, a @ b)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(products):
            mx.eval(a @ b)
        rates.append(2 * m * k * n * products / (time.perf_counter() - t0) / 1e9)
    out["gflops"][name] = rates
print(json.dumps(out))
"""


def _measure(no_openblas: bool, repeats: int, products: int) -> dict:
    env = {**os.environ}
    if no_openblas:
        env["KVMEM_NO_OPENBLAS"] = "1"
    else:
        env.pop("KVMEM_NO_OPENBLAS", None)
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(SHAPES), str(repeats), str(products)],
                          capture_output=True, text=True, env=env, check=True, cwd=Path(__file__).resolve().parents[2])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    p = harness.parser(__doc__, repeats=5, quick_repeats=2)
    p.add_argument("--products", type=int, default=10, help="products evaluated a repeat (default 10)")
    args = p.parse_args(argv)
    repeats = harness.repeats(args, full=5, quick=2)
    res = ResultFile("blas", "MLX's CPU matmuls: OpenBLAS loaded vs the bundled reference BLAS", args.quick, argv,
                     model=None)
    res.setup.append(f"{repeats} repeats of {args.products} products each, per BLAS, each BLAS in a fresh process")
    by_blas = {}
    for label, no_openblas in (("OpenBLAS", False), ("reference BLAS", True)):
        log(f"{label} ...")
        run = _measure(no_openblas, repeats, args.products)
        by_blas[label] = run
        res.record(blas=label, loaded=run["loaded"], gflops=run["gflops"])
    if not by_blas["OpenBLAS"]["loaded"]:
        res.body.append("OpenBLAS was not found here (`apt-get install libopenblas0-pthread`): both rows are the "
                        "reference BLAS.")
    rows = []
    for shape in SHAPES:
        ours, ref = by_blas["OpenBLAS"]["gflops"][shape], by_blas["reference BLAS"]["gflops"][shape]
        rows.append([shape, f"{max(ours):.1f} ({median(ours):.1f})", f"{max(ref):.1f} ({median(ref):.1f})",
                     f"{max(ours) / max(ref):.1f}x"])
    res.body += ["GFLOP/s, best repeat (median):", "",
                 *table(["product", "OpenBLAS", "reference BLAS", "OpenBLAS / reference (best)"], rows)]
    print("\n".join(res.body))
    log(f"wrote {res.write()}")
