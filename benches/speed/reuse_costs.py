"""What a reuse costs against the prefill it saves, on kvmem-default: the numbers behind kvmem's reuse rules.

For prompts of 1K, 3K and 6K tokens (1K and 3K with ``--quick``), each measured on its own:

* **cold**: a cold prefill of the whole prompt to its first token (``runtime.execution.sequence.Sequence``,
  the engine's own chunk schedule), and per token;
* **trim**: the prompt's cache parked (Q4 at rest), cut to half its tokens (``ParkedCache.truncated``):
  what reusing any common prefix adds over reusing it whole;
* **half reused**: a prompt whose first half is that cache's and whose second half is new (a compaction, an
  edit halfway): its first token from the trimmed cache, against the same prompt cold;
* **blocks read**: the cache saved (fsync off), dropped from the page cache, then its whole blocks read
  back by their hash chain (``CacheDirectory.read_prefix_blocks``, every block checked): what a sibling
  after a restart or a return to a branch pays per token instead of prefilling it.

What it shows: a trim costs microseconds and every kept token is one less to prefill, so kvmem reuses
any common prefix (no fraction of a cache is declined); a block costs a small part of its prefill to
read, so a turn reads the blocks its plan does not cover from the first one on, when they give it at
least a block more (``runtime.plan.disk_blocks``).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.speed.cache_io import drop_from_page_cache
from benches.harness import ResultFile, log, median, table
from runtime.execution.sequence import Sequence, SequenceSampling
from runtime.model.loaded import load_model
from runtime.persist import CacheDirectory
from runtime.spec import BLOCK_TOKENS

CORPUS = Path(__file__).resolve().parents[2] / "runtime" / "corpus"


def _text_of(lm, tokens: int, *, salt: str) -> str:
    """A prose prompt of about ``tokens`` tokens (the corpus, repeated as needed, after ``salt``)."""
    corpus = "\n\n".join((CORPUS / name).read_text() for name in ("essays.txt", "stories.txt", "dialogue.txt"))
    text = salt + "\n"
    while len(lm.tokenize(text)[0]) < tokens:
        text += corpus
    ids, ends = lm.tokenize(text)
    return text[: ends[tokens - 1]]


def _first_token_s(lm, prompt: str, cache=None) -> tuple[float, Sequence]:
    seq = Sequence(lm, prompt, cache, SequenceSampling(max_tokens=1))
    t0 = time.perf_counter()
    while seq.prefill_step() is None:
        pass
    return time.perf_counter() - t0, seq


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, repeats=3, quick_repeats=2)
    args = p.parse_args(argv)
    reps = harness.repeats(args, full=3, quick=2)
    sizes = [1024, 3072] if args.quick else [1024, 3072, 6144]
    res = ResultFile("reuse_costs", "What a reuse costs against the prefill it saves", args.quick, argv or [])
    lm = load_model("kvmem-default", models_dir=harness.BENCH_HOME / "models")
    res.setup.append(f"{reps} repeats per size, median; KV {lm.spec.kv_format.label}; cache saved with fsync off, "
                     "read back after dropping its files from the page cache")
    _first_token_s(lm, _text_of(lm, 256, salt="warm-up"))  # the first pass compiles and faults in the weights
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-reuse-") as tmp:
        disk = CacheDirectory(Path(tmp) / "caches", fsync=False)
        for n in sizes:
            cold, trims, reused, cold_half, reads = [], [], [], [], []
            for r in range(reps):
                prompt = _text_of(lm, n, salt=f"run {n}-{r}")
                cold_s, seq = _first_token_s(lm, prompt)
                parked = seq.park()
                half = n // 2
                t0 = time.perf_counter()
                trimmed = parked.truncated(half, lm.spec)
                trim_s = time.perf_counter() - t0
                assert trimmed is not None and trimmed.num_tokens == half
                variant = prompt[: parked.offsets[half - 1]] + _text_of(lm, n - half, salt=f" new {n}-{r}")
                reused_s, again = _first_token_s(lm, variant, parked)
                assert again.stats.tokens_reused >= half - 64, again.stats
                cold_variant_s, _ = _first_token_s(lm, variant)
                agent = f"reuse-{n}-{r}"
                disk.save(agent, parked.to_snapshot())
                drop_from_page_cache(disk.root)
                t0 = time.perf_counter()
                layers = disk.read_prefix_blocks(lm.spec.tag, parked.token_ids, layer_kinds=lm.spec.layer_kinds())
                read_s = time.perf_counter() - t0
                blocks = layers[0].arrays[next(iter(layers[0].arrays))].shape[1] // BLOCK_TOKENS if layers else 0
                assert blocks == n // BLOCK_TOKENS, blocks
                disk.delete(agent)
                cold.append(cold_s)
                trims.append(trim_s)
                reused.append(reused_s)
                cold_half.append(cold_variant_s)
                reads.append(read_s / blocks)
                res.record(tokens=n, repeat=r, cold_ms=cold_s * 1e3, trim_ms=trim_s * 1e3,
                           half_reused_ms=reused_s * 1e3, half_cold_ms=cold_variant_s * 1e3,
                           reused_tokens=again.stats.tokens_reused, block_read_ms=read_s / blocks * 1e3,
                           blocks=blocks)
                log(f"{n}: cold {cold_s * 1e3:.0f} ms, trim {trim_s * 1e6:.0f} us, half reused "
                    f"{reused_s * 1e3:.0f} ms vs cold {cold_variant_s * 1e3:.0f} ms, block read "
                    f"{read_s / blocks * 1e3:.2f} ms")
            c, t, hr, hc, rd = (median(x) for x in (cold, trims, reused, cold_half, reads))
            per_token = c / n
            rows.append([n, f"{c * 1e3:.0f}", f"{per_token * 1e3:.2f}", f"{t * 1e6:.0f}", f"{hr * 1e3:.0f}",
                         f"{hc * 1e3:.0f}", f"{hc / hr:.1f}x", f"{rd * 1e3:.2f}",
                         f"{per_token * BLOCK_TOKENS / rd:.0f}x"])
    res.body += [
        "## Reuse against prefill",
        "",
        *table(["prompt tokens", "cold first token ms", "cold ms / token", "trim to half us",
                "half reused: first token ms", "same prompt cold ms", "reuse speed-up", "one block read ms",
                "a block's prefill / its read"], rows),
        "",
        f"At 1K tokens a cold prefill costs {rows[0][2]} ms a token: below a block (256 tokens) a turn takes nothing",
        "from another agent's cache (`runtime.plan.kv_manager.MIN_SHARED_TOKENS`), which costs it at most",
        f"{float(rows[0][2]) * BLOCK_TOKENS:.0f} ms of prefill, so that a short conversation replies as it does alone",
        "whichever agents are hot.",
        "",
        "A trim is a slice of the parked cache: under a millisecond, whatever the fraction kept, so no common prefix",
        "is declined. Reading a block from disk (checked) costs a small part of prefilling its 256 tokens, so a",
        "turn whose whole blocks could give it a block or more beyond its plan reads them from the first on.",
    ]
    path = res.write()
    log(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
