"""ARCHITECTURE.md's table of where each decision is made stays true of the code.

Every module a row names exists, every name it quotes is defined in the code, and the
places a decision moved out of no longer make it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE = [p for room in ("actors", "runtime", "gateway") for p in (ROOT / room).rglob("*.py")]


def _decision_rows() -> list[tuple[str, str]]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    table = text.split("## Each decision, made once", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("decision", "--"):
            rows.append((cells[0], cells[1]))
    return rows


ROWS = _decision_rows()


def _defined(name: str, source: str) -> bool:
    last = name.split(".")[-1]
    return re.search(rf"(def|class)\s+{re.escape(last)}\b|\b{re.escape(last)}\s*(:|=|\()", source) is not None


def test_the_table_has_the_decisions_this_house_makes_once() -> None:
    assert len(ROWS) >= 12
    where = " ".join(w for _, w in ROWS)
    for module in ("runtime/plan/kv_manager.py", "runtime/plan/scheduler.py", "runtime/plan/save_queue.py", "runtime/identity.py",
                   "runtime/backend.py", "runtime/config.py"):
        assert module in where


@pytest.mark.parametrize(("decision", "where"), ROWS, ids=[d[:40] for d, _ in ROWS])
def test_each_place_the_table_names_exists_in_the_code(decision: str, where: str) -> None:
    quoted = re.findall(r"`([^`]+)`", where)
    modules = [q for q in quoted if q.endswith(".py") or q.endswith("/")]
    assert modules, f"{decision!r} names no module"
    for module in modules:
        assert (ROOT / module).exists(), f"{decision!r}: {module} does not exist"
    everything = "\n".join(p.read_text() for p in CODE)
    for name in quoted:
        if name in modules or not re.fullmatch(r"[A-Za-z_][\w.]*", name):
            continue  # a path, or not a name (`<tenant>`, `at-rest`)
        assert _defined(name, everything), f"{decision!r}: `{name}` is not defined anywhere in the code"


def test_the_places_a_decision_moved_out_of_no_longer_make_it() -> None:
    gpu = (ROOT / "actors/gpu.py").read_text()
    assert "JOIN_AHEAD_TOKENS" not in gpu and ".adopt(" not in gpu and "wants_donor(" not in gpu
    store = (ROOT / "actors/cache_store.py").read_text()
    assert "retry_at =" not in store and "_waiters" not in store
    sequence = (ROOT / "runtime/execution/sequence.py").read_text()
    assert "match_prefix" not in sequence  # the one matcher is runtime/plan/kv_manager.py's own_plan
    agent = (ROOT / "actors/agent.py").read_text()
    # One GPU request a turn, and one a forget (the GPU actor holds the hot caches, and forwards it to the store).
    assert "Render(" not in agent and len(re.findall(r"ask\(\s*self\._gpu", agent)) == 2 and "self._store" not in agent


# The structs that may carry a turn's token counts (issue 60, item 3), each for its own concept: a new record
# that copies them fails here, and nests the usage instead (``usage: TurnUsage``, or the engine's ``TurnStats``).
TOKEN_COUNTS = {
    # a turn's usage: counted by the engine, reported once finished, and its part known before the first token
    "TurnStats": "usage", "TurnUsage": "usage", "TurnStarted": "usage",
    "RunningTurn": "progress",  # a turn in flight: how far its prefill and reply got (the page, /v1/agents)
    "_InFlight": "plan",  # the KV manager's: where a turn in flight's cache begins, for its donor decisions
    "MetricsSnapshot": "sums", "PhaseFinished": "sums",  # totals over many turns: the process's, a scenario phase's
}


def test_a_turns_token_counts_live_in_three_records_and_every_other_nests_them() -> None:
    import ast

    counts = {"tokens_reused", "tokens_prefilled", "tokens_generated"}
    carriers: dict[str, str] = {}
    for path in CODE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id in counts
                    for st in node.body):
                carriers[node.name] = str(path.relative_to(ROOT))
    assert set(carriers) == set(TOKEN_COUNTS), (
        f"structs carrying a turn's token counts: {carriers}; a record of a turn nests TurnUsage instead")
    assert sum(kind == "usage" for kind in TOKEN_COUNTS.values()) <= 3
