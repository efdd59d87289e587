"""Transcripts and the working-memory report of a scenario run.

Transcripts come in *views*: ``full`` (the operator's: every phase, each line
marked with who may see it), ``public`` (only phases marked ``public``) and
an agent key (only what that agent may see). A private phase never appears in
the public view or in the view of an agent outside its ``visible_to``.

The working-memory report answers, for every agent and phase: how many prompt
tokens would that phase have prefilled without caches (every turn re-reads its
whole prompt) and how many did it actually prefill; and, when the run was made
with ``compare_cold``, the wall time of the same turns replayed from no cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from actors.scenario.spec import ScenarioSpec
from actors.scenario.state import RunState, ScenarioTurn

__all__ = [
    "ReportRow",
    "WorkingMemoryReport",
    "build_report",
    "visible_turns",
    "transcript_markdown",
    "transcript_json",
    "report_markdown",
    "plot_report",
    "write_outputs",
]


class ReportRow(msgspec.Struct, kw_only=True):
    """One agent in one phase.

    Attributes:
        prompt_tokens: tokens its turns would have prefilled without caches
            (reused + prefilled of every turn).
        prefilled: tokens actually prefilled.
        first_*: the phase's first turn of this agent: the phase boundary,
            where cross-phase injection extends the previous phase's cache.
        cold_prefilled, cold_wall_ms: the cold replay (None without it).
    """

    agent: str
    lifecycle: str
    phase: str
    turns: int
    prompt_tokens: int
    prefilled: int
    reused: int
    generated: int
    first_tier: str
    first_match: str
    first_reused: int
    first_prompt_tokens: int
    wall_ms: float
    cold_prefilled: int | None
    cold_wall_ms: float | None

    @property
    def saved_fraction(self) -> float:
        return 1.0 - self.prefilled / self.prompt_tokens if self.prompt_tokens else 0.0


class WorkingMemoryReport(msgspec.Struct, kw_only=True):
    """Rows per agent and phase, and the totals."""

    run_id: str
    scenario: str
    model: str
    rows: list[ReportRow]
    prompt_tokens: int
    prefilled: int
    generated: int
    wall_s: float
    ttft_s: float
    cold_prefilled: int | None
    cold_generated: int | None
    cold_wall_s: float | None
    cold_ttft_s: float | None

    @property
    def speedup(self) -> float | None:
        return self.cold_wall_s / self.wall_s if self.cold_wall_s and self.wall_s else None


def build_report(spec: ScenarioSpec, state: RunState) -> WorkingMemoryReport:
    """The working-memory numbers of ``state`` (any status; rows for the turns run so far)."""
    rows: list[ReportRow] = []
    order = {key: i for i, key in enumerate(spec.agents)}
    for phase in spec.phases:
        turns = state.phase_turns(phase.name)
        for agent in sorted({t.agent for t in turns}, key=order.__getitem__):
            mine = [t for t in turns if t.agent == agent]
            cold = [t.cold for t in mine if t.cold is not None]
            complete = len(cold) == len(mine)
            rows.append(
                ReportRow(
                    agent=agent,
                    lifecycle=spec.agents[agent].lifecycle,
                    phase=phase.name,
                    turns=len(mine),
                    prompt_tokens=sum(t.usage.prompt_tokens for t in mine),
                    prefilled=sum(t.usage.tokens_prefilled for t in mine),
                    reused=sum(t.usage.tokens_reused for t in mine),
                    generated=sum(t.usage.tokens_generated for t in mine),
                    first_tier=mine[0].usage.tier,
                    first_match=mine[0].usage.match,
                    first_reused=mine[0].usage.tokens_reused,
                    first_prompt_tokens=mine[0].usage.prompt_tokens,
                    wall_ms=sum(t.wall_ms for t in mine),
                    cold_prefilled=sum(c.usage.tokens_prefilled for c in cold) if complete else None,
                    cold_wall_ms=sum(c.wall_ms for c in cold) if complete else None,
                )
            )
    cold_all = [t.cold for t in state.turns if t.cold is not None]
    cold_complete = bool(state.turns) and len(cold_all) == len(state.turns)
    return WorkingMemoryReport(
        run_id=state.run_id,
        scenario=spec.name,
        model=state.options.model,
        rows=rows,
        prompt_tokens=sum(t.usage.prompt_tokens for t in state.turns),
        prefilled=sum(t.usage.tokens_prefilled for t in state.turns),
        generated=sum(t.usage.tokens_generated for t in state.turns),
        wall_s=state.wall_s,
        ttft_s=sum(t.usage.ttft_ms for t in state.turns) / 1000.0,
        cold_prefilled=sum(c.usage.tokens_prefilled for c in cold_all) if cold_complete else None,
        cold_generated=sum(c.usage.tokens_generated for c in cold_all) if cold_complete else None,
        cold_wall_s=sum(c.wall_ms for c in cold_all) / 1000.0 if cold_complete else None,
        cold_ttft_s=sum(c.usage.ttft_ms for c in cold_all) / 1000.0 if cold_complete else None,
    )


def visible_turns(spec: ScenarioSpec, state: RunState, view: str) -> list[ScenarioTurn]:
    """The turns a view may show: ``full``, ``public``, or an agent key.

    Raises:
        KeyError: ``view`` is none of these.
    """
    if view == "full":
        return list(state.turns)
    if view == "public":
        return [t for t in state.turns if t.public]
    if view not in spec.agents:
        raise KeyError(view)
    return [t for t in state.turns if view in t.visible_to]


def _stats(t: ScenarioTurn) -> str:
    u = t.usage
    return (
        f"tier={u.tier} match={u.match} reused={u.tokens_reused} prefilled={u.tokens_prefilled} "
        f"generated={u.tokens_generated} ({u.reuse_fraction:.0%} of the prompt from cache) "
        f"ttft={u.ttft_ms:.0f}ms wall={t.wall_ms:.0f}ms"
    )


def _quote(text: str) -> str:
    return "\n".join("> " + line if line else ">" for line in (text.strip() or "(says nothing)").splitlines())


def transcript_markdown(spec: ScenarioSpec, state: RunState, view: str = "full") -> str:
    """The transcript of one view as markdown, with every turn's cache statistics."""
    turns = visible_turns(spec, state, view)
    title = spec.title or spec.name
    heading = {"full": "full transcript", "public": "public transcript"}.get(view) or f"what {spec.display(view)} saw"
    out = [
        f"# {title}: {heading}",
        "",
        f"Run `{state.run_id}` · model `{state.options.model}` · status {state.status}",
        "",
    ]
    if view == "full":
        out += ["Private phases are marked with who may see them; the public transcript leaves them out.", ""]
    for phase in spec.phases:
        lines = [t for t in turns if t.phase == phase.name]
        if not lines:
            continue
        scope = "public" if phase.public else "visible to " + ", ".join(phase.audience(list(spec.agents)))
        out += [
            f"## {phase.title}",
            "",
            f"*{', '.join(spec.display(a) for a in phase.agents)} · {phase.rounds} round(s) · {scope}*",
            "",
        ]
        for t in lines:
            out += [
                f"**{spec.display(t.agent)}** (round {t.round})",
                "",
                _quote(t.reply),
                "",
                f"<sub>{_stats(t)}</sub>",
                "",
            ]
    return "\n".join(out)


