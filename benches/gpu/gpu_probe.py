"""GPU probes behind ``benches/results/gpu.md``'s open leads (issue 33), one call, under a minute.

Not a comparison with a goal, but the measurements that say where the next fix goes:

* **a save's host copy, then the cache's next use**: on CUDA MLX moves any buffer the host reads
  to managed memory for good; a parked cache copied for its save in place would page back onto the
  device at its next use, one copied from a device copy (the GPU policy's road) should not;
* **attention with sinks**: ``mx.fast.scaled_dot_product_attention`` (with and without
  sinks, no / causal / array masks, float32 and bfloat16) against a float32 reference;
* **tiny-gpt-oss**: the same prefill and decode twice on the device (does it repeat
  itself?) and once on MLX's CPU stream (is it right?), logits compared position by position;
  the suite's tiny-gpt-oss tests failed on CUDA, a different one each run (with TF32 off);
  then layer by layer, which block the device and the CPU part at first: attention (its
  rotating cache, sinks) or the MoE block (its router's choice, the sorted expert gather);
* **attention alone at new shapes**: MLX's fused attention (on CUDA, cuDNN builds a graph for
  each new set of shapes and strides) against the same attention from plain ops, plain ops over the
  cache buffer's 256-token step (shapes that repeat across turns) and kvmem's kernel, first call and
  again: what a short prefill chunk (a hot turn, a group's join) pays at a shape it has not seen;
* **products at a row count, again and again** (``products``): seven of a layer's products in one submit at
  1 to 2048 rows, the same shapes each time: whether a submit of two or more rows (cuBLASLt, captured as a
  child CUDA graph) costs far more than one row's even at shapes it has seen;
* **a new shape's first pass**: one forward of ``--probe-tokens`` new tokens over caches one
  token longer each time (as every turn of a conversation is), first call against a repeat
  at the same shape; if the first costs far more, per-shape setup (cuDNN's attention graphs)
  is what a batch's join and a hot turn pay;
* **one decode row**: tokens/s with mlx-lm's ``KVCache``, its ``BatchKVCache`` (an array
  mask) and kvmem's ``DecodeKVCache`` (no mask for a lone row), in lockstep and run ahead;
* **one row's decode in kvmem's engine** against mlx-lm's ``generate_step`` (``engine``);
* **a batch's joint prefill pass in pieces** (``joint``): the rows' caches dequantized, lined up,
  the pass over active rows, the whole pass from Q4 caches and over kept float buffers, and one row's
  hot chunk, each from an idle device, with the operations each hands MLX's submit.

The model for the last two is the first folder matching ``--model-glob`` (``benches gpu``
builds ``gpu-1b-*`` under the bench home), else ``tiny-llama``. ``--sections`` runs some of them
only (a lent session's minute goes to the questions still open). Here (CPU)::

    .venv/bin/python -m benches gpu_probe --quick
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, log, table


def _reference(q: Any, k: Any, v: Any, scale: float, mask: Any, sinks: Any) -> Any:
    import mlx.core as mx
    from mlx_lm.models.base import create_causal_mask

    rep = q.shape[1] // k.shape[1]
    qf, kf, vf = (a.astype(mx.float32) for a in (q, k, v))
    kf, vf = mx.repeat(kf, rep, axis=1), mx.repeat(vf, rep, axis=1)
    scores = (qf * scale) @ kf.swapaxes(-1, -2)
    if isinstance(mask, str):
        scores = mx.where(create_causal_mask(q.shape[2], k.shape[2] - q.shape[2]), scores, -1e30)
    elif mask is not None:
        scores = mx.where(mask, scores, -1e30)
    if sinks is None:
        return mx.softmax(scores, axis=-1) @ vf
    sink = mx.broadcast_to(sinks.astype(mx.float32)[None, :, None, None], (*scores.shape[:3], 1))
    return mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1] @ vf


def sdpa_rows(sliced: bool = False) -> list[list[str]]:
    """Fused attention against the reference over masks, sinks, shapes and dtypes: the worst error of each.

    ``sliced``: the keys and values a slice of a longer buffer, as a ``KVCache`` hands them over (run 5's
    tiny-gpt-oss failures all attend over a cached prefix; run 4's contiguous rows were right)."""
    import mlx.core as mx
    from mlx_lm.models.base import create_causal_mask

    rows = []
    for dtype in (mx.float32, mx.bfloat16):
        for b, ql, kl in ((1, 1, 116), (2, 1, 300), (1, 3, 116), (2, 16, 200), (1, 116, 116), (2, 37, 70)):
            for mask_kind in ("none", "causal", "array"):
                if mask_kind == "none" and ql > 1:
                    continue
                worst = []
                for sink in (False, True):
                    mx.random.seed(0)
                    q = mx.random.normal((b, 4, ql, 64)).astype(dtype)
                    k, v = (mx.random.normal((b, 2, kl + (256 if sliced else 0), 64)).astype(dtype) for _ in range(2))
                    if sliced:
                        mx.eval(k, v)
                        k, v = k[:, :, :kl], v[:, :, :kl]
                    sinks = mx.random.normal((4,)).astype(dtype) if sink else None
                    mask = {"none": None, "causal": "causal"}.get(mask_kind) or create_causal_mask(
                        ql, kl - ql, left_padding=mx.array([0, 5][:b]))
                    got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask, sinks=sinks)
                    err = float(mx.abs(got.astype(mx.float32) - _reference(q, k, v, 0.125, mask, sinks)).max())
                    worst.append(f"{err:.1e}")
                rows.append([str(dtype).split(".")[-1], f"{b}x{ql}x{kl}", mask_kind, *worst])
    return rows


def _tiny_gpt_oss() -> tuple[Any, Any]:
    """tiny-gpt-oss as the suite loads it (Q4 KV, no NumPy attention), and the probes' prompt as a (1, N) array."""
    import mlx.core as mx

    from runtime.model.loaded import load_model
    from runtime.spec import KVFormat

    lm = load_model("tiny-gpt-oss", kv_format=KVFormat(bits=4), models_dir=harness.BENCH_HOME / "models",
                    numpy_attention=False)
    return lm, mx.array([lm.tokenize("The harbour master kept a ledger of ships. " * 12)[0]])


