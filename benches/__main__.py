"""``python -m benches <name> [--quick] [options]``, or ``python -m benches all [--quick]``.

Each name is a module in one of ``benches/``'s rooms (:data:`benches.ROOMS`) with a ``main(argv)``; results
go to ``benches/results/<name>[_quick].{md,png}``. ``python -m benches`` lists them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from benches import ROOMS

#: Benchmarks in the order ``all`` runs them (cheapest first).
BENCHES = {
    "blas": "MLX's CPU matmul GFLOP/s with OpenBLAS loaded vs the wheel's bundled reference BLAS (KVMEM_NO_OPENBLAS=1)",
    "memory": "KV bytes per token Q4 / float16 / float32, peak memory with N hot agents, agents in 2 GB",
    "cache_io": "save / load ms vs cache size, next to the machine's sequential read / write floor",
    "ttft": "TTFT cold / warm (after restart) / hot at 1K-4K through the HTTP gateway, E2E for 64 tokens",
    "staggered": "agent B arrives 2 s after A: B TTFT and A slowdown, batched vs sequential (max_batch=1)",
    "multiturn": "3 turns on a 2K context through the gateway, with and without restarts",
    "fidelity": "PPL, KL, top-1, identical greedy continuations for float / Q8 / Q4 KV on real weights (disk round trip)",
    "fidelity_real": "PPL, KL, top-1 for float / Q8 / Q4 at-rest (disk), Q4 native, mlx-lm Q4 on kvmem-default, pydoc prose",
    "needle": "needle in a haystack at 1K-8K on kvmem-default: retrieval per KV format (float, Q4/Q8 at-rest, native, mlx-lm)",
    "needle_margins": "replays the needles whose at-rest reply differs from float's: both top-1 margins where they part",
    "vs_mlx_lm": "6 agents x 4 rounds with a restart, same requests to mlx_lm.server and kvmem serve: TTFT per round, wall",
    "vs_llama_cpp": "llama.cpp's server on the same GGUF: prompt token ids, 20 greedy continuations, top-2 margins",
    "recall": "10 fact kinds told, restart, asked warm on kvmem-default, next to a float-cache mlx-lm reference",
    "overhead": "E2E through HTTP gateway + actors vs runtime.execution.generate directly",
    "distributed_stop": "seconds until mlx.launch and both ranks are gone after SIGTERM/SIGINT to it, its group or a rank (goal: 10 s)",
    "huge_prompts": "a bystander's first token alone and while two clients loop 3.5 MB prompts and hang up (goal: <= 1.5x)",
    "durability": "kill -9 the moment a turn is answered: turns lost write-behind vs durable, the write-behind window, hot-path cost",
    "grammar_engines": "llguidance vs outlines-core on kvmem-default's tokenizer: vocab prep, schema compile, per-token mask, sanity, wheels",
    "fuzz": "a live kvmem serve fuzzed for a time budget with damaged requests on every POST route: 5xx (goal 0)",
    "tenants": "tenants of one kvmem serve --api-keys tried against each other (read, list, delete, continue, cached_tokens): leaks (goal 0)",
    "request_walk": "the kvmem modules one streaming OpenAI request runs through, traced (--compare an older checkout)",
    "cpu_attention": "kvmem's NumPy attention vs MLX's on CPU: one layer, cold prefill vs plain mlx-lm, chunk sizes, decode",
    "decode_attention": "kvmem's decode-step attention vs MLX's on CPU: one layer, whole steps at 1-8 rows x 1K/4K",
    "attention_strategy": "at-rest vs native quantized SDPA (existing)",
    "batching": "system tok/s for 1, 2, 4, 8 agents (existing)",
    "gc_pauses": "Python's full collections inside hot turns on kvmem-default: the model load's objects frozen vs not",
    "decode_runs": "one agent's decode tok/s through the actors: runs of steps vs one step per job, beside plain mlx-lm",
    "fused_projections": "plain mlx-lm's first token and decode tok/s with a layer's projections fused (4 products) and not (7)",
    "redis_tier": "two kvmem serve nodes + redis-server: TTFT remote vs warm vs hot vs cold at 1K/4K, bytes moved, Redis memory",
    "distributed": "kvmem serve --distributed: prefill tok/s and decode ms/token at 1 process vs 2 ranks (mlx.launch, loopback)",
    "race": "kvmem vs llama-server (built-in cache; slot files) vs mlx_lm.server: cold/hot/restart, multi-agent, tok/s",
    "agent_patterns": "agent clients' patterns (edit and resend, compaction, sub-agents, restarts) and a scripted tool-calling session: kvmem vs llama.cpp -np 1 / -np 4 (vs an older kvmem with --before)",
    "llama_cpp_suite": "llama.cpp's own server tests (tools/server/tests, every file) against kvmem serve on stories260K: passed / failed, each failure llama.cpp-specific or not (--before an older kvmem)",
    "reuse_costs": "a trim, a reuse of half a prompt and a block read from disk, against the prefill they save, on kvmem-default",
    "ui_screenshots": "the operator page (/ui) at 1280 and 420 px after a workload on kvmem-default, headless Debian Chromium: benches/results/ui_wide.png, ui_narrow.png",
    "constrained": "decode steps at batch 8 with 0, 4 and 8 rows under a grammar (generic tool calls): the mask's share of a step",
    "gpu": "one-call GPU check: kvmem vs plain mlx-lm on random 1B/3B Llamas (TTFT, decode, restart, batch), needles, suite",
    "gpu_probe": "GPU leads: fused attention vs a reference, tiny-gpt-oss repeated and vs CPU, a new shape's first pass, one decode row",
}


def module_of(name: str) -> str | None:
    """The module that runs benchmark ``name`` (``benches.<room>.<name>``), None if no room has it."""
    for room in ROOMS:
        if importlib.util.find_spec(f"benches.{room}.{name}") is not None:
            return f"benches.{room}.{name}"
    return None


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        for name, what in BENCHES.items():
            print(f"  {name:20s} {what}")
        return 0
    name, rest = argv[0], argv[1:]
    names = [n for n in BENCHES if module_of(n)] if name == "all" else [name]
    for n in names:
        module = module_of(n) if n in BENCHES else None
        if module is None:
            print(f"unknown benchmark {n!r}; one of: all, {', '.join(BENCHES)}", file=sys.stderr)
            return 2
        print(f"== {module} {' '.join(rest)}", file=sys.stderr, flush=True)
        importlib.import_module(module).main(rest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
