"""Attention benchmark: quantized SDPA ("native") vs Q4 only at rest.

Which is faster depends on the backend, so kvmem makes it a per-backend choice
and this benchmark backs the choice:

* **native** — prefill in chunks straight into :class:`runtime.kv.q4_cache.QuantizedKVCache`
  (mlx-lm's quantized SDPA), then decode on it.
* **at-rest** — prefill into float ``KVCache``; "park" it to Q4 once
  (float → Q4, what happens when an agent goes idle), "activate" it back
  (Q4 → float, when the agent's next turn starts), then decode on the float cache.

The model is a random-weight llama with SmolLM2-135M's geometry in float32
(the CPU path, see DESIGN.md); weights need no meaning for timing. Every
number is the median of the repeats.

Run: ``python -m benches.speed.attention_strategy`` (contexts 1K and 4K, 3 repeats;
writes ``benches/results/attention_strategy.{md,png}``) or ``--quick``
(512 tokens, 1 repeat; writes ``attention_strategy_quick.{md,png}``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import runtime  # noqa: F401  (loads OpenBLAS before mlx)
from runtime import blas

import mlx.core as mx
import mlx_lm
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from benches.harness import git_revision
from runtime.kv.q4_cache import QuantizedKVCache

RESULTS = Path(__file__).parents[1] / "results"
CHUNK = 512
DECODE_TOKENS = 16
GROUP_SIZE, BITS = 64, 4


def smollm2_135m_geometry() -> llama.Model:
    """Random-weight llama shaped like SmolLM2-135M (float32)."""
    mx.random.seed(0)
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=576,
            num_hidden_layers=30,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            rms_norm_eps=1e-5,
            vocab_size=49152,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        )
    )
    mx.eval(model.parameters())
    return model


@dataclass(frozen=True)
class Run:
    """One repeat of one attention mode at one context length (seconds)."""

    prefill_s: float
    decode_s: float
    park_s: float | None = None
    activate_s: float | None = None


def _prefill(model: Any, tokens: mx.array, cache: list[Any]) -> mx.array:
    logits = None
    for start in range(0, tokens.shape[1], CHUNK):
        logits = model(tokens[:, start : start + CHUNK], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        mx.clear_cache()
    assert logits is not None
    return mx.argmax(logits[:, -1:], axis=-1)


def _decode(model: Any, token: mx.array, cache: list[Any]) -> None:
    for _ in range(DECODE_TOKENS):
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        mx.eval(token)


def run_native(model: Any, tokens: mx.array) -> Run:
    cache = [QuantizedKVCache(group_size=GROUP_SIZE, bits=BITS) for _ in model.layers]
    t0 = time.perf_counter()
    token = _prefill(model, tokens, cache)
    t1 = time.perf_counter()
    _decode(model, token, cache)
    t2 = time.perf_counter()
    return Run(prefill_s=t1 - t0, decode_s=t2 - t1)


def run_at_rest(model: Any, tokens: mx.array) -> Run:
    cache: list[Any] = [KVCache() for _ in model.layers]
    t0 = time.perf_counter()
    token = _prefill(model, tokens, cache)
    t1 = time.perf_counter()
    parked = [
        QuantizedKVCache.from_float(
            c.keys[:, :, : c.offset], c.values[:, :, : c.offset], group_size=GROUP_SIZE, bits=BITS
        )
        for c in cache
    ]
    mx.eval([p.state for p in parked])
    t2 = time.perf_counter()
    del cache
    mx.clear_cache()
    t3 = time.perf_counter()
    active: list[Any] = []
    for p in parked:
        c = KVCache()
        keys, values = p.dequantized(mx.float32)
        c.state = (keys, values, p.offset)
        active.append(c)
    mx.eval([c.state for c in active])
    t4 = time.perf_counter()
    _decode(model, token, active)
    t5 = time.perf_counter()
    return Run(prefill_s=t1 - t0, decode_s=t5 - t4, park_s=t2 - t1, activate_s=t4 - t3)


@dataclass(frozen=True)
class Row:
    """Medians over repeats for one (context, attention)."""

    context: int
    attention: str
    prefill_tps: float
    decode_tps: float
    park_ms: float | None
    activate_ms: float | None

    @property
    def turn_s(self) -> float:
        """Seconds for prefill + decode + (at-rest) park and activate."""
        extra = ((self.park_ms or 0.0) + (self.activate_ms or 0.0)) / 1e3
        return self.context / self.prefill_tps + DECODE_TOKENS / self.decode_tps + extra


def summarize(context: int, attention: str, runs: list[Run]) -> Row:
    def med(xs: list[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return statistics.median(vals) if vals else None

    park, act = med([r.park_s for r in runs]), med([r.activate_s for r in runs])
    return Row(
        context=context,
        attention=attention,
        prefill_tps=context / statistics.median(r.prefill_s for r in runs),
        decode_tps=DECODE_TOKENS / statistics.median(r.decode_s for r in runs),
        park_ms=None if park is None else park * 1e3,
        activate_ms=None if act is None else act * 1e3,
    )


def recommendation(rows: list[Row]) -> str:
    """One sentence: which attention mode is faster here, from the largest context measured."""
    ctx = max(r.context for r in rows)
    native = next(r for r in rows if r.context == ctx and r.attention == "native")
    rest = next(r for r in rows if r.context == ctx and r.attention == "at-rest")
    winner = "at-rest" if rest.turn_s < native.turn_s else "native"
    return (
        f"On this backend ({mx.default_device()}) use **{winner}**: at {ctx} tokens, "
        f"at-rest prefills {rest.prefill_tps / native.prefill_tps:.1f}x and decodes "
        f"{rest.decode_tps / native.decode_tps:.1f}x as fast as native (quantized SDPA), "
        f"and a whole turn (prefill + {DECODE_TOKENS} tokens, plus park "
        f"{rest.park_ms or 0:.0f} ms and activate {rest.activate_ms or 0:.0f} ms) takes "
        f"{rest.turn_s:.1f} s against {native.turn_s:.1f} s."
    )


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def write_markdown(
    path: Path, rows: list[Row], *, command: str, repeats: int, load: tuple[float, float]
) -> None:
    lines = [
        "# Attention, at rest or native: quantized SDPA (native) vs Q4 at rest",
        "",
        f"- command: `{command}`",
        f"- git rev: {git_revision()}",
        f"- mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, device {mx.default_device()}, "
        f"{os.cpu_count()} cores, {platform.machine()} {platform.system()}",
        f"- BLAS: {blas.openblas_path() or 'bundled reference BLAS'}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}",
        "- model: random-weight llama, SmolLM2-135M geometry (30 layers, hidden 576, "
        "9 heads / 3 KV heads, head dim 64, vocab 49152), float32",
        f"- KV: Q4 group {GROUP_SIZE} (float16 scales/biases); prefill chunks of {CHUNK} "
        f"with `mx.eval` + `mx.clear_cache` after each; decode {DECODE_TOKENS} tokens greedy",
        f"- 1-minute load average before / after: {load[0]:.2f} / {load[1]:.2f} "
        "(the machine is shared; anything above ~0.5 means other work competed for the cores)",
        f"- medians of {repeats} repeat(s); park = float→Q4 of the whole cache, "
        "activate = Q4→float (both evaluated); turn = prefill + decode (+ park + activate)",
        "",
        "| context | attention | prefill tok/s | decode tok/s | park ms | activate ms | turn s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.context} | {r.attention} | {r.prefill_tps:.1f} | {r.decode_tps:.2f} | "
            f"{_fmt(r.park_ms, '.1f')} | {_fmt(r.activate_ms, '.1f')} | {r.turn_s:.2f} |"
        )
    lines += ["", recommendation(rows), ""]
    path.write_text("\n".join(lines))


def write_plot(path: Path, rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r.context for r in rows})
    modes = ["native", "at-rest"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.38
    for ax, attr, title in (
        (axes[0], "prefill_tps", "prefill tok/s"),
        (axes[1], "decode_tps", "decode tok/s"),
    ):
        for j, attention in enumerate(modes):
            vals = [
                getattr(next(r for r in rows if r.context == c and r.attention == attention), attr)
                for c in contexts
            ]
            xs = [i + (j - 0.5) * width for i in range(len(contexts))]
            bars = ax.bar(xs, vals, width, label=attention)
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xticks(range(len(contexts)), [f"{c} tokens" for c in contexts])
        ax.set_title(title)
        ax.legend()
    rest = [next(r for r in rows if r.context == c and r.attention == "at-rest") for c in contexts]
    for j, (attr, label) in enumerate((("park_ms", "park (float→Q4)"), ("activate_ms", "activate (Q4→float)"))):
        xs = [i + (j - 0.5) * width for i in range(len(contexts))]
        bars = axes[2].bar(xs, [getattr(r, attr) or 0.0 for r in rest], width, label=label)
        axes[2].bar_label(bars, fmt="%.0f", fontsize=8)
    axes[2].set_xticks(range(len(contexts)), [f"{c} tokens" for c in contexts])
    axes[2].set_title("at-rest conversion ms (whole cache)")
    axes[2].legend()
    fig.suptitle(f"Attention at rest or native, SmolLM2-135M geometry, mlx {mx.__version__} {mx.default_device()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 tokens, 1 repeat")
    args = parser.parse_args(argv)
    contexts, repeats = ([512], 1) if args.quick else ([1024, 4096], 3)
    suffix = "_quick" if args.quick else ""
    command = "python -m benches.speed.attention_strategy" + (" --quick" if args.quick else "")

    load_before = os.getloadavg()[0]
    model = smollm2_135m_geometry()
    warm = mx.random.randint(0, 49152, (1, 64), key=mx.random.key(1))
    run_native(model, warm)  # first-call overheads
    run_at_rest(model, warm)

    rows: list[Row] = []
    for context in contexts:
        tokens = mx.random.randint(0, 49152, (1, context), key=mx.random.key(context))
        runs: dict[str, list[Run]] = {"native": [], "at-rest": []}
        for rep in range(repeats):
            for attention, fn in (("native", run_native), ("at-rest", run_at_rest)):
                run = fn(model, tokens)
                runs[attention].append(run)
                print(f"{context:5d} {attention:8s} rep {rep}: {run}", file=sys.stderr, flush=True)
                mx.clear_cache()
        rows += [summarize(context, s, r) for s, r in runs.items()]

    RESULTS.mkdir(parents=True, exist_ok=True)
    md = RESULTS / f"attention_strategy{suffix}.md"
    load = (load_before, os.getloadavg()[0])
    write_markdown(md, rows, command=command, repeats=repeats, load=load)
    write_plot(RESULTS / f"attention_strategy{suffix}.png", rows)
    print(md.read_text())


if __name__ == "__main__":
    main()