def transcript_json(spec: ScenarioSpec, state: RunState, view: str = "full") -> dict[str, Any]:
    """The transcript of one view as a JSON-able dict (``lines`` with per-turn statistics)."""
    turns = visible_turns(spec, state, view)
    return {
        "run_id": state.run_id,
        "scenario": spec.name,
        "title": spec.title or spec.name,
        "model": state.options.model,
        "status": state.status,
        "view": view,
        "phases": [
            {
                "name": p.name,
                "label": p.title,
                "agents": list(p.agents),
                "rounds": p.rounds,
                "public": p.public,
                "visible_to": p.audience(list(spec.agents)),
            }
            for p in spec.phases
            if view == "full" or (p.public if view == "public" else p.can_see(view))
        ],
        "lines": [{"speaker": spec.display(t.agent), **msgspec.to_builtins(t)} for t in turns],
    }


def _fmt_pct(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def report_markdown(spec: ScenarioSpec, state: RunState, report: WorkingMemoryReport | None = None) -> str:
    """The working-memory report as markdown."""
    report = report or build_report(spec, state)
    env = state.environment
    out = [
        f"# Working memory: {spec.title or spec.name}",
        "",
        f"Scenario `{spec.name}` ({len(spec.phases)} phases, {len(spec.agents)} agents), run `{state.run_id}`, "
        f"model `{report.model}`, status {state.status}.",
        "",
    ]
    if env:
        out += ["| | |", "| --- | --- |"]
        out += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in env.items()]
        out.append("")
    out += [
        "Per agent and phase: **without caches** every turn re-prefills its whole prompt "
        "(tokens reused + prefilled); **with caches** only what the agent's cache does not cover "
        "is prefilled. *Phase start* is the agent's first turn of the phase — the phase boundary, "
        "where its prompt extends the cache of its previous phase.",
        "",
    ]
    cold = report.cold_wall_s is not None
    header = (
        "| agent | lifecycle | phase | turns | prefill without caches | prefilled with caches | saved "
        "| phase start: reused / prompt (tier, match) |"
    )
    rule = "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"
    if cold:
        header += " cold run prefilled | wall with caches | wall cold |"
        rule += " ---: | ---: | ---: |"
    out += [header, rule]
    for r in report.rows:
        row = (
            f"| {spec.display(r.agent)} | {r.lifecycle} | {r.phase} | {r.turns} "
            f"| {r.prompt_tokens:,} | {r.prefilled:,} | "
            f"{r.saved_fraction:.0%} | {r.first_reused:,} / {r.first_prompt_tokens:,} "
            f"({_fmt_pct(r.first_reused, r.first_prompt_tokens)}, {r.first_tier}, {r.first_match}) |"
        )
        if cold:
            row += f" {r.cold_prefilled or 0:,} | {r.wall_ms / 1000:.1f} s | {(r.cold_wall_ms or 0) / 1000:.1f} s |"
        out.append(row)
    saved = 1 - report.prefilled / report.prompt_tokens if report.prompt_tokens else 0.0
    total = (
        f"| **all** | | | {len(state.turns)} | **{report.prompt_tokens:,}** | **{report.prefilled:,}** "
        f"| **{saved:.0%}** | |"
    )
    if cold:
        total += (
            f" **{report.cold_prefilled or 0:,}** | **{report.wall_s:.1f} s** | **{report.cold_wall_s or 0:.1f} s** |"
        )
    out += [total, ""]
    permanent = [r for r in report.rows if r.lifecycle == "permanent"]
    boundary = [r for r in permanent if r.phase != _first_phase(state, r.agent)]
    if boundary:
        reused = sum(r.first_reused for r in boundary)
        prompt = sum(r.first_prompt_tokens for r in boundary)
        extend = sum(1 for r in boundary if r.first_match == "extend")
        out += [
            f"Phase boundaries of permanent agents: {len(boundary)}, of which {extend} extended the previous "
            f"phase's cache (`match=extend`); their first turns reused {reused:,} of {prompt:,} prompt tokens "
            f"({_fmt_pct(reused, prompt)}).",
            "",
        ]
    out += [
        f"Wall time of the {len(state.turns)} turns with caches: **{report.wall_s:.1f} s** "
        f"(time to first token, summed over the turns: {report.ttft_s:.1f} s)."
    ]
    if cold and report.cold_ttft_s is not None:
        ttft_ratio = report.cold_ttft_s / report.ttft_s if report.ttft_s else 0.0
        out += [
            f"The same turns from no cache (cold recompute): **{report.cold_wall_s:.1f} s** — "
            f"**{report.speedup:.2f}×** the cached run's wall time; time to first token summed "
            f"{report.cold_ttft_s:.1f} s ({ttft_ratio:.2f}×). Wall time includes decoding the replies, which "
            "caches do not shorten; time to first token is the prefill a cache saves.",
            "",
            "The cold run was measured in the same invocation, on the same loaded model: each turn was replayed "
            "cold right after it ran with caches, so both runs saw the same machine load (a throwaway warm-up "
            "turn precedes both). It replays the cached run's prompts (the same message lists, turn by turn) "
            "on fresh agent ids that neither reuse nor share any cache, and generates as many reply tokens "
            "as the cached turn did "
            f"(cached {report.generated:,}, cold {report.cold_generated or 0:,}): a reply that took another "
            "branch at a near-tie (Q4 against float KV) would otherwise change the length of what is computed. Wall times are the turns' own (submit to reply), excluding model load; the cached run's "
            "include its cache saves, and both include decoding.",
        ]
        if report.cold_prefilled is not None and report.cold_prefilled != report.prompt_tokens:
            out += [
                "",
                f"The cold run prefilled {report.cold_prefilled:,} tokens where the cached run's prompts count "
                f"{report.prompt_tokens:,}: a cold prompt tokenizes every earlier reply's text afresh, while a cache "
                "keeps the token ids each reply was generated as (generated token sequences need not be the ones "
                "the tokenizer would choose for the same text, most often with random-weight models).",
            ]
    else:
        out += ["", "(Run with `--compare-cold` to measure the same turns without caches.)"]
    out.append("")
    return "\n".join(out)


