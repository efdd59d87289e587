"""Per-token cost of ``kvmem serve --distributed`` at 1 vs 2 ranks, on this machine (two ranks on loopback).

What one rank-0 engine pays per token, measured on kvmem's real engine path:
one process (:class:`runtime.execution.mlx_engine.MlxEngine`) against two ranks under
``mlx.launch --backend ring`` on 127.0.0.1 (rank 0's
:class:`runtime.distributed.leader.LeaderEngine`, which sends every call to rank 1
first; both halves of the model meet in the ``all_sum`` of each layer):

* **prefill**: a cold prompt of P tokens, kvmem's own chunks, tokens per second;
* **decode**: one sequence's decode steps over that prompt, ms per token (median step).

Configurations: one process with OpenBLAS on 1 thread and on 2 threads (both
cores), and two ranks with 1 thread each (one core each: this machine has 2).
Models: ``tiny-llama`` (4 layers, hidden 128: the fixed cost per call
dominates) and ``smollm2-even``, SmolLM2-135M's geometry with 8 attention / 4
key-value heads instead of 9 / 3 (hidden 512), so that it splits over two ranks
(random float32 weights, built here; timings depend only on the geometry).

Run: ``python -m benches distributed`` (prompts of 128 and 512 tokens, 32 decode
steps, 3 repeats) or ``--quick`` (128 tokens, 1 repeat). Writes
``benches/results/distributed[_quick].{md,png}``. ``--worker`` is the per-rank
entry point the benchmark starts itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

from benches import harness
from benches.harness import BENCH_HOME, ResultFile, log, median, table

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = Path(sys.executable).parent / "mlx.launch"
DECODE_STEPS = 32
CONFIGS = (("1 process, 1 BLAS thread", 1, 1), ("1 process, 2 BLAS threads", 1, 2),
           ("2 ranks, 1 BLAS thread each", 2, 1))


def even_model_dir() -> Path:
    """``smollm2-even``: SmolLM2-135M's geometry with 8 / 4 heads (hidden 512), built once under the bench home."""
    from runtime.model import tiny_models as tm

    recipe = tm.TinyModelRecipe(
        name="smollm2-even",
        architecture="llama",
        config=MappingProxyType({
            **tm.RECIPES[tm.RANDOM_SMOLLM2].config,
            "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
        }),
        tokenizer_vocab=8192,
        out_gain=0.7,
    )
    folder = BENCH_HOME / "models" / f"smollm2-even-{tm.recipe_hash(recipe)}"
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".smollm2-even.", dir=folder.parent))
        tm.build_tiny_model(recipe, staging)
        staging.chmod(0o755)
        os.rename(staging, folder)
    return folder


# -- the worker: one rank (or the one process) -----------------------------------


def worker(args: argparse.Namespace) -> int:
    """Load the model (this rank's part), then time prefill and decode; rank 0 writes the results to ``--out``."""
    import runtime  # noqa: F401  (OpenBLAS before mlx)
    from benches.prompts import context_text
    from runtime.config import Config
    from runtime.execution.mlx_engine import MlxEngine

    config = Config().replace(model=args.model, home=args.home, models_dir=str(BENCH_HOME / "models"), prewarm_mb=0,
                              fsync=False)
    folder = Path(args.model) if Path(args.model).is_dir() else harness.model_dir(args.model)
    hidden = int(json.loads((folder / "config.json").read_text())["hidden_size"])
    rank = None
    engine: Any
    all_sum_ms = _all_sum_latency(hidden) if args.ranks > 1 else None
    plain = _plain_decode(folder, context_text(folder, args.prompts[0], label="plain"), args.decode,
                          sharded=args.ranks > 1)
    if args.ranks > 1:
        from runtime.distributed.launch import LeaderRank, open_rank

        opened = open_rank(config)
        if not isinstance(opened, LeaderRank):
            return opened.run()
        rank, engine = opened, opened.engine
    else:
        engine = MlxEngine(models_dir=config.models_path, kv_bits=config.kv_bits, kv_group_size=config.kv_group_size,
                           attention=config.attention, prewarm_mb=0)
    try:
        t0 = time.perf_counter()
        engine.load(args.model)
        runs: list[dict[str, Any]] = [{"load_s": time.perf_counter() - t0, "all_sum_ms": all_sum_ms,
                                       "plain_steps_s": plain}]
        request_id = 0
        for repeat in range(args.repeats):
            for tokens in args.prompts:
                request_id += 1
                prompt = context_text(folder, tokens, label=f"r{repeat}-{tokens}")
                runs.append({"repeat": repeat, "prompt_tokens": tokens,
                             **_one_turn(engine, request_id, prompt, args.decode)})
        Path(args.out).write_text(json.dumps(runs))
    finally:
        if rank is not None:
            engine.close()
            rank.close()
    return 0


