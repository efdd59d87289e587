"""Multi-phase scenarios from the command line: ``kvmem scenario run|resume|validate|list``.

``kvmem scenario run FILE`` runs a scenario (a YAML file, or the name of a
shipped one) through the in-process runtime (through the server's when one holds
the home: :mod:`actors.owner_client`; the same lines, files and exit codes), printing one line per turn
(phase, agent, cache tier and match, tokens reused vs prefilled), and writes
into the run folder: ``state.json`` (after every turn), ``transcript.md/.json``
(every phase, each marked with who may see it), ``public.md/.json`` (public
phases only), and the working-memory report ``report.md/.json/.png``.
``--compare-cold`` replays the same turns from no cache in the same
invocation and adds the cold wall time to the report.

``kvmem scenario resume DIR`` continues a run that was stopped
(``--stop-after PHASE``), interrupted (Ctrl-C) or killed, in a new process:
the permanent agents' caches come back from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.cli_common import add_setting_options, config_from_args

if TYPE_CHECKING:
    from runtime.config import Config

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add ``kvmem scenario ...`` to the ``kvmem`` parser."""
    scenario = sub.add_parser("scenario", help="run multi-phase, multi-agent scenarios (working memory across phases)")
    commands = scenario.add_subparsers(dest="scenario_command", required=True)

    run = commands.add_parser("run", help="run a scenario file or a shipped scenario")
    run.add_argument("file", help="scenario YAML file, or the name of a shipped scenario (see: kvmem scenario list)")
    run.add_argument("--out", type=Path, help="run folder (default: HOME/scenarios/RUN_ID)")
    run.add_argument("--max-tokens", type=int, help="reply length of every turn (default: the scenario's)")
    run.add_argument("--temperature", type=float, help="sampling temperature (default: the scenario's, usually 0)")
    run.add_argument("--fresh", action="store_true", help="forget the permanent agents' caches before starting")
    _add_run_options(run)
    run.set_defaults(func=_run)

    resume = commands.add_parser("resume", help="continue a stopped or interrupted run from its saved state")
    resume.add_argument("run", help="the run folder (or a run id under HOME/scenarios)")
    _add_run_options(resume)
    resume.set_defaults(func=_resume)

    validate = commands.add_parser("validate", help="check scenario files without running them")
    validate.add_argument("files", nargs="+", help="scenario YAML files or shipped scenario names")
    validate.set_defaults(func=_validate)

    listing = commands.add_parser("list", help="list the shipped scenarios")
    listing.set_defaults(func=_list)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compare-cold", action="store_true", help="also replay every turn from no cache and report both wall times"
    )
    p.add_argument(
        "--stop-after", metavar="PHASE", help="stop after this phase (continue with 'kvmem scenario resume')"
    )
    p.add_argument("--show-replies", action="store_true", help="print each reply under its turn")
    p.add_argument("--json", action="store_true", help="print progress events as JSON lines")
    p.add_argument("--no-plot", action="store_true", help="do not draw report.png")
    add_setting_options(p)


