"""Why an at-rest needle reply differs from float's: the float run's top-1 margin where the two part.

``python -m benches needle`` compares each at-rest format's reply with float's on
the same needle. Where the texts differ, this replays both (the same context,
prefilled in float; the at-rest copy parked, saved, loaded and activated as
there) and records, at the first token where the greedy replies part, the gap
between float's two best logits and between the at-rest run's. A difference
where float's own margin is within the stated Q4 tolerance (1.0 nats, as in
``tests/model/test_real_model_memory.py``) is a near-tie that 4-bit KV may tip either
way; one above it would be a real loss. Each replay first checks that it
reproduces both journaled replies token for token, so the margins belong to the
trials the table counts.

Rows go to :data:`benches.quality.needle.MARGINS` (JSON lines); ``python -m benches
needle --resume`` then reports them under its goal. Only the trials that differ
are replayed: one float prefill of the context each (about 20-50 s at 2K, 7 min
at 8K on a 2-core CPU).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.quality import prose
from benches.harness import log
from benches.quality.needle import (DEFAULT_FORM, DERIVED, FORMS, LENGTHS, MARGINS, Q4_TOLERANCE, Haystack, Needle,
                            _read_journal, _trial_key, at_rest_caches, cache_kinds, greedy, prefill)


def differing(journal: dict[tuple[Any, ...], dict[str, Any]], hay: Haystack, needles: list[Needle], fmt: str, *,
              form: str, seed: int) -> list[tuple[Needle, dict[str, Any], dict[str, Any]]]:
    """The needles whose ``fmt`` reply text differs from float's, with both journal rows."""
    out = []
    for needle in needles:
        rows = [journal.get(_trial_key(form, seed, hay.length, f, needle.position, needle.key, needle.value))
                for f in ("float", fmt)]
        fl, at = rows
        if fl is not None and at is not None and fl["answer"] != at["answer"]:
            out.append((needle, fl, at))
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    """The first step at which two greedy replies choose different tokens (a stop counts as a choice)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def replay(lm: Any, hay: Haystack, needle: Needle, fmts: list[str], tmp: Path) -> dict[str, Any]:
    """Float's reply and each at-rest format's on ``needle``, with every step's top-1 margin."""
    kind = cache_kinds(lm)["float"]
    context = hay.context(needle)
    caches = kind.fresh()
    prefill(lm.model, context, caches)
    context_kv = kind.snapshot(caches, context)
    suffix = hay.suffix_ids(needle.key)
    out = {"float": greedy(lm, suffix, caches)}
    for fmt in fmts:
        caches, _ = at_rest_caches(lm, context_kv, context, fmt, tmp / f"{hay.length}-{needle.index}-{fmt}")
        out[fmt] = greedy(lm, suffix, caches)
    return out


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--needles", type=int, default=20, help="needles per length, as the needle run had (default 20)")
    p.add_argument("--formats", nargs="+", choices=sorted(DERIVED), default=sorted(DERIVED))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    form = DEFAULT_FORM
    lm = prose.load_default(4)
    text = prose.prose()
    ids, ends = lm.tokenize(text)
    journal = _read_journal(args.seed)
    MARGINS.parent.mkdir(parents=True, exist_ok=True)
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-needle-margins-") as tmpdir:
        for length in args.lengths:
            hay = Haystack(lm, FORMS[form], length, (ids, ends, text))
            needles = hay.needles(args.needles, seed=args.seed)
            todo: dict[int, tuple[Needle, dict[str, tuple[dict[str, Any], dict[str, Any]]]]] = {}
            for fmt in args.formats:
                for needle, fl, at in differing(journal, hay, needles, fmt, form=form, seed=args.seed):
                    todo.setdefault(needle.index, (needle, {}))[1][fmt] = (fl, at)
            log(f"L={length}: {len(todo)} needles with a reply that differs from float's")
            for needle, pairs in todo.values():
                t0 = time.perf_counter()
                runs = replay(lm, hay, needle, list(pairs), Path(tmpdir))
                f_ids, f_margins = runs["float"]
                for fmt, (fl, at) in pairs.items():
                    a_ids, a_margins = runs[fmt]
                    at_step = first_difference(f_ids + [-1], a_ids + [-1])
                    row = {"form": form, "seed": args.seed, "length": length, "format": fmt,
                           "position": needle.position, "key": needle.key, "value": needle.value,
                           "float_answer": fl["answer"], "answer": at["answer"],
                           "reproduced": (lm.tokenizer.decode(f_ids) == fl["answer"]
                                          and lm.tokenizer.decode(a_ids) == at["answer"]),
                           "step": at_step, "float_margin": f_margins[at_step], "margin": a_margins[at_step],
                           "float_margins": f_margins, "margins": a_margins,
                           "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                           "replay_s": round(time.perf_counter() - t0, 1)}
                    with MARGINS.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    worst = max(worst, row["float_margin"])
                    log(f"L={length} {fmt} depth {needle.depth:.2f}: part at step {at_step}, float margin "
                        f"{row['float_margin']:.3f}, {fmt} margin {row['margin']:.3f}, "
                        f"reproduced {row['reproduced']}")
    log(f"largest float margin where a reply parts: {worst:.3f} nats (tolerance {Q4_TOLERANCE})")


if __name__ == "__main__":
    main()
