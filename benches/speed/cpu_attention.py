"""kvmem's NumPy attention (runtime/cpu/attention.py) against MLX's own on the CPU backend.

Three questions, each answered side by side in one run on ``kvmem-default``
(SmolLM2-135M-Instruct, float32 weights):

1. **The kernel** — one layer's attention at the default geometry (9 query
   heads, 3 KV heads, head dim 64): ``mx.fast.scaled_dot_product_attention``
   vs :func:`runtime.cpu.attention.numpy_attention`, for prefill chunks and
   decode steps (alone and a batch of 8).
2. **Cold prefill** of a C-token prompt: plain mlx-lm (``generate_step``, its
   own 2048-token chunks, attention untouched) vs kvmem's sequence (its chunk
   schedule) with MLX's attention and with NumPy attention; then kvmem with
   NumPy attention at fixed chunk sizes, to choose the schedule.
3. **A hot turn's forward**: a 20-token suffix over a resident float cache of
   1K / 4K / 8K tokens, plain mlx-lm vs kvmem. (Decode steps are not compared:
   one query per call stays on MLX's attention, measured faster in section 1.)

Run: ``python -m benches cpu_attention`` (1K-8K; 3 repeats up to 2K, 1 above)
or ``--quick`` (1K and 2K, 1 repeat). Writes ``benches/results/cpu_attention.{md,png}``.
"""

from __future__ import annotations

import time
from typing import Any

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, eval_median_s, log, median, table
from benches.prompts import context_text

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def kernel_section(res: ResultFile, repeats: int, quick: bool) -> None:
    import mlx.core as mx

    from runtime.cpu.attention import numpy_attention

    shapes = [(1, 512, 1024), (1, 512, 4096), (1, 1, 1024), (1, 1, 4096), (8, 1, 1024), (8, 1, 4096)]
    if not quick:
        shapes[2:2] = [(1, 512, 8192)]
        shapes.append((1, 1, 8192))
    rows = []
    for batch, length, span in shapes:
        q = mx.random.normal((batch, HEADS, length, HEAD_DIM))
        k = mx.random.normal((batch, KV_HEADS, span, HEAD_DIM))
        v = mx.random.normal((batch, KV_HEADS, span, HEAD_DIM))
        mask = "causal" if length > 1 else None
        mx.eval(q, k, v)
        n = max(repeats, 5)
        mlx_s = eval_median_s(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask), n)
        np_s = eval_median_s(lambda: numpy_attention(q, k, v, scale=0.125, mask=mask), n)
        err = mx.abs(
            numpy_attention(q, k, v, scale=0.125, mask=mask)
            - mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        ).max().item()
        kind = f"prefill chunk of {length}" if length > 1 else ("decode step" if batch == 1 else f"decode, batch of {batch}")
        rows.append([kind, span, f"{mlx_s * 1e3:.2f}", f"{np_s * 1e3:.2f}", f"{mlx_s / np_s:.1f}x", f"{err:.1e}"])
        res.record(section="kernel", batch=batch, length=length, span=span, mlx_s=mlx_s, numpy_s=np_s, max_abs_diff=err)
        log(f"kernel {kind} over {span}: mlx {mlx_s * 1e3:.2f} ms, numpy {np_s * 1e3:.2f} ms")
    res.body += ["## 1. One layer's attention (ms, median)", ""]
    res.body += table(["call", "keys", "MLX (mx.fast SDPA)", "kvmem NumPy", "speed-up", "max |diff|"], rows, "lrrrrr")
    res.body += [""]


def _prompt_ids(lm: Any, tokens: int) -> tuple[str, list[int]]:
    # the rendered prompt stays within the model's 8192-token context
    text = context_text(harness.model_dir(), tokens - 64, label="cpu-attention")
    prompt = lm.render([{"role": "user", "content": text + "\n\nSummarize the text above."}])
    ids, _ = lm.tokenize(prompt)
    return prompt, ids


def _kvmem_prefill(lm: Any, prompt: str, *, numpy_attention: bool, chunk: int | None = None) -> tuple[float, int]:
    """Seconds from a cold start to the first token through kvmem's sequence, and its first token."""
    import mlx.core as mx

    from runtime.execution.sequence import SequenceSampling, Sequence

    lm.numpy_attention = numpy_attention
    mx.clear_cache()
    t0 = time.perf_counter()
    seq = Sequence(lm, prompt, None, SequenceSampling(max_tokens=2))
    while seq.prefill_step(chunk) is None:
        pass
    return time.perf_counter() - t0, seq.generated[0]


