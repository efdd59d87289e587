"""Needle in a haystack on the real default model: retrieval accuracy per KV format at 1K-8K context.

Haystack: the prose of ``pydoc_data.topics`` (:mod:`benches.quality.prose`). Needle: one
sentence with a random city and a random 5-digit number (``--form``, chosen by
``--select-form``), inserted at a sentence boundary at ``n`` depths spread evenly
over 0-100% of the haystack (``--needles``, one number or one per length). The
user turn is the haystack followed by the question; greedy answer of at most
12 tokens; a hit when the number appears in the answer. A context length ``L``
counts everything: chat template, haystack, needle, question and the answer's
12 tokens fit in ``L`` (8192 is the model's trained context).

What each format's KV is, and how it is produced:

* ``float``: the whole prompt prefilled into mlx-lm's float ``KVCache``.
* ``q4-at-rest`` / ``q8-at-rest`` / ``q4g32-at-rest`` / ``k8v4-at-rest``: kvmem's at-rest
  attention. The context (template, haystack with the needle) was a turn run in float: it
  is the float run's context KV, parked by ``ActiveKV.park`` (quantized to Q4 / Q8 in groups
  of 64, Q4 in groups of 32: ``kv_group_size``, or keys in Q8 with values in Q4:
  ``kv_key_bits``), saved and loaded with ``CacheDirectory`` (fsync), activated
  (dequantized); the question and the answer then run in float on top, as the next turn
  would. (H200 run 6: Q4 at rest lost 2 of float's 75 hits; the other three say which
  change keeps them, at what memory.)
* ``q4-native``: kvmem's packed Q4 cache (``runtime.kv.q4_cache.QuantizedKVCache``)
  from the first token, every token quantized as it is appended, attention on
  Q4 (quantized SDPA); the context is parked and the question turn activated
  (packed, in memory).
* ``mlx-q4``: mlx-lm's plain ``QuantizedKVCache(group_size=64, bits=4)`` from the
  first token.

Compute is shared, never approximated: each length's haystack is prefilled once
per cache kind, up to each needle's position in depth order; every needle starts
from a copy of that prefix (a parked cache, or sliced buffers) and prefills the
needle and the rest of the haystack itself. The at-rest formats reuse the float
run's context KV, which is exactly what they would have computed. Native Q4 and
mlx-lm need their own prefill (quantized during prefill, 3-5x slower than float
on this CPU), so ``--quantized-lengths`` / ``--quantized-needles`` say where they
run (an evenly spread subset of the same needles).

The full run, 20 needles at 1K / 2K / 4K / 8K for every format, is ``python -m
benches needle`` (many hours on a 2-core CPU); every trial is appended to a
journal as it finishes and ``--resume`` reuses it, so a stopped run goes on.
Where an at-rest reply differs from float's, ``python -m benches needle_margins``
replays the trial and the report gives float's top-1 margin where they part.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.quality import prose
from benches.quality.fidelity_real import park, park_float, specs_by_bits, through_disk
from benches.harness import ResultFile, log, table
from runtime.spec import KVFormat

LENGTHS = (1024, 2048, 4096, 8192)
FORMATS = ("float", "q4-at-rest", "q8-at-rest", "q4g32-at-rest", "k8v4-at-rest", "q4-native", "mlx-q4")
FORMAT_LABELS = {"float": "float", "q4-at-rest": "kvmem Q4 at-rest (disk)", "q8-at-rest": "kvmem Q8 at-rest (disk)",
                 "q4g32-at-rest": "kvmem Q4 at-rest, groups of 32 (disk)",
                 "k8v4-at-rest": "kvmem keys Q8, values Q4 at-rest (disk)",
                 "q4-native": "kvmem Q4 native", "mlx-q4": "mlx-lm QuantizedKVCache Q4"}
AT_REST_FORMATS = {"q4-at-rest": KVFormat(bits=4), "q8-at-rest": KVFormat(bits=8),
                   "q4g32-at-rest": KVFormat(bits=4, group_size=32), "k8v4-at-rest": KVFormat(bits=4, key_bits=8)}
"""kvmem's at-rest formats measured."""
DERIVED = tuple(AT_REST_FORMATS)
"""The formats a float trial's context KV gives (:func:`at_rest_caches`)."""
ANSWER_TOKENS = 12
CHUNK = 1024
#: Every trial as it finishes (JSON lines); ``--resume`` reuses them, so a long run that stops can go on.
JOURNAL = harness.BENCH_HOME / "needle_trials.jsonl"
#: Where an at-rest reply differs from float's, both margins at the first differing token (``benches.quality.needle_margins``).
MARGINS = harness.BENCH_HOME / "needle_margins.jsonl"
Q4_TOLERANCE = 1.0  # nats, as tests/model/test_real_model_memory.py states it
CITIES = ("Lisbon", "Nairobi", "Oslo", "Lima", "Hanoi", "Quito", "Dublin", "Warsaw", "Cairo", "Manila",
          "Santiago", "Helsinki", "Bogota", "Prague", "Jakarta", "Vienna", "Havana", "Seoul", "Athens", "Dakar",
          "Montreal", "Kyoto", "Marseille", "Glasgow", "Nagoya", "Porto", "Tunis", "Zurich", "Krakow", "Perth")


