"""The race's pure parts: its must-show verdicts and sizing a text in any tokenizer (no servers, no MLX)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benches/ is not an installed package
from benches.prompts import sized_text
from benches.peers.race_goals import KVMEM, LLAMA, LLAMA_SLOTS, MLX_LM, race_goals


def _verdicts(after: dict[tuple[str, int], float], hot: dict[tuple[str, int], float],
              summed: dict[str, float]) -> dict[str, str]:
    return {g.what: g.verdict for g in race_goals(after, hot, summed)}


def test_goals_pass_at_their_bounds_and_fail_past_them() -> None:
    hot = {(KVMEM, c): 100.0 for c in (1024, 4096, 8192)}
    after = {(KVMEM, 1024): 110.0, (KVMEM, 4096): 111.0, (KVMEM, 8192): 90.0,
             (LLAMA, 4096): 20 * 111.0, (LLAMA_SLOTS, 4096): 111.0 / 1.5}
    summed = {KVMEM: 50.0, LLAMA: 100.0, MLX_LM: 199.0}
    goals = {g.what: g for g in race_goals(after, hot, summed)}
    verdicts = {what: g.verdict for what, g in goals.items()}
    assert verdicts["kvmem after-restart TTFT / hot TTFT at 1K"] == "**pass**"  # 1.1 exactly
    assert verdicts["kvmem after-restart TTFT / hot TTFT at 4K"] == "**FAIL**"  # 1.11
    assert verdicts["kvmem after-restart TTFT / hot TTFT at 8K"] == "**pass**"
    restart = [g for what, g in goals.items() if what.startswith("after a restart at 4K")]
    assert [g.verdict for g in restart] == ["**pass**", "**pass**"]  # 20x and 1.5x exactly
    multi = [g for what, g in goals.items() if what.startswith("multi-agent")]
    assert [round(g.value or 0, 3) for g in multi] == [0.5, 3.98]
    assert [g.verdict for g in multi] == ["**pass**", "**FAIL**"]


def test_the_batching_goal_is_eight_agents_system_rate_over_one() -> None:
    def verdict(eight: float) -> str:
        (goal,) = [g for g in race_goals({}, {}, {}, {1: 10.0, 8: eight}) if "agents at once" in g.what]
        return goal.verdict

    assert verdict(35.0) == "**pass**" and verdict(34.9) == "**FAIL**"


def test_goals_not_measured_when_the_run_left_them_out() -> None:
    verdicts = _verdicts({(KVMEM, 1024): 120.0}, {(KVMEM, 1024): 100.0}, {})
    assert verdicts.pop("kvmem after-restart TTFT / hot TTFT at 1K") == "**FAIL**"
    assert set(verdicts.values()) == {"not measured in this run"}


def test_sized_text_is_the_longest_word_cut_within_the_count() -> None:
    def words(text: str) -> int:
        return len(text.split())

    for tokens in (50, 333):
        text = sized_text(words, tokens, label="a", offset=123)
        assert words(text) == tokens
        assert text.startswith("Session a.")
    assert sized_text(words, 200, label="b") != sized_text(words, 200, label="b", offset=7)
