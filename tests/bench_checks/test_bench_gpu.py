"""The GPU check's report (``benches.gpu.gpu``): verdicts and tables from hand-made numbers, no model runs.

Item 4's goals are ratios of medians; each is checked here on both sides of
its limit, so a loss is reported as plainly as a win.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benches.gpu import gpu
from benches.gpu.gpu import BatchRound, GeometryRun, Plan, Sample

PLAN = Plan(sizes=(1024, 16384), decode_sizes=(1024,), decode_tokens=128, restart_size=16384, repeats=2, batch=8,
            batch_context=1024, batch_tokens=64, profile="auto")


def _run(*, kv_ttft: float = 100.0, kv_tps: float = 95.0, warm: float = 40.0, hot: float = 20.0,
         batch_tps: float = 600.0, batch_ttft: float = 150.0) -> GeometryRun:
    run = GeometryRun(gpu.GEOMETRIES["1b"], chunk_ms=80.0, chunk_tokens=2048)
    for size in PLAN.sizes:
        gen = 128 if size in PLAN.decode_sizes else 1
        run.mlx[size] = [Sample(ttft_ms=100.0, decode_tps=100.0, generated=gen, prompt_tokens=size)] * 2
        run.kvmem[size] = [Sample(ttft_ms=kv_ttft, decode_tps=kv_tps, generated=gen, prompt_tokens=size)] * 2
    run.hot = [Sample(ttft_ms=hot, tier="hot", reused=16400, prefilled=14)] * 2
    run.warm = [Sample(ttft_ms=warm, tier="warm", reused=16400, prefilled=14)]
    run.warm_ahead = [Sample(ttft_ms=warm, tier="warm", reused=16400, prefilled=14)]
    run.rounds = [BatchRound(1, 1.0, 100, (100.0,)), BatchRound(8, 800 / batch_tps, 800, (batch_ttft,) * 8)]
    return run


def _words(run: GeometryRun) -> dict[str, str]:
    return {v.goal: v.word for v in gpu.verdicts(run, restart_size=PLAN.restart_size)}


def test_every_goal_passes_within_its_limit() -> None:
    words = _words(_run(kv_ttft=109.0, kv_tps=91.0, warm=9.0, hot=9.0, batch_tps=500.0, batch_ttft=180.0))
    assert set(words.values()) == {"PASS"}, words
    assert len(words) == 2 + 1 + 3 + 2  # TTFT per size, decode at 1K, hot/warm and warm twice, batch pair


def test_each_goal_fails_past_its_limit() -> None:
    words = _words(_run(kv_ttft=111.0, kv_tps=89.0, warm=11.0, hot=12.0, batch_tps=490.0, batch_ttft=181.0))
    assert set(words.values()) == {"**FAIL**"}, words


def test_missing_measurements_are_not_verdicts() -> None:
    run = GeometryRun(gpu.GEOMETRIES["3b"], error="RuntimeError: out of memory")
    words = _words(run)
    assert set(words.values()) == {"not measured"}
    body = "\n".join(gpu.render_body([run], PLAN, ["Not run yet."], ["- suite: not given"]))
    assert "**stopped early: RuntimeError: out of memory**" in body


def test_report_names_each_goal_with_its_ratio_and_the_needle_table() -> None:
    needles = gpu.render_needles(
        [{"length": 1024, "format": "float", "needle": 0, "hit": True, "answer": " 12345."},
         {"length": 1024, "format": "q4-at-rest", "needle": 0, "hit": True, "answer": " 12345."},
         {"length": 1024, "format": "q4-native", "needle": 0, "hit": False, "answer": " 12.."}],
        ["q4-at-rest", "q4-native"], "q4-at-rest", model="kvmem-default", note=None, skipped=[8192])
    body = "\n".join(gpu.render_body([_run(kv_ttft=120.0)], PLAN, needles, ["- suite: `3 passed in 1.0s`"]))
    assert "| Llama-3.2-1B | cold TTFT at 16K ≤ 1.1x mlx-lm | 1.20x (120 / 100 ms) | **FAIL** |" in body
    assert "| kvmem Q4 at-rest (disk) — **kvmem's default** | 1/1 |" in body
    assert "| kvmem Q4 at-rest (disk): float's hits kept | 1/1 |" in body
    assert "float's hits kept | 0/1 |" in body  # native lost float's one hit
    assert "- L = 1024, needle 0, kvmem Q4 native: float ' 12345.', this ' 12..'" in body  # and what it said
    assert body.count("- L = ") == 1  # at-rest kept it: not listed
    assert "Not run for lack of time (`--deadline-s`, `--needle-deadline-s`): L = [8192]." in body
    # item 3's reading: which formats kept every float hit, at what bytes, and whether the default is one
    assert ("Item 3: every one of float's hits kept by kvmem Q4 at-rest (disk) (1.00x Q4's bytes). Lost some: "
            "kvmem Q4 native 1 of 1.") in body
    assert "The profile's default (kvmem Q4 at-rest (disk)): PASS." in body


def test_suite_summary_is_the_last_pytest_count_line(tmp_path: Path) -> None:
    log = tmp_path / "suite.log"
    log.write_text("tests/test_a.py ....\n========== 1 failed, 411 passed, 3 skipped in 95.20s (0:01:35) ==========\n"
                   "some trailing output\n")
    lines = gpu.suite_lines(log)
    assert lines[0] == "- suite (`suite.log`): `1 failed, 411 passed, 3 skipped in 95.20s (0:01:35)`"
    assert lines[1].startswith("- pytest-xdist: ")
    assert gpu.summary_line("collected 3 items\nTimeout\n") is None


def test_geometries_are_the_llama_shapes_the_issue_names() -> None:
    one, three = gpu.GEOMETRIES["1b"].config(), gpu.GEOMETRIES["3b"].config()
    assert (one["hidden_size"], one["num_hidden_layers"], one["num_attention_heads"], one["num_key_value_heads"],
            one["head_dim"], one["torch_dtype"]) == (2048, 16, 32, 8, 64, "bfloat16")
    assert (three["hidden_size"], three["num_hidden_layers"], three["num_attention_heads"],
            three["num_key_value_heads"], three["head_dim"]) == (3072, 28, 24, 8, 128)


def test_a_cold_turns_wait_is_read_from_the_trace_copies_before_its_admission_included() -> None:
    def ev(kind: str, rid: int, at: float) -> dict:
        return {"kind": kind, "ids": [rid], "at": at}

    trace = {"cold": [{"agent": "waits", "t0": 10.0, "t1": 10.5}, {"agent": "straight", "t0": 11.0, "t1": 11.2}],
             "events": [ev("finish", 1, 9.99), ev("checkout", 2, 10.001), ev("submit", 2, 10.002), ev("rendered", 2, 10.0025),
                        ev("planned", 2, 10.003), ev("tokenized", 2, 10.004),
                        ev("copy", 7, 10.15), ev("copy", 8, 10.40), ev("admit", 2, 10.41),
                        ev("chunk", 2, 10.42), ev("chunk", 2, 10.43), ev("finish", 2, 10.44),
                        ev("admit", 3, 11.01), ev("chunk", 3, 11.05),
                        {**ev("step", 3, 11.06), "timing": [7.5, 0.0, 0.0, 1.0, 7.4]}, ev("chunk", 4, 11.07)]}
    assert gpu.waits_before_first_token(trace) == [["waits", "1.0", "2.0", "2.5", "3.0", "4.0", "410.0", "2 (396 ms)",
                                                    "430.0", "—"],
                                                   ["straight", "—", "—", "—", "—", "—", "10.0", "0", "50.0", "7.5"]]
    body = "\n".join(gpu.render_body([_run()], PLAN, [], []))
    assert "first tokens went" not in body  # a run without a trace reports none


def test_a_batch_rounds_first_tokens_are_read_from_the_trace() -> None:
    def ev(kind: str, ids: list[int], at: float, **extra: object) -> dict:
        return {"kind": kind, "ids": ids, "at": at, **extra}

    timing = [20.0, 0.5, 0.1, 2.0, 19.0]  # launch, wait, host, build, launch CPU
    trace = {"rounds": [{"agents": 2, "t0": 10.0, "t1": 10.5}],
             "events": [ev("checkout", [1], 10.001), ev("checkout", [2], 10.0015), ev("submit", [1], 10.002),
                        ev("submit", [2], 10.006), ev("tokenized", [1], 10.003), ev("tokenized", [2], 10.007),
                        ev("admit", [1], 10.008), ev("admit", [2], 10.008),
                        ev("chunk", [1, 2], 10.030, timing=timing), ev("step", [1, 2], 10.040, timing=[9.0, 0, 0, 1, 9]),
                        ev("step", [1, 2], 10.045, timing=[4.0, 0, 0, 1, 4]), ev("chunk", [3], 10.2, timing=timing)]}
    assert gpu.batch_round_waits(trace) == [["0 (2 agents)", "1.0 / 1.5", "2.0 / 6.0", "7.0", "8.0", "1", "30.0",
                                             "20.0", "9.0"]]
    assert gpu.batch_round_waits({"events": []}) == []


def test_decode_steps_are_split_from_the_trace_by_kind_of_window() -> None:
    def step(at: float, timing: list[float] | None) -> dict:
        return {"kind": "step", "ids": [1], "at": at, **({"timing": timing} if timing else {})}

    trace = {"cold": [{"agent": "cold-1024-r0", "t0": 0.0, "t1": 1.0}, {"agent": "cold-1024-r1", "t0": 2.0, "t1": 3.0}],
             "rounds": [{"agents": 8, "t0": 4.0, "t1": 5.0}],
             "events": [step(0.100, [1.0, 2.0, 0.5, 0.6, 0.9]), step(0.104, [1.0, 2.0, 0.5, 0.6, 0.9]),
                        step(0.109, [1.0, 2.5, 0.5, 0.7, 0.2]),
                        step(2.100, [1.0, 0.0, 0.5, 0.6, 0.9]), step(2.104, [1.5, 0.0, 0.5, 0.5, 1.4]), step(2.5, None),
                        # a trace from before the launch's split: three timings a step
                        step(4.000, [2.0, 1.0, 1.0]), step(4.007, [2.0, 1.0, 1.0]), step(4.015, [2.0, 2.0, 1.0])]}
    rows = gpu.decode_step_split(trace)
    # cold 1K pools three intervals (4, 5 and 4 ms) from two repeats; a step without timing is left out;
    # the launch splits into build and submit (medians of each: 0.6 and 0.4), with the thread's CPU time
    assert rows[0] == ["cold-1024", "3", "4.00", "4.33", "1.00", "0.60", "0.40", "0.90", "2.00", "0.50", "1.00"]
    assert rows[1] == ["batch round, 8 agents", "2", "7.50", "7.50", "2.00", "—", "—", "—", "1.50", "1.00", "3.00"]
    body = "\n".join(gpu.render_body([_run()], PLAN, [], []))
    assert "decode steps' time went" not in body  # a run without a trace reports none


def test_prefill_chunks_are_split_from_the_trace_by_kind_of_window() -> None:
    def chunk(at: float, timing: list[float] | None) -> dict:
        return {"kind": "chunk", "ids": [1], "at": at, **({"timing": timing} if timing else {})}

    trace = {"cold": [{"agent": "cold-4096-r0", "t0": 0.0, "t1": 1.0}, {"agent": "cold-4096-r1", "t0": 2.0, "t1": 3.0}],
             "rounds": [{"agents": 8, "t0": 4.0, "t1": 5.0}],
             "events": [chunk(0.1, [10.0, 0.0, 0.0, 8.0, 9.0]), chunk(0.2, [12.0, 5.0, 1.0, 9.0, 11.0]),
                        chunk(2.1, [11.0, 0.0, 0.0, 8.5, 10.0]), chunk(2.2, [13.0, 4.0, 1.0, 10.0, 12.0]),
                        chunk(2.3, [1.0, 1.0, 1.0]),  # a trace from before the split: left out
                        chunk(4.5, [40.0, 20.0, 2.0, 30.0, 39.0]),
                        {"kind": "step", "ids": [1], "at": 4.6, "timing": [1.0, 1.0, 1.0, 1.0, 1.0]}]}
    rows = gpu.chunk_split(trace)
    # cold 4K: four chunks from two repeats (medians of each part); its windows' chunks took 28 and 29 ms in all
    assert rows[0] == ["cold-4096", "4", "11.50", "8.75", "2.75", "10.50", "2.00", "0.50", "28.5"]
    assert rows[1] == ["batch round, 8 agents", "1", "40.00", "30.00", "10.00", "39.00", "20.00", "2.00", "62.0"]
    body = "\n".join(gpu.render_body([_run()], PLAN, [], []))
    assert "prefill chunks' time went" not in body  # a run without a trace reports none


def test_the_collectors_runs_are_counted_by_kind_of_window() -> None:
    def run(at: float, generation: int, took_ms: float) -> dict:
        return {"kind": "gc", "ids": [], "at": at, "generation": generation, "took_ms": took_ms}

    trace = {"cold": [{"agent": "cold-1024-r0", "t0": 0.0, "t1": 1.0}, {"agent": "cold-1024-r1", "t0": 2.0, "t1": 2.5}],
             "rounds": [{"agents": 8, "t0": 4.0, "t1": 5.0}],
             "events": [run(0.1, 0, 0.2), run(0.5, 2, 41.0), run(2.2, 1, 1.5), run(3.0, 2, 50.0),  # between windows
                        {"kind": "step", "ids": [1], "at": 4.1, "timing": [1.0, 1.0, 1.0, 1.0, 1.0]}]}
    rows = gpu.collections_split(trace)
    # cold 1K pools both repeats' windows (1.5 s); the full collection between windows is no window's
    assert rows[0] == ["cold-1024", "1", "1", "1", "42.7", "41.0", "1500"]
    assert rows[1] == ["batch round, 8 agents", "0", "0", "0", "0.0", "0.0", "1000"]


def test_decode_runs_are_told_by_how_they_ended() -> None:
    def step(at: float) -> dict:
        return {"kind": "step", "ids": [1], "at": at, "timing": [1.0, 0.0, 0.0, 0.5, 0.9]}

    def run(at: float, detail: str, took_ms: float, waited_ms: float) -> dict:
        return {"kind": "run", "ids": [1], "at": at, "took_ms": took_ms, "waited_ms": waited_ms, "detail": detail}

    trace = {"cold": [{"agent": "cold-1024-r0", "t0": 0.0, "t1": 1.0}],
             "events": [step(0.100), step(0.104), run(0.105, "2 steps; a message (Generate)", 20.0, 0.2), step(0.114),
                        run(0.115, "1 steps; a message (Prepare)", 8.0, 1.5), step(0.118), step(0.122),
                        run(0.123, "2 steps; a row finished", 4.0, 0.5)]}
    rows = gpu.decode_runs_split(trace)
    # the gaps: 0.104 -> 0.114 and 0.114 -> 0.118 (the last run has no next step); the loop passes: 0.105 to the
    # second run's call (0.115 - 8 ms) and 0.115 to the third's (0.123 - 4 ms); the next runs' waits 1.5 and 0.5
    assert rows == [["cold-1024", "3", "2", "a message (Generate) 1; a message (Prepare) 1; a row finished 1", "7.00",
                     "3.00", "1.00"]]


def test_the_stores_disk_jobs_are_counted_by_kind_of_window() -> None:
    def job(kind: str, at: float, took_ms: float) -> dict:
        return {"kind": kind, "ids": [], "at": at, "took_ms": took_ms, "detail": ""}

    trace = {"cold": [{"agent": "cold-1024-r0", "t0": 0.0, "t1": 1.0}, {"agent": "warm-16384-r0", "t0": 2.0, "t1": 2.5}],
             "events": [job("save", 0.5, 40.0), job("save", 0.9, 12.0), job("read", 2.2, 150.0), job("save", 3.0, 9.0)]}
    assert gpu.disk_split(trace) == [["cold-1024", "2", "52", "0", "0", "1000"],
                                     ["warm-16384", "0", "0", "1", "150", "500"]]


def test_a_chunks_time_runs_from_the_previous_unit_of_work_not_from_what_ran_beside_it() -> None:
    from actors.metrics import GpuEvent

    def ev(kind: str, at: float) -> GpuEvent:
        return GpuEvent(kind=kind, request_ids=(1,) if kind in ("admit", "chunk") else (), at=at)

    # a collection, a save and a read ended during the second chunk: it still took 20 ms
    events = [ev("admit", 1.000), ev("chunk", 1.020), ev("gc", 1.025), ev("save", 1.030), ev("read", 1.035),
              ev("chunk", 1.040), ev("run", 1.041)]
    assert gpu._chunk_ms(events, [(0.9, 1.1)]) == pytest.approx(20.0)


def test_a_tiny_geometry_runs_end_to_end_with_each_sizes_warm_up_pair_left_out(tmp_path: Path) -> None:
    """The whole measurement on the CPU under the GPU policy, as a lent device runs it (a bug here would
    cost a GPU session): every goal measured, and each side's samples are the repeats alone, each size's
    first turn (its new shapes) a warm-up that is not one of them."""
    plan = Plan(sizes=(256,), decode_sizes=(256,), decode_tokens=4, restart_size=256, repeats=1, batch=2,
                batch_context=128, batch_tokens=4, profile="gpu")
    run = gpu.run_geometry(gpu.GEOMETRIES["tiny"], plan, tmp_path / "models", tmp_path)
    assert run.error is None
    assert [len(run.mlx[256]), len(run.kvmem[256])] == [1, 1]
    assert "warm-up pairs" in run.phases
    assert all(v.ok is not None for v in gpu.verdicts(run, restart_size=plan.restart_size))
    assert not any(m["agent"].startswith("warm-up") for m in run.trace["cold"])  # nor in the trace's tables
    # each decoding turn on either side and each batch round says which threads ran during it (Linux /proc)
    turns = [row[0] for row in gpu.thread_rows(run.trace)]
    assert {"kvmem cold-256-r0", "mlx-lm cold-256-r0", "kvmem batch round, 2 agents"} <= set(turns)
    assert all(row[5] for row in gpu.thread_rows(run.trace))  # some thread ran in each


def test_a_needle_length_stops_between_needles_when_told_each_run_needle_with_all_its_formats(
        tmp_path: Path) -> None:
    """The GPU check's needle rows run under a time limit: asked before each needle, a stop leaves the rest
    unrun, and every needle that ran has its float answer and its derived at-rest one (so they compare)."""
    from benches.quality import needle, prose
    from conftest import models_dir

    from runtime.model.loaded import load_model
    from runtime.spec import KVFormat

    lm = load_model("tiny-llama", kv_format=KVFormat(bits=4), models_dir=models_dir())
    text = prose.prose()
    ids, ends = lm.tokenize(text)
    hay = needle.Haystack(lm, needle.FORMS[needle.DEFAULT_FORM], 384, (ids, ends, text))
    results: list[tuple[str, int]] = []
    needle.run_length(lm, hay, hay.needles(4, seed=0), needle.cache_kinds(lm)["float"], derived=["q4-at-rest"],
                      tmp=tmp_path, on_result=lambda f, nd, reply, extra: results.append((f, nd.index)),
                      stop=lambda: len(results) >= 4)
    ran = sorted({index for _, index in results})
    assert len(ran) == 2
    assert sorted(results) == sorted((f, i) for f in ("float", "q4-at-rest") for i in ran)


def test_the_needle_table_compares_a_format_cut_short_on_the_needles_it_ran_and_names_the_cut() -> None:
    def row(f: str, i: int, hit: bool) -> dict[str, object]:
        return {"length": 8192, "format": f, "needle": i, "hit": hit, "answer": "x"}

    rows = [row("float", 0, True), row("float", 1, True), row("float", 2, False),
            row("q4-at-rest", 0, True), row("q4-at-rest", 1, True), row("q4-at-rest", 2, False),
            row("q4-native", 0, True)]  # the time limit stopped native after one needle
    body = "\n".join(gpu.render_needles(rows, ["q4-at-rest", "q4-native"], "q4-at-rest", model="m", note=None,
                                        skipped=[], count=3))
    assert "| kvmem Q4 native: float's hits kept | 1/1 |" in body  # not 1/2: needle 1 never ran there
    assert "| kvmem Q4 at-rest (disk): float's hits kept | 2/2 |" in body
    assert "q4-native at L = 8192: 1 of 3." in body and "float at L" not in body
    assert "Item 3: every one of float's hits kept by" in body and "PASS" in body


def test_the_needle_verdict_names_what_each_format_costs_and_fails_a_default_that_lost_a_hit() -> None:
    rows = [{"length": 4096, "format": f, "needle": i, "hit": hit, "answer": ""}
            for i, hits in enumerate([(True, True, True, True), (True, False, True, True)])
            for f, hit in zip(["float", "q4-at-rest", "q8-at-rest", "k8v4-at-rest"], hits, strict=True)]
    body = "\n".join(gpu.render_needles(rows, ["q4-at-rest", "q8-at-rest", "k8v4-at-rest"], "q4-at-rest", model="m",
                                        note=None, skipped=[]))
    assert ("Item 3: every one of float's hits kept by kvmem Q8 at-rest (disk) (1.89x Q4's bytes); kvmem keys Q8, "
            "values Q4 at-rest (disk) (1.44x Q4's bytes). Lost some: kvmem Q4 at-rest (disk) 1 of 2.") in body
    assert "The profile's default (kvmem Q4 at-rest (disk)): **FAIL**." in body


def test_a_suite_run_after_the_bench_goes_into_its_report(tmp_path: Path) -> None:
    """A lent session runs the suite in a call after the bench's: its summary replaces the report's
    placeholder, and nothing else of the report changes."""
    body = gpu.render_body([_run()], PLAN, ["needles"], gpu.suite_lines(None))
    report = tmp_path / "gpu.md"
    report.write_text("# GPU check\n\n" + "\n".join(body) + "\n![gpu](gpu.png)\n\n## Raw runs\n\n```json\n{}\n```\n")
    log = tmp_path / "suite.log"
    log.write_text("....\nFAILED tests/test_a.py::test_b\n==== 1 failed, 1200 passed, 30 skipped in 240.10s ====\n")
    before = report.read_text()
    gpu.main(["--suite-log", str(log), "--into", str(report)])
    after = report.read_text()
    assert "- suite (`suite.log`): `1 failed, 1200 passed, 30 skipped in 240.10s`" in after
    assert "not given" not in after and "not given" in before
    assert [line for line in after.splitlines() if not line.startswith("- suite")] == [
        line for line in before.splitlines() if not line.startswith("- suite")]  # the bench's xdist line too