@dataclass(frozen=True)
class NeedleForm:
    """How a needle is said and asked: ``{key}`` a city, ``{value}`` a 5-digit number."""

    fact: str
    question: str
    primer: str = ""  # the start of the assistant's reply, given in the prompt


FORMS = {
    "code-primed": NeedleForm(" The secret code for {key} is {value}.", "What is the secret code for {key}?",
                              "The secret code for {key} is"),
    "magic": NeedleForm(" The special magic number for {key} is: {value}.",
                        "What is the special magic number for {key} mentioned in the provided text?"),
    "magic-primed": NeedleForm(" The special magic number for {key} is: {value}.",
                               "What is the special magic number for {key} mentioned in the provided text?",
                               "The special magic number for {key} mentioned in the provided text is"),
    "phone-primed": NeedleForm(" The phone number of the {key} office is {value}.",
                               "What is the phone number of the {key} office?",
                               "The phone number of the {key} office is"),
    "pin-primed": NeedleForm(" The PIN of the {key} locker is {value}.", "What is the PIN of the {key} locker?",
                             "The PIN of the {key} locker is"),
}
DEFAULT_FORM = "phone-primed"


@dataclass(frozen=True)
class Needle:
    """One trial: where the fact goes and what it says."""

    index: int
    depth: float  # target fraction of the haystack before the needle
    position: int  # haystack tokens before the needle (a sentence boundary)
    key: str
    value: str


class Haystack:
    """The prompt pieces of one context length, as token ids.

    ``prefix`` (template up to the user's text) + ``hay[:position]`` + needle +
    ``hay[position:]`` is the context; ``suffix`` (question, end of turn,
    assistant header, primer) follows it.
    """

    def __init__(self, lm: Any, form: NeedleForm, length: int, stream: tuple[list[int], list[int], str]) -> None:
        ids, ends, text = stream
        self.lm, self.form, self.length = lm, form, length
        marker = "\x00DOC\x00"
        rendered = lm.render([{"role": "user", "content": marker + "\n\n" + form.question}])
        head, tail = rendered.split(marker)
        self.prefix = lm.tokenize(head)[0]
        self._tail = tail
        longest = max(len(self.needle_ids(k, "99999")) + len(self.suffix_ids(k)) for k in CITIES)
        budget = length - len(self.prefix) - longest - ANSWER_TOKENS
        # Sentence boundaries: a token ending in "." followed by one starting with whitespace.
        self.boundaries = [0] + [j for j in range(1, min(budget, len(ids)) + 1)
                                 if text[ends[j - 1] - 1] == "." and (j == len(ids) or text[ends[j - 1]].isspace())]
        self.hay = ids[:self.boundaries[-1]]
        self.hay_text = text[:ends[len(self.hay) - 1]]

    def needle_ids(self, key: str, value: str) -> list[int]:
        return list(self.lm.tokenize(self.form.fact.format(key=key, value=value))[0])

    def suffix_ids(self, key: str) -> list[int]:
        # The rendered tail holds the question with "{key}" still in it.
        return list(self.lm.tokenize(self._tail.replace("{key}", key) + self.form.primer.format(key=key))[0])

    def needles(self, n: int, *, seed: int) -> list[Needle]:
        """``n`` needles at depths evenly spread over 0-1, snapped to the nearest sentence boundary."""
        out = []
        for i, depth in enumerate(np.linspace(0.0, 1.0, n) if n > 1 else [0.5]):
            rng = random.Random(f"{seed}-{self.length}-{i}")
            target = depth * len(self.hay)
            position = min(self.boundaries, key=lambda b: abs(b - target))
            value = str(rng.randrange(10000, 100000))
            while value in self.hay_text:
                value = str(rng.randrange(10000, 100000))
            out.append(Needle(i, float(depth), position, rng.choice(CITIES), value))
        return out

    def context(self, needle: Needle) -> list[int]:
        """Template head, haystack with ``needle`` at its position: everything before the question."""
        return (self.prefix + self.hay[:needle.position] + self.needle_ids(needle.key, needle.value)
                + self.hay[needle.position:])

    def context_len(self, needle: Needle) -> int:
        return len(self.context(needle))


