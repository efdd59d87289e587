"""The docs run: every shell and Python block in ``README.md`` and ``docs/*.md``, so they cannot rot.

A fenced block in ``bash``, ``sh``, ``shell``, ``console`` or ``python`` is run, one test per
block named ``page:line``, in the order a reader meets them: the README's, then each page's in
the order they are written, each page in a working folder of its own, all on one kvmem home:
the suite's own (``$KVMEM_HOME``, which ``.ci/test`` sets; its ``models/`` the suite's built
models), as a reader would type them: ``.venv/bin/kvmem`` is this test run's virtual
environment. Shell blocks run under ``bash -euo pipefail`` with ``curl`` failing on an HTTP
error; Python blocks in a fresh interpreter. A reader's chats start fresh: the agents with a
``kvmem chat`` conversation in the home are forgotten before the first block.

The README starts a server in a block of its own (``.venv/bin/kvmem serve --port 8000``, the
default model): that block starts it, as written but on a free port, and it runs on for every
later block, so the README's and the docs' commands and snippets after it run beside it, as
the reader's do (acting through it: ``actors.owner_client``), and the HTTP examples talk to it
(``127.0.0.1:8000`` and ``localhost:8000`` in a block become its address; a block selected alone
that needs it starts it too). Nothing may reach the network (``PIP_NO_INDEX``).
``bash .ci/setup && `` before a command is dropped: the tests run in what ``.ci/setup`` installed.
The last test counts: every block without a skip marker ran and passed.

A block that cannot run here (a server that runs until stopped, two Macs, a Redis cluster, an
installer, a placeholder) carries an HTML comment on the line right above its fence, with its
reason: ``<!-- doc-test: skip (needs two Macs) -->``. Output samples and configuration files
use a fence language that is not run (``text``, ``toml``, ``json``, ``yaml``); TOML, JSON and
YAML blocks must parse. Every fence names its language, and every relative link and anchor in
the pages resolves.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest
import yaml
from conftest import models_dir
from serve_process import ServeProcess, kvmem_serve

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
SHELL = {"bash", "sh", "shell", "console"}
RUNNABLE = SHELL | {"python"}
PARSED = {"toml", "json", "yaml"}
DOCS_ADDRESS = re.compile(r"(?:127\.0\.0\.1|localhost):8000\b")
SERVE_COMMAND = re.compile(r"^\.venv/bin/kvmem serve(?P<args>[^#\n]*?)\s*(?:#.*)?$")
SKIP_MARKER = re.compile(r"<!-- doc-test: skip \((?P<reason>.*\S.*)\) -->")
ANY_MARKER = re.compile(r"^\s*<!--\s*doc-test")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
ALREADY_SET_UP = re.compile(r"^bash \.ci/setup && ", re.M)
BLOCK_TIMEOUT_S = 240
# Shell blocks start with this: an HTTP error fails the block instead of printing quietly.
SHELL_PREAMBLE = 'curl() { command curl --fail-with-body --show-error --max-time 120 "$@"; }\n'


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text, and the skip marker above it."""

    page: Path
    line: int  # the opening fence's line, 1-based
    lang: str
    code: str
    marker: str | None  # the comment line right above the fence, if it is a doc-test marker

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        found = SKIP_MARKER.fullmatch(self.marker.strip()) if self.marker else None
        return found.group("reason").strip() if found else None


def fenced_blocks(page: Path) -> list[Block]:
    """Every fenced block of a Markdown page (CommonMark fences: ``` or ~~~, closed by a longer or equal run)."""
    lines = page.read_text(encoding="utf-8").split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening.group("fence"), len(opening.group("indent"))
        lang = opening.group("info").strip().split(" ")[0] if opening.group("info").strip() else ""
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing.group("fence")[0] == fence[0] and len(closing.group("fence")) >= len(fence) \
                    and not closing.group("info").strip():
                break
            body.append(lines[j][indent:] if lines[j].startswith(" " * indent) else lines[j].lstrip(" "))
            j += 1
        above = lines[i - 1] if i > 0 and ANY_MARKER.search(lines[i - 1]) else None
        blocks.append(Block(page, i + 1, lang, "\n".join(body) + "\n", above))
        i = j + 1
    return blocks


def markers_not_above_a_fence(page: Path) -> list[str]:
    """``page:line`` of every doc-test marker that is not on the line right above a fence."""
    lines = page.read_text(encoding="utf-8").split("\n")
    fence_lines = {b.line for b in fenced_blocks(page)}
    in_fence = _lines_inside_fences(page)
    return [f"{page.relative_to(ROOT)}:{n}" for n, text in enumerate(lines, 1)
            if ANY_MARKER.search(text) and n not in in_fence and n + 1 not in fence_lines]


def _lines_inside_fences(page: Path) -> set[int]:
    inside: set[int] = set()
    for block in fenced_blocks(page):
        inside.update(range(block.line, block.line + block.code.count("\n") + 2))
    return inside


