"""The catalog of scenarios shipped with kvmem (the files in ``actors/scenario/library/``)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["library_names", "library_text", "resolve_scenario"]


def _folder() -> resources.abc.Traversable:
    return resources.files("actors.scenario").joinpath("library")


def library_names() -> list[str]:
    """Names of the shipped scenarios (file names without ``.yaml``)."""
    return sorted(p.name[: -len(".yaml")] for p in _folder().iterdir() if p.name.endswith(".yaml"))


def library_text(name: str) -> str:
    """The source of shipped scenario ``name``.

    Raises:
        KeyError: no shipped scenario has that name.
    """
    if name not in library_names():
        raise KeyError(name)
    return _folder().joinpath(f"{name}.yaml").read_text(encoding="utf-8")


def resolve_scenario(ref: str) -> tuple[str, str]:
    """``(text, source)`` of a scenario file path or a shipped scenario's name.

    Raises:
        FileNotFoundError: ``ref`` is neither an existing file nor a shipped scenario.
    """
    path = Path(ref)
    if path.is_file():
        return path.read_text(encoding="utf-8"), str(path)
    name = ref[: -len(".yaml")] if ref.endswith(".yaml") else ref
    try:
        return library_text(name), f"library:{name}"
    except KeyError:
        raise FileNotFoundError(
            f"no scenario file {ref!r} and no shipped scenario of that name (shipped: {', '.join(library_names())})"
        ) from None
