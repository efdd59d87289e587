"""Layering rules (STYLE.md item 2): runtime/ never imports trio; data flows gateway → actors → runtime.

Checked on the source (imports written in each module), since third-party
packages may pull in anything transitively (mlx-lm's dependencies load trio);
and, for MLX, in a fresh process: importing any module of ``actors`` or
``gateway`` must not load it, through whatever those modules import.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


FORBIDDEN = {
    "runtime": {"trio", "actors", "gateway", "starlette", "hypercorn"},
    "actors": {"gateway", "starlette", "hypercorn", "mlx", "mlx_lm"},
    "gateway": {"mlx", "mlx_lm"},
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_downstream(package):
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_actors_and_gateway_import_no_mlx_directly_or_at_start_up():
    """Every module of ``actors`` and ``gateway`` imported in a fresh process leaves MLX unloaded.

    MLX work lives in ``runtime`` (the engine, models, caches) and is imported on
    the GPU actor's thread when a runtime starts, never when the HTTP layer or an
    orchestrator merely imports kvmem.
    """
    code = (
        "import importlib, pkgutil, sys\n"
        "import actors, gateway\n"
        "names = [info.name for pkg in (actors, gateway)\n"
        "         for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "    if 'mlx' in sys.modules or 'mlx_lm' in sys.modules:\n"
        "        print(name)\n"
        "        break\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.strip() == "", f"importing {out.stdout.strip()} loads mlx"


PLAIN_PACKAGES = ("runtime.plan", "runtime.persist")
"""Rooms of plain Python: the pure plan and pools (policy apart from mechanism, STYLE.md item 1),
and the cache directory (tools that only read caches neither pay for MLX nor need it installed)."""


def _plain_modules() -> list[str]:
    """Every module of the plain rooms, and every module at the top of ``runtime/``.

    By the package they live in, not by a list: ``runtime/``'s top level holds only what every
    room reads (settings, the home folder, ids, errors, the KV geometry, the backend policy,
    OpenBLAS and the allocator's settings); MLX code lives in its rooms (kv, model, reply,
    execution, cpu, distributed).
    """
    top = [f"runtime.{p.stem}" for p in sorted((ROOT / "runtime").glob("*.py")) if p.stem != "__init__"]
    rooms = [
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for package in PLAIN_PACKAGES
        for p in sorted((ROOT / package.replace(".", "/")).rglob("*.py"))
    ]
    return top + rooms


PLAIN_MODULES = _plain_modules()
"""Modules that import neither trio nor mlx (``import runtime`` loads OpenBLAS, a shared library: fine)."""


def test_the_plain_rooms_hold_the_policy_modules():
    for module in ("runtime.plan.kv_manager", "runtime.plan.scheduler", "runtime.plan.save_queue",
                   "runtime.plan.block_pool", "runtime.plan.turn_plan", "runtime.plan.sampling",
                   "runtime.plan.tools", "runtime.plan.engine", "runtime.plan.hot_tier", "runtime.config", "runtime.identity",
                   "runtime.spec", "runtime.backend", "runtime.persist.directory"):
        assert module in PLAIN_MODULES


@pytest.mark.parametrize("module", PLAIN_MODULES)
def test_plain_modules_import_neither_trio_nor_mlx(module):
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('trio', 'mlx', 'mlx_lm'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_a_file_checksum_is_computed_in_one_module() -> None:
    """Issue 60: a change of the on-disk checksum touches at most two modules: the codec, which computes every
    file's data checksum (XXH3; CRC-32 for format 3) and header SHA-256, and the format, whose version says which
    a file records. Everything else (the load, the save's pieces, the shared tier) calls the codec."""
    root = Path(__file__).resolve().parents[2]
    computing = sorted(str(p.relative_to(root)) for p in (root / "runtime" / "persist").rglob("*.py")
                       if re.search(r"\bimport xxhash\b|\bcrc32\(|\bxxh3_|hashlib\.sha256\(header|\bheader_sha256\s*=",
                                    p.read_text()))
    assert computing == ["runtime/persist/codec.py"], computing


def test_no_class_name_is_defined_twice() -> None:
    """One name per concept (issue 60, item 3): a reader who meets ``Turn`` or ``Step`` knows which it is."""
    where: dict[str, list[str]] = {}
    for room in ("actors", "runtime", "gateway", "benches"):
        for path in sorted((ROOT / room).rglob("*.py")):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