def gpt_oss_rows(steps: int) -> list[list[str]]:
    """tiny-gpt-oss: a prefill and ``steps`` greedy steps twice on the device and once on the CPU stream,
    as kvmem loads it (on CUDA with MLX's compile off since run 4: :mod:`runtime.model.cuda_compile`;
    the layer-by-layer rows below set compile per run)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    lm, ids = _tiny_gpt_oss()

    def run(stream: Any) -> Any:
        with mx.stream(stream):
            cache = make_prompt_cache(lm.model)
            out = [lm.model(ids, cache=cache)[:, -1]]
            y = mx.argmax(out[-1], axis=-1)[:, None]
            for _ in range(steps):
                out.append(lm.model(y, cache=cache)[:, -1])
                y = mx.argmax(out[-1], axis=-1)[:, None]
            logits = mx.concatenate(out).astype(mx.float32)
            mx.eval(logits)
            return logits

    first, second = run(mx.default_stream(mx.default_device())), run(mx.default_stream(mx.default_device()))
    cpu = run(mx.cpu)
    again = mx.abs(first - second).max(axis=-1).tolist()
    vs_cpu = mx.abs(first - cpu).max(axis=-1).tolist()
    return [[str(i), f"{a:.2e}", f"{c:.2e}"] for i, (a, c) in enumerate(zip(again, vs_cpu, strict=True))]


def gpt_oss_part_rows() -> list[list[str]]:
    """tiny-gpt-oss layer by layer, device against MLX's CPU stream: which block parts them first.

    For each layer and each pass (the prefill, whose expert gather is sorted, and one decode
    token, whose gather is not), the worst difference of the attention block's and the MoE
    block's outputs, then the MoE block alone on the device fed the CPU's own input (a
    difference there is the MoE kernels', not an inherited one), and the share of tokens whose
    router picks other experts from that same input, then from the device's own input (a router
    near a tie flips on float noise: run 3's 4.5 at layer 2 may be that, and no kernel's fault). Two more device runs ask why (H200 run 3: the
    MoE block fed its own device input was off by 4.5 at layer 2, fed the CPU's input it matched):
    one evaluates each block's input before the block (a graph boundary), one with ``mx.compile``
    off (mlx-lm's ``swiglu_oai`` is compiled shapeless). The one-token rows follow each run's own
    argmax, so past a differing prefill they compare different tokens.
    """
    import mlx.core as mx
    from mlx_lm.models import gpt_oss
    from mlx_lm.models.cache import make_prompt_cache

    lm, ids = _tiny_gpt_oss()
    model = lm.model
    layer_of = {id(m): i for i, layer in enumerate(model.layers) for m in (layer.self_attn, layer.mlp)}
    calls = {"attention": gpt_oss.AttentionBlock.__call__, "moe": gpt_oss.MLPBlock.__call__}
    seen: dict[tuple[str, str, str, int], tuple[Any, Any]] = {}
    where = {"run": "", "pass": ""}

    def recording(kind: str) -> Any:
        def call(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
            if where["run"] == "device, inputs evaluated":
                mx.eval(x)
            out = calls[kind](self, x, *args, **kwargs)
            seen[(where["run"], where["pass"], kind, layer_of[id(self)])] = (x, out)
            return out
        return call

    device = mx.default_stream(mx.default_device())
    gpt_oss.AttentionBlock.__call__, gpt_oss.MLPBlock.__call__ = recording("attention"), recording("moe")
    try:
        for run, stream in (("device", device), ("device, inputs evaluated", device), ("device, compile off", device),
                            ("cpu", mx.cpu)):
            # Loading the model turned compile off on CUDA (runtime.model.cuda_compile): each run sets its own.
            (mx.disable_compile if run == "device, compile off" else mx.enable_compile)()
            with mx.stream(stream):
                where.update(run=run, **{"pass": "prefill"})
                cache = make_prompt_cache(model)
                y = mx.argmax(model(ids, cache=cache)[:, -1], axis=-1)[:, None]
                where["pass"] = "one token"
                model(y, cache=cache)
                mx.eval([v for key, pair in seen.items() if key[0] == run for v in pair])
            mx.enable_compile()
    finally:
        mx.enable_compile()
        gpt_oss.AttentionBlock.__call__, gpt_oss.MLPBlock.__call__ = calls["attention"], calls["moe"]

    def worst(a: Any, b: Any) -> float:
        return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())

    def experts(mlp: Any, x: Any, stream: Any) -> Any:
        with mx.stream(stream):
            return mx.sort(mx.argpartition(mlp.router(x), kth=-mlp.num_experts_per_tok, axis=-1)
                           [..., -mlp.num_experts_per_tok:], axis=-1)

    rows = []
    for phase in ("prefill", "one token"):
        for i, layer in enumerate(model.layers):
            x_cpu, out_cpu = seen[("cpu", phase, "moe", i)]
            with mx.stream(device):
                alone = calls["moe"](layer.mlp, x_cpu)
            other = mx.any(experts(layer.mlp, x_cpu, device) != experts(layer.mlp, x_cpu, mx.cpu), axis=-1)
            # The device's own input (off from the CPU's by float noise) against the CPU's: a router near a
            # tie flips an expert here, and that token's output moves by O(1) with no kernel at fault.
            x_dev = seen[("device", phase, "moe", i)][0]
            own = mx.any(experts(layer.mlp, x_dev, device) != experts(layer.mlp, x_cpu, mx.cpu), axis=-1)
            rows.append([phase, str(i), f"{worst(*(seen[(r, phase, 'attention', i)][1] for r in ('device', 'cpu'))):.2e}",
                         f"{worst(seen[('device', phase, 'moe', i)][1], out_cpu):.2e}", f"{worst(alone, out_cpu):.2e}",
                         f"{float(other.astype(mx.float32).mean()):.0%} of {other.size}",
                         f"{float(own.astype(mx.float32).mean()):.0%} of {own.size}",
                         *(f"{worst(seen[(r, phase, 'moe', i)][1], out_cpu):.2e}"
                           for r in ("device, inputs evaluated", "device, compile off"))])
    return rows


GATHER_WAYS = ("unsorted", "sorted", "sorted, inputs evaluated", "SwitchGLU", "SwitchGLU, inputs evaluated")
"""The ways :func:`gather_rows` multiplies tokens by their experts (see there)."""


def gather_rows(tokens: tuple[int, ...] = (4, 40, 193)) -> list[list[str]]:
    """tiny-gpt-oss's expert products alone, device against MLX's CPU stream: which road is wrong.

    Run 5's three tiny-gpt-oss failures (float32, compile off) all differ by O(10) in a logit, and run 4's
    layer rows put the error in the MoE block when a layer's graph is evaluated whole, not when the
    block's input is evaluated first. mlx-lm's ``SwitchGLU`` sorts the tokens by expert once a pass routes
    64 or more (token, expert) pairs; MLX 0.32's CUDA ``GatherMM`` then takes a CUTLASS grouped GEMM whose
    group offsets a kernel computes on the device from the sorted indices, where fewer pairs take a
    gather-and-multiply per pair. For each token count (``tokens``: under the sort threshold, then two over it)
    and dtype, with layer 0's own expert weights and random inputs and routes: ``mx.gather_mm`` unsorted, sorted
    (``_gather_sort`` as mlx-lm sorts, the products, the unsort) with its inputs lazy in one graph and evaluated
    first, and the whole ``SwitchGLU`` (the activation's compile as the process has it) both ways. Each value is
    the worst difference from the same computation on the CPU stream, then between two runs on the device."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort

    lm, _ = _tiny_gpt_oss()
    mlp = lm.model.layers[0].mlp
    glu, k, experts = mlp.experts, mlp.num_experts_per_tok, mlp.num_local_experts
    weight = glu.gate_proj["weight"]  # (experts, out, in)
    device = mx.default_stream(mx.default_device())
    rows = []
    for n in tokens:
        key = mx.random.key(n)
        x0 = mx.random.normal((1, n, weight.shape[-1]), key=key)
        scores = mx.random.normal((1, n, experts), key=mx.random.split(key)[1])
        routes = mx.argpartition(scores, kth=-k, axis=-1)[..., -k:].astype(mx.uint32)
        mx.eval(x0, routes)
        # MLX's CPU GatherMM takes float32 only: the CPU computes every row's reference in float32 (a bfloat16
        # row's difference includes bfloat16's own rounding, about 1e-2 here; a wrong road is off by O(1)).
        for dtype in (mx.float32, *([mx.bfloat16] if mx.default_device() == mx.gpu else [])):
            def way(name: str, stream: Any, x0: Any = x0, dtype: Any = dtype) -> Any:
                dtype = mx.float32 if stream == mx.cpu else dtype
                with mx.stream(stream):
                    x = x0.astype(dtype) * 1.0  # lazy: part of the graph the products are in
                    w = weight.astype(dtype)
                    if name.endswith("evaluated"):
                        mx.eval(x, w)
                    if name.startswith("SwitchGLU"):
                        saved = {p: glu[p]["weight"] for p in ("gate_proj", "up_proj", "down_proj")}
                        for p, v in saved.items():
                            glu[p]["weight"] = v.astype(dtype)
                        try:
                            out = glu(x, routes)
                        finally:
                            for p, v in saved.items():
                                glu[p]["weight"] = v
                    else:
                        xe = mx.expand_dims(x, (-2, -3))
                        if name == "unsorted":
                            out = mx.gather_mm(xe, w.swapaxes(-1, -2), rhs_indices=routes)
                        else:
                            xs, idx, inv = _gather_sort(xe, routes)
                            if name.endswith("evaluated"):
                                mx.eval(xs, idx, inv)
                            out = _scatter_unsort(mx.gather_mm(xs, w.swapaxes(-1, -2), rhs_indices=idx,
                                                               sorted_indices=True), inv, routes.shape)
                    out = out.astype(mx.float32)
                    mx.eval(out)
                    return out

            for name in GATHER_WAYS:
                cpu, first, second = way(name, mx.cpu), way(name, device), way(name, device)
                rows.append([str(n), f"{n * k}{' (sorted by mlx-lm)' if n * k >= 64 else ''}", str(dtype).split(".")[-1],
                             name, f"{float(mx.abs(first - cpu).max()):.2e}", f"{float(mx.abs(first - second).max()):.2e}"])
    return rows


def _model(glob_pattern: str) -> tuple[Any, str]:
    from mlx_lm import load

    folders = sorted(glob.glob(glob_pattern))
    if folders:
        return load(folders[0])[0], folders[0]
    from runtime.model.loaded import load_model

    lm = load_model("tiny-llama", models_dir=harness.BENCH_HOME / "models", numpy_attention=False)
    return lm.model, "tiny-llama"


def _prefilled(model: Any, n: int) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cache = [KVCache() for _ in model.layers]
    ids = mx.random.randint(10, min(4000, model.args.vocab_size), (1, n))  # inside any vocabulary
    for i in range(0, n, 2048):
        model(ids[:, i : i + 2048], cache=cache)
        mx.eval([c.keys for c in cache])
    return cache


def shape_rows(model: Any, contexts: list[int], new_tokens: int) -> list[list[str]]:
    """One forward of ``new_tokens`` over a cache of each length: the first call at that shape, then a repeat."""
    import mlx.core as mx

    rows = []
    for n in contexts:
        times = []
        for _ in range(2):
            cache = _prefilled(model, n)
            ids = mx.random.randint(10, min(4000, model.args.vocab_size), (1, new_tokens))
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval(model(ids, cache=cache))
            times.append((time.perf_counter() - t0) * 1e3)
        rows.append([str(n), f"{times[0]:.1f}", f"{times[1]:.1f}"])
        log(f"shape: {new_tokens} over {n}: first {times[0]:.1f} ms, again {times[1]:.1f} ms")
    return rows


SHAPE_WAYS = ("fused", "plain", "plain, keys to the buffer's 256 step", "kvmem kernel", "kvmem kernel, two passes")
"""The ways :func:`attention_shape_rows` attends, in its columns' order (the kernels where CUDA has them)."""


def attention_shape_rows(queries: list[int], contexts: list[int]) -> list[list[str]]:
    """Attention alone (1B geometry, bf16, keys a slice of a 256-step buffer as in mlx-lm's ``KVCache``) at
    shapes never seen before, first call and again, :data:`SHAPE_WAYS`: the fused kernel (cuDNN: one graph
    per shape); kvmem's plain-operation attention (:func:`runtime.cpu.attention.plain_attention`); the same
    over the buffer up to its 256-token step, the keys past the cache masked (its products' shapes repeat
    across a conversation's turns: run 4's plain first calls cost 4-9 ms a new shape against 0.4-0.8 again);
    and kvmem's kernel (:mod:`runtime.kv.short_attention`, up to its most queries), one pass and two (its
    long-keys road, :func:`~runtime.kv.short_attention.long_attention`: the short passes over more than
    :data:`~runtime.kv.short_attention.SHORT_PASS_KEYS` keys, where it is on); then the largest
    difference from the fused kernel's output of any of the others. One query is a lone row's decode step:
    MLX 0.32's CUDA backend sends it to cuDNN when its keys are a slice of a buffer a multiple of 256 long
    (``use_cudnn_for_decoding``), with a graph per buffer length: H200 run 5's one-agent batch rounds had a
    first decode step of 44 ms in two rounds of three (7.5 in the third, 2.3 a step after), as the agent's
    cache crossed a 256-token step."""
    import mlx.core as mx

    from runtime.cpu.attention import plain_attention  # kvmem's own (the plain_attention_queries setting)
    from runtime.kv import short_attention

    rows = []
    heads, kv_heads, dim, scale = 32, 8, 64, 64**-0.5
    for ql in queries:
        for n in contexts:
            kl = n + ql
            cap = (kl + 255) // 256 * 256
            q = mx.random.normal((1, heads, ql, dim)).astype(mx.bfloat16)
            kbuf, vbuf = (mx.random.normal((1, kv_heads, cap, dim)).astype(mx.bfloat16) for _ in range(2))
            k, v = kbuf[:, :, :kl], vbuf[:, :, :kl]
            mx.eval(q, kbuf, vbuf)

            def stepped() -> Any:
                seen = mx.arange(cap)[None] <= (mx.arange(ql)[:, None] + (kl - ql))  # causal, and no key past kl
                return plain_attention(q, kbuf, vbuf, scale=scale, mask=seen)

            ways = {"fused": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"),
                    "plain": lambda: plain_attention(q, k, v, scale=scale, mask="causal"),
                    "plain, keys to the buffer's 256 step": stepped}
            if short_attention.available() and ql <= short_attention.MAX_QUERIES:
                first_key = mx.zeros((1,), dtype=mx.int32)
                ways["kvmem kernel"] = lambda: short_attention.short_attention(q, k, v, scale=scale, starts=first_key)
                ways["kvmem kernel, two passes"] = lambda: short_attention.long_attention(
                    q, k, v, scale=scale, starts=first_key)
            times: dict[str, list[float]] = {}
            outs = {}
            for name, fn in ways.items():
                for _ in range(2):
                    mx.synchronize()
                    t0 = time.perf_counter()
                    outs[name] = fn()
                    mx.eval(outs[name])
                    times.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
            fused = outs["fused"].astype(mx.float32)
            diff = max(mx.abs(out.astype(mx.float32) - fused).max().item() for name, out in outs.items()
                       if name != "fused")
            rows.append([str(ql), str(n), *(f"{t:.2f}" if name in times else "—"
                                             for name in SHAPE_WAYS for t in times.get(name, [None, None])),
                         f"{diff:.2g}"])
            log(f"attention {ql} over {n}: " + ", ".join(f"{name} {t}" for name, t in times.items()) + " ms")
    return rows


def batch_decode_attention_rows(rows: int, contexts: list[int], repeats: int = 20) -> list[list[str]]:
    """One decode step's attention for a batch of ``rows`` of different lengths (1B geometry, bf16, keys
    left-padded in one buffer as kvmem's batch holds them), four ways: the fused kernel with no mask
    (rows of one length need none: the floor), with the boolean padding mask (on CUDA any array mask
    sends a one-query attention to MLX's unfused fallback), once per row on its own unpadded slice
    (fused, no mask, then joined), kvmem's plain operations with the mask, and on CUDA kvmem's kernel
    (:mod:`runtime.kv.short_attention`: each row from its first key, no mask), one pass and two (its long-keys
    road, which the runtime gives only short passes over long keys: this row says whether steps should). Per call: the host's
    time to build it, and its whole time with the evaluation (medians, ms); H200 run 3's batch of 8
    stepped 5-7 ms against one agent's 2.6-4, and a step runs this once per layer. Then the whole time
    again with the keys one longer each call, as a decode's are: H200 run 4's batch of 8 stepped faster
    with CUDA graphs off (4.98x one agent, 3.67x with them), and MLX keys a CUDA graph on its kernels, a
    library call's (cuBLAS's) captured whole, so a product whose kernels change with the length would
    build a graph a call; the same length again finds it built."""
    import statistics as stats

    import mlx.core as mx

    from runtime.cpu.attention import plain_attention
    from runtime.kv import short_attention

    heads, kv_heads, dim, scale = 32, 8, 64, 64**-0.5
    longest = max(contexts[:rows])
    lengths = [contexts[i % len(contexts)] for i in range(rows)]
    pads = [longest - n for n in lengths]
    q = mx.random.normal((rows, heads, 1, dim)).astype(mx.bfloat16)
    room = longest + repeats + 2
    k, v = (mx.random.normal((rows, kv_heads, room, dim)).astype(mx.bfloat16) for _ in range(2))
    starts = mx.array(pads)[:, None, None, None]
    mx.eval(q, k, v, starts)

    def per_row(n: int) -> Any:
        return mx.concatenate([mx.fast.scaled_dot_product_attention(
            q[i : i + 1], k[i : i + 1, :, p:n], v[i : i + 1, :, p:n], scale=scale) for i, p in enumerate(pads)])

    def masked(fn: Any) -> Any:
        return lambda n: fn(q, k[:, :, :n], v[:, :, :n], scale=scale, mask=mx.arange(n)[None, None, None, :] >= starts)

    ways = {"fused, no mask (the floor)": lambda n: mx.fast.scaled_dot_product_attention(
                q, k[:, :, :n], v[:, :, :n], scale=scale),
            "fused, padding mask": masked(mx.fast.scaled_dot_product_attention),
            "fused, one call a row": per_row,
            "plain operations, padding mask": masked(plain_attention)}
    if short_attention.available():  # kvmem's kernel (the short_attention_kernel setting): each row from its first key
        first_keys = mx.array(pads, dtype=mx.int32)
        ways["kvmem kernel, each row from its first key"] = lambda n: short_attention.short_attention(
            q, k[:, :, :n], v[:, :, :n], scale=scale, starts=first_keys)
        ways["kvmem kernel in two passes"] = lambda n: short_attention.long_attention(
            q, k[:, :, :n], v[:, :, :n], scale=scale, starts=first_keys)

    def timed(fn: Any, growing: bool) -> tuple[list[float], list[float], Any]:
        builds, totals, result = [], [], None
        for i in range(repeats + 2):
            mx.synchronize()
            t0 = time.perf_counter()
            result = fn(longest + i if growing else longest)
            t1 = time.perf_counter()
            mx.eval(result)
            if i >= 2:  # the first calls build kernels
                builds.append((t1 - t0) * 1e3)
                totals.append((time.perf_counter() - t0) * 1e3)
        return builds, totals, result

    out = []
    reference = None
    for name, fn in ways.items():
        try:
            builds, totals, result = timed(fn, growing=False)
            _, growing, _ = timed(fn, growing=True)
        except Exception as exc:  # noqa: BLE001 - a kernel that does not build is a row of the report
            out.append([name, "—", "—", "—", f"failed: {type(exc).__name__}: {str(exc)[:160]}"])
            continue
        if name == "fused, padding mask":
            reference = result
        diff = "—" if reference is None or name.startswith("fused, no mask") else \
            f"{mx.abs(result.astype(mx.float32) - reference.astype(mx.float32)).max().item():.2g}"
        out.append([name, f"{stats.median(builds):.3f}", f"{stats.median(totals):.3f}", f"{stats.median(growing):.3f}",
                    diff])
        log(f"batch attention {rows} rows, {name}: build {stats.median(builds):.3f}, total {stats.median(totals):.3f}, "
            f"keys growing {stats.median(growing):.3f} ms")
    return out


def host_read_rows(tokens: int, layers: int = 16, repeats: int = 3) -> list[list[str]]:
    """What a save's host copy costs afterwards, by each road of :func:`runtime.kv.host_copy.host_readable`.

    A cache of a 1B model's Q4 shape (``layers`` layers of packed keys and values, ``tokens``
    tokens) is read by a device pass (one reduction an array), and as many new arrays of its
    arrays' size are written by a kernel; then it is copied to the host (numpy) in place or from a
    device copy; then the same device pass and new arrays again. On CUDA, MLX moves a buffer the host
    reads to managed memory for good, and a freed managed buffer goes back to MLX's buffer cache,
    which hands it to the next allocation of its size: after an in-place copy the pass would page
    the cache back onto the device; after either road, new arrays may land in managed buffers. The
    host copy splits into MLX's move of each buffer to managed memory (``memoryview``, on the model's
    thread) and numpy's read of it (which any thread could do: if it is the slow part, a save's copy
    can leave the model's thread). Medians of ``repeats`` fresh caches, ms."""
    import statistics as stats

    import mlx.core as mx
    import numpy as np

    from runtime.kv.host_copy import host_readable

    def timed(fn: Any) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        return (time.perf_counter() - t0) * 1e3

    shape = (1, 8, tokens, 8)
    rows = []
    for road, by_copy in (("the cache's own arrays (the road before)", False), ("a device copy (the GPU policy's road)", True)):
        samples: dict[str, list[float]] = {}
        for _ in range(repeats):
            cache = [mx.random.randint(0, 2**31, shape).astype(mx.uint32) for _ in range(2 * layers)]
            mx.eval(cache)

            def device_pass() -> list[Any]:
                return [a.sum() for a in cache]  # noqa: B023 - called within this repeat

            def new_arrays() -> list[Any]:
                return [mx.zeros(shape, dtype=mx.uint32) + i for i in range(2 * layers)]

            timed(device_pass), timed(new_arrays)  # kernels built outside the samples
            samples.setdefault("pass before", []).append(timed(device_pass))
            samples.setdefault("new before", []).append(timed(new_arrays))
            t0 = time.perf_counter()
            host = [host_readable(a[0], by_copy=by_copy) for a in cache]
            mx.eval(host)
            t1 = time.perf_counter()
            views = [memoryview(h) for h in host]  # MLX moves each buffer to managed memory here
            t2 = time.perf_counter()
            [np.array(v, copy=True) for v in views]  # the host reads it (any thread could)
            del host, views
            t3 = time.perf_counter()
            samples.setdefault("copy", []).append((t3 - t0) * 1e3)
            samples.setdefault("move", []).append((t2 - t1) * 1e3)
            samples.setdefault("read", []).append((t3 - t2) * 1e3)
            samples.setdefault("pass after", []).append(timed(device_pass))
            samples.setdefault("new after", []).append(timed(new_arrays))
            del cache
            mx.clear_cache()
        med = {k: stats.median(v) for k, v in samples.items()}
        mb = 2 * layers * 8 * tokens * 8 * 4 / 2**20
        rows.append([road, f"{mb:.0f}", f"{med['copy']:.1f}", f"{med['move']:.1f}", f"{med['read']:.1f}",
                     f"{med['pass before']:.2f}", f"{med['pass after']:.2f}",
                     f"{med['new before']:.2f}", f"{med['new after']:.2f}"])
        log(f"host read, {road}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()))
    return rows


def decode_rows(model: Any, contexts: list[int], steps: int) -> list[list[str]]:
    """Tokens/s of one row's decode with each cache, in lockstep and run ahead (as mlx-lm's ``generate_step``)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from runtime.execution.decode_batch import merge_with_room

    def rate(cache: list[Any], ahead: bool) -> float:
        y = mx.array([[5]])
        for _ in range(3):
            y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
            mx.eval(y)
        t0 = time.perf_counter()
        if ahead:
            nxt = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
            mx.async_eval(nxt)
            for _ in range(steps):
                cur, nxt = nxt, mx.argmax(model(nxt, cache=cache)[:, -1], axis=-1)[:, None]
                mx.async_eval(nxt)
                cur.tolist()
        else:
            for _ in range(steps):
                y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
                mx.eval(y)
        return steps / (time.perf_counter() - t0)

    caches = {"mlx-lm KVCache": lambda c: c, "mlx-lm BatchKVCache (array mask)": lambda c: [
        BatchKVCache.merge([x]) for x in c], "kvmem DecodeKVCache (no mask)": lambda c: [merge_with_room([x]) for x in c]}
    rows = []
    for n in contexts:
        for name, wrap in caches.items():
            rows.append([str(n), name, *(f"{rate(wrap(_prefilled(model, n)), ahead):.1f}" for ahead in (False, True))])
        mx.clear_cache()
    return rows


def engine_decode_rows(folder: str, steps: int, profile: str = "auto", after_tokens: int = 0,
                       repeats: int = 3) -> list[list[str]]:
    """One row's decode on the same model in this process: plain mlx-lm (``generate_step``) and kvmem's
    engine called directly (``MlxEngine.step`` in a loop: no actors), three ways: on this thread; on an
    :class:`actors.mlx_thread.MlxThread` (the runtime's own thread) with no trio work; and on one whose
    every step posts to trio, which then runs a callback, as the GPU actor's decode runs do. The runtime's
    own rate is the bench's decode row; the engine alone between the two splits run 4's 0.78x (the engine
    alone made 282 tokens/s against mlx-lm's 263) into the engine's work, the thread's and trio's.

    ``after_tokens``: the engine alone again after a turn of that many tokens with MLX's cache kept (as before
    session 26), then after ``mx.clear_cache()`` (as mlx-lm's ``generate_step`` does after every prefill chunk),
    then after another such turn whose end emptied the cache (the GPU policy's ``clear_cache_after_prefill``).
    H200 run 5's 3B decoded at 227 tokens/s in its first 1K turn and 155-171 in the ones after its 32K turns,
    mlx-lm at 188-264. ``repeats``: turns a rate's median is of (1 to 3: each rate's turns have ids of their own)."""
    import statistics as stats

    if not 1 <= repeats <= 3:
        raise ValueError(f"repeats must be 1 to 3, not {repeats}")

    import trio

    from actors.mlx_thread import MlxThread
    from benches.gpu.gpu import mlx_lm_turn
    from runtime.execution.mlx_engine import MlxEngine
    from runtime.plan.sampling import SamplingOptions
    from runtime.plan.turn_plan import ColdStart, TurnPlan

    text = " ".join(f"note{i % 97} was kept" for i in range(300))  # about a thousand tokens
    from mlx_lm import load

    model, tokenizer = load(folder)
    mlx_lm_turn(model, tokenizer, text, 16)  # warm-up
    plain = [mlx_lm_turn(model, tokenizer, text, steps).decode_tps for _ in range(repeats)]
    plain_step_line = _mlx_lm_step_operations(model, tokenizer, text)
    del model
    cold = TurnPlan(tier="cold", source=ColdStart(), match="empty", reuse_tokens=0, reuse_chars=0)

    def loaded() -> MlxEngine:
        engine = MlxEngine(models_dir=Path(folder).parent, kv_bits=4, kv_group_size=64, attention="auto",
                           profile=profile)
        engine.load(folder)
        return engine

    def engine_rate(engine: MlxEngine, rid: int, n: int, post: Any = None) -> float:
        engine.start(rid, text, cold, engine.tokenize(text, cold), SamplingOptions(max_tokens=n))
        while engine.prefill(rid, None).remaining:
            pass
        engine.join(rid)
        engine.step()  # the first token
        t0, made = time.perf_counter(), 1
        while True:
            tokens = engine.step()
            if post is not None:
                post(tokens)
            if any(t.finished for t in tokens):
                break
            made += 1
        rate = made / (time.perf_counter() - t0)
        engine.finish(rid)
        return rate

    engine = loaded()
    engine_rate(engine, 1, 16)  # warm-up
    alone = [engine_rate(engine, 2 + i, steps) for i in range(repeats)]
    step_line = _one_step_operations(engine, text, cold)
    after: list[tuple[str, list[float]]] = []
    if after_tokens:
        import mlx.core as mx
        import msgspec

        long_text = " ".join(f"note{i % 97} was kept" for i in range(after_tokens * 3 // 10))
        emptying = engine.profile.clear_cache_after_prefill

        def long_turn(rid: int, empty: bool) -> None:
            engine._profile = msgspec.structs.replace(engine.profile, clear_cache_after_prefill=empty)
            engine.start(rid, long_text, cold, engine.tokenize(long_text, cold), SamplingOptions(max_tokens=1))
            while engine.prefill(rid, None).remaining:
                pass
            engine.finish(rid)
            engine._profile = msgspec.structs.replace(engine.profile, clear_cache_after_prefill=emptying)

        long_turn(5, False)  # as before session 26: MLX's cache keeps what the long prompt's chunks freed
        after.append((f"same, after a {after_tokens}-token turn, MLX's cache kept",
                      [engine_rate(engine, 6 + i, steps) for i in range(repeats)]))
        mx.clear_cache()
        after.append(("same, then after mx.clear_cache()", [engine_rate(engine, 9 + i, steps) for i in range(repeats)]))
        long_turn(12, True)  # the GPU policy's since: emptied at the turn's finish
        after.append((f"same, after a {after_tokens}-token turn, MLX's cache emptied at its end (the GPU policy)",
                      [engine_rate(engine, 13 + i, steps) for i in range(repeats)]))
    engine.unload()

    async def on_the_mlx_thread() -> tuple[list[float], list[float]]:
        received = []
        async with MlxThread(on_exit=None, tune_allocator=False) as thread:
            engine = await thread.run(loaded)
            await thread.run(engine_rate, engine, 1, 16)

            def post(tokens: Any) -> None:  # the GPU actor's per-step post: trio wakes and runs a callback
                thread.post(received.append, len(tokens))

            quiet = [await thread.run(engine_rate, engine, 10 + i, steps) for i in range(repeats)]
            posting = [await thread.run(engine_rate, engine, 20 + i, steps, post) for i in range(repeats)]
            await thread.run(engine.close)
        return quiet, posting

    quiet, posting = trio.run(on_the_mlx_thread)
    log(f"decode: mlx-lm {plain}, engine alone {alone}, on an MlxThread {quiet}, posting to trio {posting} tok/s")
    base = stats.median(plain)
    return [["mlx-lm generate_step", f"{base:.1f}", "1.00x"]] + [
        [name, f"{stats.median(rates):.1f}", f"{stats.median(rates) / base:.2f}x"]
        for name, rates in (("kvmem MlxEngine.step, no actors, this thread", alone), *after,
                            ("same, on the runtime's MLX thread (MlxThread), no trio work", quiet),
                            ("same, each step posting to trio (as the GPU actor's decode runs)", posting))] + [
        [plain_step_line, "—", "—"], [step_line, "—", "—"]]


def _one_step_operations(engine: Any, text: str, plan: Any) -> str:
    """One steady decode step of ``engine``'s: the operations it hands MLX's submit and the submit's time (the
    count taken out of it), as a line: the joint section's pieces are read against it (µs an operation)."""
    from runtime.plan.sampling import SamplingOptions

    engine.start(99, text, plan, engine.tokenize(text, plan), SamplingOptions(max_tokens=8))
    while engine.prefill(99, None).remaining:
        pass
    engine.join(99)
    engine.step()  # the first token, then a step in flight (run ahead): the next ones launch one step each
    engine.step()
    with counting_submits() as counted:
        engine.step()
    timing = engine.last_step_timing
    engine.finish(99)
    if timing is None or not counted.operations:
        return "one decode step: not measured (no step timing, or no operations submitted)"
    submit = timing.launch_ms - timing.build_ms - counted.ms
    return (f"one decode step: {counted.operations} operations, build {timing.build_ms:.2f} ms, submit {submit:.2f} ms "
            f"({submit * 1e3 / counted.operations:.1f} µs an operation; by kind: {counted.kinds()})")


def _mlx_lm_step_operations(model: Any, tokenizer: Any, text: str) -> str:
    """One of plain mlx-lm's steady decode steps (``generate_step``): its operations by kind, as a line beside
    kvmem's (:func:`_one_step_operations`): on a GPU each is paid at every step, and the CPU's counts expand MLX's
    fused operations into their fallbacks, so only a device says which kinds a step could lose."""
    from benches.gpu.gpu import mlx_lm_turn

    with counting_submits() as counted:
        mlx_lm_turn(model, tokenizer, text, 9)
    if len(counted.calls) < 3:
        return "mlx-lm's decode step: not measured (fewer than 3 submits)"
    middle = len(counted.calls) // 2
    return f"mlx-lm's decode step: {sum(counted.calls[middle].values())} operations (by kind: {counted.kinds(middle)})"


def product_rows(rows: tuple[int, ...], shapes: list[tuple[int, int]], dtype_name: str, repeats: int = 10,
                 kernel: bool = False) -> list[list[str]]:
    """One layer's worth of products (``x @ w.T`` for each (out, in) of ``shapes``, in ``dtype_name``, one submit)
    at each row count, the same shapes again and again: build, submit (the ``mx.async_eval`` call) and wait, ms,
    medians after a first call, and the submit's µs a product.

    Why: MLX's CUDA backend commits a CUDA graph every 100 operations on an H200 and reuses a cached executable
    when it can update it; a product of more than one row goes through cuBLASLt, captured as a child graph, and a
    graph holding a kernel launched in a cluster taller than one (as Hopper's GEMM kernels may be) cannot be
    updated, so each such commit instantiates a new one; and MLX 0.32.1 builds each product's ``CublasGemm``
    afresh, so every call asks cuBLASLt for its algorithm again. A one-row product is MLX's own kernel. If the
    submit of 2 or more rows stays far above one row's at the same shapes, a prefill chunk's and a joint pass's
    host time is that (run 5: a 1B hot chunk's submit 5.6 ms against a decode step's 1.5), and the
    ``fused_projections`` setting's four products a layer instead of seven (its own rows) pay. ``kernel``: each
    product of 2 to 16 rows through kvmem's own kernel instead (:mod:`runtime.model.small_products`, the
    ``small_products_kernel`` setting; row counts past it are left out)."""
    import statistics as stats

    import mlx.core as mx

    dtype = getattr(mx, dtype_name)
    weights = [mx.random.normal(shape).astype(dtype) * shape[1] ** -0.5 for shape in shapes]
    mx.eval(weights)
    inputs = {w: mx.random.normal((1, 1, w)).astype(dtype) for w in {shape[1] for shape in shapes}}
    from runtime.model.small_products import MAX_ROWS, small_product

    out = []
    for n in rows:
        if kernel and not 2 <= n <= MAX_ROWS:
            continue
        xs = {w: mx.repeat(x, n, axis=1) for w, x in inputs.items()}  # each input width's rows, made once
        mx.eval(xs)

        def layer() -> list[Any]:
            if kernel:
                return [small_product(xs[w.shape[1]][0], w) for w in weights]
            return [xs[w.shape[1]] @ w.T for w in weights]

        _timed_submit(layer)  # the first call builds what the shape needs once
        samples = [_timed_submit(layer) for _ in range(repeats)]
        build, submit, wait = (stats.median(x[k] for x in samples) for k in range(3))
        out.append([str(n), f"{build:.3f}", f"{submit:.3f}", f"{wait:.3f}", f"{submit * 1e3 / len(weights):.1f}"])
    return out


def layer_product_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                         fused: bool) -> list[tuple[int, int]]:
    """A llama layer's products as (out, in): q, k, v, o, gate, up, down; or, ``fused``, as the
    ``fused_projections`` setting runs them: qkv, o, gate-and-up, down."""
    q, kv = heads * head_dim, kv_heads * head_dim
    if fused:
        return [(q + 2 * kv, hidden), (hidden, q), (2 * intermediate, hidden), (hidden, intermediate)]
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (intermediate, hidden), (intermediate, hidden),
            (hidden, intermediate)]


def joint_pass_rows(folder: str, rows: int, context: int, rounds: int, profile: str = "auto",
                    models_dir: Path | None = None) -> list[list[str]]:
    """Where a batch's joint prefill pass goes, in pieces, on ``rows`` agents' hot turns over ``context``-token
    Q4 caches (the bench's batch rounds; kvmem's engine functions called directly, no actors).

    H200 run 5: the joint pass of 8 joins launched in 32 ms on the 1B (85 ms on the 3B), nearly all of it
    MLX's submit (the ``mx.async_eval`` call), where one agent's hot chunk took 8 ms; so no first token came
    within one 2048-token chunk (13 ms) of its own. A CUDA wait in the submit spins the host, so its CPU
    time cannot tell the host's work from a wait for the device. Here every piece starts from an idle
    device (``mx.synchronize()``) and is timed as the trace times it: ``build`` (the Python graph), ``submit``
    (the ``async_eval`` call) and ``wait`` (until the device is done); the pieces are the rows' Q4 caches
    dequantized (``activate``), lined up in one batch cache per layer, and the joint pass over rows already
    active; then the whole joint pass from the rows' Q4 caches (as the GPU actor makes it for caches read from
    disk), over the float buffers each row's cache kept (as it makes it in a hot round: each row's last turn is
    written into them as its dequantized Q4 first), the same again at the shapes it just used, one row's
    hot chunk alone (over its kept float buffers too), and one row's chunk over a cache read ahead (its float
    buffers made before the turn, as after a server's restart). Each round's new messages differ in length from the last's (new
    shapes, as in the bench: MLX's CUDA backend asks cuBLASLt for an algorithm at every product of more
    than one row, which may cost more at a shape it has not seen); the first round is reported apart.

    Each piece also counts the operations handed to MLX's submit (its graph, as ``export_to_dot`` draws it,
    counted outside the times): a submit that grows with them, at about a decode step's cost an operation,
    is the host's work per operation; one far above that is something else (a graph built, a wait)."""
    import statistics as stats

    import mlx.core as mx

    from benches.gpu.gpu import _ask
    from runtime.execution.batch_prefill import LinedUpCache, choose_group, prefill_together
    from runtime.execution.generate import decode_alone, generate
    from runtime.execution.mlx_engine import MlxEngine
    from runtime.execution.sequence import Sequence, SequenceSampling
    from runtime.kv.kvstate import with_kept_float

    if models_dir is None:  # a folder's own parent, else the bench's (a named model: tiny-llama)
        models_dir = Path(folder).parent if Path(folder).is_dir() else harness.BENCH_HOME / "models"
    engine = MlxEngine(models_dir=models_dir, kv_bits=4, kv_group_size=64, attention="auto", profile=profile)
    engine.load(folder)
    lm = engine.lm
    words = max(8, context // 3)  # about three tokens a "noteN was kept"
    firsts, prompts = [], []  # the rows' first turns' (text, parked Q4 cache), and their prompts
    for a in range(rows):
        prompt = " ".join(f"note{(i * 7 + a) % 97} was kept" for i in range(words))
        done = generate(lm, prompt, None, SequenceSampling(max_tokens=4), attention=engine.profile.attention)
        firsts.append((prompt + done.reply, done.cache))
        prompts.append(prompt)
    times: dict[str, list[tuple[float, float, float, int]]] = {}

    def timed(name: str, build: Any) -> None:
        """``build()`` returns the arrays to evaluate; (build, submit, wait) ms and its operations under ``name``."""
        times.setdefault(name, []).append(_timed_submit(build, count=True))

    def passed(name: str, run: Any, seq: Any) -> None:
        """``run()`` from an idle device; ``seq``'s pass timing as (build, submit, wait until the device is done)
        and the operations it submitted (counted inside its submit, that time taken out again)."""
        mx.synchronize()
        with counting_submits() as counted:
            t0 = time.perf_counter()
            run()
            mx.synchronize()
            wall = (time.perf_counter() - t0) * 1e3 - counted.ms
        t = seq.last_chunk_timing
        launch = t.launch_ms - counted.ms
        times.setdefault(name, []).append((t.build_ms, launch - t.build_ms, wall - launch, counted.operations))

    def sequences(q: int) -> list[Any]:
        return [Sequence(lm, text + _ask(q + a), cache, SequenceSampling(max_tokens=2),
                         attention=engine.profile.attention) for a, (text, cache) in enumerate(firsts)]

    def kept_float_sequences(q: int, count: int = rows) -> list[Any]:
        """The first ``count`` rows' next turns over caches parked with their float buffers kept, as a hot
        round's are (a turn takes its cache's kept buffers: each round makes its first turns again)."""
        out = []
        for a, prompt in enumerate(prompts[:count]):
            first = Sequence(lm, prompt, None, SequenceSampling(max_tokens=4), attention=engine.profile.attention)
            for _ in decode_alone(first):
                pass
            kept = first.park(keep_float=True, wait=False)  # as the engine parks a turn under the GPU policy
            if kept is None or kept.resident is None:
                raise RuntimeError(f"row {a}: no kept float buffers")
            out.append(Sequence(lm, kept.text + _ask(q + a), kept, SequenceSampling(max_tokens=2),
                                attention=engine.profile.attention))
        return out

    for q in range(rounds):
        tag = " (first round)" if q == 0 else ""
        seqs = sequences(q)
        group = choose_group(dict(enumerate(seqs)))
        if len(group) < 2:
            raise RuntimeError(f"round {q}: the rows did not group ({group})")
        ids = list(group)
        pads = [group[i] for i in ids]
        grouped = [seqs[i] for i in ids]
        width = grouped[0].to_prefill + pads[0]
        timed(f"activate {len(ids)} rows' caches{tag}",
              lambda: [a for s in grouped for c in s.kv.caches for a in (c.keys, c.values)])
        timed(f"line them up, one batch cache a layer{tag}",
              lambda: [a for layer in zip(*(s.kv.caches for s in grouped), strict=True)
                       for c in [LinedUpCache(list(layer), pads, width)] for a in (c.keys, c.values)])
        passed(f"joint pass, rows already active{tag}", lambda: prefill_together(grouped, pads), grouped[0])
        whole = sequences(q)  # as the GPU actor runs it for caches read from disk: their dequantization in the pass
        passed(f"joint pass from the rows' Q4 caches{tag}",
               lambda: prefill_together([whole[i] for i in ids], pads), whole[ids[0]])
        hot = kept_float_sequences(q)  # as it runs a hot round: each row's last turn written into its float buffers
        hot_group = choose_group(dict(enumerate(hot)))
        if len(hot_group) < 2:
            raise RuntimeError(f"round {q}: the rows over kept float buffers did not group ({hot_group})")
        passed(f"joint pass over their kept float buffers{tag}",
               lambda: prefill_together([hot[i] for i in hot_group], list(hot_group.values())),
               hot[next(iter(hot_group))])
        again = sequences(q)  # the same messages again: every shape of the pass seen just before
        passed(f"same, again at the same shapes{tag}",
               lambda: prefill_together([again[i] for i in ids], pads), again[ids[0]])
        alone = kept_float_sequences(q, 1)[0]  # a hot turn: over its kept float buffers too
        passed(f"one row's hot chunk alone{tag}", lambda: _prefill_all(alone), alone)
        # a warm turn read ahead (a server's restart): its float buffers made from the Q4 read from disk before the
        # turn, as MlxEngine.prepare makes them; no last turn to write in (run 5: 13 ms of submit against hot's 5.6)
        ahead = Sequence(lm, firsts[0][0] + _ask(q), with_kept_float(firsts[0][1], lm.spec),
                         SequenceSampling(max_tokens=2), attention=engine.profile.attention)
        passed(f"one row's chunk over a cache read ahead{tag}", lambda: _prefill_all(ahead), ahead)
    engine.unload()  # not close(): that clears this thread's MLX streams, and the caller goes on with MLX
    out = []
    for name, samples in times.items():
        build, submit, wait = (stats.median(x[i] for x in samples) for i in range(3))
        operations = int(stats.median(x[3] for x in samples))
        per = f"{submit * 1e3 / operations:.1f}" if operations else "—"
        out.append([name, str(len(samples)), str(operations), f"{build:.2f}", f"{submit:.2f}", f"{wait:.2f}",
                    f"{build + submit + wait:.2f}", per])
    return out


def _timed_submit(build: Any, *, count: bool = False) -> tuple[float, float, float, int]:
    """``build()`` from an idle device, then MLX's submit of the arrays it returns (``mx.async_eval``) and the wait
    until the device is done: (build, submit, wait) ms, and with ``count`` the operations submitted (counted
    between the build and the submit, outside both)."""
    import mlx.core as mx

    mx.synchronize()
    t0 = time.perf_counter()
    out = build()
    t1 = time.perf_counter()
    operations = graph_operations(out) if count else 0
    t2 = time.perf_counter()
    mx.async_eval(out)
    t3 = time.perf_counter()
    mx.eval(out)
    mx.synchronize()
    t4 = time.perf_counter()
    return (t1 - t0) * 1e3, (t3 - t2) * 1e3, (t4 - t3) * 1e3, operations


def graph_operation_names(arrays: Any) -> list[str]:
    """The operations an evaluation of ``arrays`` would run, by name (MLX's graph as ``export_to_dot`` draws it;
    arrays already evaluated are inputs). On the CPU MLX builds its fused operations (attention, RoPE, norms, a
    dequantization) from smaller ones, so a CPU's count is larger than a GPU's for the same pass."""
    import io
    import re

    import mlx.core as mx

    out = io.StringIO()
    mx.export_to_dot(out, arrays)
    return re.findall(r'label ="([^"]+)", shape=rectangle', out.getvalue())


def graph_operations(arrays: Any) -> int:
    """How many operations an evaluation of ``arrays`` would run (:func:`graph_operation_names`)."""
    return len(graph_operation_names(arrays))


class SubmitCount:
    """What :func:`counting_submits` saw: operations handed to ``mx.async_eval``, and ms spent counting them."""

    def __init__(self) -> None:
        self.operations = 0
        self.ms = 0.0
        self.calls: list[collections.Counter[str]] = []  # each call's operations by kind

    def kinds(self, call: int = -1) -> str:
        """One call's operations by kind, the most frequent first (``Slice 96, Reshape 48, ...``)."""
        return ", ".join(f"{kind} {n}" for kind, n in self.calls[call].most_common()) if self.calls else "none"


@contextlib.contextmanager
def counting_submits() -> Iterator[SubmitCount]:
    """Count the operations of every ``mx.async_eval`` call (on any thread) while on, before it submits them."""
    import mlx.core as mx

    counted, submit = SubmitCount(), mx.async_eval

    def counting(*arrays: Any) -> Any:
        t0 = time.perf_counter()
        kinds = collections.Counter(graph_operation_names(list(arrays)))
        counted.calls.append(kinds)
        counted.operations += sum(kinds.values())
        counted.ms += (time.perf_counter() - t0) * 1e3
        return submit(*arrays)

    mx.async_eval = counting
    try:
        yield counted
    finally:
        mx.async_eval = submit


def _prefill_all(seq: Any) -> None:
    """A sequence's prefill chunks until its first token."""
    while seq.prefill_step() is None:
        pass


def gguf_prefill_rows(gguf: str, lengths: list[int]) -> list[list[str]]:
    """The needle GGUF's forward pass of each length (new shapes), weights packed as the GPU policy holds
    them (float16 around the blocks) and unpacked to float16: the first call, then the same shape again.
    H200 run 3's 8K needle rows took 232 s on this 135M model; a first call far above its repeat under
    ``quantized`` only would point at MLX compiling its quantized matmul kernels (NVRTC) at first use."""
    import mlx.core as mx

    from runtime.model.loaded import load_model

    rows = []
    for weights, floats in (("quantized", "float16"), ("float16", "auto")):
        lm = load_model(gguf, models_dir=harness.BENCH_HOME / "models", weights=weights, packed_floats=floats,
                        numpy_attention=False)
        for n in lengths:
            times = []
            for _ in range(2):
                ids = mx.random.randint(10, 4000, (1, n))
                mx.synchronize()
                t0 = time.perf_counter()
                mx.eval(lm.model(ids))
                times.append((time.perf_counter() - t0) * 1e3)
            rows.append([weights, str(n), f"{times[0]:.1f}", f"{times[1]:.1f}"])
            log(f"gguf {weights} {n}: first {times[0]:.1f} ms, again {times[1]:.1f} ms")
        del lm
    return rows


SECTIONS = ("host-copy", "sdpa", "gpt-oss", "gather", "shapes", "products", "batch-attention", "first-pass", "decode-row",
            "engine", "joint", "gguf")
"""The probes, in the order they run (``--sections``)."""


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--model-glob", default=str(harness.BENCH_HOME / "models" / "gpu-1b-*"))
    p.add_argument("--contexts", type=int, nargs="+", help="cache lengths (default 1000 1001 1002 4000 4001)")
    p.add_argument("--probe-tokens", type=int, default=15, help="new tokens per shape probe (a hot turn's size)")
    p.add_argument("--gguf", default=os.environ.get("KVMEM_NEEDLE_GGUF"),
                   help="a GGUF whose forward passes are timed packed and unpacked (default $KVMEM_NEEDLE_GGUF; none: skipped)")
    p.add_argument("--engine-after-tokens", type=int, default=0,
                   help="the engine section's rows again after a turn of this many tokens, and after mx.clear_cache()")
    p.add_argument("--joint-rows", type=int, default=8, help="the joint section's agents (default 8)")
    p.add_argument("--joint-context", type=int, default=1000, help="the joint section's cache tokens (default 1000)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="the probes to run, in this order whatever the order given (default all)")
    args = p.parse_args(argv)
    on = set(args.sections)
    quick = args.quick
    res = ResultFile("gpu_probe", "GPU probes: fused attention, tiny-gpt-oss, a new shape's first pass, one decode row",
                     quick, argv or [], model=None)
    from benches.gpu.gpu import device_lines

    res.setup += device_lines()
    res.setup.append(f"MLX_ENABLE_TF32={os.environ.get('MLX_ENABLE_TF32', 'unset (MLX: 1, float32 products in TF32 on CUDA)')}"
                     " (the suite runs with 0: tests/conftest.py)")
    if "host-copy" in on:
        res.body += ["## A save's host copy, then the cache's next use on the device (a 1B model's Q4 cache; ms)", "",
                     *table(["host reads", "MB", "host copy", "of it: MLX's move to managed memory",
                             "of it: numpy's read", "device pass before", "device pass after",
                             "new arrays before", "new arrays after"],
                            host_read_rows(512 if quick else 16384)), ""]
        res.write()  # kept if what follows runs past the session's time limit
    if "sdpa" in on:
        res.body += ["## Fused attention against a float32 reference (worst |error|: without / with sinks)", "",
                     *table(["dtype", "B x q x k", "mask", "no sinks", "sinks"], sdpa_rows()), "",
                     "## The same, the keys and values a slice of a longer buffer (as a cache hands them over)", "",
                     *table(["dtype", "B x q x k", "mask", "no sinks", "sinks"], sdpa_rows(sliced=True)), ""]
    if "gpt-oss" in on:
        res.body += ["## tiny-gpt-oss: the same tokens twice on the device, and on MLX's CPU stream", "",
                     *table(["position", "max |logit diff|, device twice", "device vs CPU"],
                            gpt_oss_rows(4 if quick else 8)),
                     "", "## tiny-gpt-oss layer by layer: the device against the CPU stream (worst |diff|)", "",
                     *table(["pass", "layer", "attention block", "MoE block", "MoE block alone, the CPU's input",
                             "tokens routed to other experts", "same, the device's own input",
                             "MoE block, each block's input evaluated first",
                             "MoE block, mx.compile off"], gpt_oss_part_rows()), ""]
    if "gather" in on:
        res.write()  # kept if a kernel under suspicion stops the process
        res.body += ["## tiny-gpt-oss's expert products alone, each road: the device against the CPU stream, and "
                     "twice on the device (worst |diff|)", ""]
        try:
            res.body += [*table(["tokens", "(token, expert) pairs", "dtype", "road", "device vs CPU", "device twice"],
                                gather_rows((4, 40) if quick else (4, 40, 193))), ""]
        except Exception as exc:  # noqa: BLE001 - a one-shot device run reports it
            res.body += [f"Stopped: {type(exc).__name__}: {str(exc)[:300]}", ""]
    if "shapes" in on:
        res.body += ["## Attention alone at new shapes: fused (cuDNN, a graph per shape), plain ops, plain ops over "
                     "the buffer's 256 step, kvmem's kernel (ms)", "",
                     *table(["new tokens", "cache tokens", *(f"{way} {when}" for way in SHAPE_WAYS
                                                             for when in ("first", "again")),
                             "max |diff| from fused"],
                            attention_shape_rows([1, 16] if quick else [1, 16, 128, 1024],
                                                 [100, 101] if quick else [1000, 1001, 4000, 16000])), ""]
    if "products" in on:
        from runtime.model import small_products

        width, dtype = (256, "float32") if quick else (2048, "bfloat16")
        counts = (1, 2, 13) if quick else (1, 2, 8, 13, 64, 256, 2048)
        repeats = 3 if quick else 10
        geometry = (width, 4 * width, width // 64, width // 256, 64)  # the 1B's at 2048: 8192 wide MLP, 32/8 heads
        res.body += [f"## A layer's products in one submit, the same shapes again and again ({dtype}, {width} wide; "
                     "ms, medians)", "",
                     "Seven square products, then a llama layer's seven (at 2048 wide, the 1B's shapes), then the "
                     "same layer's four as the `fused_projections` setting runs them (queries, keys and values one "
                     "product; gate and up another), then those four of 2 to 16 rows in kvmem's kernel (the "
                     "`small_products_kernel` setting; where MLX runs CUDA kernels).", "",
                     *table(["products", "rows", "build", "submit", "wait", "submit µs a product"],
                            [[what, *row] for what, shapes, kernel in (
                                ("7 square", [(width, width)] * 7, False),
                                ("a layer's 7", layer_product_shapes(*geometry, fused=False), False),
                                ("the layer's 4, fused", layer_product_shapes(*geometry, fused=True), False),
                                *([("the layer's 4, fused, kvmem's kernel", layer_product_shapes(*geometry, fused=True),
                                    True)] if small_products.available() else []))
                             for row in product_rows(counts, shapes, dtype, repeats, kernel)]), ""]
    if "batch-attention" in on:
        lengths = [1030, 1061, 1002, 1117, 1089, 1045, 1150, 1013]
        # at about 1K keys (the bench's batch rounds), then 16K (whether a long batch's padded steps should take the
        # kernel's two passes: the runtime gives them only to short passes over long keys so far)
        for scale in (1, 16):
            rows_lengths = [n * scale // (10 if quick else 1) for n in lengths]
            res.body += [f"## One decode step's attention, a batch of 8 rows of {min(rows_lengths)} to "
                         f"{max(rows_lengths)} keys (1B geometry; ms a call, a step makes one a layer)", "",
                         *table(["way", "host build", "with evaluation", "with evaluation, one key more a call",
                                 "max |diff| against the mask"], batch_decode_attention_rows(8, rows_lengths)), ""]
    model, name = _model(args.model_glob) if on & {"first-pass", "decode-row", "engine", "joint"} else (None, "")
    contexts = args.contexts or ([100, 101] if quick else [1000, 1001, 1002, 4000, 4001])
    if "first-pass" in on:
        res.body += [f"## A new shape's first pass (`{name}`, {args.probe_tokens} new tokens; ms)", "",
                     *table(["cache tokens", "first call", "same shape again"], shape_rows(model, contexts,
                                                                                        args.probe_tokens)), ""]
    if "decode-row" in on:
        res.body += [f"## One decode row (`{name}`; tokens/s)", "",
                     *table(["context", "cache", "lockstep", "run ahead"], decode_rows(
                         model, [min(contexts), max(contexts) * 4] if not quick else [100], 16 if quick else 64)), ""]
    if "engine" in on and not name.startswith("tiny"):
        res.write()  # kept if what follows runs past the session's time limit
        try:
            res.body += [f"## One row's decode, plain mlx-lm against kvmem's engine with no actors (`{name}`; tokens/s)",
                         "", *table(["path", "tokens/s (median of 3)", "against mlx-lm"],
                                    engine_decode_rows(name, 128, after_tokens=args.engine_after_tokens)), ""]
        except Exception as exc:  # noqa: BLE001 - a one-shot device run reports it
            res.body += [f"Stopped: {type(exc).__name__}: {str(exc)[:300]}", ""]
    if "joint" in on:
        res.write()  # kept if what follows runs past the session's time limit
        context = 100 if quick else args.joint_context
        try:
            res.body += [f"## A batch's joint prefill pass in pieces, each from an idle device (`{Path(name).name}`, "
                         f"{args.joint_rows} hot turns over ~{context}-token caches; ms, medians)", "",
                         *table(["piece", "rounds", "operations", "build", "submit", "wait", "in all",
                                 "submit µs an operation"],
                                joint_pass_rows(name, args.joint_rows, context, 3 if quick else 6)), ""]
        except Exception as exc:  # noqa: BLE001 - a one-shot device run reports it
            res.body += [f"Stopped: {type(exc).__name__}: {str(exc)[:300]}", ""]
    if "gguf" in on and args.gguf and args.gguf != "none":
        res.write()  # the probes above are kept if this one runs past the session's time limit
        res.body += [f"## The needle GGUF's forward at new lengths, packed and unpacked (`{Path(args.gguf).name}`; ms)", ""]
        try:  # last, and on its own: the probes above keep their report whatever happens here
            res.body += [*table(["weights", "tokens", "first call", "same shape again"],
                                gguf_prefill_rows(args.gguf, [100, 101] if quick else [1000, 1001, 2048, 4000])), ""]
        except Exception as exc:  # noqa: BLE001 - a one-shot device run reports it
            res.body += [f"Stopped: {type(exc).__name__}: {str(exc)[:300]}", ""]
    print(res.write().read_text())


if __name__ == "__main__":
    main()