def _all_sum_latency(hidden: int, calls: int = 200) -> float:
    """ms per ``all_sum`` of one decode step's activations (1 x 1 x hidden float32), on every rank at once."""
    import mlx.core as mx

    group = mx.distributed.init(strict=True)
    x = mx.ones((1, 1, hidden))
    mx.eval(mx.distributed.all_sum(x, group=group))
    t0 = time.perf_counter()
    for _ in range(calls):
        mx.eval(mx.distributed.all_sum(x, group=group))
    return (time.perf_counter() - t0) / calls * 1e3


def _plain_decode(folder: Path, prompt: str, steps: int, *, sharded: bool) -> list[float]:
    """Plain mlx-lm, no kvmem: the same model (this rank's shard), the prompt at once, then greedy steps (s each).

    Every rank runs it at once; it separates MLX's own cost of the sharded forward
    pass from what kvmem's engine and command channel add."""
    import gc

    import mlx.core as mx
    from mlx_lm import load as mlx_load
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = mlx_load(str(folder))[:2]
    if sharded:
        model.shard(mx.distributed.init(strict=True))
        mx.eval(model.parameters())
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokenizer.encode(prompt)]), cache=cache)
    token = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(token)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(token)
        times.append(time.perf_counter() - t)
    del model, cache, logits, token
    gc.collect()
    mx.clear_cache()
    return times


def _one_turn(engine: Any, request_id: int, prompt: str, decode: int) -> dict[str, Any]:
    from runtime.plan.sampling import SamplingOptions
    from runtime.plan.turn_plan import COLD

    tokens = engine.tokenize(prompt, COLD)
    t0 = time.perf_counter()
    engine.start(request_id, prompt, COLD, tokens, SamplingOptions(max_tokens=decode + 1, temperature=0.0))
    while (result := engine.prefill(request_id, None)).text is None:
        pass
    prefill_s = time.perf_counter() - t0
    steps: list[float] = []
    if not result.finished:
        engine.join(request_id)
        for _ in range(decode):
            t = time.perf_counter()
            (token,) = engine.step()
            steps.append(time.perf_counter() - t)
            if token.finished:
                break
    engine.finish(request_id)
    return {"prefill_s": prefill_s, "prefilled": len(tokens.ids), "steps_s": steps}


# -- the benchmark: each configuration in its own processes ------------------------


