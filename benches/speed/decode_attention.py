"""kvmem's decode-step attention vs MLX's on the CPU backend: one layer, then whole decode steps.

Two questions, answered side by side in one run on ``kvmem-default``
(SmolLM2-135M-Instruct, float32 weights, 9 query heads, 3 KV heads, head dim 64):

1. **The kernel**: one layer's attention for one query per row,
   ``mx.fast.scaled_dot_product_attention`` vs
   :func:`runtime.cpu.attention.decode_attention`, for 1, 2, 4 and 8 rows over
   1K and 4K keys (rows left-padded to different lengths, as a batch is).
2. **A decode step of the model**: ``LoadedModel.forward`` of one token per
   row over a batch cache (mlx-lm's ``BatchKVCache``, rows of different
   lengths; one agent: a plain ``KVCache``), with kvmem's decode attention and
   with it off (MLX's attention), alternated step by step; greedy tokens of
   the two are compared.
3. **Rows that share a prompt**: the same step over rows whose first 1K
   tokens hold the same keys and values (agents over one system prompt),
   :func:`runtime.cpu.attention.shared_prefix_attention` (the shared keys read
   once) against :func:`~runtime.cpu.attention.decode_attention` (every row's
   keys read), alternated step by step.

Run: ``python -m benches decode_attention`` (3 repeats) or ``--quick``
(1K only, 1 repeat). Writes ``benches/results/decode_attention.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, eval_median_s, log, median, table

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
ROWS = (1, 2, 4, 8)
STEPS = 8  # decode steps per repeat and setting


def _padding_mask(rows: int, span: int) -> Any:
    """Row b's first 7*b keys are padding (None for one row: nothing to pad)."""
    import mlx.core as mx

    if rows == 1:
        return None
    return mx.arange(span)[None, None, None, :] >= (7 * mx.arange(rows))[:, None, None, None]


def kernel_section(res: ResultFile, spans: list[int], repeats: int) -> None:
    import mlx.core as mx

    from runtime.cpu.attention import decode_attention

    rows_out = []
    for span in spans:
        for rows in ROWS:
            q = mx.random.normal((rows, HEADS, 1, HEAD_DIM))
            k = mx.random.normal((rows, KV_HEADS, span, HEAD_DIM))
            v = mx.random.normal((rows, KV_HEADS, span, HEAD_DIM))
            mask = _padding_mask(rows, span)
            mx.eval(q, k, v)
            n = max(repeats * 10, 20)
            mlx_s = eval_median_s(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask), n)
            ours_s = eval_median_s(lambda: decode_attention(q, k, v, scale=0.125, mask=mask), n)
            err = mx.abs(decode_attention(q, k, v, scale=0.125, mask=mask)
                         - mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)).max().item()
            rows_out.append([rows, span, f"{mlx_s * 1e3:.2f}", f"{ours_s * 1e3:.2f}", f"{mlx_s / ours_s:.2f}x",
                             f"{err:.1e}"])
            res.record(section="kernel", rows=rows, span=span, mlx_s=mlx_s, kvmem_s=ours_s, max_abs_diff=err)
            log(f"kernel {rows} rows x {span}: mlx {mlx_s * 1e3:.2f} ms, kvmem {ours_s * 1e3:.2f} ms")
    res.body += ["## 1. One layer's attention, one query per row (ms, median)", ""]
    res.body += table(["rows", "keys", "MLX (mx.fast SDPA)", "kvmem decode_attention", "speed-up", "max |diff|"],
                      rows_out, "rrrrrr")
    res.body += [""]