def _mlx_lm_prefill(lm: Any, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token through plain ``mlx_lm.generate.generate_step`` (attention untouched)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    mx.clear_cache()
    t0 = time.perf_counter()
    token, _ = next(generate_step(mx.array(ids), lm.model, max_tokens=1))
    return time.perf_counter() - t0, int(token)


def prefill_section(res: ResultFile, lm: Any, contexts: list[int], repeats: int) -> dict[int, dict[str, float]]:
    rows, out = [], {}
    for ctx in contexts:
        prompt, ids = _prompt_ids(lm, ctx)
        n = repeats if ctx <= 2048 else 1
        runs: dict[str, list[float]] = {"mlx_lm": [], "kvmem_mlx": [], "kvmem_numpy": []}
        firsts = set()
        for r in range(n):
            s, tok = _mlx_lm_prefill(lm, ids)
            runs["mlx_lm"].append(s)
            firsts.add(("mlx_lm", tok))
            for name, on in (("kvmem_mlx", False), ("kvmem_numpy", True)):
                s, tok = _kvmem_prefill(lm, prompt, numpy_attention=on)
                runs[name].append(s)
                firsts.add((name, tok))
            log(f"prefill {ctx} repeat {r + 1}/{n}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()))
        med = {k: median(v) for k, v in runs.items()}
        out[ctx] = med
        same = len({tok for _, tok in firsts}) == 1
        rows.append([len(ids), n, f"{med['mlx_lm']:.2f}", f"{med['kvmem_mlx']:.2f}", f"{med['kvmem_numpy']:.2f}",
                     f"{med['kvmem_numpy'] / med['mlx_lm']:.2f}", f"{med['kvmem_mlx'] / med['kvmem_numpy']:.2f}x",
                     "yes" if same else "no"])
        res.record(section="prefill", tokens=len(ids), runs=runs, first_tokens=sorted(firsts))
    res.body += ["## 2. Cold prefill to the first token (s, median)", ""]
    res.body += table(
        ["prompt tokens", "repeats", "plain mlx-lm", "kvmem, MLX attention", "kvmem, NumPy attention",
         "kvmem NumPy / mlx-lm", "NumPy speed-up", "same first token"],
        rows, "lrrrrrrr",
    )
    res.body += [
        "",
        "Plain mlx-lm: `mlx_lm.generate.generate_step` with its default 2048-token prefill chunks and "
        "mlx-lm's own attention (`mx.fast.scaled_dot_product_attention`); kvmem: `runtime.execution.sequence.Sequence` "
        "with its chunk schedule (`prefill_chunk_size`), float KV while active (what `at-rest` runs).",
        "",
    ]
    return out


def chunk_section(res: ResultFile, lm: Any, ctx: int, chunks: list[int]) -> None:
    prompt, ids = _prompt_ids(lm, ctx)
    rows = []
    base, _ = _kvmem_prefill(lm, prompt, numpy_attention=True)
    rows.append(["kvmem's schedule (512 / 256 / 128 by context)", f"{base:.2f}", "1.00"])
    for chunk in chunks:
        s, _ = _kvmem_prefill(lm, prompt, numpy_attention=True, chunk=chunk)
        rows.append([f"fixed {chunk}", f"{s:.2f}", f"{s / base:.2f}"])
        res.record(section="chunks", tokens=len(ids), chunk=chunk, seconds=s)
        log(f"chunk {chunk} at {len(ids)}: {s:.2f} s")
    res.record(section="chunks", tokens=len(ids), chunk="schedule", seconds=base)
    res.body += [f"## 2b. Chunk size, NumPy attention, {len(ids)}-token cold prefill (s, one run each)", ""]
    res.body += table(["chunks", "seconds", "vs schedule"], rows)
    res.body += [""]


def suffix_section(res: ResultFile, lm: Any, contexts: list[int], repeats: int) -> None:
    """A hot turn's work: a short suffix forward over a resident float cache, mlx-lm untouched vs kvmem."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    suffix = 20
    rows = []
    for ctx in contexts:
        _, ids = _prompt_ids(lm, ctx)
        cache = make_prompt_cache(lm.model)
        lm.numpy_attention = True
        for a in range(0, len(ids), 512):  # the context, prefilled once
            mx.eval(lm.forward(mx.array([ids[a : a + 512]]), cache))
        question = mx.array([lm.tokenize(" What was the last thing the notes said, in one sentence?")[0][:suffix]])
        samples: dict[str, list[float]] = {"mlx_lm": [], "kvmem": []}
        for _ in range(max(repeats, 5)):
            for name in samples:
                t0 = time.perf_counter()
                if name == "mlx_lm":
                    mx.eval(lm.model(question, cache=cache))
                else:
                    mx.eval(lm.forward(question, cache))
                samples[name].append(time.perf_counter() - t0)
                for c in cache:
                    c.trim(question.shape[1])
        mlx_s, ours = median(samples["mlx_lm"]), median(samples["kvmem"])
        rows.append([len(ids), question.shape[1], f"{mlx_s * 1e3:.0f}", f"{ours * 1e3:.0f}", f"{ours / mlx_s:.2f}"])
        res.record(section="suffix", tokens=len(ids), suffix=question.shape[1], runs=samples)
        log(f"suffix over {len(ids)}: mlx-lm {mlx_s * 1e3:.0f} ms, kvmem {ours * 1e3:.0f} ms")
    res.body += ["## 3. A hot turn's forward: a short suffix over a resident float cache (ms, median)", ""]
    res.body += table(["context tokens", "suffix tokens", "plain mlx-lm forward", "kvmem forward (NumPy attention)",
                       "kvmem / mlx-lm"], rows)
    res.body += [
        "",
        "The same float cache, the same suffix, alternated; the cache is trimmed back after each forward. "
        "This is the model work of a hot turn (MLX's floor in the race issue); the TTFT benchmarks add "
        "kvmem's own steps (activation, scheduling, HTTP).",
        "",
    ]


def _plot(res: ResultFile, prefill: dict[int, dict[str, float]]) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ctxs = sorted(prefill)
    labels = {"mlx_lm": "plain mlx-lm", "kvmem_mlx": "kvmem, MLX attention", "kvmem_numpy": "kvmem, NumPy attention"}
    width = 0.27
    for i, (key, label) in enumerate(labels.items()):
        ax.bar([x + (i - 1) * width for x in range(len(ctxs))], [prefill[c][key] for c in ctxs], width, label=label)
    ax.set_xticks(range(len(ctxs)), [f"{c // 1024}K" for c in ctxs])
    ax.set_ylabel("cold prefill to first token (s)")
    ax.set_title("Cold prefill on kvmem-default, CPU (lower is better)")
    ax.legend()
    harness.save_figure(res, fig)


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--contexts", type=int, nargs="+", help="prompt sizes in tokens (default 1024 2048 4096 8192)")
    args = p.parse_args(argv)
    reps = harness.repeats(args)
    contexts = args.contexts or ([1024, 2048] if args.quick else [1024, 2048, 4096, 8192])
    res = ResultFile("cpu_attention", "kvmem's NumPy attention vs MLX's on the CPU backend", args.quick, argv or [])
    from runtime.cpu.attention import TESTED_MLX_LM
    from runtime.model.loaded import load_model

    lm = load_model("kvmem-default", models_dir=harness.BENCH_HOME / "models")
    if not lm.numpy_attention:
        raise SystemExit("runtime.cpu.attention is not available here (not the CPU backend, or an untested mlx-lm)")
    res.setup += [
        f"kvmem's attention replaces `scaled_dot_product_attention` in mlx-lm's llama and qwen2 modules only inside "
        f"kvmem's forward passes (tested mlx-lm releases {TESTED_MLX_LM}); 'MLX attention' is the same kvmem code "
        "with it off (`--no-numpy-attention`)",
    ]
    kernel_section(res, reps, args.quick)
    prefill = prefill_section(res, lm, contexts, reps)
    chunk_section(res, lm, 2048 if args.quick else 4096, [128, 256, 512, 1024] if args.quick else [128, 256, 512, 1024, 2048])
    suffix_section(res, lm, [1024] if args.quick else [1024, 4096, 8192], reps)
    _plot(res, prefill)
    log(f"wrote {res.write(plot=True)}")


if __name__ == "__main__":
    main()
