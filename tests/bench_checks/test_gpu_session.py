"""``benches/gpu_session.sh`` runs on a lent GPU only, in one prepared call with minutes to spare: a flag a bench
no longer takes, or a test file that moved, would cost that run. Every bench command the script runs is parsed
here by the bench's own parser (nothing runs), and every test path it names exists."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from benches.__main__ import module_of

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benches" / "gpu_session.sh"


def _lines() -> list[str]:
    """The script's commands, continuation lines joined, comments left out."""
    return [line.strip() for line in SCRIPT.read_text().replace("\\\n", " ").splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _bench_calls() -> list[tuple[str, list[str]]]:
    calls = []
    for line in _lines():
        for match in re.finditer(r"python3 -m benches (\w+)([^>;|&]*)", line):
            args = match.group(2).replace('"$out"', "/tmp/out").replace('"$KVMEM_NEEDLE_GGUF"', "model.gguf")
            calls.append((match.group(1), shlex.split(args)))
    return calls


class _Parsed(Exception):
    """Raised in place of running a bench once its arguments parsed."""


@pytest.mark.parametrize(("name", "argv"), _bench_calls(), ids=lambda value: str(value)[:60])
def test_every_bench_command_of_the_session_parses(name: str, argv: list[str], monkeypatch) -> None:
    parse = argparse.ArgumentParser.parse_args

    def parsed_only(self: argparse.ArgumentParser, args: list[str] | None = None, namespace: object = None) -> None:
        parse(self, args, namespace)  # an unknown flag or a bad value exits here: the test fails with its message
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed_only)
    with pytest.raises(_Parsed):
        module = module_of(name)
        assert module is not None, f"no benchmark {name!r} in any of benches/'s rooms"
        importlib.import_module(module).main(argv)


def test_the_session_runs_the_benches_it_says_and_its_test_paths_exist() -> None:
    assert {name for name, _ in _bench_calls()} == {"gpu", "gpu_probe"}
    paths = {path for line in _lines() if "pytest" in line for path in re.findall(r"tests/\S+\.py", line)}
    assert paths and all((ROOT / path).is_file() for path in paths), paths
