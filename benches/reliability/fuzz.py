"""Fuzz a live ``kvmem serve`` for a time budget: damaged bytes, odd headers, every route; count 5xx (goal 0).

Each case takes a valid request for one route and damages it at random: the
body truncated, bytes flipped, inserted or deleted (bytes that are not UTF-8,
controls, quotes, braces), a field replaced by a hostile JSON value (huge or
non-finite numbers, deep nesting, long strings, wrong types), duplicated keys,
a wrong content type, an odd ``X-Agent-ID``. Seeded, so a run is reproducible.
A case passes when the answer is below 500 and, for an error, in the API's own
error shape with no traceback. Every 2 s a valid request checks that the server
still serves.

``tests/http_and_cli/test_security_http_fuzz.py`` runs :func:`fuzz` for a fixed budget in
CI; ``python -m benches fuzz`` runs it longer (``--seconds``, default 300) and
writes ``benches/results/fuzz.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "tiny-llama"

VALID: dict[str, dict[str, Any]] = {
    "/v1/messages": {"model": MODEL, "max_tokens": 2, "system": "Be brief.",
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "hi é"}]}]},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 2, "stop": ["\n"],
                             "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]},
    "/v1/agents/fuzz/messages": {"prompt": "hi", "max_tokens": 2},
}
HOSTILE_VALUES: list[Any] = [
    None, True, -1, 0, 2**64, -(2**63), 1e308, "", "x" * 5000, "\u0000\u202e\ud7ff", [], {}, [[[[[]]]]],
    {"type": "bogus"}, [{"role": "user"}], {"role": "user", "content": [{"type": "image"}]},
]
RAW_VALUES = [b"1e400", b"-1e400", b"NaN", b"Infinity", b"99999999999999999999999", b"[" * 5000 + b"]" * 5000]
NOISE = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00", b'"', b"{", b"}", b"[", b",", b":", b"\\", b"\n"]
CONTENT_TYPES = ["application/json", "text/plain", "", "application/json; charset=latin-1", "multipart/form-data"]
AGENT_IDS = [None, None, None, "fuzz-a", "../../etc", "a" * 300, "con", "\u202eevil", " ", "%00"]


@dataclass
class FuzzReport:
    """What a run tried and saw."""

    cases: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    by_route: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # 5xx, a bad error shape, a traceback, a dead server
    liveness_checks: int = 0


def _damage(rng: random.Random, path: str) -> tuple[bytes, str]:
    body = json.loads(json.dumps(VALID[path]))
    kind = rng.randrange(6)
    if kind == 0:  # a field replaced by a hostile value
        key = rng.choice(list(body))
        body[key] = rng.choice(HOSTILE_VALUES)
    raw = json.dumps(body, ensure_ascii=False).encode()
    if kind == 1:
        raw = raw[: rng.randrange(len(raw) + 1)]
    elif kind == 2:
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(raw) + 1)
            raw = raw[:at] + rng.choice(NOISE) + raw[at:]
    elif kind == 3:
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(max(len(raw), 1))
            raw = raw[:at] + raw[at + 1 :]
    elif kind == 4:
        raw = raw.replace(b": 2", b": " + rng.choice(RAW_VALUES), 1) if b": 2" in raw else raw[:-1] + b', "model": 1}'
    elif kind == 5:
        raw = raw[:-1] + b"," + raw[1:]  # every key twice
    return raw, rng.choice(CONTENT_TYPES) if rng.random() < 0.3 else "application/json"


def _shape_ok(path: str, response: httpx.Response) -> bool:
    if "Traceback" in response.text:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and bool(body.get("error", {}).get("type"))
    return bool(body.get("error", {}).get("message"))


def fuzz(url: str, *, seconds: float, seed: int = 0, headers: dict[str, str] | None = None) -> FuzzReport:
    """Fuzz the server at ``url`` for ``seconds``; see the module docstring."""
    rng = random.Random(seed)
    report = FuzzReport()
    deadline = time.monotonic() + seconds
    next_check = 0.0
    limits = httpx.Limits(max_keepalive_connections=0)  # a rejected body closes its connection anyway
    with httpx.Client(base_url=url, timeout=httpx.Timeout(60, connect=5), limits=limits) as client:
        while time.monotonic() < deadline:
            path = rng.choice(list(VALID))
            raw, ctype = _damage(rng, path)
            request_headers = dict(headers or {})
            if ctype:
                request_headers["content-type"] = ctype
            agent = rng.choice(AGENT_IDS)
            if agent is not None and agent.isprintable() and agent.isascii() and agent == agent.strip():
                request_headers["x-agent-id"] = agent
            report.cases += 1
            try:
                response = client.post(path, content=raw, headers=request_headers)
            except httpx.TransportError as exc:  # refused, reset, timed out: the server is in trouble
                report.failures.append(f"{path}: {type(exc).__name__}: {exc}")
                continue
            report.by_status[response.status_code] += 1
            report.by_route[path] += 1
            if response.status_code >= 500 or (response.status_code >= 400 and not _shape_ok(path, response)):
                report.failures.append(f"{path} {response.status_code} {raw[:120]!r}: {response.text[:200]}")
            if time.monotonic() >= next_check:
                report.liveness_checks += 1
                try:
                    ok = client.post("/v1/messages/count_tokens", json=VALID["/v1/messages/count_tokens"],
                                     headers=headers or {})
                    if ok.status_code != 200:
                        report.failures.append(f"liveness check: {ok.status_code} {ok.text[:200]}")
                except httpx.TransportError as exc:
                    report.failures.append(f"liveness check: {type(exc).__name__}: {exc}")
                next_check = time.monotonic() + 2.0
    return report


def main(argv: list[str] | None = None) -> None:
    from benches.harness import ResultFile, log, table
    from gateway.testing import ServerThread
    from runtime.config import Config

    p = argparse.ArgumentParser(prog="python -m benches fuzz", description=__doc__)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="20 seconds")
    args = p.parse_args(argv)
    seconds = 20.0 if args.quick else args.seconds
    res = ResultFile("fuzz", "Fuzzing a live kvmem serve: damaged requests on every POST route", args.quick,
                     argv or [], model=None,
                     setup=[f"model `{MODEL}` (rejections do not depend on weights), budget {seconds:.0f} s, "
                            f"seed {args.seed}; max_body_bytes 64 KiB, max_tokens_limit 16"])
    with tempfile.TemporaryDirectory(prefix="kvmem-fuzz-") as tmp:
        config = Config(model=MODEL, port=0, cache_dir=tmp, max_body_bytes=64 * 1024, max_tokens_limit=16,
                        prewarm_mb=0, budget_mb=128, hot_budget_mb=32)
        with ServerThread(config) as server:
            report = fuzz(server.url, seconds=seconds, seed=args.seed)
    fivexx = sum(n for status, n in report.by_status.items() if status >= 500)
    log(f"{report.cases} cases, {fivexx} 5xx, {len(report.failures)} failures")
    res.record(cases=report.cases, by_status=dict(report.by_status), failures=report.failures)
    res.body += ["## Outcome", "", *table(["cases", "5xx", "failures (5xx, bad error shape, dead server)",
                                           "liveness checks"],
                                          [[report.cases, fivexx, len(report.failures), report.liveness_checks]]), ""]
    res.body += ["## Answers by status", "", *table(["status", "cases"], sorted(report.by_status.items())), ""]
    res.body += ["## Cases by route", "", *table(["route", "cases"], sorted(report.by_route.items())), ""]
    if report.failures:
        res.body += ["## Failures", "", *[f"- `{f}`" for f in report.failures[:50]], ""]
    res.write()
    print(res.md_path.read_text())