def _batch_cache(lm: Any, rows: int, span: int) -> list[Any]:
    """Random float KV for ``rows`` rows of about ``span`` tokens (row b is 7*b shorter), as a decode batch holds it."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    layers = []
    for _ in range(len(lm.model.layers)):
        parts = []
        for b in range(rows):
            c = KVCache()
            n = span - 7 * b
            c.update_and_fetch(mx.random.normal((1, KV_HEADS, n, HEAD_DIM)), mx.random.normal((1, KV_HEADS, n, HEAD_DIM)))
            parts.append(c)
        layers.append(parts[0] if rows == 1 else BatchKVCache.merge(parts))
    mx.eval([a for c in layers for a in (c.keys, c.values)])
    return layers


def _alternated_steps(lm: Any, cache: list[Any], rows: int, settings: dict[str, Callable[[], Any]], steps: int, *,
                      grow: bool) -> tuple[dict[str, list[float]], int, int]:
    """The same decode step under each setting in turn (a context manager each), ``steps`` times.

    The cache is trimmed back after each run; with ``grow`` it then grows by the first
    setting's greedy token. Returns each setting's step times and how many greedy tokens
    of the two settings agreed, out of how many.
    """
    import mlx.core as mx

    token = mx.array([[42]] * rows)
    samples: dict[str, list[float]] = {name: [] for name in settings}
    agree = total = 0
    for _ in range(steps):
        picks = {}
        for name, setting in settings.items():
            t0 = time.perf_counter()
            with setting():
                logits = lm.forward(token, cache)[:, -1, :]
            picks[name] = logits.argmax(-1)
            mx.eval(picks[name])
            samples[name].append(time.perf_counter() - t0)
            for c in cache:  # the same step again for the other setting
                c.trim(1)
        first, other = picks.values()
        agree += int((first == other).sum().item())
        total += rows
        token = first[:, None]
        if grow:
            mx.eval(lm.forward(token, cache))  # the cache grows by the agreed token
    return samples, agree, total


@contextmanager
def _threshold(name: str, value: int) -> Iterator[None]:
    """One of :mod:`runtime.cpu.attention`'s dispatch thresholds set to ``value`` within the block."""
    from runtime.cpu import attention as cpu_attention

    before = getattr(cpu_attention, name)
    setattr(cpu_attention, name, value)
    try:
        yield
    finally:
        setattr(cpu_attention, name, before)


@contextmanager
def _shared_from_2(tokens: int) -> Iterator[None]:
    """``tokens`` shared, attended once from two rows up."""
    from runtime.cpu import attention as cpu_attention

    with _threshold("MIN_SHARED_ROWS", 2), cpu_attention.sharing(tokens):
        yield


def step_section(res: ResultFile, lm: Any, spans: list[int], repeats: int) -> dict[tuple[int, int], dict[str, float]]:
    """Whole decode steps, kvmem's decode attention on and off, alternated over the same growing cache."""
    import mlx.core as mx

    from runtime.cpu import attention as cpu_attention

    on_threshold = cpu_attention.MIN_DECODE_KEYS
    out: dict[tuple[int, int], dict[str, float]] = {}
    rows_out = []
    for span in spans:
        for rows in ROWS:
            cache = _batch_cache(lm, rows, span)
            samples, agree, total = _alternated_steps(
                lm, cache, rows, {"mlx": lambda: _threshold("MIN_DECODE_KEYS", 1 << 62),
                                "kvmem": lambda: _threshold("MIN_DECODE_KEYS", on_threshold)},
                repeats * STEPS, grow=True)
            used = rows * span >= on_threshold
            med = {k: median(v) for k, v in samples.items()}
            out[(rows, span)] = med
            rows_out.append([rows, span, f"{med['mlx'] * 1e3:.1f}", f"{med['kvmem'] * 1e3:.1f}",
                             f"{med['mlx'] / med['kvmem']:.2f}x", "yes" if used else "no (MLX)",
                             f"{agree}/{total}", f"{rows / med['kvmem']:.1f}"])
            res.record(section="step", rows=rows, span=span, runs=samples, greedy_agree=agree, greedy_total=total)
            log(f"step {rows} rows x {span}: mlx {med['mlx'] * 1e3:.1f} ms, kvmem {med['kvmem'] * 1e3:.1f} ms")
            del cache
            mx.clear_cache()
    res.body += ["## 2. One decode step of the model (ms, median)", ""]
    res.body += table(["rows", "keys per row", "MLX attention", "kvmem (auto)", "speed-up", "decode_attention used",
                       "same greedy token", "tokens/s of the step"], rows_out, "rrrrrlrr")
    res.body += [
        "",
        f"Both settings run the same step on the same cache, alternated ({STEPS} steps x repeats); the cache is "
        "trimmed back after each and then grows by the greedy token. 'kvmem (auto)' is what kvmem runs: "
        f"`decode_attention` where a step attends at least `MIN_DECODE_KEYS` = {on_threshold} keys over its rows, "
        "MLX's attention below. The step includes the weight matmuls, which this does not change.",
        "",
    ]
    return out


