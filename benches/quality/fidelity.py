"""Fidelity of quantized KV on real weights, through kvmem's own cache path with a disk round trip.

Model ``../shared/fixtures/tinystories-hd64`` (llama, 4 layers, 2 KV heads,
head_dim 64, trained weights); text ``../shared/fixtures/tinystories-heldout/val.npy``
(held-out 512-token sequences; 20, 8 with ``--quick``). For each sequence:

1. the reference: one float forward pass over all 512 tokens (``model.make_cache()``);
2. kvmem: prefill the first half into an ``ActiveKV`` (attention at-rest or native),
   **park** it (quantize to Q8 / Q4, or keep float), **save and load** it with
   ``CacheDirectory`` (safetensors on disk, fsync), then run the second half on
   the reloaded cache;
3. plain mlx-lm ``QuantizedKVCache`` (group 64), no disk: the same split, for a
   side-by-side reference.

Metrics over the second half's next-token predictions: perplexity (and its change
vs float), mean KL(float || quantized), top-1 agreement; and a 32-token greedy
continuation after the first half (first token from the prefill's last logits,
the rest decoded on the reloaded cache), counted identical when all 32 tokens
match the float reference.

An experiment section then asks whether Q4 can be beaten at the same bytes
(KIVI-style, simulated in memory, no disk): :class:`SimulatedQ4Cache` quantizes
every token like mlx-lm's ``QuantizedKVCache`` but may quantize keys per channel
(group 64 over tokens) and keep the newest tokens in float until a 64-token
block is released. Quantization is simulated: float buffers whose quantized
regions are replaced by ``dequantize(quantize(...))``. Each sequence is fed in
chunks cut where a block is quantized, so every query sees the cache exactly as
token-by-token decoding would.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, log, table

MODEL = harness.SHARED / "fixtures" / "tinystories-hd64"
HELDOUT = harness.SHARED / "fixtures" / "tinystories-heldout" / "val.npy"
SPLIT, GREEDY = 256, 32


def _log_probs(logits: Any) -> Any:
    import mlx.core as mx

    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _top(logits: Any) -> int:
    import mlx.core as mx

    return int(np.asarray(mx.argmax(logits)))


def _greedy(model: Any, first: int, caches: Any, n: int) -> list[int]:
    import mlx.core as mx

    out = [first]
    for _ in range(n - 1):
        logits = model(mx.array([[out[-1]]]), cache=caches)[0, -1]
        out.append(_top(logits))
    return out


def main(argv: list[str] | None = None) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    from runtime.spec import KVFormat
    from runtime.kv.kvstate import ActiveKV, ParkedCache
    from runtime.model.loaded import load_model
    from runtime.persist import CacheDirectory

    args = harness.parser(__doc__).parse_args(argv)
    if not MODEL.exists() or not HELDOUT.exists():
        print(f"fixtures absent ({MODEL}, {HELDOUT}); skipping")
        return
    nseq = 8 if args.quick else 20
    rows_all = np.load(HELDOUT).astype("int32")[:nseq]
    res = ResultFile("fidelity", "Fidelity of Q8 / Q4 KV on real weights (tinystories-hd64, held-out text)",
                     args.quick, argv or [], model=str(MODEL))
    configs: list[tuple[str, int | None, str]] = [("float", None, "at-rest")]
    configs += [(f"q{b}", b, s) for b in (8, 4) for s in ("at-rest", "native")]
    results: dict[str, dict[str, Any]] = {}
    ref_cache: dict[int, tuple[Any, list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-fid-") as tmp:
        for label, bits, attention in configs:
            lm = load_model(str(MODEL), kv_format=KVFormat(bits=bits))
            model = lm.model
            store = CacheDirectory(Path(tmp) / f"{label}-{attention}", fsync=True)
            nll, nll_ref, kls, agree, identical = [], [], [], [], 0
            for i, row in enumerate(rows_all):
                tokens = mx.array(row[None])
                if i not in ref_cache:
                    ref_lp = _log_probs(model(tokens, cache=model.make_cache())[0])
                    c = model.make_cache()
                    pre = model(tokens[:, :SPLIT], cache=c)[0, -1]
                    ref_cont = _greedy(model, _top(pre), c, GREEDY)
                    mx.eval(ref_lp)
                    ref_cache[i] = (ref_lp, ref_cont)
                ref_lp, ref_cont = ref_cache[i]
                kv = ActiveKV(ParkedCache.empty(lm.spec), lm.spec, attention)
                pre = model(tokens[:, :SPLIT], cache=kv.caches)[0, -1]
                first = _top(pre)
                ids = [int(t) for t in row[:SPLIT]]
                parked = kv.park(text="t" * SPLIT, token_ids=ids, offsets=list(range(1, SPLIT + 1)))
                assert parked is not None
                store.save(f"s{i}", parked.to_snapshot())
                loaded = ParkedCache.from_snapshot(store.load(f"s{i}", model_tag=lm.spec.tag),
                                                   float_dtype=lm.float_dtype)
                ours = _log_probs(model(tokens[:, SPLIT:], cache=ActiveKV(loaded, lm.spec, attention).caches)[0])
                cont = _greedy(model, first, ActiveKV(loaded, lm.spec, attention).caches, GREEDY)
                for acc, value in zip((nll, nll_ref, kls, agree), _score(ours, ref_lp, row), strict=True):
                    acc.append(value)
                identical += int(cont == ref_cont)
            new = {f"kvmem {label} {attention}": _summary(nll, nll_ref, kls, agree, identical, nseq)}
            if bits is not None and attention == "at-rest":
                new[f"mlx-lm QuantizedKVCache q{bits}"] = _mlx_lm_reference(
                    model, rows_all, bits, ref_cache, QuantizedKVCache)
            for k, v in new.items():
                log(f"{k}: {v}")
                res.record(config=k, **v)
            results |= new

    rows = [[k, f"{v['ppl']:.4f}", f"{v['ppl_delta_pct']:+.4f}%", f"{v['kl']:.5f}", f"{v['top1'] * 100:.1f}%",
             f"{v['identical']}/{nseq}"] for k, v in results.items()]
    res.setup.append(f"{nseq} held-out sequences x 512 tokens, split at {SPLIT}; metrics over the "
                     f"{512 - SPLIT} second-half predictions; {GREEDY}-token greedy continuations; group 64")
    res.body += [
        *table(["KV path", "PPL (2nd half)", "PPL vs float", "mean KL to float", "top-1 agreement",
                f"identical {GREEDY}-token continuations"], rows),
        "",
        ("kvmem rows go through the full cache path (ActiveKV → park → CacheDirectory save/load → ActiveKV); "
        "mlx-lm rows quantize in memory with plain `QuantizedKVCache(group_size=64)`. Reference given in the "
        "task (plain mlx-lm, group 64): Q8 PPL −0.0003%, top-1 99.7%, 19/20 identical; Q4 +0.43% PPL, "
        "KL 0.0041, top-1 97.0%, 11/20."),
    ]
    native, mlx4 = results["kvmem q4 native"], results["mlx-lm QuantizedKVCache q4"]
    res.body += [
        "",
        ("Why at-rest Q4 is so much closer to float than native Q4 or mlx-lm: at-rest quantizes only the parked "
         "first half (once, at park) and keeps every token of the running turn in float, so the second half's own "
         "keys and values are never quantized; native (and plain mlx-lm) quantize each new token as it is "
         f"appended. kvmem's native Q4 matches plain mlx-lm within noise (PPL {native['ppl_delta_pct']:+.3f}% vs "
         f"{mlx4['ppl_delta_pct']:+.3f}%, KL {native['kl']:.5f} vs {mlx4['kl']:.5f}, {native['identical']}/{nseq} "
         f"vs {mlx4['identical']}/{nseq}): the disk round trip adds no error (save/load is bit-exact). The PPL "
         f"change for mlx-lm Q4 ({mlx4['ppl_delta_pct']:+.2f}%) is above the task's reference (+0.43%) while "
         "KL / top-1 / identical match it: a different split or sequence set is the likely cause."),
    ]
    q4_spec = load_model(str(MODEL), kv_format=KVFormat(bits=4)).spec
    experiment = {v.label: _simulated_run(model, rows_all, v, ref_cache) for v in VARIANTS}
    for label, summary in experiment.items():
        log(f"{label}: {summary}")
        res.record(config=f"experiment {label}", **summary)
    res.body += ["", *_experiment_section(experiment, results, q4_spec, nseq)]
    print(res.write().read_text())


def _score(ours: Any, ref_lp: Any, row: Any) -> tuple[Any, Any, Any, Any]:
    """Per-prediction NLL (ours, float), KL(float || ours) and top-1 agreement over the second half."""
    return score(ours, ref_lp[SPLIT:], row[SPLIT + 1:])


def score(ours: Any, ref: Any, targets: Any) -> tuple[Any, Any, Any, Any]:
    """Per-prediction NLL (ours, reference), KL(reference || ours) and top-1 agreement.

    ``ours`` and ``ref`` are log-probabilities for the same positions; ``targets``
    are the tokens that follow each position but the last (one fewer).
    """
    import mlx.core as mx

    t = mx.array(targets)[:, None]
    return (np.array(-mx.take_along_axis(ours[:-1], t, axis=-1)[:, 0]),
            np.array(-mx.take_along_axis(ref[:-1], t, axis=-1)[:, 0]),
            np.array((mx.exp(ref) * (ref - ours)).sum(-1)),
            np.array(ref.argmax(-1) == ours.argmax(-1)))


def _summary(nll: list[Any], nll_ref: list[Any], kls: list[Any], agree: list[Any], identical: int,
             nseq: int) -> dict[str, Any]:
    ppl = float(np.exp(np.concatenate(nll).mean()))
    ppl_ref = float(np.exp(np.concatenate(nll_ref).mean()))
    return {"ppl": ppl, "ppl_float": ppl_ref, "ppl_delta_pct": (ppl / ppl_ref - 1) * 100,
            "kl": float(np.concatenate(kls).mean()), "top1": float(np.concatenate(agree).mean()),
            "identical": identical, "sequences": nseq}


def _mlx_lm_reference(model: Any, rows_all: Any, bits: int, ref_cache: dict[int, tuple[Any, list[int]]],
                      qcache: Any) -> dict[str, Any]:
    import mlx.core as mx

    nll, nll_ref, kls, agree, identical = [], [], [], [], 0
    for i, row in enumerate(rows_all):
        tokens = mx.array(row[None])
        ref_lp, ref_cont = ref_cache[i]
        caches = [qcache(group_size=64, bits=bits) for _ in model.layers]
        pre = model(tokens[:, :SPLIT], cache=caches)[0, -1]
        first = _top(pre)
        # A second quantized cache of the first half for the greedy run (the second-half pass extends `caches`).
        greedy_caches = [qcache(group_size=64, bits=bits) for _ in model.layers]
        model(tokens[:, :SPLIT], cache=greedy_caches)
        ours = _log_probs(model(tokens[:, SPLIT:], cache=caches)[0])
        cont = _greedy(model, first, greedy_caches, GREEDY)
        for acc, value in zip((nll, nll_ref, kls, agree), _score(ours, ref_lp, row), strict=True):
            acc.append(value)
        identical += int(cont == ref_cont)
    return _summary(nll, nll_ref, kls, agree, identical, len(rows_all))


@dataclass(frozen=True)
class Q4Variant:
    """A Q4 KV policy: how keys are grouped and which tokens stay float.

    Attributes:
        label: row name in the result table.
        per_channel_keys: quantize keys along the token axis (one group = one channel
            over ``block`` tokens, KIVI) instead of along head_dim.
        block: tokens quantized together; 1 quantizes each token as it arrives.
        residual: the newest tokens kept in float; the oldest block is quantized once
            more than ``residual`` tokens (and at least a full block) are unquantized.
    """

    label: str
    per_channel_keys: bool
    block: int
    residual: int

    def quantized_after(self, arrived: int, done: int) -> int:
        """Tokens quantized once ``arrived`` tokens are in the cache, ``done`` of them quantized before."""
        while arrived - done >= self.block and arrived - done > self.residual:
            done += self.block
        return done

    def chunk_starts(self, n: int) -> list[int]:
        """Where to cut ``n`` tokens so that each model call sees the cache as token-by-token decoding would.

        A call appends its whole chunk before attending, so a block quantized by a
        token inside the chunk would be seen quantized by the earlier queries too:
        cut before every token that quantizes tokens older than itself.
        """
        starts, done = [0], 0
        for t in range(n):
            now = self.quantized_after(t + 1, done)
            if now > done and done < t and starts[-1] != t:
                starts.append(t)
            done = now
        return starts

    def max_float_tokens(self, n: int) -> int:
        """The most tokens ever held in float while ``n`` tokens arrive one by one."""
        done, most = 0, 0
        for t in range(n):
            done = self.quantized_after(t + 1, done)
            most = max(most, t + 1 - done)
        return most


VARIANTS = (
    Q4Variant("A: per-token K/V, no float residual", per_channel_keys=False, block=1, residual=0),
    Q4Variant("A': per-token K/V, partial 64-block float", per_channel_keys=False, block=64, residual=0),
    Q4Variant("B: per-channel K, per-token V, partial 64-block float", per_channel_keys=True, block=64, residual=0),
    Q4Variant("C: per-token K/V, float residual 128", per_channel_keys=False, block=64, residual=128),
    Q4Variant("C64: per-token K/V, float residual 64", per_channel_keys=False, block=64, residual=64),
    Q4Variant("D: per-channel K, per-token V, float residual 128 (KIVI)", per_channel_keys=True, block=64,
              residual=128),
    Q4Variant("D64: per-channel K, per-token V, float residual 64", per_channel_keys=True, block=64, residual=64),
)


class SimulatedQ4Cache:
    """mlx-lm cache protocol (``offset``, ``update_and_fetch``, ``make_mask``) with simulated Q4 KV.

    Keys and values live in float buffers; once a region is quantized under the
    variant's policy it is replaced by ``dequantize(quantize(...))`` (Q4, group 64),
    so attention sees exactly what a real Q4 cache would hold. It has no ``bits``
    attribute on purpose: mlx-lm's attention then takes the float path.
    """

    def __init__(self, variant: Q4Variant, *, group_size: int = 64, kv_bits: int = 4) -> None:
        self.variant, self.group_size, self.kv_bits = variant, group_size, kv_bits
        self.offset = 0
        self.quantized = 0
        self.keys: Any = None
        self.values: Any = None

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        import mlx.core as mx

        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        done = self.variant.quantized_after(self.offset, self.quantized)
        if done > self.quantized:
            a = self.quantized
            self.keys = _splice(self.keys, a, done, self._per_channel if self.variant.per_channel_keys
                                else self._per_token)
            self.values = _splice(self.values, a, done, self._per_token)
            self.quantized = done
        return self.keys, self.values

    def make_mask(self, n: int, *, return_array: bool = False, window_size: int | None = None) -> Any:
        from mlx_lm.models.cache import create_attention_mask

        return create_attention_mask(n, offset=self.offset, return_array=return_array, window_size=window_size)

    @property
    def state(self) -> tuple[Any, Any]:
        return self.keys, self.values

    def _per_token(self, x: Any) -> Any:
        import mlx.core as mx

        g, b = self.group_size, self.kv_bits
        return mx.dequantize(*mx.quantize(x, group_size=g, bits=b), group_size=g, bits=b)

    def _per_channel(self, x: Any) -> Any:
        batch, heads, tokens, dim = x.shape
        blocks = x.reshape(batch, heads, tokens // self.group_size, self.group_size, dim).swapaxes(-1, -2)
        return self._per_token(blocks).swapaxes(-1, -2).reshape(batch, heads, tokens, dim)


def _splice(x: Any, start: int, stop: int, quantize: Any) -> Any:
    import mlx.core as mx

    return mx.concatenate([x[:, :, :start], quantize(x[:, :, start:stop]), x[:, :, stop:]], axis=2)


def _feed(model: Any, row: Any, caches: list[SimulatedQ4Cache], variant: Q4Variant) -> Any:
    """Logits for every position of ``row``, fed in the variant's exact chunks."""
    import mlx.core as mx

    cuts = [*variant.chunk_starts(len(row)), len(row)]
    return mx.concatenate([model(mx.array(row[None, a:b]), cache=caches)[0] for a, b in pairwise(cuts)])


