"""Which kvmem modules one OpenAI request runs through, traced, for ARCHITECTURE.md.

A profile hook on every thread (``threading.setprofile`` before the server
starts) records each kvmem module (``actors/``, ``gateway/``, ``runtime/``)
whose Python functions run while one streaming ``/v1/chat/completions``
request on ``tiny-llama`` is served, from the request to its write-behind save,
in the order they first run. A warm-up request (another agent) runs first, so
model loading and first-use imports are not counted.

``--compare DIR`` traces another checkout too (e.g. ``git worktree add /tmp/old
<commit>``), side by side; the script adapts to the older configuration API.
Not a timing benchmark: one run is the answer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benches.harness import ResultFile, log, table

ROOT = Path(__file__).resolve().parents[2]

_TRACER = r'''
import json, os, sys, threading, time
root = os.path.abspath(sys.argv[1]); sys.path.insert(0, root); os.chdir(root)
import runtime  # noqa: F401  (OpenBLAS before mlx)
recording = False
seen = {}
def profile(frame, event, arg):
    if recording and event == "call":
        f = frame.f_code.co_filename
        if f.startswith(root + "/") and f[len(root) + 1:].split("/")[0] in ("actors", "gateway", "runtime"):
            seen.setdefault(f[len(root) + 1:], len(seen))
threading.setprofile(profile)
sys.setprofile(profile)
import httpx
from gateway.testing import ServerThread
try:
    from runtime.config import Config
except ImportError:  # before the one-configuration change
    from gateway.config import ServeConfig as Config
config = Config(model="tiny-llama", port=0, cache_dir=sys.argv[2], prewarm_mb=0)
body = {"model": "tiny-llama", "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hello there, how are you today?"}]}
with ServerThread(config) as server, httpx.Client(base_url=server.url, timeout=300) as client:
    client.post("/v1/chat/completions", json=body, headers={"X-Agent-ID": "warm-up"}).raise_for_status()
    time.sleep(1)
    recording = True
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                       headers={"X-Agent-ID": "walker"}) as response:
        for _ in response.iter_lines():
            pass
    time.sleep(2)  # the write-behind save
    recording = False
sys.setprofile(None)
threading.setprofile(None)
print(json.dumps(sorted(seen, key=seen.get)), flush=True)
os._exit(0)  # the profile hook must not meet the MLX thread's teardown
'''


def trace(root: Path) -> list[str]:
    """The modules of ``root``'s checkout one request runs through, in first-run order."""
    with tempfile.TemporaryDirectory(prefix="kvmem-walk-") as tmp:
        out = subprocess.run([sys.executable, "-c", _TRACER, str(root), tmp], capture_output=True, text=True,
                             check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rooms(modules: list[str]) -> dict[str, int]:
    rooms = {"gateway": 0, "actors": 0, "runtime (outside persistence)": 0, "persistence": 0}
    for m in modules:
        if m.startswith("runtime/persist"):
            rooms["persistence"] += 1
        elif m.startswith("runtime/"):
            rooms["runtime (outside persistence)"] += 1
        else:
            rooms[m.split("/")[0]] += 1
    return rooms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benches request_walk", description=__doc__)
    p.add_argument("--compare", type=Path, help="another checkout to trace side by side (the 'before')")
    p.add_argument("--quick", action="store_true", help="same run (there is nothing to shorten)")
    args = p.parse_args(argv)
    res = ResultFile("request_walk", "Modules one streaming OpenAI request runs through (traced)", args.quick,
                     argv or [], model=None,
                     setup=["model: `tiny-llama` (the path does not depend on the weights); a warm-up request "
                            "first; traced: one streaming request of a new agent, through its write-behind save"])
    runs = {"this checkout": trace(ROOT)}
    if args.compare is not None:
        runs[f"{args.compare} (before)"] = trace(args.compare)
    for name, modules in runs.items():
        log(f"{name}: {len(modules)} modules")
        res.record(checkout=name, modules=modules)
    rooms = {name: _rooms(mods) for name, mods in runs.items()}
    rows = [[room, *[str(rooms[name][room]) for name in runs]] for room in next(iter(rooms.values()))]
    rows.append(["**total**", *[f"**{len(m)}**" for m in runs.values()]])
    res.body += ["## Modules per room", "", *table(["room", *runs], rows), ""]
    for name, modules in runs.items():
        res.body += [f"## In first-run order: {name}", "", *(f"{i + 1}. `{m}`" for i, m in enumerate(modules)), ""]
    res.write()
    print(res.md_path.read_text())
