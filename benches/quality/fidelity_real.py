"""Fidelity of quantized KV on the real default model and real English text, through kvmem's cache path and disk.

Model ``kvmem-default`` (SmolLM2-135M-Instruct, 30 layers, 3 KV heads x 64);
text: the prose of ``pydoc_data.topics`` (:mod:`benches.quality.prose`), cut into
``--seqs`` sequences of ``--seq-len`` tokens (2 x 2048; 1 x 1024 with
``--quick``), each split in half. The metrics of :mod:`benches.quality.fidelity`
(perplexity, mean KL(float || format), top-1 agreement) over the second half's
next-token predictions, for:

* the reference: the first half prefilled into mlx-lm's float ``KVCache``, the
  second half run on it (no park, no disk);
* kvmem float / Q8 / Q4 / keys Q8 with values Q4 (``kv_key_bits``) / Q4 in groups of 32
  **at-rest**: that same float prefill (at-rest prefills in
  float; it is computed once and shared) put into an ``ActiveKV``, **parked**
  (quantized), **saved and loaded** with ``CacheDirectory`` (fsync), activated
  (dequantized) and the second half run on it in float;
* kvmem Q4 **native**: the first half prefilled on kvmem's packed Q4 cache
  (quantized SDPA), parked, saved, loaded, and the second half attended on Q4;
* mlx-lm's plain ``QuantizedKVCache`` (4 bits, group 64): both halves in memory.

Every disk round trip is checked bit-exact. The retrieval side of the same
question is :mod:`benches.quality.needle`.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.quality import prose
from benches.quality.fidelity import _log_probs, _summary, score
from benches.harness import ResultFile, log, table

MLX_LM_Q4 = "mlx-lm QuantizedKVCache q4"
AT_REST = {"kvmem float at-rest": (None, 64, None), "kvmem q8 at-rest": (8, 64, None),
           "kvmem q4 at-rest": (4, 64, None), "kvmem k8v4 at-rest": (4, 64, 8), "kvmem q4g32 at-rest": (4, 32, None)}
"""The at-rest rows: (bits, group size, keys' own bits) of each :class:`runtime.spec.KVFormat`."""


def specs_by_bits(spec: Any) -> dict[int | None, Any]:
    """The model's cache spec with float, Q8 and Q4 at-rest formats (one model load serves all three)."""
    from runtime.spec import KVFormat

    return {bits: replace(spec, kv_format=KVFormat(bits=bits)) for bits in (None, 8, 4)}


def park_float(float_kv: list[tuple[Any, Any]], spec: Any, token_ids: list[int]) -> Any:
    """Park float keys/values ``(1, H, T, D)`` per layer in ``spec``'s format, as kvmem parks an at-rest turn."""
    from runtime.kv.kvstate import ActiveKV, ParkedCache

    kv = ActiveKV(ParkedCache.empty(spec), spec, "at-rest")
    for cache, (k, v) in zip(kv.caches, float_kv, strict=True):
        cache.state = (k, v, int(k.shape[2]))
    return park(kv, token_ids)


def park(kv: Any, token_ids: list[int]) -> Any:
    """``kv.park`` over ``token_ids`` with placeholder text (one character per token)."""
    n = len(token_ids)
    parked = kv.park(text="t" * n, token_ids=list(token_ids), offsets=list(range(1, n + 1)))
    assert parked is not None
    return parked


def through_disk(parked: Any, spec: Any, float_dtype: Any, root: Path) -> tuple[Any, bool]:
    """Save ``parked`` with ``CacheDirectory`` (fsync) under ``root``, load it back; and whether it is bit-exact."""
    from runtime.kv.kvstate import ParkedCache
    from runtime.persist import CacheDirectory

    store = CacheDirectory(root, fsync=True)
    snap = parked.to_snapshot()
    store.save("agent", snap)
    back = store.load("agent", model_tag=spec.tag)
    exact = all(a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
                for a, b in ((la.arrays, lb.arrays) for la, lb in zip(snap.layers, back.layers, strict=True)))
    return ParkedCache.from_snapshot(back, float_dtype=float_dtype), exact


def main(argv: list[str] | None = None) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    from runtime.kv.kvstate import ActiveKV, ParkedCache

    p = harness.parser(__doc__)
    p.add_argument("--seqs", type=int, help="sequences (default 2; 1 with --quick)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence, split in half (default 2048; 1024 with --quick)")
    args = p.parse_args(argv)
    nseq = args.seqs or (1 if args.quick else 2)
    seq_len = args.seq_len or (1024 if args.quick else 2048)
    split = seq_len // 2
    lm = prose.load_default(4)
    from runtime.spec import KVFormat

    model, specs = lm.model, specs_by_bits(lm.spec)
    at_rest = {label: replace(lm.spec, kv_format=KVFormat(bits=b, group_size=g, key_bits=k))
               for label, (b, g, k) in AT_REST.items()}
    ids, _ = lm.tokenize(prose.prose())
    if len(ids) < nseq * seq_len:
        raise SystemExit(f"the prose has {len(ids)} tokens, fewer than {nseq} x {seq_len}")
    rows = [ids[i * seq_len:(i + 1) * seq_len] for i in range(nseq)]
    res = ResultFile("fidelity_real", "Fidelity of Q8 / Q4 KV on the real default model (pydoc_data.topics prose)",
                     args.quick, argv or [], model=str(prose.model_folder()))
    labels = [*AT_REST, "kvmem q4 native", MLX_LM_Q4]
    acc: dict[str, list[list[Any]]] = {k: [[], [], [], []] for k in labels}
    seconds: dict[str, float] = dict.fromkeys(["float prefill + reference", *labels], 0.0)
    exact_all = True
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-fidreal-") as tmp:
        for i, row in enumerate(rows):
            tokens = mx.array([row])
            first, second = tokens[:, :split], tokens[:, split:]
            targets = np.array(row[split + 1:])
            t0 = time.perf_counter()
            ref_caches = model.make_cache()
            model(first, cache=ref_caches)
            float_kv = [(c.keys[..., :split, :], c.values[..., :split, :]) for c in ref_caches]
            mx.eval(float_kv)
            ref = _log_probs(model(second, cache=ref_caches)[0])
            mx.eval(ref)
            seconds["float prefill + reference"] += time.perf_counter() - t0

            def run(label: str, ours: Any, t_start: float) -> None:
                mx.eval(ours)
                seconds[label] += time.perf_counter() - t_start
                for a, value in zip(acc[label], score(ours, ref, targets), strict=True):
                    a.append(value)

            for label, spec in at_rest.items():
                t0 = time.perf_counter()
                parked = park_float(float_kv, spec, row[:split])
                loaded, exact = through_disk(parked, spec, lm.float_dtype, Path(tmp) / f"{i}-{spec.kv_format.label}")
                exact_all &= exact
                run(label, _log_probs(model(second, cache=ActiveKV(loaded, spec, "at-rest").caches)[0]), t0)
            t0 = time.perf_counter()
            kv = ActiveKV(ParkedCache.empty(specs[4]), specs[4], "native")
            model(first, cache=kv.caches)
            loaded, exact = through_disk(park(kv, row[:split]), specs[4], lm.float_dtype, Path(tmp) / f"{i}-native")
            exact_all &= exact
            run("kvmem q4 native", _log_probs(model(second, cache=ActiveKV(loaded, specs[4], "native").caches)[0]),
                t0)
            t0 = time.perf_counter()
            caches = [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
            model(first, cache=caches)
            run(MLX_LM_Q4, _log_probs(model(second, cache=caches)[0]), t0)
            log(f"sequence {i + 1}/{nseq} done")

    results = {k: _summary(*v, identical=0, nseq=nseq) for k, v in acc.items()}
    for k, v in results.items():
        v.pop("identical")
        log(f"{k}: {v}")
        res.record(config=k, seconds=seconds[k], **v)
    res.record(config="float prefill + reference", seconds=seconds["float prefill + reference"])
    res.setup += [
        prose.model_line(),
        prose.describe(),
        (f"{nseq} sequences x {seq_len} tokens (the first {nseq * seq_len} of {len(ids)} prose tokens), split at "
         f"{split}; metrics over the {nseq * (seq_len - split)} second-half predictions (perplexity over the "
         f"{nseq * (seq_len - split - 1)} with a target); groups of 64 unless named"),
        f"every disk round trip (CacheDirectory save → load) bit-exact: {exact_all}",
    ]
    rows_md = [[k, f"{v['ppl']:.4f}", f"{v['ppl_delta_pct']:+.4f}%", f"{v['kl']:.5f}", f"{v['top1'] * 100:.2f}%",
                f"{seconds[k]:.0f}"] for k, v in results.items()]
    res.body += [
        *table(["KV path", "PPL (2nd half)", "PPL vs float", "mean KL to float", "top-1 agreement",
                "wall s (all sequences)"], rows_md),
        "",
        (f"Float reference PPL {results[labels[0]]['ppl_float']:.4f}: mlx-lm `KVCache`, same split, no disk. kvmem "
         "rows go through ActiveKV → park → CacheDirectory save/load (fsync) → ActiveKV; the at-rest rows share the "
         "reference's float prefill of the first half (that is what at-rest does: a turn runs in float and is "
         "quantized when parked), so their only difference from float is the quantization of the parked half. "
         "Native Q4 and mlx-lm quantize every token as it is appended, the second half's own tokens included. "
         "Wall times are from a shared 2-core machine; native and mlx-lm attend with "
         "quantized SDPA (slower than float on CPU); the at-rest rows' time is park + disk + the second half."),
        "",
        *_findings(results, labels),
    ]
    print(res.write().read_text())


def _bytes_vs_q4(label: str) -> float:
    """A format's bytes a token over Q4's (groups of 64), on heads of 64."""
    from runtime.spec import KVFormat

    b, g, k = AT_REST[label]
    return KVFormat(bits=b, group_size=g, key_bits=k).bytes_vs_q4()


def _findings(results: dict[str, dict[str, Any]], labels: list[str]) -> list[str]:
    q8r, q4r, k8v4, q4g32, q4n, mlx = (results[k] for k in labels[1:])

    def against_q4(r: dict[str, Any], label: str) -> str:
        return (f"PPL {r['ppl_delta_pct']:+.3f}%, KL {r['kl']:.5f} ({r['kl'] / max(q4r['kl'], 1e-12):.2f}x Q4's), "
                f"top-1 {r['top1'] * 100:.2f}%, at {_bytes_vs_q4(label):.2f}x Q4's bytes")

    return [(f"Quantizing only the parked half (at-rest): Q8 PPL {q8r['ppl_delta_pct']:+.4f}%, KL {q8r['kl']:.6f}; "
             f"Q4 PPL {q4r['ppl_delta_pct']:+.3f}%, KL {q4r['kl']:.5f}, top-1 {q4r['top1'] * 100:.2f}%; keys Q8 with "
             f"values Q4 {against_q4(k8v4, 'kvmem k8v4 at-rest')}; Q4 in groups of 32 "
             f"{against_q4(q4g32, 'kvmem q4g32 at-rest')}. Quantizing "
             f"every appended token: kvmem native Q4 PPL {q4n['ppl_delta_pct']:+.3f}%, KL {q4n['kl']:.5f}, top-1 "
             f"{q4n['top1'] * 100:.2f}%; mlx-lm Q4 PPL {mlx['ppl_delta_pct']:+.3f}%, KL {mlx['kl']:.5f}, top-1 "
             f"{mlx['top1'] * 100:.2f}%. Native Q4's KL is {q4n['kl'] / max(q4r['kl'], 1e-12):.1f}x at-rest Q4's, "
             f"mlx-lm's {mlx['kl'] / max(q4r['kl'], 1e-12):.1f}x.")]


if __name__ == "__main__":
    main()
