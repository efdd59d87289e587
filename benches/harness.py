"""Shared harness for kvmem's benchmarks: provenance, medians, result files, plots.

Every benchmark module exposes ``main(argv)`` and writes
``benches/results/<name>[_quick].md`` (and a PNG where a curve says more)
through :class:`ResultFile`, which records what a reader needs to trust or
reproduce a number: the command, the git revision, package versions, the
machine (cores, memory, BLAS), the model's geometry, the 1-minute load average
before and after the run, and the raw per-run numbers behind every median.

This module imports neither mlx nor trio at import time, so ``python -m benches``
can list the benchmarks instantly; benchmarks import ``runtime`` first (it loads
OpenBLAS before mlx).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
SHARED = ROOT.parent / "shared"
#: KVMEM_HOME for bench runs: models are built here once and reused; caches go to per-run temp folders.
BENCH_HOME = Path(os.environ.get("KVMEM_BENCH_HOME", "/tmp/kvmem-bench"))
PACKAGES = ("mlx", "mlx-lm", "numpy", "trio", "hypercorn", "starlette", "httpx", "msgspec", "safetensors")


def load1() -> float:
    """The machine's 1-minute load average (other engineers share this 2-core box)."""
    return os.getloadavg()[0]


def median(values: Iterable[float]) -> float:
    vals = list(values)
    return statistics.median(vals) if vals else float("nan")


def git_revision() -> str:
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=False, cwd=ROOT)
        return out.stdout.strip()

    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    return rev + (" (working tree has uncommitted changes)" if git("status", "--porcelain") else "")


def package_versions() -> str:
    parts = []
    for name in PACKAGES:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(parts)


def machine() -> str:
    mem_gib = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
    except OSError:
        pass
    blas_path = "?"
    if "runtime" in sys.modules:
        from runtime import blas

        blas_path = blas.openblas_path() or "bundled reference BLAS"
    return (
        f"{os.cpu_count()} cores, {mem_gib:.1f} GiB RAM, {platform.machine()} {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}; BLAS {blas_path}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
    )


def model_dir(name: str = "kvmem-default") -> Path:
    """An ordinary Hugging Face folder of ``name`` under the bench home, built on first use.

    Tiny recipes are built as such; ``kvmem-default`` (a GGUF) is written out with
    the float32 weights kvmem runs on CPU, so servers that take only folders
    (``mlx_lm.server``) serve the very same weights.
    """
    from runtime.model.default_model import DEFAULT_MODEL, default_model_file
    from runtime.model.tiny_models import ensure_tiny_model

    if name != DEFAULT_MODEL:
        return ensure_tiny_model(name, BENCH_HOME / "models")
    folder = BENCH_HOME / "models" / f"{DEFAULT_MODEL}-float32"
    if not (folder / "model.safetensors").exists():
        import shutil

        import mlx.core as mx

        from runtime.model.gguf import prepare_gguf

        gguf = prepare_gguf(default_model_file(), models_dir=BENCH_HOME / "models", weights="float32")
        staging = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(gguf.folder, staging)
        config = {**gguf.config, "torch_dtype": "float32"}
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        mx.save_safetensors(str(staging / "model.safetensors"), gguf.weights)
        staging.rename(folder)
    return folder


def model_geometry(folder: Path) -> str:
    cfg = json.loads((folder / "config.json").read_text())
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else "?")
    return (
        f"{cfg.get('model_type')}: {cfg.get('num_hidden_layers')} layers, hidden {cfg.get('hidden_size')}, "
        f"{heads} heads / {cfg.get('num_key_value_heads')} KV heads, head_dim {head_dim}, "
        f"vocab {cfg.get('vocab_size')}, dtype {cfg.get('torch_dtype', cfg.get('dtype', '?'))}"
    )


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> list[str]:
    """Markdown table lines; ``align`` is one of 'l'/'r' per column (default: first left, others right)."""
    align = align or ("l" + "r" * (len(headers) - 1))
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(":--" if a == "l" else "--:" for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


@dataclass
class ResultFile:
    """One benchmark's result file: header (provenance), body sections, raw runs.

    Create it at the start of a run (it records the load average then), append
    body lines and raw records while measuring, and call :meth:`write` at the end.
    """

    name: str
    title: str
    quick: bool
    argv: Sequence[str]
    model: str | None = "kvmem-default"
    variant: str = ""  # appended to the file name (e.g. "_4k"), not to the command
    setup: list[str] = field(default_factory=list)
    body: list[str] = field(default_factory=list)
    raw: list[dict[str, Any]] = field(default_factory=list)
    load_before: float = field(default_factory=load1)
    started: float = field(default_factory=time.time)
    # Taken at the start: the code that ran, before this run's own plots dirty the tree.
    revision: str = field(default_factory=git_revision)

    @property
    def stem(self) -> str:
        return self.name + self.variant + ("_quick" if self.quick else "")

    @property
    def md_path(self) -> Path:
        return RESULTS / f"{self.stem}.md"

    @property
    def png_path(self) -> Path:
        return RESULTS / f"{self.stem}.png"

    def command(self) -> str:
        return "python -m benches " + " ".join([self.name, *self.argv]).strip()

    def record(self, **run: Any) -> None:
        self.raw.append(run)

    def write(self, *, plot: bool = False) -> Path:
        RESULTS.mkdir(parents=True, exist_ok=True)
        load_after = load1()
        lines = [
            f"# {self.title}",
            "",
            f"- command: `{self.command()}` (wall {time.time() - self.started:.0f} s)",
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(self.started))}",
            f"- git rev: {self.revision}",
            f"- packages: {package_versions()}",
            f"- machine: {machine()}",
        ]
        if self.model:
            folder = model_dir(self.model) if not Path(self.model).is_dir() else Path(self.model)
            lines.append(f"- model: `{self.model}` — {model_geometry(folder)}")
        lines.append(
            f"- load average (1 min): {self.load_before:.2f} before, {load_after:.2f} after "
            "(shared 2-core machine: absolute times move with its load; ratios are measured side by side)"
        )
        lines += [f"- {s}" for s in self.setup]
        lines += ["", *self.body, ""]
        if plot:
            lines += [f"![{self.stem}]({self.png_path.name})", ""]
        lines += ["## Raw runs", "", "```json"]
        lines += [json.dumps(r, sort_keys=True, default=_jsonable) for r in self.raw]
        lines += ["```", ""]
        self.md_path.write_text("\n".join(lines))
        return self.md_path


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 4)
    return str(x)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(res: ResultFile, fig: Any) -> None:
    """Lay out ``fig``, write it as the result's PNG and close it."""
    fig.tight_layout()
    fig.savefig(res.png_path, dpi=110)
    pyplot().close(fig)


def parser(doc: str | None, *, repeats: int = 3, quick_repeats: int = 1) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    p.add_argument("--quick", action="store_true", help="a short run (smaller sizes, fewer repeats)")
    p.add_argument("--repeats", type=int, help=f"runs per point (default {repeats}; {quick_repeats} with --quick)")
    return p


def repeats(args: argparse.Namespace, full: int = 3, quick: int = 1) -> int:
    return int(args.repeats or (quick if args.quick else full))


def eval_median_s(fn: Any, repeats: int) -> float:
    """Median seconds of ``mx.eval(fn())`` over ``repeats`` runs."""
    import mlx.core as mx

    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        samples.append(time.perf_counter() - t0)
    return median(samples)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