def _first_phase(state: RunState, agent: str) -> str | None:
    return next((t.phase for t in state.turns if t.agent == agent), None)


def plot_report(spec: ScenarioSpec, report: WorkingMemoryReport, path: Path) -> bool:
    """Bar charts of prefill per agent and phase (and wall time, with a cold run); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = report.rows
    labels = [f"{spec.display(r.agent)}\n{r.phase}" for r in rows]
    cold = report.cold_wall_s is not None
    fig, axes = plt.subplots(
        1,
        2 if cold else 1,
        figsize=(max(7.0, 0.9 * len(rows)) + (5 if cold else 0), 4.5),
        gridspec_kw={"width_ratios": [max(3, len(rows)), 2.5]} if cold else None,
        squeeze=False,
    )
    ax = axes[0][0]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r.prompt_tokens for r in rows], width=0.4, label="without caches", color="#c44e52")
    ax.bar([x + 0.2 for x in xs], [r.prefilled for r in rows], width=0.4, label="with caches", color="#4c72b0")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("tokens prefilled")
    ax.set_title(f"{spec.title or spec.name}: prefill per agent and phase")
    ax.legend()
    if cold:
        ax2 = axes[0][1]
        groups = ["wall time", "time to first token"]
        cached = [report.wall_s, report.ttft_s]
        cold_values = [report.cold_wall_s or 0.0, report.cold_ttft_s or 0.0]
        ax2.bar([x - 0.2 for x in range(2)], cached, width=0.4, label="with caches", color="#4c72b0")
        ax2.bar([x + 0.2 for x in range(2)], cold_values, width=0.4, label="cold recompute", color="#c44e52")
        ax2.set_xticks(range(2))
        ax2.set_xticklabels(groups)
        ax2.set_ylabel("seconds, summed over all turns")
        ttft_ratio = (report.cold_ttft_s or 0.0) / report.ttft_s if report.ttft_s else 0.0
        ax2.set_title(f"cold recompute / with caches:\nwall {report.speedup:.2f}x, TTFT {ttft_ratio:.2f}x", fontsize=10)
        ax2.set_ylim(0, max(cold_values + cached) * 1.3)
        ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(run_dir: Path, spec: ScenarioSpec, state: RunState, *, plot: bool = True) -> list[Path]:
    """Write transcripts (markdown + JSON, full and public) and the working-memory report into ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    report = build_report(spec, state)
    files: dict[str, str] = {
        "transcript.md": transcript_markdown(spec, state, "full"),
        "transcript.json": json.dumps(transcript_json(spec, state, "full"), indent=1, ensure_ascii=False),
        "public.md": transcript_markdown(spec, state, "public"),
        "public.json": json.dumps(transcript_json(spec, state, "public"), indent=1, ensure_ascii=False),
        "report.md": report_markdown(spec, state, report),
        "report.json": json.dumps(msgspec.to_builtins(report), indent=1),
    }
    written = []
    for name, text in files.items():
        path = run_dir / name
        path.write_text(text + ("\n" if not text.endswith("\n") else ""), encoding="utf-8")
        written.append(path)
    if plot and state.turns and plot_report(spec, report, run_dir / "report.png"):
        written.append(run_dir / "report.png")
    return written