ALL_BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]
RUN_BLOCKS = [block for block in ALL_BLOCKS if block.lang in RUNNABLE]
PARSED_BLOCKS = [block for block in ALL_BLOCKS if block.lang in PARSED]


def _serve_args(block: Block) -> list[str] | None:
    """The arguments of a block that only starts ``kvmem serve`` (None: another block)."""
    lines = [line for line in block.code.splitlines() if line.strip()]
    found = SERVE_COMMAND.match(lines[0].strip()) if len(lines) == 1 and block.lang in SHELL else None
    return found.group("args").split() if found else None


SERVE_BLOCKS = [block for block in RUN_BLOCKS if block.marker is None and _serve_args(block) is not None]
# Where the reader starts the server: every block from here on runs beside it.
SERVER_FROM = RUN_BLOCKS.index(SERVE_BLOCKS[0]) if SERVE_BLOCKS else len(RUN_BLOCKS)
OUTCOMES: dict[str, str] = {}  # block name -> "passed", or why it was skipped (the count at the end)


def docs_home() -> Path:
    """The suite's own kvmem home (``$KVMEM_HOME``, as ``.ci/test`` sets it), where the built models are."""
    return models_dir().parent


def _clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    venv_bin = str(Path(sys.executable).parent)
    return {**env, "KVMEM_HOME": str(home), "PATH": venv_bin + os.pathsep + env.get("PATH", ""),
            "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass
class PageFolder:
    """Where one page's blocks run: a working folder with ``.venv`` linked in, and the environment (the home)."""

    cwd: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def page_folders() -> dict[Path, PageFolder]:
    """One folder per page, made when the page's first block runs (a dict filled by :func:`page_folder`)."""
    return {}


@pytest.fixture
def page_folder(request: pytest.FixtureRequest, page_folders: dict[Path, PageFolder],
                tmp_path_factory: pytest.TempPathFactory) -> PageFolder:
    block: Block = request.node.callspec.params["block"]
    if block.page not in page_folders:
        cwd = tmp_path_factory.mktemp(block.page.stem)
        (cwd / ".venv").symlink_to(sys.prefix, target_is_directory=True)
        page_folders[block.page] = PageFolder(cwd, _clean_env(docs_home()))
    return page_folders[block.page]


@pytest.fixture(scope="module")
def fresh_chats() -> None:
    """Forget every agent with a ``kvmem chat`` conversation in the home, as a reader's first chat finds none."""
    conversations = docs_home() / "conversations"
    for path in sorted(conversations.glob("*.json")) if conversations.is_dir() else ():
        agent = str(json.loads(path.read_text(encoding="utf-8")).get("agent", path.stem))
        forgot = subprocess.run([sys.executable, "-m", "gateway.cli", "forget", agent], cwd=ROOT, text=True,
                                capture_output=True, env=_clean_env(docs_home()), timeout=BLOCK_TIMEOUT_S)
        assert forgot.returncode == 0, forgot.stderr


@pytest.fixture(scope="module")
def docs_server() -> Iterator[ServeProcess]:
    """The README's ``kvmem serve``, as it is written but on a free port, on the suite's home; stopped once this
    file's tests are done (it holds the home: the suite's other files must find it free)."""
    assert SERVE_BLOCKS, "the README starts a server in a block of its own: .venv/bin/kvmem serve --port 8000"
    args = _serve_args(SERVE_BLOCKS[0])
    assert args is not None
    args = ["0" if a == "8000" and i and args[i - 1] == "--port" else a for i, a in enumerate(args)]
    with kvmem_serve(*args, env=_clean_env(docs_home())) as server:
        yield server


def _skip_without_default_model(block: Block) -> None:
    from runtime.model.default_model import default_model_file
    from runtime.errors import ModelError

    try:
        default_model_file()
    except ModelError as exc:
        _skip(block, f"the default model is not installed: {exc}")


def _console_commands(code: str) -> str:
    """A ``console`` block's commands: its ``$ `` lines (the rest is output)."""
    return "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ ")) + "\n"