@dataclass
class CacheKind:
    """A way to hold a prefix and start trials from it: fresh caches, a snapshot, a restore."""

    name: str
    fresh: Callable[[], list[Any]]
    snapshot: Callable[[list[Any], list[int]], Any]
    restore: Callable[[Any], list[Any]]


def cache_kinds(lm: Any) -> dict[str, CacheKind]:
    """``float`` (mlx-lm KVCache), ``q4-native`` (kvmem, via park / ActiveKV) and ``mlx-q4`` (mlx-lm)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from runtime.kv.kvstate import ActiveKV, ParkedCache

    spec4 = specs_by_bits(lm.spec)[4]
    n_layers = len(lm.model.layers)

    def float_snapshot(caches: list[Any], ids: list[int]) -> Any:
        return [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in caches]

    def float_restore(snap: Any) -> list[Any]:
        out = []
        for k, v in snap:
            c = KVCache()
            c.state = (k, v, int(k.shape[2]))
            out.append(c)
        return out

    def native_snapshot(caches: list[Any], ids: list[int]) -> Any:
        kv = ActiveKV(ParkedCache.empty(spec4), spec4, "native")
        kv.caches = caches
        return park(kv, ids)

    def mlx_snapshot(caches: list[Any], ids: list[int]) -> Any:
        return [(tuple(x[..., :c.offset, :] for x in c.keys), tuple(x[..., :c.offset, :] for x in c.values), c.offset)
                for c in caches]

    def mlx_restore(snap: Any) -> list[Any]:
        out = []
        for k, v, offset in snap:
            c = QuantizedKVCache(group_size=64, bits=4)
            c.keys, c.values, c.offset = k, v, offset
            out.append(c)
        return out

    return {
        "float": CacheKind("float", lm.model.make_cache, float_snapshot, float_restore),
        "q4-native": CacheKind("q4-native", lambda: ActiveKV(ParkedCache.empty(spec4), spec4, "native").caches,
                               native_snapshot, lambda parked: ActiveKV(parked, spec4, "native").caches),
        "mlx-q4": CacheKind("mlx-q4", lambda: [QuantizedKVCache(group_size=64, bits=4) for _ in range(n_layers)],
                            mlx_snapshot, mlx_restore),
    }


def prefill(model: Any, ids: Sequence[int], caches: list[Any]) -> Any:
    """Run ``ids`` through ``caches`` in chunks; returns the last chunk's (lazy) logits."""
    import mlx.core as mx

    logits = None
    for a in range(0, len(ids), CHUNK):
        logits = model(mx.array([list(ids[a:a + CHUNK])]), cache=caches)
        mx.eval([(c.keys, c.values) for c in caches])
    return logits


def answer(lm: Any, suffix: list[int], caches: list[Any]) -> str:
    """Greedy reply of at most :data:`ANSWER_TOKENS` tokens after ``suffix``."""
    return str(lm.tokenizer.decode(greedy(lm, suffix, caches)[0]))


def greedy(lm: Any, suffix: list[int], caches: list[Any]) -> tuple[list[int], list[float]]:
    """The reply's token ids after ``suffix`` (end of turn left out) and each step's top-1 margin: the gap between
    the two best logits, in nats (the eos step included, so a reply that stops has one more margin than ids)."""
    import mlx.core as mx

    logits = prefill(lm.model, suffix, caches)
    out: list[int] = []
    margins: list[float] = []
    eos = lm.eos_token_ids
    for _ in range(ANSWER_TOKENS):
        last = np.asarray(logits[0, -1].astype(mx.float32))
        token = int(np.argmax(last))  # the first of equal maxima, as mx.argmax picks
        margins.append(float(last[token] - np.partition(last, -2)[-2]))
        if token in eos:
            break
        out.append(token)
        logits = lm.model(mx.array([[token]]), cache=caches)
    return out, margins


