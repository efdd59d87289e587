"""kvmem installed as a user installs it, not run from the checkout (issue 59, item 3).

``python -m build`` makes the sdist and the wheel as a release would (no build isolation: the dev extra
brings ``build`` and a setuptools that reads ``project.license`` as an SPDX string, so no deprecation
warning); the wheel is then installed into a folder of its own (``pip install --no-deps --target``: the
dependencies are this environment's) and its ``kvmem`` runs from a directory outside the checkout, the
checkout off ``sys.path``. What it catches: a module or a data file (the operator page, the corpora,
the scenario library) the package leaves out, a console script that does not start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import models_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir",
                            str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert "deprecat" not in (built.stdout + built.stderr).lower(), built.stderr[-3000:]
    return out


def test_the_wheel_and_sdist_carry_every_module_and_data_file(dist: Path) -> None:
    wheel = next(dist.glob("kvmem-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("gateway/ui/index.html", "gateway/ui/app.js", "runtime/corpus/essays.txt",
                   "actors/scenario/library/gossip.yaml", "gateway/cli.py", "runtime/model/gguf.py"):
        assert needed in names, needed
    assert any(n.endswith("entry_points.txt") for n in names)
    sdist = next(dist.glob("kvmem-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    assert {"pyproject.toml", "README.md", "gateway/ui/app.js", "runtime/corpus/essays.txt"} <= members


def test_the_installed_kvmem_chats_on_the_default_model_outside_the_checkout(dist: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    wheel = next(dist.glob("kvmem-*.whl"))
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                                "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    script = target / "bin" / "kvmem"
    assert script.is_file()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    env.update(PYTHONPATH=str(target), PYTHONSAFEPATH="1", KVMEM_HOME=str(tmp_path / "home"),
               KVMEM_MODELS_DIR=str(models_dir()), KVMEM_PREWARM_MB="0")
    where = subprocess.run([sys.executable, "-c", "import gateway, sys; print(gateway.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip().startswith(str(target)), where.stdout + where.stderr  # the wheel's, not the checkout's
    version = subprocess.run([sys.executable, str(script), "--version"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("kvmem "), version.stderr
    chat = subprocess.run([sys.executable, str(script), "chat", "--agent", "installed", "--max-tokens", "4",
                           "Say hello."], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert "[installed] tier=cold" in chat.stderr + chat.stdout, chat.stdout + chat.stderr