SHARED = 1024  # tokens every row shares in section 3
OWN = (60, 140, 90, 200, 75, 120, 160, 100)  # each row's own tokens after them


def _shared_cache(lm: Any, rows: int) -> list[Any]:
    """Float KV for ``rows`` rows whose first :data:`SHARED` tokens are alike, merged as a decode batch."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from runtime.execution.decode_batch import merge_with_room

    layers = []
    for _ in range(len(lm.model.layers)):
        common = [mx.random.normal((1, KV_HEADS, SHARED, HEAD_DIM)) for _ in range(2)]
        parts = []
        for b in range(rows):
            c = KVCache()
            own = [mx.random.normal((1, KV_HEADS, OWN[b], HEAD_DIM)) for _ in range(2)]
            c.update_and_fetch(*(mx.concatenate([x, y], axis=2) for x, y in zip(common, own, strict=True)))
            parts.append(c)
        layers.append(merge_with_room(parts, extra=64))
    mx.eval([a for c in layers for a in (c.keys, c.values)])
    return layers


def shared_section(res: ResultFile, lm: Any, repeats: int) -> None:
    """Decode steps over rows sharing a prompt: its keys attended once for all rows, or row by row."""
    import mlx.core as mx

    from runtime.cpu import attention as cpu_attention
    from runtime.execution.shared_prefix import shared_prefix_length

    rows_out = []
    threshold = cpu_attention.MIN_SHARED_ROWS
    for rows in (2, 4, 6, 8):  # measured at every row count; kvmem uses it from the threshold up
        cache = _shared_cache(lm, rows)
        shared = shared_prefix_length(cache, [list(range(SHARED + OWN[b])) for b in range(rows)])
        samples, agree, total = _alternated_steps(
            lm, cache, rows, {"each row": lambda: cpu_attention.sharing(0), "shared once": lambda: _shared_from_2(shared)},
            repeats * STEPS, grow=False)
        med = {k: median(v) for k, v in samples.items()}
        rows_out.append([rows, SHARED, f"{min(OWN[:rows])}-{max(OWN[:rows])}", f"{med['each row'] * 1e3:.1f}",
                         f"{med['shared once'] * 1e3:.1f}", f"{med['each row'] / med['shared once']:.2f}x",
                         f"{agree}/{total}"])
        res.record(section="shared", rows=rows, shared=shared, runs=samples, greedy_agree=agree, greedy_total=total)
        log(f"shared {rows} rows: each row {med['each row'] * 1e3:.1f} ms, shared once {med['shared once'] * 1e3:.1f} ms")
        del cache
        mx.clear_cache()
    res.body += ["## 3. A decode step over rows that share a prompt (ms, median)", ""]
    res.body += table(["rows", "shared tokens", "own tokens per row", "decode_attention (each row's keys)",
                       "shared_prefix_attention", "speed-up", "same greedy token"], rows_out, "rrrrrrr")
    res.body += [
        "",
        "The rows' first 1K tokens hold bit-identical keys and values, as agents over one parked system prompt do "
        "(`runtime.execution.shared_prefix` checks that when rows join a batch); each row then has its own tokens. Both "
        "settings run the same step on the same cache, alternated; the step includes the weight matmuls. kvmem "
        f"attends shared keys once from `MIN_SHARED_ROWS` = {threshold} rows.",
        "",
    ]


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__)
    args = p.parse_args(argv)
    reps = harness.repeats(args)
    spans = [1024] if args.quick else [1024, 4096]
    res = ResultFile("decode_attention", "kvmem's decode-step attention vs MLX's on the CPU backend", args.quick,
                     argv or [])
    from runtime.model.loaded import load_model

    lm = load_model("kvmem-default", models_dir=harness.BENCH_HOME / "models")
    if not lm.numpy_attention:
        raise SystemExit("runtime.cpu.attention is not available here (not the CPU backend, or an untested mlx-lm)")
    kernel_section(res, spans, reps)
    step_section(res, lm, spans, reps)
    shared_section(res, lm, reps)
    log(f"wrote {res.write()}")


if __name__ == "__main__":
    main()
