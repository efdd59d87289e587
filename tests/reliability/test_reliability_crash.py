"""A small version of ``benches/reliability/crash.py``: ``kill -9`` a real ``kvmem serve`` mid-write, restart, verify.

After each kill and restart: no temporary file survives startup, every stored cache loads and
verifies (all checksums) or is a miss, and no durable turn (response received AND its save seen
complete through ``GET /v1/agents/{id}``) is lost. The benchmark runs 50 trials.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from conftest import models_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benches/ is not an installed package
from benches.reliability.crash import run_trials


def test_kill_9_during_saves_loses_no_durable_turn(tmp_path: Path) -> None:
    os.environ.setdefault("KVMEM_HOME", str(models_dir().parent))
    out = run_trials(2, cache_dir=tmp_path / "cache", agents=3, save_window_s=0.05, seed=7,
                     time_limit_s=50)
    print(out)
    assert out.kills == 2 and out.turns_durable >= 1
    assert out.durable_lost == [] and out.load_failures == []
    assert out.temp_files_after_startup == 0
    assert out.agents_verified + out.agents_missed == out.agents_checked and out.durable_checked >= 1
