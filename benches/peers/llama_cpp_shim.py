#!/usr/bin/env python3
"""A ``llama-server`` stand-in that runs ``kvmem serve``, for llama.cpp's own server tests.

``benches/peers/llama_cpp_suite.py`` copies this file into a temp folder and points
llama.cpp's test harness at it (``LLAMA_SERVER_BIN_PATH``). It takes
llama-server's command line and:

* maps the model: ``--hf-repo``/``--hf-file``/``--model`` naming a model that is
  in ``models`` of the config (stories260K, kept locally) becomes that local
  folder or GGUF; any other model exits at once with status 3 ("not available
  offline"), so the test that asked for it fails fast and is counted as one
  that could not run;
* serves it under ``--alias`` (or the file's name) as the model id: ``kvmem serve
  --model <alias>`` from a folder that holds a link named ``<alias>``, with
  ``--accept-any-model`` (llama-server answers a request naming any model with
  its one model; a request that names no model is still kvmem's 400);
* maps ``--api-key``, ``--parallel`` (``--max-batch``) and ``--n-predict``
  (``--default-max-tokens``); records every other flag, and the ones that turn
  on a llama.cpp-only feature (``--embedding``, ``--lora``, ``--slot-save-path``,
  ...) as such, and starts anyway, so the test's own requests show what
  kvmem answers;
* listens on ``--host``/``--port`` itself and passes each request to kvmem
  byte for byte (one request per connection, streams unbuffered), except that
  ``/health`` (the harness's readiness check) goes to kvmem's ``/healthz`` and
  llama-server's OpenAI paths without ``/v1`` (``/chat/completions``,
  ``/completions``, ``/models``, ...) to the ``/v1`` ones (:data:`ROUTES`), so a
  test is judged on what it asks rather than on the alias it uses; a JSON body
  to one of those routes that names no model (or ``null``), which llama-server
  takes and OpenAI's and Anthropic's APIs refuse, gets the served model's name
  (logged as ``model_filled``); until kvmem is up it answers 503. Every request's method, path,
  JSON body keys, status and the start of an error body are appended to the log.

Configuration comes from ``$KVMEM_SHIM_CONFIG`` (JSON: ``root``, ``python``,
``home``, ``tmp``, ``log``, ``models``); ``$KVMEM_SHIM_TEST`` names the test
that started it. Standard library only: it runs with whichever Python runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: llama-server flags that take a value (as llama.cpp's tests/utils.py passes them).
VALUE_FLAGS = frozenset({
    "--port", "--temp", "--seed", "--host", "--model", "-m", "--model-url", "--model-draft", "--hf-repo", "-hf",
    "--hf-file", "-hff", "--models-dir", "--models-max", "--models-preset", "--cors-origins", "--batch-size", "-b",
    "--ubatch-size", "-ub", "--threads", "-t", "-tb", "--n-gpu-layers", "-ngl", "--pooling", "--alias", "-a",
    "--tags", "--ctx-size", "-c", "--parallel", "-np", "-ctk", "-ctv", "--cache-type-k", "--cache-type-v", "-fa",
    "--flash-attn", "--n-predict", "-n", "--slot-save-path", "--grp-attn-n", "--grp-attn-w", "--lora",
    "--spec-type", "--api-key", "--spec-draft-n-max", "--spec-draft-n-min", "--spec-synth-len",
    "--spec-synth-rates", "--reasoning-format", "--reasoning", "--chat-template", "--chat-template-file",
    "--mmproj-url", "--media-path", "--sleep-idle-seconds", "--cache-ram", "--tools", "--tools-runtime",
    "--mcp-servers-config", "--mcp-servers-json", "--reasoning-budget", "--draft-max", "--draft-min",
})

#: Flags that turn on a feature only llama.cpp's server has: flag -> the feature.
LLAMA_ONLY = {
    "--embedding": "embeddings model (/embedding, pooling)", "--pooling": "embedding pooling",
    "--reranking": "reranking (/rerank)", "--lora": "LoRA adapters", "--model-draft": "speculative decoding",
    "--spec-type": "speculative decoding", "--spec-draft-n-max": "speculative decoding",
    "--spec-draft-n-min": "speculative decoding", "--spec-synth-len": "speculative decoding",
    "--spec-synth-rates": "speculative decoding", "--context-shift": "context shift (--ctx-shift)",
    "--slot-save-path": "slot save/restore (/slots)", "--slots": "the /slots endpoint",
    "--grp-attn-n": "group attention (self-extend)", "--grp-attn-w": "group attention (self-extend)",
    "--models-dir": "router mode", "--models-max": "router mode", "--models-preset": "router mode",
    "--no-models-autoload": "router mode", "--mmproj-url": "multimodal projector", "--media-path": "local media",
    "--sleep-idle-seconds": "sleep when idle", "--tools": "built-in server tools",
    "--tools-runtime": "built-in server tools", "--mcp-servers-config": "MCP servers",
    "--mcp-servers-json": "MCP servers", "--ui-mcp-proxy": "web UI MCP proxy",
    "--chat-template": "a chat template chosen on the server's command line",
    "--chat-template-file": "a chat template file on the server's command line",
    "--kv-unified": "unified KV buffer", "--tags": "model tags", "--backend_sampling": "backend sampling",
    "--model-url": "model download by URL", "--cors-origins": "CORS origins / CORS proxy",
    "--reasoning-format": "reasoning format parsing", "--reasoning": "reasoning on/off",
    "--cache-ram": "host-memory prompt cache size", "--no-cache-idle-slots": "idle slot caching",
    "--n-gpu-layers": "GPU offload",
}

#: Flags mapped onto ``kvmem serve``'s own (flag -> kvmem flag).
MAPPED = {"--api-key": "--api-key", "--parallel": "--max-batch", "-np": "--max-batch",
          "--n-predict": "--default-max-tokens", "-n": "--default-max-tokens"}

#: Flags for the serving process that change nothing a client sees, or that kvmem has no equivalent for.
NOT_MAPPED_NOTE = "tuning or default-sampling flag without a kvmem equivalent"

#: llama-server's paths that name an OpenAI route without ``/v1`` (and its ``/health``) -> kvmem's path.
ROUTES = {b"/health": b"/healthz", b"/chat/completions": b"/v1/chat/completions", b"/completions": b"/v1/completions",
          b"/models": b"/v1/models", b"/embeddings": b"/v1/embeddings", b"/responses": b"/v1/responses"}

#: kvmem routes whose body must name a model (OpenAI's and Anthropic's APIs require one; llama-server does not).
NAMED_MODEL = frozenset({b"/v1/chat/completions", b"/v1/completions", b"/v1/messages", b"/v1/messages/count_tokens",
                         b"/v1/responses", b"/v1/embeddings"})

_URL = re.compile(r"serving .* on (http://\S+)")
CONFIG: dict[str, Any] = json.loads(os.environ.get("KVMEM_SHIM_CONFIG", "{}"))
TEST = os.environ.get("KVMEM_SHIM_TEST", "?")


def log(record: dict[str, Any]) -> None:
    """Append one JSON line (with the test's id and the time) to the shared log."""
    path = CONFIG.get("log")
    if not path:
        return
    line = json.dumps({"test": TEST, "t": round(time.time(), 3), **record}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """llama-server's arguments as {flag: value} (``""`` for switches), and the ones it did not know."""
    opts: dict[str, str] = {}
    unknown: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in VALUE_FLAGS and i + 1 < len(argv):
            opts[arg] = argv[i + 1]
            i += 2
            continue
        if arg.startswith("-"):
            opts[arg] = ""
        else:
            unknown.append(arg)
        i += 1
    return opts, unknown


def resolve_model(opts: dict[str, str]) -> tuple[str | None, str]:
    """The local path of the model the command line names, or None; and how the model was named."""
    repo = opts.get("--hf-repo") or opts.get("-hf") or ""
    hf_file = opts.get("--hf-file") or opts.get("-hff") or ""
    file = opts.get("--model") or opts.get("-m") or ""
    named = " ".join(x for x in (repo, hf_file, file) if x) or "(no model: router mode)"
    models: dict[str, str] = CONFIG.get("models", {})
    for key in (f"{repo}:{hf_file}" if hf_file else repo, file):
        if key and key in models:
            return models[key], named
    if file and Path(file).exists() and file.endswith(".gguf"):
        return str(Path(file).resolve()), named
    return None, named


def set_parent_death_signal() -> None:
    """Linux: kvmem serve gets SIGTERM if this shim dies (the harness SIGKILLs a slow stop)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Proxy:
    """Requests on the test's host and port passed to kvmem's, ``/health`` to ``/healthz``."""

    def __init__(self, alias: str) -> None:
        self.upstream: tuple[str, int] | None = None
        self.alias = alias

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request: rewrite its head, pass its body, stream the answer back, close."""
        record: dict[str, Any] = {"kind": "request"}
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head[:-4].split(b"\r\n")
            method, target, version = lines[0].split(b" ", 2)
            path = target.split(b"?", 1)[0]
            record.update(method=method.decode(), path=target.decode(errors="replace"))
            if path in ROUTES:
                target = ROUTES[path] + target[len(path):]
            headers = [h for h in lines[1:] if h and not h.lower().startswith(b"connection:")]
            length = next((int(h.split(b":", 1)[1]) for h in headers if h.lower().startswith(b"content-length:")), 0)
            body = await reader.readexactly(length) if length else b""
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                parsed = json.loads(body) if body else None
                if isinstance(parsed, dict):
                    record["keys"] = sorted(parsed)
                    if target.split(b"?", 1)[0] in NAMED_MODEL and parsed.get("model") is None:
                        parsed["model"] = self.alias  # llama-server needs no model name; OpenAI and Anthropic do
                        body = json.dumps(parsed).encode()
                        headers = [h for h in headers if not h.lower().startswith(b"content-length:")]
                        headers.append(b"content-length: %d" % len(body))
                        record["model_filled"] = True
            if self.upstream is None:
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                record["status"] = 503
                return
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            upstream_writer.write(b" ".join([method, target, version]) + b"\r\n" + b"\r\n".join(headers)
                                  + b"\r\nConnection: close\r\n\r\n" + body)
            await upstream_writer.drain()
            watch = asyncio.create_task(reader.read(1))  # the client hanging up mid-answer
            first = b""
            while True:
                read = asyncio.create_task(upstream_reader.read(65536))
                done, _ = await asyncio.wait({read, watch}, return_when=asyncio.FIRST_COMPLETED)
                if watch in done and not watch.result():
                    read.cancel()
                    record["client_left"] = True
                    break
                chunk = await read
                if not chunk:
                    break
                if len(first) < 4096:
                    first += chunk[: 4096 - len(first)]
                writer.write(chunk)
                await writer.drain()
            watch.cancel()
            status = re.match(rb"HTTP/1\.[01] (\d{3})", first)
            record["status"] = int(status.group(1)) if status else None
            if record["status"] and record["status"] >= 400:
                record["error"] = first.split(b"\r\n\r\n", 1)[-1][:300].decode(errors="replace")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            record["exception"] = repr(exc)[:200]
        finally:
            if record.get("method") and not (record.get("status") == 503 and self.upstream is None):
                log(record)  # (not the readiness polls before kvmem is up)
            for w in (upstream_writer, writer):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()


async def run(opts: dict[str, str], cmd: list[str], cwd: str, env: dict[str, str], alias: str) -> int:
    """Start kvmem serve and the proxy; end both on SIGTERM/SIGINT or when kvmem exits."""
    proxy = Proxy(alias)
    loop = asyncio.get_running_loop()
    hosts = [h.strip() for h in (opts.get("--host") or "127.0.0.1").split(",") if h.strip()]
    servers = [await asyncio.start_server(proxy.handle, host, int(opts.get("--port") or 8080), reuse_address=True)
               for host in hosts]
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=subprocess.STDOUT, preexec_fn=set_parent_death_signal)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    t0 = time.monotonic()

    async def follow() -> None:
        """Copy kvmem's output through and learn its address from its "serving ... on URL" line."""
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace")
            sys.stdout.write("[kvmem] " + line)
            sys.stdout.flush()
            m = _URL.search(line)
            if m and proxy.upstream is None:
                url = m.group(1).rstrip("/").removeprefix("http://")
                host, _, port = url.rpartition(":")
                proxy.upstream = (host, int(port))
                log({"kind": "ready", "seconds": round(time.monotonic() - t0, 2)})

    follower = asyncio.create_task(follow())
    waiter = asyncio.create_task(proc.wait())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    for s in servers:
        s.close()
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 4.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    follower.cancel()
    code = proc.returncode or 0
    if not stop.is_set():
        log({"kind": "exited", "code": code})
        return code or 1
    return 0


def main(argv: list[str]) -> int:
    """Translate the command line, then serve (or exit 3 when the model is not here)."""
    opts, unknown = parse(argv)
    model, named = resolve_model(opts)
    llama_only = {f: LLAMA_ONLY[f] for f in opts if f in LLAMA_ONLY}
    # (--n-predict -1, llama-server's "until the end of text or context", is kvmem's default: not mapped)
    mapped = {f: opts[f] for f in opts if f in MAPPED and not (MAPPED[f] == "--default-max-tokens"
                                                               and opts[f].lstrip("-").isdigit() and int(opts[f]) <= 0)}
    record = {"kind": "start", "argv": argv, "model": named, "llama_only": llama_only, "mapped": mapped,
              "unknown": unknown}
    if model is None:
        log({**record, "refused": f"model not available offline: {named}"})
        print(f"kvmem shim: model not available offline: {named}", file=sys.stderr)
        return 3
    log(record)
    alias = opts.get("--alias") or opts.get("-a") or Path(opts.get("--hf-file") or model).stem
    workdir = Path(tempfile.mkdtemp(prefix="kvmem-shim-", dir=CONFIG.get("tmp")))
    link = workdir / alias  # kvmem serves the name given to --model: the alias, resolved from workdir
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(model)
    cmd = [CONFIG.get("python", sys.executable), "-m", "gateway.cli", "serve", "--model", alias,
           "--home", CONFIG.get("home", str(workdir / "home")), "--cache-dir", str(workdir / "cache"),
           "--host", "127.0.0.1", "--port", "0", "--no-fsync", "--prewarm-mb", "0",
           "--accept-any-model"]  # llama-server answers any model name with its one model
    for flag, value in mapped.items():
        cmd += [MAPPED[flag], value]
    env = {**os.environ, "PYTHONPATH": CONFIG.get("root", ""), "PYTHONDONTWRITEBYTECODE": "1"}
    return asyncio.run(run(opts, cmd, str(workdir), env, alias))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