def _run(model: str, ranks: int, threads: int, *, prompts: list[int], repeats: int, home: Path) -> list[dict[str, Any]]:
    out = home / f"result-{ranks}-{threads}.json"
    worker_args = ["-m", "benches.gpu.distributed", "--worker", "--model", model, "--ranks", str(ranks),
                   "--repeats", str(repeats), "--decode", str(DECODE_STEPS), "--home", str(home), "--out", str(out),
                   "--prompts", *map(str, prompts)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVMEM_", "MLX_"))}
    env.update(OPENBLAS_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    if ranks == 1:
        command = [sys.executable, *worker_args]
    else:
        command = [str(LAUNCH), "-n", str(ranks), "--backend", "ring", "--python", sys.executable, *worker_args]
    subprocess.run(command, cwd=ROOT, env=env, check=True, stdin=subprocess.DEVNULL, timeout=1800)
    return list(json.loads(out.read_text()))


def main(argv: list[str]) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--decode", type=int, default=DECODE_STEPS)
    p.add_argument("--prompts", type=int, nargs="+")
    p.add_argument("--home")
    p.add_argument("--out")
    p.add_argument("--models", nargs="+", help="models to measure (default: tiny-llama and smollm2-even)")
    args = p.parse_args(argv)
    if args.worker:
        raise SystemExit(worker(args))
    if not LAUNCH.exists():
        raise SystemExit(f"mlx.launch is not installed beside {sys.executable}")
    reps = harness.repeats(args)
    prompts = args.prompts or ([128] if args.quick else [128, 512])
    models = args.models or ["tiny-llama", str(even_model_dir())]
    res = ResultFile("distributed", "Per-token cost at 1 vs 2 ranks (kvmem serve --distributed, loopback)",
                     args.quick, argv, model=None)
    res.setup += [
        f"{DECODE_STEPS} decode steps of one sequence after a cold prompt; prefill in kvmem's own chunks; "
        f"{reps} repeat(s), medians; each configuration in fresh processes",
        "2 ranks: `mlx.launch -n 2 --backend ring` on 127.0.0.1 (this machine, 2 cores: one per rank)",
    ]
    rows: list[list[Any]] = []
    latency: dict[str, float] = {}
    layers: dict[str, int] = {}
    curves: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-distributed-") as tmp:
        for model in models:
            name = Path(model).name.rsplit("-", 1)[0] if Path(model).is_dir() else model
            folder = Path(model) if Path(model).is_dir() else harness.model_dir(model)
            layers[name] = int(json.loads((folder / "config.json").read_text())["num_hidden_layers"])
            for label, ranks, threads in CONFIGS:
                home = Path(tmp) / f"{name}-{ranks}-{threads}"
                home.mkdir()
                log(f"{name}: {label}")
                runs = _run(model, ranks, threads, prompts=prompts, repeats=reps, home=home)
                for run in runs:
                    res.record(model=name, config=label, ranks=ranks, blas_threads=threads, **run)
                load_s = runs[0]["load_s"]
                plain_ms = median(t * 1e3 for t in runs[0]["plain_steps_s"][1:])
                if runs[0].get("all_sum_ms") is not None:
                    latency[name] = runs[0]["all_sum_ms"]
                for tokens in prompts:
                    mine = [r for r in runs[1:] if r["prompt_tokens"] == tokens]
                    prefill_tps = median(r["prefilled"] / r["prefill_s"] for r in mine)
                    step_ms = median(s * 1e3 for r in mine for s in r["steps_s"][1:])  # the first step merges the batch
                    plain_cell = f"{plain_ms:.1f}" if tokens == prompts[0] else ""
                    rows.append([name, label, tokens, f"{prefill_tps:.0f}", f"{step_ms:.1f}", f"{1e3 / step_ms:.1f}",
                                 plain_cell, f"{load_s:.1f}"])
                    curves.setdefault(f"{name}\n{tokens}-token prompt", {})[label] = step_ms
                    log(f"  {tokens} tokens: prefill {prefill_tps:.0f} tok/s, decode {step_ms:.1f} ms/token")
    res.body += ["## Prefill and decode per configuration (medians)", ""]
    res.body += table(["model", "configuration", "prompt tokens", "prefill tok/s", "decode ms/token", "decode tok/s",
                       "plain mlx-lm decode ms/token", "load s"], rows, "llrrrrrr")
    res.body += ["", "*plain mlx-lm*: the same model (each rank its shard) decoded by mlx-lm's forward pass alone, "
                 "no kvmem engine or command channel, after the first prompt length; measured in the same processes "
                 "before kvmem loads."]
    res.body += [""]
    res.body += ["## What a decode step waits for: one `all_sum` between the ranks", "",
                 "Each layer of a sharded llama sums its attention output and its MLP output over the ranks: "
                 "2 `all_sum`s per layer per step, each of one token's activations (hidden size, float32). "
                 "Measured alone, 200 in a row, before the model loads:", ""]
    res.body += table(["model", "ms per all_sum", "layers", "all_sums per token", "ms per token in all_sums"],
                      [[name, f"{ms:.2f}", layers[name], 2 * layers[name], f"{2 * layers[name] * ms:.1f}"]
                       for name, ms in latency.items()], "lrrrr")
    res.body += [""]
    _plot(res, curves)
    path = res.write(plot=True)
    log(f"wrote {path}")


def _plot(res: ResultFile, curves: dict[str, dict[str, float]]) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    groups = list(curves)
    labels = [c[0] for c in CONFIGS]
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        ax.bar([g + i * width for g in range(len(groups))], [curves[k].get(label, 0) for k in groups], width,
               label=label)
    ax.set_xticks([g + width * (len(labels) - 1) / 2 for g in range(len(groups))], groups, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("decode ms per token (log scale; lower is better)")
    ax.set_title("kvmem decode cost: 1 process vs 2 ranks on one 2-core machine")
    ax.legend(fontsize=8)
    harness.save_figure(res, fig)


if __name__ == "__main__":
    main(sys.argv[1:])