# -- subcommands ---------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    from actors.scenario.catalog import library_names, library_text
    from actors.scenario.spec import load_scenario

    for name in library_names():
        spec = load_scenario(library_text(name), source=f"library:{name}")
        kinds = ", ".join(f"{k}{'' if spec.permanent(k) else ' (ephemeral)'}" for k in spec.agents)
        print(f"{name:20} {spec.title or name}: {len(spec.phases)} phases; agents {kinds}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from actors.scenario.catalog import resolve_scenario
    from actors.scenario.spec import ScenarioError, check_scenario, decode_scenario

    failed = 0
    for ref in args.files:
        try:
            text, source = resolve_scenario(ref)
            spec = decode_scenario(text, source=source)
        except (FileNotFoundError, ScenarioError) as exc:
            print(f"{ref}: {exc}", file=sys.stderr)
            failed += 1
            continue
        problems, warnings = check_scenario(spec)
        for w in warnings:
            print(f"{source}: warning: {w}", file=sys.stderr)
        if problems:
            failed += 1
            print(ScenarioError(source, problems), file=sys.stderr)
        else:
            turns = sum(len(p.schedule()) for p in spec.phases)
            print(f"{source}: ok ({spec.name}: {len(spec.agents)} agents, {len(spec.phases)} phases, {turns} turns)")
    return 1 if failed else 0


def _run(args: argparse.Namespace) -> int:
    from actors.scenario.catalog import resolve_scenario
    from actors.scenario.runner import new_run_state
    from actors.scenario.spec import check_scenario, load_scenario
    from actors.scenario.state import STATE_FILE, RunOptions
    from runtime.home import KvmemHome

    try:
        text, source = resolve_scenario(args.file)
    except FileNotFoundError as exc:
        print(f"kvmem: {exc}", file=sys.stderr)
        return 2
    spec = load_scenario(text, source=source)
    for warning in check_scenario(spec)[1]:
        print(f"{source}: warning: {warning}", file=sys.stderr)
    if args.stop_after is not None and args.stop_after not in [p.name for p in spec.phases]:
        print(f"kvmem: --stop-after: no phase {args.stop_after!r} in {spec.name}", file=sys.stderr)
        return 2
    config = config_from_args(args)
    home = KvmemHome(config.home_path)
    options = RunOptions(
        model=config.model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        compare_cold=args.compare_cold,
        command=_command(),
    )
    state = new_run_state(spec, text, source=source, options=options)
    state.environment = _environment(config)
    run_dir = args.out or home.root / "scenarios" / state.run_id
    if (run_dir / STATE_FILE).exists():
        print(
            f"kvmem: {run_dir} already holds a run; continue it with: kvmem scenario resume {run_dir}", file=sys.stderr
        )
        return 2
    return _drive(args, spec, state, run_dir, config, fresh=args.fresh)


def _resume(args: argparse.Namespace) -> int:
    from actors.scenario.spec import load_scenario
    from actors.scenario.state import load_state
    from runtime.home import KvmemHome

    config = config_from_args(args)
    run_dir = Path(args.run)
    if not run_dir.exists() and "/" not in args.run:
        run_dir = KvmemHome(config.home_path).root / "scenarios" / args.run
    try:
        state = load_state(run_dir)
    except FileNotFoundError:
        print(f"kvmem: no saved scenario run in {run_dir}", file=sys.stderr)
        return 2
    spec = load_scenario(state.scenario_text, source=state.source)
    if state.status == "done" and not (args.compare_cold and any(t.cold is None for t in state.turns)):
        from actors.scenario.report import write_outputs

        write_outputs(run_dir, spec, state, plot=not args.no_plot)
        print(f"run {state.run_id} is already done (report: {run_dir / 'report.md'})")
        return 0
    if args.model is None:  # resume on the run's model, not on KVMEM_MODEL's or the TOML file's
        config = config.replace(model=state.options.model)
    if config.model != state.options.model:
        print(
            f"warning: the run used model {state.options.model}, resuming on {config.model}: "
            "its caches will not match",
            file=sys.stderr,
        )
        state.options.model = config.model
    state.options.compare_cold = state.options.compare_cold or args.compare_cold
    state.sessions += 1
    state.environment[f"command (session {state.sessions})"] = _command()
    return _drive(args, spec, state, run_dir, config, fresh=False)


# -- running ------------------------------------------------------------------


def _drive(args: argparse.Namespace, spec: Any, state: Any, run_dir: Path, config: Config, *, fresh: bool) -> int:
    import trio

    from actors.scenario.report import build_report, write_outputs
    from actors.scenario.state import save_state
    from gateway.cli_common import the_one_error

    out = sys.stdout
    if not args.json:
        turns = sum(len(p.schedule()) for p in spec.phases)
        print(
            f"scenario {spec.name} ({spec.title or spec.name}): {len(spec.phases)} phases, {len(spec.agents)} agents, "
            f"{turns} turns on {config.model}",
            file=out,
        )
        print(f"run {state.run_id} -> {run_dir}", file=out, flush=True)
    interrupted = False
    try:
        trio.run(_session, args, spec, state, run_dir, config, fresh)
    except KeyboardInterrupt:
        interrupted = True
        if state.status == "running":
            state.status = "interrupted"
    except BaseException as exc:
        if state.status == "running":  # refused before the runner began (the home in use, the model): not running
            reason = the_one_error(exc, (Exception,)) if isinstance(exc, BaseExceptionGroup) else exc
            state.status = "failed"
            state.error = f"{type(reason).__name__}: {reason}"
        raise
    finally:
        try:
            state.environment["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
            save_state(run_dir, state)
        except OSError:
            pass
        try:
            written = write_outputs(run_dir, spec, state, plot=not args.no_plot)
        except OSError as exc:  # pragma: no cover - reported, not fatal
            print(f"kvmem: cannot write the outputs: {exc}", file=sys.stderr)
            written = []
    report = build_report(spec, state)
    if args.json:
        print(
            json.dumps(
                {
                    "type": "Summary",
                    "run_id": state.run_id,
                    "run_dir": str(run_dir),
                    "status": state.status,
                    "files": [str(p) for p in written],
                }
            ),
            flush=True,
        )
    else:
        saved = 1 - report.prefilled / report.prompt_tokens if report.prompt_tokens else 0.0
        print(
            f"\n{state.status}: {len(state.turns)} turns; prompt tokens {report.prompt_tokens:,}, prefilled "
            f"{report.prefilled:,} ({saved:.0%} saved by caches); wall {report.wall_s:.1f} s",
            file=out,
        )
        if report.cold_wall_s is not None and report.speedup is not None:
            print(f"cold recompute of the same turns: {report.cold_wall_s:.1f} s ({report.speedup:.2f}x)", file=out)
        if written:
            print(f"transcript: {run_dir / 'transcript.md'}   report: {run_dir / 'report.md'}", file=out)
    if interrupted or state.status in ("stopped", "interrupted", "failed"):
        print(f"continue with: kvmem scenario resume {run_dir}", file=sys.stderr)
    if interrupted:
        return 130
    return 0 if state.status in ("done", "stopped") else 1


async def _session(args: argparse.Namespace, spec: Any, state: Any, run_dir: Path, config: Config, fresh: bool) -> None:
    from actors import open_runtime
    from actors.scenario.runner import ScenarioRunner, forget_permanent_agents

    async with open_runtime(config) as rt:
        if fresh:
            for agent_id in await forget_permanent_agents(rt, spec):
                if not args.json:
                    print(f"forgot {agent_id}", flush=True)
        runner = ScenarioRunner(
            rt, spec, state, run_dir=run_dir, on_event=_printer(spec, args), stop_after=args.stop_after
        )
        await runner.run()


def _printer(spec: Any, args: argparse.Namespace) -> Any:
    import msgspec

    from actors.scenario.runner import (
        ColdTurnFinished,
        PhaseFinished,
        PhaseStarted,
        RunFinished,
        TurnFinished,
        ScenarioTurnStarted,
    )

    tty = sys.stdout.isatty()
    width = max(len(a.name) for a in spec.agents.values())

    def on_event(event: Any) -> None:
        if args.json:
            print(msgspec.json.encode(event).decode(), flush=True)
            return
        match event:
            case PhaseStarted():
                names = ", ".join(spec.display(a) for a in event.agents)
                print(
                    f"\n== {event.label}  [{event.index + 1}/{event.count}: {names}; {event.rounds} round(s)]",
                    flush=True,
                )
            case ScenarioTurnStarted():
                if tty:
                    print(f"  r{event.round} {spec.display(event.agent):<{width}}  ...", end="\r", flush=True)
            case TurnFinished(record=r):
                u = r.usage
                print(
                    f"  r{r.round} {spec.display(r.agent):<{width}}  {u.tier:<6} {u.match:<8}"
                    f"  reused {u.tokens_reused:>6,}  prefilled {u.tokens_prefilled:>6,}"
                    f"  generated {u.tokens_generated:>4}  {u.reuse_fraction:>4.0%} from cache"
                    f"  ttft {u.ttft_ms:>7.0f} ms  wall {r.wall_ms / 1000:>5.1f} s",
                    flush=True,
                )
                if args.show_replies:
                    print("      " + (r.reply.strip().replace("\n", "\n      ") or "(nothing)"), flush=True)
            case PhaseFinished():
                print(
                    f"  -- {event.phase}: reused {event.tokens_reused:,}, prefilled {event.tokens_prefilled:,} "
                    f"in {event.wall_s:.1f} s",
                    flush=True,
                )
            case ColdTurnFinished(record=r):
                c = r.cold
                assert c is not None
                print(
                    f"  cold #{r.index:<3} {r.phase:<18} {spec.display(r.agent):<{width}}"
                    f"  prefilled {c.usage.tokens_prefilled:>6,}"
                    f"  wall {c.wall_ms / 1000:>5.1f} s  (with caches: prefilled {r.usage.tokens_prefilled:,}, "
                    f"{r.wall_ms / 1000:.1f} s)",
                    flush=True,
                )
            case RunFinished():
                pass

    return on_event


def _command() -> str:
    return "kvmem " + shlex.join(sys.argv[1:])


def _environment(config: Config) -> dict[str, Any]:
    """The record of where and how a run was made (printed in its report)."""
    from importlib import metadata

    env: dict[str, Any] = {"command": _command(), "date (UTC)": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    repo = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if rev.returncode == 0:
            dirty = subprocess.run(
                ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            env["git revision"] = rev.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    env["machine"] = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({cpu or 'unknown CPU'})"
    try:
        env["load average at start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    env["python"] = platform.python_version()
    for package in ("mlx", "mlx-lm"):
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    env["model"] = config.model
    from runtime.backend import GPU_KV_KEY_BITS

    kv = "float" if config.kv_bits is None else f"Q{config.kv_bits} (group {config.kv_group_size})"
    if config.kv_bits is not None and config.kv_key_bits not in (None, config.kv_bits):
        kv = f"keys Q{config.kv_key_bits}, values Q{config.kv_bits} (group {config.kv_group_size})"
    elif config.kv_bits is not None and config.kv_key_bits is None:
        kv += f", keys as the backend profile decides (Q{GPU_KV_KEY_BITS} under the GPU policy)"
    env["kv"] = f"{kv}, attention {config.attention}"
    if "OPENBLAS_NUM_THREADS" in os.environ:
        env["OPENBLAS_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"]
    return env