def _run(argv: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run a block in its own process group, and leave nothing of it running (a stray ``&``)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running after {BLOCK_TIMEOUT_S} s\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _skip(block: Block, reason: str) -> NoReturn:
    """Skip ``block``'s test, and say why in the count (:func:`test_every_block_without_a_marker_ran_and_passed`)."""
    OUTCOMES[block.name] = reason
    pytest.skip(f"{block.name}: {reason}")


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.name for b in RUN_BLOCKS])
def test_the_block_runs(block: Block, page_folder: PageFolder, fresh_chats: None,
                        request: pytest.FixtureRequest) -> None:
    OUTCOMES[block.name] = "failed"  # until it passes or is skipped
    if block.marker is not None:
        reason = block.skip_reason
        assert reason, f"{block.name}: a doc-test marker must read <!-- doc-test: skip (reason) -->: {block.marker}"
        _skip(block, f"marked: {reason}")
    code = _console_commands(block.code) if block.lang == "console" else block.code
    code = ALREADY_SET_UP.sub("", code)
    _skip_without_default_model(block)  # the README's server and its chats run it
    if ".venv/bin/kvmem" in code and not (Path(sys.prefix) / "bin" / "kvmem").exists():
        # A checkout on PYTHONPATH (a lent GPU machine) has no console script: the blocks are the install's.
        _skip(block, f"no kvmem console script in {sys.prefix} (kvmem is not pip-installed here)")
    if block in SERVE_BLOCKS or RUN_BLOCKS.index(block) > SERVER_FROM or DOCS_ADDRESS.search(code):
        server: ServeProcess = request.getfixturevalue("docs_server")
        assert server.process is not None and server.process.poll() is None, "the README's server stopped"
        if block in SERVE_BLOCKS:  # the server it starts is the one running (another needs a skip marker)
            assert _serve_args(block) == _serve_args(SERVE_BLOCKS[0]), f"{block.name} starts another server"
            OUTCOMES[block.name] = "passed"
            return  # it serves from here on
        code = DOCS_ADDRESS.sub(server.url.removeprefix("http://"), code)
    name = re.sub(r"\W", "_", block.name)
    if block.lang in SHELL:
        script = page_folder.cwd / f"{name}.sh"
        script.write_text(SHELL_PREAMBLE + code, encoding="utf-8")
        argv = ["bash", "-euo", "pipefail", str(script)]
    else:
        script = page_folder.cwd / f"{name}.py"
        script.write_text(code, encoding="utf-8")
        argv = [sys.executable, str(script)]
    result = _run(argv, cwd=page_folder.cwd, env=page_folder.env)
    assert result.returncode == 0, (
        f"{block.name} ({block.lang}) exited with {result.returncode}\n--- block\n{code}"
        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    )
    OUTCOMES[block.name] = "passed"


def test_every_block_without_a_marker_ran_and_passed() -> None:
    """The count: of the runnable blocks, those with a skip marker (a reason in the page) were skipped,
    and every other one ran and passed (run after them; only when they were all selected)."""
    if set(OUTCOMES) != {b.name for b in RUN_BLOCKS}:
        pytest.skip(f"{len(OUTCOMES)} of the {len(RUN_BLOCKS)} blocks ran in this session (selected with -k?)")
    marked = [b.name for b in RUN_BLOCKS if b.marker is not None]
    not_run = {name: why for name, why in OUTCOMES.items() if why != "passed" and name not in marked}
    assert not not_run, f"blocks skipped without a reason in their page: {not_run}"
    assert sum(why == "passed" for why in OUTCOMES.values()) == len(RUN_BLOCKS) - len(marked)


@pytest.mark.parametrize("block", PARSED_BLOCKS, ids=[b.name for b in PARSED_BLOCKS])
def test_a_configuration_block_parses(block: Block) -> None:
    match block.lang:
        case "toml":
            tomllib.loads(block.code)
        case "json":
            json.loads(block.code)
        case "yaml":
            yaml.safe_load(block.code)


def test_every_fence_names_its_language_and_every_marker_sits_on_a_runnable_block() -> None:
    unnamed = [b.name for b in ALL_BLOCKS if not b.lang]
    assert not unnamed, f"fences without a language (text for output, bash or python to run): {unnamed}"
    misplaced = [m for page in PAGES for m in markers_not_above_a_fence(page)]
    assert not misplaced, f"doc-test markers not on the line right above a fence: {misplaced}"
    stray = [b.name for b in ALL_BLOCKS if b.marker is not None and b.lang not in RUNNABLE]
    assert not stray, f"skip markers on blocks that never run (drop the marker): {stray}"
    unreasoned = [b.name for b in ALL_BLOCKS if b.marker is not None and not b.skip_reason]
    assert not unreasoned, f"skip markers without a reason, <!-- doc-test: skip (reason) -->: {unreasoned}"


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_the_readme_shows_the_test_command_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = re.search(r"^exec (.+)$", ci, re.M)
    assert command, ".ci/run execs the README's test command"
    readme_commands = [b.code.strip() for b in fenced_blocks(ROOT / "README.md") if b.lang in SHELL]
    assert command.group(1).strip() in readme_commands


def test_the_readme_links_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme]
    assert not missing, f"docs pages the README's table does not link: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    inside = _lines_inside_fences(page)
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    for n, line in enumerate(page.read_text(encoding="utf-8").split("\n"), 1):
        heading = re.match(r"^#{1,6} +(.+?)#*\s*$", line)
        if heading and n not in inside:
            slug = _slug(heading.group(1))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(page: Path) -> Iterator[tuple[int, str]]:
    inside = _lines_inside_fences(page)
    for n, line in enumerate(page.read_text(encoding="utf-8").split("\n"), 1):
        if n in inside:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            yield n, target


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in PAGES:
        for n, target in _links(page):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}:{n}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)
