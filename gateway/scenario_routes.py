"""HTTP routes for scenarios: ``GET /v1/scenarios``, ``POST /v1/scenarios`` and ``GET /v1/scenarios/{id}``.

``GET /v1/scenarios`` lists the shipped scenarios and the runs kept under the home,
newest first (the operator page's scenarios panel)::

    -> 200 {"library": [{"name": "gossip", "title": "Gossip Network", "phases": 3, "agents": 4}, ...],
            "runs": [{"id": "...", "scenario": "gossip", "title": ..., "status": "done",
                      "started_at": ..., "finished_at": ..., "turns_done": 12}, ...]}

``POST /v1/scenarios`` starts a run in the background and answers ``202``::

    {"name": "gossip"}                     a shipped scenario, or
    {"yaml": "name: ...\\nagents: ..."}     a scenario file's text, or
    {"resume": "<run id>"}                 continue a stopped or interrupted run
    optional: "max_tokens", "temperature", "compare_cold", "fresh", "stop_after", "model"

    -> 202 {"id": "...", "status": "running", "scenario": "gossip", "url": "/v1/scenarios/<id>"}

An invalid scenario is a ``400`` whose ``error.problems`` name each problem; a
second run of a scenario that is still running is a ``409`` (the runs would
share the permanent agents' caches).

``GET /v1/scenarios/{id}[?view=public|full|<agent>]`` describes a run: status,
progress per phase, every turn's cache statistics (no text), the working-memory
report, and the transcript of one view — by default ``public`` (only phases
marked public: a private phase never appears there); ``<agent>`` shows what
that agent may see; ``full`` is the operator's view.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from actors.scenario.catalog import library_names, library_text
from actors.scenario.service import RunConflictError, RunNotFoundError, ScenarioService
from actors.scenario.spec import ScenarioError, load_scenario
from gateway.context import decode_body
from gateway.errors import ApiError

if TYPE_CHECKING:
    from actors.supervisor import Runtime

__all__ = ["scenario_routes", "ScenarioRequest"]


class ScenarioRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/scenarios`` (exactly one of ``name``, ``yaml``, ``resume``)."""

    name: str | None = None
    yaml: Annotated[str, msgspec.Meta(max_length=1_000_000)] | None = None
    resume: str | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=8192)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    compare_cold: bool = False
    fresh: bool = False
    stop_after: str | None = None
    model: str | None = None


_decoder = msgspec.json.Decoder(ScenarioRequest)


def _error(status: int, kind: str, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message, **extra}}, status_code=status)


MAX_LISTED_RUNS = 50
"""``GET /v1/scenarios`` lists this many runs at most (the newest)."""


def _library() -> list[dict[str, Any]]:
    entries = []
    for name in library_names():
        try:
            spec = load_scenario(library_text(name), source=f"library:{name}")
        except ScenarioError:
            continue  # a broken shipped file is the tests' business, not the listing's
        entries.append({"name": name, "title": spec.title, "phases": len(spec.phases), "agents": len(spec.agents)})
    return entries


def _newest_folders(root: Path) -> list[str]:
    """The names of the newest run folders under ``root`` (on a worker thread: a directory scan)."""
    found: list[tuple[float, str]] = []
    try:
        for entry in root.iterdir():
            try:
                if entry.is_dir():
                    found.append((entry.stat().st_mtime, entry.name))
            except OSError:
                continue  # removed meanwhile
    except OSError:
        return []
    return [name for _, name in sorted(found, reverse=True)[:MAX_LISTED_RUNS]]


def _runs(service: ScenarioService, folders: list[str]) -> list[dict[str, Any]]:
    runs = []
    for folder in folders:
        try:
            state = service.load(folder)  # the live state for a run under way here
        except RunNotFoundError:
            continue  # not a run (or not yet written)
        runs.append({"id": state.run_id, "scenario": state.scenario, "title": state.title, "status": state.status,
                     "started_at": state.started_at, "finished_at": state.finished_at,
                     "turns_done": len(state.turns)})
    return runs


def scenario_routes(rt: Runtime, *, home: Path, nursery: trio.Nursery | None = None) -> list[BaseRoute]:
    """The scenario routes, bound to runtime ``rt``; runs are kept under ``home/scenarios``.

    Args:
        nursery: where background runs execute (None: the service opens its own,
            see :mod:`actors.scenario.service`).
    """
    service = ScenarioService(rt, home=home, nursery=nursery)
    library = _library()

    async def listing(request: Request) -> JSONResponse:
        """The shipped scenarios and the newest runs."""
        runs = _runs(service, await trio.to_thread.run_sync(_newest_folders, service.root))
        return JSONResponse({"library": library, "runs": runs})

    async def create(request: Request) -> JSONResponse:
        try:
            body = decode_body(await request.body(), _decoder)
        except ApiError as exc:  # malformed, too deeply nested, not UTF-8, or not the schema
            return _error(exc.status, exc.kind, exc.message)
        given = [k for k in ("name", "yaml", "resume") if getattr(body, k) is not None]
        if len(given) != 1:
            return _error(400, "invalid_request", "give exactly one of 'name', 'yaml' or 'resume'")
        try:
            if body.resume is not None:
                state = await service.resume(
                    body.resume, compare_cold=body.compare_cold or None, stop_after=body.stop_after
                )
            else:
                if body.name is not None:
                    if body.name not in library_names():
                        return _error(
                            404,
                            "not_found",
                            f"no shipped scenario {body.name!r} (shipped: {', '.join(library_names())})",
                        )
                    text, source = library_text(body.name), f"library:{body.name}"
                else:
                    assert body.yaml is not None
                    text, source = body.yaml, "request"
                state = await service.start(
                    text,
                    source=source,
                    max_tokens=body.max_tokens,
                    temperature=body.temperature,
                    compare_cold=body.compare_cold,
                    fresh=body.fresh,
                    stop_after=body.stop_after,
                    model=body.model,
                )
        except ScenarioError as exc:
            return _error(400, "invalid_scenario", str(exc), problems=exc.problems)
        except RunNotFoundError:
            return _error(404, "not_found", f"no scenario run {body.resume!r}")
        except RunConflictError as exc:
            return _error(409, "conflict", str(exc))
        return JSONResponse(
            {
                "id": state.run_id,
                "status": state.status,
                "scenario": state.scenario,
                "url": f"/v1/scenarios/{state.run_id}",
            },
            status_code=202,
        )

    async def describe(request: Request) -> JSONResponse:
        run_id = request.path_params["run_id"]
        view = request.query_params.get("view", "public")
        try:
            return JSONResponse(service.describe(run_id, view=view))
        except RunNotFoundError:
            return _error(404, "not_found", f"no scenario run {run_id!r}")
        except ValueError as exc:
            return _error(400, "invalid_request", str(exc))

    routes: list[BaseRoute] = [
        Route("/v1/scenarios", listing, methods=["GET"]),
        Route("/v1/scenarios", create, methods=["POST"]),
        Route("/v1/scenarios/{run_id}", describe, methods=["GET"]),
    ]
    return routes