def run_length(lm: Any, hay: Haystack, needles: list[Needle], kind: CacheKind, *, derived: Sequence[str],
               tmp: Path, on_result: Callable[[str, Needle, str, dict[str, Any]], None],
               stop: Callable[[], bool] | None = None) -> None:
    """All ``needles`` of one length with one cache kind, sharing the haystack prefix; ``derived`` at-rest formats
    (float kind only) reuse each trial's float context KV. ``stop``, asked before each needle: once it says so,
    the rest are not run (a time limit: a needle that starts gets its answers in ``kind`` and every ``derived``
    format; needles go by position, so a cut set holds the earlier ones)."""
    main = kind.fresh()
    prefill(lm.model, hay.prefix, main)
    done = 0
    for needle in sorted(needles, key=lambda n: n.position):
        if stop is not None and stop():
            return
        t0 = time.perf_counter()
        prefill(lm.model, hay.hay[done:needle.position], main)
        done = needle.position
        head = hay.prefix + hay.hay[:done]
        caches = kind.restore(kind.snapshot(main, head))
        context = hay.context(needle)
        prefill(lm.model, context[len(head):], caches)
        suffix = hay.suffix_ids(needle.key)
        context_kv = kind.snapshot(caches, context) if derived else None
        if kind.name == "q4-native":  # the question is the next turn: park the context, activate it
            caches = kind.restore(kind.snapshot(caches, context))
        t1 = time.perf_counter()
        on_result(kind.name, needle, answer(lm, suffix, caches), {"prefill_s": t1 - t0,
                                                                   "answer_s": time.perf_counter() - t1})
        for fmt in derived:
            t0 = time.perf_counter()
            at_rest, extra = at_rest_caches(lm, context_kv, context, fmt, tmp / f"{hay.length}-{needle.index}-{fmt}")
            text = answer(lm, suffix, at_rest)
            on_result(fmt, needle, text, {"answer_s": time.perf_counter() - t0, **extra})


