"""Multi-phase, multi-agent scenarios whose agents carry their KV cache from phase to phase.

* :mod:`actors.scenario.spec` — the YAML format (msgspec structs) and its validation;
* :mod:`actors.scenario.prompts` — prompts rendered from one agent's perspective, with visibility;
* :mod:`actors.scenario.runner` — runs a scenario through the in-process runtime (and the cold replay);
* :mod:`actors.scenario.state` — the run state saved after every turn (``resume``);
* :mod:`actors.scenario.report` — transcripts (full, public, per agent) and the working-memory report;
* :mod:`actors.scenario.service` — runs in the background for the HTTP routes;
* :mod:`actors.scenario.catalog` — the shipped scenarios.

Importing this package pulls in neither MLX nor trio; the runner needs a
:class:`actors.supervisor.Runtime` (``open_runtime``).
"""

from __future__ import annotations

from actors.scenario.spec import ScenarioError, ScenarioSpec, load_scenario

__all__ = ["ScenarioError", "ScenarioSpec", "load_scenario"]
