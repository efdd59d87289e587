"""The race's must-show ratios (issue 15), computed from one run's medians, each with a pass / fail verdict.

Plain arithmetic on numbers the race measured side by side; it imports
nothing heavy, so it is unit-tested without any server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

KVMEM, LLAMA, LLAMA_SLOTS, MLX_LM = "kvmem", "llama.cpp", "llama.cpp + slot files", "mlx_lm.server"
WARM_CONTEXTS = (1024, 4096, 8192)
RESTART_CONTEXT = 4096
BATCH = 8


@dataclass(frozen=True)
class Goal:
    """One must-show ratio: its measured value (None: not measured in this run) against a bound."""

    what: str
    value: float | None
    bound: float
    at_most: bool  # True: passes when value <= bound; False: when value >= bound
    how: str  # the numbers the ratio comes from

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "not measured in this run"
        ok = self.value <= self.bound if self.at_most else self.value >= self.bound
        return "**pass**" if ok else "**FAIL**"

    def row(self) -> list[str]:
        goal = f"{'≤' if self.at_most else '≥'} {self.bound:g}"
        value = "—" if self.value is None else f"{self.value:.2f}"
        return [self.what, goal, value, self.verdict, self.how]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def race_goals(after_ms: Mapping[tuple[str, int], float], hot_ms: Mapping[tuple[str, int], float],
               summed_s: Mapping[str, float], batched_tps: Mapping[int, float] | None = None) -> list[Goal]:
    """The must-show goals.

    Args:
        after_ms: median user-facing TTFT after a restart per (server, context):
            the first request once the restarted server is ready, slot restore included.
        hot_ms: median hot TTFT per (server, context).
        summed_s: summed TTFT of the 6-agent restart workload per server.
        batched_tps: kvmem's median system tokens/s per number of agents answering at once.
    """
    goals = []
    for c in WARM_CONTEXTS:
        after, hot = after_ms.get((KVMEM, c)), hot_ms.get((KVMEM, c))
        goals.append(Goal(f"kvmem after-restart TTFT / hot TTFT at {c // 1024}K", _ratio(after, hot), 1.1, True,
                          _ms(after, "after restart") + ", " + _ms(hot, "hot")))
    c = RESTART_CONTEXT
    kv, cold, slots = after_ms.get((KVMEM, c)), after_ms.get((LLAMA, c)), after_ms.get((LLAMA_SLOTS, c))
    goals += [
        Goal(f"after a restart at {c // 1024}K: llama.cpp without slot files / kvmem (TTFT)", _ratio(cold, kv), 20,
             False, _ms(cold, LLAMA) + ", " + _ms(kv, KVMEM)),
        Goal(f"after a restart at {c // 1024}K: kvmem / llama.cpp restoring its slot file (TTFT, restore included)",
             _ratio(kv, slots), 1.5, True, _ms(kv, KVMEM) + ", " + _ms(slots, LLAMA_SLOTS)),
    ]
    kv_s, llama_s, mlx_s = summed_s.get(KVMEM), summed_s.get(LLAMA), summed_s.get(MLX_LM)
    goals += [
        Goal("multi-agent restart workload: kvmem / llama.cpp built-in (summed TTFT)", _ratio(kv_s, llama_s), 0.5,
             True, _s(kv_s, KVMEM) + ", " + _s(llama_s, LLAMA)),
        Goal("multi-agent restart workload: mlx_lm.server / kvmem (summed TTFT)", _ratio(mlx_s, kv_s), 4, False,
             _s(mlx_s, MLX_LM) + ", " + _s(kv_s, KVMEM)),
    ]
    tps = batched_tps or {}
    eight, one = tps.get(BATCH), tps.get(1)
    goals.append(Goal(f"kvmem: system tokens/s of {BATCH} agents at once / of one", _ratio(eight, one), 3.5, False,
                      _tps(eight, f"{BATCH} agents") + ", " + _tps(one, "1 agent")))
    return goals


def _tps(value: float | None, label: str) -> str:
    return f"{label} {'—' if value is None else f'{value:.1f} tok/s'}"


def _ms(value: float | None, label: str) -> str:
    return f"{label} {'—' if value is None else f'{value:.0f} ms'}"


def _s(value: float | None, label: str) -> str:
    return f"{label} {'—' if value is None else f'{value:.1f} s'}"