def _simulated_run(model: Any, rows_all: Any, variant: Q4Variant,
                   ref_cache: dict[int, tuple[Any, list[int]]]) -> dict[str, Any]:
    nll, nll_ref, kls, agree, identical = [], [], [], [], 0
    for i, row in enumerate(rows_all):
        ref_lp, ref_cont = ref_cache[i]
        logits = _feed(model, row, [SimulatedQ4Cache(variant) for _ in model.layers], variant)
        first = _top(logits[SPLIT - 1])
        greedy_caches = [SimulatedQ4Cache(variant) for _ in model.layers]
        _feed(model, row[:SPLIT], greedy_caches, variant)
        cont = _greedy(model, first, greedy_caches, GREEDY)
        for acc, value in zip((nll, nll_ref, kls, agree), _score(_log_probs(logits[SPLIT:]), ref_lp, row),
                              strict=True):
            acc.append(value)
        identical += int(cont == ref_cont)
    return _summary(nll, nll_ref, kls, agree, identical, len(rows_all))


def _experiment_section(experiment: dict[str, dict[str, Any]], results: dict[str, dict[str, Any]],
                        q4_spec: Any, nseq: int) -> list[str]:
    q4_bytes = q4_spec.bytes_per_token()
    fp16_layer = [layer.kv_heads * (layer.k_head_dim + layer.v_head_dim) * 2 for layer in q4_spec.layers]
    q4_layer = q4_bytes // len(q4_spec.layers)
    rows = []
    by_label = {v.label: v for v in VARIANTS}
    for label, v in [*((k, results[k]) for k in ("mlx-lm QuantizedKVCache q4", "kvmem q4 at-rest") if k in results),
                     *experiment.items()]:
        variant = by_label.get(label)
        if variant is not None:
            most = variant.max_float_tokens(512)
            extra = f"{most} tok; {most * (fp16_layer[0] - q4_layer) / 1024:.1f} KiB/layer"
        elif label.startswith("kvmem"):
            extra = "the whole running turn"
        else:
            extra = "0"
        rows.append([label, f"{v['ppl']:.4f}", f"{v['ppl_delta_pct']:+.4f}%", f"{v['kl']:.5f}",
                     f"{v['top1'] * 100:.1f}%", f"{v['identical']}/{nseq}", str(q4_bytes), extra])
    return [
        "## Experiment: KIVI-style variants (simulated, in memory, no disk)",
        "",
        ("Same sequences, split and metrics; every token goes through the Q4 cache as it arrives (like "
         "`QuantizedKVCache`), including the second half's own tokens. Quantization is simulated "
         "(`dequantize(quantize(x))`, 4 bits, group 64) and each sequence is fed in chunks cut wherever a "
         "block is quantized, so each query sees exactly the cache of token-by-token decoding. Per-channel "
         "keys group one channel over 64 tokens: with head_dim 64 that is as many scales and biases as "
         "per-token groups, so every variant holds the same bytes at rest once its blocks are full "
         f"({q4_bytes} B/token over {len(q4_spec.layers)} layers, fp16 scales and biases). The last column is "
         "the transient float residual: the most tokens held in float, and their extra bytes per layer over "
         f"Q4 as fp16 KV ({fp16_layer[0]} B/token/layer fp16 vs {q4_layer} Q4; this float32 model doubles "
         "the float side)."),
        "",
        *table(["Q4 KV policy", "PPL (2nd half)", "PPL vs float", "mean KL to float", "top-1 agreement",
                f"identical {GREEDY}-token continuations", "bytes/token at rest", "float residual (max)"],
               rows),
        "",
        *_experiment_findings(experiment, results, nseq, transient_kib=128 * (fp16_layer[0] - q4_layer) / 1024,
                              layers=len(q4_spec.layers)),
    ]