def at_rest_caches(lm: Any, context_kv: Any, context: list[int], fmt: str, folder: Path) -> tuple[list[Any], dict[str, Any]]:
    """The caches a turn after ``context`` starts from under the at-rest format ``fmt`` (one of :data:`DERIVED`),
    from the float run's context KV: kvmem's park, the disk (``folder``, removed after) and its activation.
    Also what to record with it."""
    from dataclasses import replace

    from runtime.kv.kvstate import ActiveKV

    spec = replace(lm.spec, kv_format=AT_REST_FORMATS[fmt])
    loaded, exact = through_disk(park_float(context_kv, spec, context), spec, lm.float_dtype, folder)
    shutil.rmtree(folder)
    return ActiveKV(loaded, spec, "at-rest").caches, {"disk_bit_exact": exact}


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="context lengths in tokens")
    p.add_argument("--needles", type=int, nargs="+", default=[20],
                   help="needles per length: one count for all, or one per length (default 20)")
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--quantized-lengths", type=int, nargs="*",
                   help="lengths at which q4-native and mlx-q4 run (default: all)")
    p.add_argument("--quantized-needles", type=int, nargs="+",
                   help="needles for q4-native / mlx-q4: an evenly spread subset of each length's (default: all)")
    p.add_argument("--form", choices=sorted(FORMS), default=DEFAULT_FORM, help=f"needle form (default {DEFAULT_FORM})")
    p.add_argument("--select-form", action="store_true",
                   help="float only, every form, at the first length: which form the model retrieves")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help=f"reuse trials already in the journal ({JOURNAL}) instead of running them again")
    p.add_argument("--report", action="store_true",
                   help="write the result file from the journal alone: run nothing, leave out trials it lacks")
    args = p.parse_args(argv)
    args.resume |= args.report
    if args.quick:
        args.lengths, args.needles = args.lengths[:1], [4]
    forms = sorted(FORMS) if args.select_form else [args.form]
    if args.select_form:
        args.lengths, args.formats = args.lengths[:1], ["float"]
    counts = _per_length(args.needles, args.lengths, "--needles")
    qlengths = args.lengths if args.quantized_lengths is None else args.quantized_lengths
    qcounts = _per_length(args.quantized_needles or args.needles, args.lengths, "--quantized-needles")

    lm = prose.load_default(4)
    text = prose.prose()
    ids, ends = lm.tokenize(text)
    kinds = cache_kinds(lm)
    res = ResultFile("needle", "Needle in a haystack on the real default model: retrieval per KV format, 1K-8K",
                     args.quick, argv or [], model=str(prose.model_folder()),
                     variant="_forms" if args.select_form else "")
    results: list[dict[str, Any]] = []
    journal = _read_journal(args.seed) if args.resume else {}

    def on_result(fmt: str, needle: Needle, reply: str, extra: dict[str, Any]) -> None:
        row = {"form": form_name, "seed": args.seed, "length": hay.length, "format": fmt, "needle": needle.index,
               "depth": round(needle.depth, 4), "position": needle.position, "key": needle.key,
               "value": needle.value, "hit": needle.value in reply, "answer": reply,
               "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), **extra}
        results.append(row)
        res.record(**row)
        JOURNAL.parent.mkdir(parents=True, exist_ok=True)
        with JOURNAL.open("a") as f:
            f.write(json.dumps(row) + "\n")
        log(f"{form_name} L={hay.length} {fmt:10s} depth {needle.depth:.2f} {'HIT ' if row['hit'] else 'miss'} "
            f"{needle.value} {reply!r} {extra}")

    with tempfile.TemporaryDirectory(prefix="kvmem-bench-needle-") as tmpdir:
        for form_name in forms:
            for length, n, qn in zip(args.lengths, counts, qcounts, strict=True):
                hay = Haystack(lm, FORMS[form_name], length, (ids, ends, text))
                needles = hay.needles(n, seed=args.seed)
                derived = [f for f in args.formats if f in DERIVED]
                if "float" in args.formats or derived:
                    t0 = time.perf_counter()
                    todo = _not_journaled(journal, results, res, hay, needles, ["float", *derived],
                                          form=form_name, seed=args.seed)
                    if not args.report:
                        run_length(lm, hay, todo, kinds["float"], derived=derived, tmp=Path(tmpdir),
                                   on_result=on_result)
                    log(f"L={length} float (+ {derived}): {time.perf_counter() - t0:.0f} s")
                for fmt in ("q4-native", "mlx-q4"):
                    if fmt in args.formats and length in qlengths:
                        subset = [needles[int(j)] for j in np.unique(np.linspace(0, n - 1, min(qn, n)).round())]
                        t0 = time.perf_counter()
                        todo = _not_journaled(journal, results, res, hay, subset, [fmt], form=form_name,
                                              seed=args.seed)
                        if not args.report:
                            run_length(lm, hay, todo, kinds[fmt], derived=[], tmp=Path(tmpdir),
                                       on_result=on_result)
                        log(f"L={length} {fmt}: {time.perf_counter() - t0:.0f} s")
                _write(res, results, args, forms)
    print(res.md_path.read_text())


def _trial_key(form: str, seed: int, length: int, fmt: str, position: int, key: str, value: str) -> tuple[Any, ...]:
    return form, seed, length, fmt, position, key, value


def _read_journal(seed: int) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Trials recorded by earlier runs (the last record of each wins)."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    if JOURNAL.exists():
        for line in JOURNAL.read_text().splitlines():
            r = json.loads(line)
            if r.get("seed") == seed:
                out[_trial_key(r["form"], seed, r["length"], r["format"], r["position"], r["key"], r["value"])] = r
    return out


def _not_journaled(journal: dict[tuple[Any, ...], dict[str, Any]], results: list[dict[str, Any]], res: ResultFile,
                   hay: Haystack, needles: list[Needle], fmts: list[str], *, form: str, seed: int) -> list[Needle]:
    """The needles that still need a run for ``fmts``; the journaled ones go straight into ``results``."""
    todo = []
    for needle in needles:
        rows = [journal.get(_trial_key(form, seed, hay.length, f, needle.position, needle.key, needle.value))
                for f in fmts]
        if any(r is None for r in rows):
            todo.append(needle)
            continue
        for r in rows:
            assert r is not None
            row = {**r, "needle": needle.index, "depth": round(needle.depth, 4), "resumed": True}
            results.append(row)
            res.record(**row)
    if len(todo) < len(needles):
        log(f"L={hay.length} {fmts}: {len(needles) - len(todo)} needles from the journal, {len(todo)} to run")
    return todo


def _per_length(counts: list[int], lengths: list[int], flag: str) -> list[int]:
    if len(counts) == 1:
        return counts * len(lengths)
    if len(counts) != len(lengths):
        raise SystemExit(f"{flag}: give one count or one per length ({len(lengths)})")
    return counts


def _write(res: ResultFile, results: list[dict[str, Any]], args: Any, forms: list[str]) -> None:
    """(Re)write the result file with what has run so far (a long run leaves a readable partial file)."""
    res.body = _body(results, args, forms)
    res.setup = [prose.model_line(), prose.describe(), *_setup(args, forms)]
    resumed = sum(bool(r.get("resumed")) for r in results)
    if resumed:
        res.setup.append(f"{resumed} of {len(results)} trials were reused from the journal (`--resume`, "
                         f"{JOURNAL}): run by an earlier invocation with the same needles, dates in the raw runs")
    res.write()
    if not args.select_form:
        _plot(res, results)
        res.write(plot=True)


def _setup(args: Any, forms: list[str]) -> list[str]:
    form = FORMS[forms[0]]
    lines = [] if args.select_form else [
        (f"needle: `{form.fact.strip()}`; question: `{form.question}`"
         + (f"; the reply starts with `{form.primer}` (given)" if form.primer else "")
         + f"; city from {len(CITIES)}, number uniform in 10000-99999 (seed {args.seed}); greedy, at most "
         f"{ANSWER_TOKENS} tokens; hit = the number appears in the reply. Form chosen with `python -m benches "
         "needle --select-form --lengths 1024 --needles 6` (needle_forms.md: the primed forms 6/6 in float at 1K; "
         "unprimed, the model restates the question and runs out of its 12 tokens; a 'secret code' reads as "
         "program code next to Python docs)")]
    return [*lines, (f"length L = every token (template, haystack, needle, question, primer and {ANSWER_TOKENS} "
                     f"answer tokens) fits in L; the haystack ends at the last sentence boundary that fits; prefill "
                     f"in chunks of {CHUNK} tokens")]


def _code(reply: str) -> str:
    """A reply as inline code in a table cell: pipes escaped, line breaks shown as ⏎."""
    return "`" + reply.strip().replace("\n", "⏎").replace("|", "\\|") + "`"


def _fmt_cell(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "—"
    hits = sum(r["hit"] for r in rows)
    return f"{hits}/{len(rows)} ({hits / len(rows) * 100:.0f}%)"


def _body(results: list[dict[str, Any]], args: Any, forms: list[str]) -> list[str]:
    if args.select_form:
        lengths = sorted({r["length"] for r in results})
        rows = [[f"`{name}`", f"`{FORMS[name].fact.strip()}`", f"`{FORMS[name].question}`",
                 f"`{FORMS[name].primer}`" if FORMS[name].primer else "—",
                 _fmt_cell([r for r in results if r["form"] == name])] for name in forms]
        return ["## Needle forms, float KV", "",
                f"Which needle this 135M model retrieves at L = {lengths}, before comparing KV formats.", "",
                *table(["form", "needle", "question", "reply starts with", "float hits"], rows, "lllll")]
    lengths = sorted({r["length"] for r in results})
    fmts = [f for f in FORMATS if any(r["format"] == f for r in results)]
    by = {(r["length"], r["format"], r["needle"]): r for r in results}
    acc_rows = [[FORMAT_LABELS[f], *(_fmt_cell([r for r in results if r["length"] == n and r["format"] == f])
                                     for n in lengths)] for f in fmts]
    agree_rows = []
    for f in fmts:
        if f == "float":
            continue
        cells = []
        for n in lengths:
            pairs = [(r, by.get((n, "float", r["needle"]))) for r in results if r["length"] == n and r["format"] == f]
            pairs = [(r, fl) for r, fl in pairs if fl is not None]
            if not pairs:
                cells.append("—")
                continue
            same_hit = sum(r["hit"] == fl["hit"] for r, fl in pairs)
            same_text = sum(r["answer"] == fl["answer"] for r, fl in pairs)
            float_hits = sum(fl["hit"] for _, fl in pairs)
            cells.append(f"{same_hit}/{len(pairs)} same hit/miss, {same_text}/{len(pairs)} same reply; "
                         f"float {float_hits}/{len(pairs)} on these")
        agree_rows.append([FORMAT_LABELS[f], *cells])
    detail = []
    for n in lengths:
        needles = sorted({r["needle"] for r in results if r["length"] == n})
        for i in needles:
            any_row = next(r for r in results if r["length"] == n and r["needle"] == i)
            marks = ["·" if (n, f, i) not in by else "✓" if by[(n, f, i)]["hit"] else "✗" for f in fmts]
            float_reply = by[(n, "float", i)]["answer"] if (n, "float", i) in by else ""
            detail.append([n, f"{any_row['depth'] * 100:.0f}%", any_row["position"], any_row["key"],
                           any_row["value"], *marks, _code(float_reply)])
    return [
        "## Retrieval accuracy per KV format",
        "",
        *table(["KV format", *(f"L = {n}" for n in lengths)], acc_rows),
        "",
        "## Agreement with float on the same needles",
        "",
        *table(["KV format", *(f"L = {n}" for n in lengths)], agree_rows),
        "",
        *_coverage(results, lengths, fmts),
        "",
        *_goal(results, lengths),
        "",
        *_partings(results),
        "## Per needle",
        "",
        "✓ hit, ✗ miss, · not run; position = haystack tokens before the needle.",
        "",
        *table(["L", "depth", "position", "city", "number", *fmts, "float reply"], detail,
               "rrrll" + "l" * len(fmts) + "l"),
    ]


def _goal(results: list[dict[str, Any]], lengths: list[int]) -> list[str]:
    """Whether at-rest Q4 retrieves exactly what float retrieves, length by length, with this run's numbers."""
    by = {(r["length"], r["format"], r["needle"]): r for r in results}
    parts, flipped = [], []
    for n in lengths:
        pairs = [(r, by[(n, "float", r["needle"])]) for r in results
                 if r["length"] == n and r["format"] == "q4-at-rest" and (n, "float", r["needle"]) in by]
        if not pairs:
            continue
        same = sum(r["hit"] == f["hit"] for r, f in pairs)
        here = [(r, f) for r, f in pairs if r["hit"] != f["hit"]]
        flipped += [r for r, _ in here]
        flips = "".join(f" (depth {r['depth'] * 100:.0f}%: float {_code(f['answer'])}, Q4 at-rest "
                        f"{_code(r['answer'])})" for r, f in here)
        parts.append(f"{n}: float {sum(f['hit'] for _, f in pairs)}/{len(pairs)}, Q4 at-rest "
                     f"{sum(r['hit'] for r, _ in pairs)}/{len(pairs)}, same outcome on {same}/{len(pairs)}{flips}, "
                     f"same reply text on {sum(r['answer'] == f['answer'] for r, f in pairs)}/{len(pairs)}")
    if not parts:
        return []
    quantized = []
    for fmt in ("q4-native", "mlx-q4"):
        rows = [r for r in results if r["format"] == fmt and (r["length"], "float", r["needle"]) in by]
        if rows:
            lost = [r for r in rows if by[(r["length"], "float", r["needle"])]["hit"] and not r["hit"]]
            quantized.append(f"{FORMAT_LABELS[fmt]} lost {len(lost)} of the float hits among its {len(rows)} "
                             f"needles (L = {sorted({r['length'] for r in rows})})"
                             + (": " + "; ".join(f"L={r['length']} depth {r['depth'] * 100:.0f}% answered "
                                                  f"{_code(r['answer'])} for {r['value']}" for r in lost)
                                if lost else ""))
    # The small-sample caveat only matters while some format ran fewer needles than another.
    uneven = len(set(Counter((r["length"], r["format"]) for r in results).values())) > 1
    literal = "**Literally: holds on these needles.** "
    if flipped:
        gained = sum(r["hit"] for r in flipped)
        literal = (f"**Literally: does not hold on these needles**: {len(flipped)} hit/miss "
                   f"flip{'s' if len(flipped) > 1 else ''}, {gained} where Q4 at-rest found a needle float missed and "
                   f"{len(flipped) - gained} where it missed one float found. ")
    tolerance = ""
    known = [m["float_margin"] for _, m in _read_margins(flipped)]
    if flipped and len(known) == len(flipped):
        within = all(x <= Q4_TOLERANCE for x in known)
        tolerance = (f"**Within the stated Q4 tolerance ({Q4_TOLERANCE} nats): "
                     f"{'holds' if within else 'does not hold'}**: at the token where the flipped replies part, "
                     f"float's own top-1 margin is {', '.join(f'{x:.3f}' for x in known)} nats (see the next "
                     "section). ")
    return [
        "## Goal: at-rest Q4 retrieves exactly what float retrieves at every length",
        "",
        (literal + tolerance + "Per length — "
         + "; ".join(parts) + ". "
         + (" ".join(q + "." for q in quantized) + " " if quantized else "")
         + "At-rest Q4 differs from float only in the parked context's KV (quantized once, after a float "
         "prefill); the question and the answer run in float."
         + (" Fewer needles at a length (see coverage) make its row weaker evidence: 5 needles that all agree "
            "bound the disagreement rate far less tightly than 20." if uneven else "")),
    ]


def _read_margins(results: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Replayed reply differences (:data:`MARGINS`) that belong to trials in ``results``, with their trial row."""
    if not MARGINS.exists():
        return []
    rows = {}
    for line in MARGINS.read_text().splitlines():
        m = json.loads(line)
        rows[_trial_key(m["form"], m["seed"], m["length"], m["format"], m["position"], m["key"], m["value"])] = m
    out = []
    for r in results:
        m = rows.get(_trial_key(r["form"], r["seed"], r["length"], r["format"], r["position"], r["key"], r["value"]))
        if m is not None and m["answer"] == r["answer"]:
            out.append((r, m))
    return out


def _partings(results: list[dict[str, Any]]) -> list[str]:
    """Where at-rest replies part from float's: both top-1 margins at the first differing token."""
    at_rest = [r for r in results if r["format"] in DERIVED]
    by = {(r["length"], r["format"], r["needle"]): r for r in results}
    differ = [r for r in at_rest if (r["length"], "float", r["needle"]) in by
              and r["answer"] != by[(r["length"], "float", r["needle"])]["answer"]]
    if not differ:
        return []
    replayed = _read_margins(differ)
    head = ["## Where an at-rest reply parts from float's", ""]
    if not replayed:
        return [*head, f"{len(differ)} at-rest replies differ from float's; not replayed yet (`python -m benches "
                       "needle_margins`).", ""]
    worst = max(m["float_margin"] for _, m in replayed)
    within = sum(m["float_margin"] <= Q4_TOLERANCE for _, m in replayed)
    rows = [[r["length"], FORMAT_LABELS[r["format"]], f"{r['depth'] * 100:.0f}%",
             _code(m["float_answer"]), _code(r["answer"]),
             m["step"], f"{m['float_margin']:.3f}", f"{m['margin']:.3f}", "yes" if m["reproduced"] else "**no**"]
            for r, m in sorted(replayed, key=lambda x: (x[0]["length"], x[0]["format"], x[0]["needle"]))]
    return [
        *head,
        (f"{len(differ)} at-rest replies differ in text from float's on the same needle; {len(replayed)} were "
         "replayed (`python -m benches needle_margins`: the same context prefilled in float, the at-rest copy "
         "parked, saved, loaded and activated, both replies decoded greedily again). At the first token where the "
         f"replies part, float's own top-1 margin is at most **{worst:.3f} nats**: {within} of {len(replayed)} are "
         f"within the stated Q4 tolerance of {Q4_TOLERANCE} nats, i.e. near-ties that 4-bit KV may tip either "
         "way. Step = reply token index where they part (0 = the first answer token); margins = the gap between "
         "the two best logits there; reproduced = the replay gave both journaled replies token for token."),
        "",
        *table(["L", "KV format", "depth", "float reply", "at-rest reply", "step", "float margin",
                "at-rest margin", "reproduced"], rows, "rllllrrrl"),
        "",
    ]


def _coverage(results: list[dict[str, Any]], lengths: list[int], fmts: list[str]) -> list[str]:
    lines = ["Coverage (needles per length, as run):", ""]
    for f in fmts:
        got = {n: sum(1 for r in results if r["length"] == n and r["format"] == f) for n in lengths}
        lines.append(f"- {FORMAT_LABELS[f]}: " + ", ".join(f"{n}: {k}" for n, k in got.items()))
    return lines


def _plot(res: ResultFile, results: list[dict[str, Any]]) -> None:
    plt = harness.pyplot()
    lengths = sorted({r["length"] for r in results})
    fmts = [f for f in FORMATS if any(r["format"] == f for r in results)]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    width = 0.8 / max(len(fmts), 1)
    for j, f in enumerate(fmts):
        labeled = False
        for i, n in enumerate(lengths):
            rows = [r for r in results if r["length"] == n and r["format"] == f]
            if not rows:
                continue
            acc = sum(r["hit"] for r in rows) / len(rows) * 100
            x = i + (j - (len(fmts) - 1) / 2) * width
            ax.bar(x, acc, width, color=f"C{j}", label=None if labeled else FORMAT_LABELS[f])
            ax.text(x, acc + 1, f"{len(rows)}", ha="center", va="bottom", fontsize=7)
            labeled = True
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needles retrieved (%)")
    ax.set_ylim(0, 110)
    ax.set_title("Needle retrieval per KV format (number over a bar: needles run)")
    harness.save_figure(res, fig)


if __name__ == "__main__":
    main()
