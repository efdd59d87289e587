"""A small version of ``benches/reliability/load.py``: 8 agents x 3 turns at once over HTTP, no errors, no cross-talk.

Agents mix Anthropic and OpenAI endpoints, streaming and not. Each agent's replies must equal its
reference: the same conversation run alone on the same server first (see ``benches.reliability.load``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio
from conftest import models_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benches/ is not an installed package
from benches.reliability.load import mismatches, reference, run_load, summary
from gateway.testing import ServerThread
from runtime.config import Config


def test_eight_concurrent_agents_get_their_own_replies(tmp_path: Path) -> None:
    config = Config(model="tiny-llama", port=0, home=str(models_dir().parent), cache_dir=str(tmp_path),
                         budget_mb=128, hot_budget_mb=32, graceful_timeout_s=2)
    with ServerThread(config) as server:
        ref = trio.run(lambda: reference(server.url, 8, 3, max_tokens=8))
        load = trio.run(lambda: run_load(server.url, 8, 3, max_tokens=8))
    stats = summary(load)
    print(stats)
    assert load.errors == []
    assert stats["requests"] == 24
    assert mismatches(load, ref) == []
    assert {t.flavor for t in load.turns} == {"anthropic", "openai"} and {t.stream for t in load.turns} == {True, False}
    # distinct agents got distinct conversations (the check above is not vacuous)
    assert len({tuple(r) for r in ref.values()}) == 8
