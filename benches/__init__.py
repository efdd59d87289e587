"""kvmem benchmarks: ``python -m benches <name>`` runs one (``python -m benches`` lists them).

The benchmarks live in rooms by what they measure; the kit they share stays here:

* ``speed/`` — throughput and latency: batching, TTFT by tier, staggered arrivals, decode runs, attention
  kernels, cache I/O, memory, what a reuse costs;
* ``quality/`` — what quantized KV does to the model's answers: perplexity, KL, needles, recall;
* ``reliability/`` — what is kept and what is refused: kill -9 trials, fuzzing, tenants, load, huge prompts,
  the shared tier;
* ``peers/`` — kvmem beside other servers on the same weights: the race, agent patterns, llama.cpp's own
  server tests;
* ``gpu/`` — what runs on a lent GPU machine, and one model over several ranks;
* ``house/`` — how the house itself is built and seen: a request's walk, the operator page's screenshots;
* here: ``harness`` (provenance, medians, result files, plots), ``server`` (a real ``kvmem serve``),
  ``prompts``, ``openai_client``, ``snapshots``, ``thread_cpu``, ``chromium``.

Results go to ``benches/results/`` (its ``README.md`` is the index).
"""

ROOMS = ("speed", "quality", "reliability", "peers", "gpu", "house")
"""The folders that hold benchmarks, in the order ``python -m benches all`` looks in them."""