def _experiment_findings(experiment: dict[str, dict[str, Any]], results: dict[str, dict[str, Any]], nseq: int,
                         *, transient_kib: float, layers: int) -> list[str]:
    """What helped, with the numbers of this run (the wording assumes the ordering measured on 2026-11-22)."""
    x = {label.split(":")[0]: v for label, v in experiment.items()}
    x["A1"] = x["A'"]  # "A'" cannot be written inside the single-quoted keys below
    mlx, rest = results.get("mlx-lm QuantizedKVCache q4"), results.get("kvmem q4 at-rest")
    if mlx is None or rest is None or len(x) < len(VARIANTS):
        return []

    def kl(k: str) -> str:
        return f"{x[k]['kl']:.5f}"

    def less(a: str, b: str) -> str:
        return f"{(1 - x[a]['kl'] / x[b]['kl']) * 100:.0f}%"

    return [
        (f"**What helped.** A reproduces plain mlx-lm (PPL {x['A']['ppl_delta_pct']:+.3f}% vs "
         f"{mlx['ppl_delta_pct']:+.3f}%, KL {kl('A')} vs {mlx['kl']:.5f}, {x['A']['identical']}/{nseq} vs "
         f"{mlx['identical']}/{nseq}), so the simulation is faithful. Nearly all of the gain comes from keeping the "
         f"newest tokens in float: leaving only the not-yet-full 64-token block float (A', per-token groups) cuts "
         f"KL {x['A']['kl'] / x['A1']['kl']:.0f}x (to {kl('A1')}) and the PPL change from "
         f"{x['A']['ppl_delta_pct']:+.2f}% to {x['A1']['ppl_delta_pct']:+.3f}%; a 128-token float "
         f"residual (C) cuts KL {x['A']['kl'] / x['C']['kl']:.0f}x (to {kl('C')}), top-1 "
         f"{x['C']['top1'] * 100:.1f}%, {x['C']['identical']}/{nseq} identical continuations. Per-channel keys "
         f"help on top of a short residual (KL {less('B', 'A1')} lower with the partial block, B vs "
         f"A'; {less('D64', 'C64')} lower with R = 64, D64 vs C64) and little once 128 tokens are float "
         f"(D vs C: {less('D', 'C')} lower KL, {x['D']['identical']} vs {x['C']['identical']} identical, within "
         f"the noise of {nseq} sequences). R = 64 with 64-token blocks is nearly the partial-block policy (its "
         "float window cycles over 1–64 tokens instead of 0–63), so C64 ≈ A'. The PPL changes of A'–D64 "
         "(all within ±0.01%) are below what these predictions resolve; KL and top-1 separate the variants. "
         "Bytes at rest are the same for all; the price is transient: up to R float tokens per sequence, "
         f"{transient_kib:.0f} KiB per layer for R = 128 at fp16 ({transient_kib * layers:.0f} KiB for this "
         f"{layers}-layer model)."),
        "",
        (f"**kvmem's at-rest attention** is the same idea with the residual stretched to the whole running turn: "
         f"the parked prefix is per-token Q4 at rest (as in A) and every token of the current turn stays float until "
         f"the turn is parked, so here the second half never sees its own tokens quantized (KL {rest['kl']:.5f}, "
         f"{rest['identical']}/{nseq}): {mlx['kl'] / rest['kl']:.0f}x below mlx-lm, between A'/B and C/D. C and D "
         "beat it although they hold at most 128 float tokens (at-rest here holds up to 256) because at-rest quantizes the prefix's last tokens, which are the most "
         "recent ones when the turn starts, while C/D keep the newest 65–128 tokens float across the split. Two "
         "changes this points to for kvmem: keep a parked prefix's tail (its last partial block, or 128 tokens) "
         "in float, at a cost in bytes at rest of that tail only, and quantize keys per channel over full 64-token "
         "blocks (same bytes as per-token Q4 when head_dim = 64)."),
    ]


if __name__ == "__main__":
    main()
